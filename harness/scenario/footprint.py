"""How much memory a scenario's run needs, estimated from its sizes before anything is built, so
that sizes no machine here can hold are refused at load with both numbers, instead of a run that
grinds and dies with MemoryError."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GiB = 2**30
# Python-side costs, measured on the reference workload and rounded up: a request's plan,
# sequence and history events; each token it holds (prompt list, output, step events); each
# entry of a snapshot kept in the history (free list, ref counts, table).
REQUEST_BYTES = 4096
TOKEN_BYTES = 128
SNAPSHOT_ENTRY_BYTES = 16
FLOAT32 = 4


@dataclass(frozen=True)
class Part:
    what: str  # in words, for the message
    keys: str  # the scenario keys that size it
    bytes: int
    on_device: bool  # on the run's device (the KV pool, weights); else always in host memory


def _longest(d) -> int:
    """The longest length a LengthDist can draw (a fixed length is not clipped)."""
    return d.value if d.dist == "fixed" else d.max


def estimate(sc) -> list[Part]:
    """The big allocations of one run of Scenario sc, largest first."""
    cfg = sc.engine_config()
    m, c, w = cfg.model, cfg.cache, sc.workload
    hid, inter, hd = m.hidden_size, m.intermediate_size, m.head_dim
    qkv = (m.num_heads + 2 * m.num_kv_heads) * hd
    per_layer = qkv * hid + hid * m.num_heads * hd + 3 * hid * inter + 2 * hid
    weights = (2 * m.vocab_size * hid + m.num_layers * per_layer + hid) * m.dtype_bytes
    # the longest context a request can reach, in whole blocks (decode gathers whole blocks)
    ctx = _longest(w.prompt_len) + _longest(w.output_len) + w.fork_extra_tokens
    requests = w.num_requests + w.fork_groups
    if w.prefix:  # a prefix before the prompt, whole blocks with segments; samples and turns
        pre = w.prefix
        ctx += _longest(pre.prefix_len) + 2 * c.block_size
        ctx += pre.turns * (_longest(pre.turn_len) + _longest(w.output_len))
        requests += w.num_requests * (pre.samples - 1 + pre.turns)
    ctx_blocks = min(c.max_blocks_per_seq, -(-ctx // c.block_size))
    per_token_layer = m.kv_bytes_per_token() // m.num_layers
    decode = c.max_num_seqs * ctx_blocks * c.block_size * per_token_layer
    prefill = cfg.max_prefill_tokens * (4 * hid + qkv + 2 * inter + m.vocab_size) * FLOAT32
    oracle = c.max_num_seqs * min(ctx, c.max_tokens_per_seq) * m.kv_bytes_per_token()
    table = c.max_num_seqs * c.max_blocks_per_seq
    # max_steps is a cap, not a plan: a run stops when its requests are done (or starve)
    steps = min(
        sc.run.max_steps,
        int(w.num_requests / w.arrival_rate) + requests * ctx + sc.run.liveness_bound_steps,
    )
    snapshots = (steps // sc.run.snapshot_every + 2) * (2 * c.num_blocks + table)
    parts = [
        Part(
            "the KV pool",
            "engine.cache.num_blocks x block_size, engine.model",
            m.kv_bytes_per_token() * c.block_size * c.num_blocks,
            True,
        ),
        Part(
            "the model weights",
            "engine.model.hidden_size, vocab_size, intermediate_size, num_layers",
            weights,
            True,
        ),
        Part(
            "activations",
            "engine.model.hidden_size, vocab_size, engine.max_prefill_tokens, block_size",
            max(prefill, decode) + oracle,
            True,
        ),
        Part(
            "the rotary tables",
            "engine.model.max_position",
            m.max_position * hd * 2 * 8,  # angles in float64, then cos and sin
            True,
        ),
        Part(
            "the block table",
            "engine.cache.max_num_seqs x max_blocks_per_seq",
            table * 4 * 3 * cfg.tp_size,  # host table, staging copy, device copy, per rank
            False,
        ),
        Part(
            "the requests",
            "workload.num_requests, prompt_len, output_len",
            requests * (REQUEST_BYTES + ctx * TOKEN_BYTES),
            False,
        ),
        Part(
            "the snapshots kept in the history",
            "engine.cache.num_blocks, max_blocks_per_seq, run.max_steps / snapshot_every",
            snapshots * SNAPSHOT_ENTRY_BYTES,
            False,
        ),
    ]
    return sorted(parts, key=lambda p: -p.bytes)


def available(device: str) -> tuple[int | None, str]:
    """(bytes free, where) for a run on device: on the host, the least this process can really
    get (free RAM, its address-space and data limits, its cgroup's memory limit); for CUDA the
    device's free memory when CUDA is already up in this process (asking would start it: a
    forked worker could then not use it), else None (unknown: only the host part is judged)."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_initialized():
            return None, device
        index = int(device.partition(":")[2] or torch.cuda.current_device())
        return torch.cuda.mem_get_info(index)[0], f"free on {device}"
    return min(host_limits(), key=lambda x: x[0])


def host_limits() -> list[tuple[int, str]]:
    """Each bound on this process's host memory, as (bytes left, in words): free RAM, then the
    soft RLIMIT_AS (ulimit -v) and RLIMIT_DATA (ulimit -d) less what the process maps already
    (a run's worker inherits both), then the cgroup memory limit less its usage."""
    import psutil

    out = [(psutil.virtual_memory().available, "available host RAM")]
    try:
        import resource
    except ImportError:  # not on this platform (Windows)
        return out
    mem = psutil.Process().memory_info()
    for limit, used, what, flag in (
        (resource.RLIMIT_AS, mem.vms, "the address-space limit", "ulimit -v"),
        (resource.RLIMIT_DATA, getattr(mem, "data", mem.vms), "the data-size limit", "ulimit -d"),
    ):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY:
            out.append((max(0, soft - used), f"left under {what} ({flag} {_gib(soft)})"))
    return out + cgroup_limits()


CGROUP = Path("/sys/fs/cgroup")
# per version: (the limit, the usage, the page cache memory.stat counts that the kernel reclaims
# before it refuses memory, so not counted as used)
CGROUP_FILES = {
    "v2": ("memory.max", "memory.current", "inactive_file"),
    "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a huge page-rounded number


def _read(p: Path) -> str | None:
    try:
        return p.read_text().strip()
    except OSError:
        return None


def _stat(stat: str | None, key: str) -> int:
    for line in (stat or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.isdigit():
            return int(value)
    return 0


def cgroup_limits(root: Path = CGROUP, proc: Path = Path("/proc/self/cgroup")) -> list:
    """(bytes left, in words) under the tightest memory limit of this process's cgroup and those
    above it, v2 (memory.max) or v1 (memory.limit_in_bytes); [] when none is set or readable.
    A folder the mount does not show (a cgroup namespace's view) is skipped."""
    best = None
    for line in (_read(proc) or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        controllers, path = fields[1], fields[2]
        if controllers == "":  # v2: one hierarchy, at the mount's root
            base, files = root, CGROUP_FILES["v2"]
        elif "memory" in controllers.split(","):
            base, files = root / "memory", CGROUP_FILES["v1"]
        else:
            continue
        d = base / path.lstrip("/")
        while True:
            limit, usage = _read(d / files[0]), _read(d / files[1])
            if limit and limit.isdigit() and int(limit) < UNLIMITED and usage and usage.isdigit():
                used = int(usage) - _stat(_read(d / "memory.stat"), files[2])
                left = max(0, int(limit) - max(0, used))
                if best is None or left < best[0]:
                    where = f"{d / files[0]}: {_gib(int(limit))}"
                    best = (left, f"left under the cgroup memory limit ({where})")
            if d == base or not d.is_relative_to(base):
                break
            d = d.parent
    return [best] if best else []


def _gib(n: int | float) -> str:
    return f"{n / GiB:,.1f} GiB"


def check(sc, device: str = "cpu") -> None:
    """Raise ValueError naming the largest part when sc's run cannot fit in device's memory (the
    device parts) or in host RAM (the host parts; all of them on the CPU)."""
    parts = estimate(sc)
    on_cpu = not device.startswith("cuda")
    groups = [([p for p in parts if on_cpu or not p.on_device], "cpu")]
    if not on_cpu:
        groups.append(([p for p in parts if p.on_device], device))
    for group, where in groups:
        need = sum(p.bytes for p in group)
        have, what = available(where)
        if have is not None and need > have:
            top = group[0]
            raise ValueError(
                f"memory: this run needs about {_gib(need)} ({top.what}: {_gib(top.bytes)}, "
                f"sized by {top.keys}); {_gib(have)} {what}"
            )
