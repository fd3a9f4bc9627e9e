"""Real tensor-parallel ranks on torch.distributed (`tp_mode = "distributed"`): gloo between CPU
processes, NCCL with one GPU per rank. The in-process simulation (kvchaos.engine.ranks) stays the default.

Rank 0 is the in-process Engine (scheduler, block manager, outputs) unchanged but for where its
table upload, batch and attention go. Every rank holds its own copy of the flat block table and the
pool of its num_kv_heads / world KV heads, and computes attention for its heads; the outputs are
all-gathered per layer, so rank 0's tokens and logits are bit-identical to the simulation's. The
rest of the model is tiny and replicated: every rank needs the whole hidden state for its q, k, v.

One step on the wire, from rank 0:
  broadcast   header: op, step, table version, sync; batch: token ids, positions, decode rows,
              prefill chunks, copy-on-write copies, and which ranks get a table update (and its size)
  isend/recv  the table updates due this step whose table changed (int32)
  all_gather  [version, crc] of the table each rank is about to compute with: the acknowledgement
              (with sync on, any rank on another version makes every rank refuse the step) and
              the cross-rank checker's input, recorded by rank 0 in the step stats
  all_gather  per layer, each rank's attention output for its heads
Table updates leave rank 0 through its RankGroup, the simulation's own queues: the ordering-race
trigger (the rank_delay seam) holds lag_rank's update there for lag_steps steps, the remediation
(rank_sync) drains every update in flight before the header goes out, and the defect is a rank
computing, unacknowledged, on whatever table it holds.

A rank that dies or stops answering fails a collective on rank 0 (a closed connection at once, or
the group's timeout). Rank 0 names it (exit status, the error it posted, or the progress it last
reported), kills the other followers and raises RankFailure, which the runner records as ERROR.

Followers are launched by rank 0 (`python -m kvchaos.engine.distributed`, the torchrun environment) or
by torchrun itself, where ranks > 0 call serve(). They idle on the store between runs.
"""

from __future__ import annotations

import atexit
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvchaos.engine.attention import paged_decode_torch, paged_prefill_torch, plan_decode, write_kv
from kvchaos.engine.config import CacheConfig, EngineConfig, ModelConfig
from kvchaos.engine.engine import Engine, _decode_backend
from kvchaos.engine.errors import ConfigError, KVChaosError
from kvchaos.engine.model import Model
from kvchaos.engine.ranks import VirtualRank

STEP, END = 1, 2
HEAD = 9  # op, step, version, sync; then how many tokens, decode rows, prefill chunks, copies, table updates
TIMERS = ("bcast", "table", "ack", "gather", "compute")
DEFAULT_TIMEOUT_S = float(os.environ.get("KVCHAOS_RANK_TIMEOUT", "60"))
STARTUP_S = 300.0  # importing torch on a loaded box takes a while; a crash is seen at once anyway
TEST_FAULT_ENV = "KVCHAOS_TP_TEST_FAULT"  # test-only: "die:RANK:STEP" or "hang:RANK:STEP"


class RankFailure(KVChaosError):
    """A rank died or stopped answering. `ranks` names them."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class StaleTable(KVChaosError):
    """A rank was about to compute on a table version other than the step's: refused."""


def external_launch() -> bool:
    """Started by torchrun (or any launcher that sets its environment), rather than by us."""
    return (
        "RANK" in os.environ
        and "WORLD_SIZE" in os.environ
        and "KVCHAOS_PARENT_PID" not in os.environ
    )


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _rank_device(device: str, rank: int) -> torch.device:
    """One GPU per rank: a launcher's LOCAL_RANK, else the configured GPU plus the rank."""
    d = torch.device(device)
    return (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", (d.index or 0) + rank)))
        if d.type == "cuda"
        else d
    )


def config_from_dict(d: dict) -> EngineConfig:
    d = dict(d)
    return EngineConfig(
        model=ModelConfig(**d.pop("model")), cache=CacheConfig(**d.pop("cache")), **d
    )


def step_capacity(cfg: EngineConfig, world: int) -> int:
    """Ints in a step's one broadcast: room for a full batch; a longer one sends the rest in a second."""
    seqs = cfg.cache.max_num_seqs
    return HEAD + 2 * (cfg.max_prefill_tokens + seqs) + 6 * seqs + 2 * world


class Wire:
    """The step's collectives, timed by kind and counted on every rank in the same order: the count
    is a rank's progress, which names the rank that hangs. (On NCCL the times are launch times.)"""

    def __init__(self, device: torch.device, world: int) -> None:
        self.dev, self.world = device, world
        self.ops = 0
        self.busy = False  # between a step's broadcast and its last collective
        self.sends: list = []
        self.t = dict.fromkeys(TIMERS, 0.0)

    def _op(self, kind: str, fn, *args):
        self.ops += kind != "table"  # point-to-point traffic differs by rank: not progress
        t0 = time.perf_counter()
        out = fn(*args)
        self.t[kind] += time.perf_counter() - t0
        return out

    def broadcast_step(self, msg: list[int] | None, cap: int) -> torch.Tensor:
        """Rank 0's header and batch (msg), in one broadcast of `cap` ints if it fits."""
        x = (
            torch.tensor(msg + [0] * (cap - len(msg)), dtype=torch.int64, device=self.dev)
            if msg is not None
            else torch.empty(cap, dtype=torch.int64, device=self.dev)
        )
        self._op("bcast", dist.broadcast, x[:cap], 0)
        n = HEAD + Batch.body_len(x[:HEAD].tolist())
        if n > cap:
            if msg is None:
                x = torch.cat([x, torch.empty(n - cap, dtype=torch.int64, device=self.dev)])
            self._op("bcast", dist.broadcast, x[cap:n], 0)
        return x[:n]

    def gather(self, x: torch.Tensor, kind: str) -> list[torch.Tensor]:
        out = [torch.empty_like(x) for _ in range(self.world)]
        self._op(kind, dist.all_gather, out, x)
        return out

    def send_table(self, dst: int, table: torch.Tensor) -> None:
        msg = table.to(self.dev)
        self.sends.append(
            (self._op("table", dist.isend, msg, dst), msg)
        )  # msg stays alive until sent

    def settle(self) -> None:
        for work, _ in self.sends:
            self._op("table", work.wait)
        self.sends = []

    def recv_table(self, numel: int) -> torch.Tensor:
        msg = torch.empty(numel, dtype=torch.int32, device=self.dev)
        self._op("table", dist.recv, msg, 0)
        return msg


@dataclass
class Batch:
    """One step's inputs, the same on every rank. Table entries travel as indices (entry (row, j)
    of the flat table is row * width + j), so every rank resolves them through its own copy."""

    op: int
    step: int
    version: int
    sync: bool
    tokens: torch.Tensor
    positions: torch.Tensor
    bases: list[int]  # each decode row's entry 0
    max_len: int  # longest decode context
    min_len: int  # shortest decode context
    prefill: list[tuple[int, int, int]]  # (row's entry 0, start, n)
    copies: list[tuple[int, int]]  # copy-on-write (src block, dst block)
    updates: list[
        tuple[int, int, int]
    ]  # table updates, in order: (rank, version, numel); numel 0: the
    # rank's previous table under a new version, else sent after this

    @staticmethod
    def pack(step, version, sync, tok, pos, bases, prefill, copies, updates) -> list[int]:
        head = [
            STEP,
            step,
            version,
            int(sync),
            len(tok),
            len(bases),
            len(prefill),
            len(copies),
            len(updates),
        ]
        return head + tok + pos + bases + [x for t in (*prefill, *copies, *updates) for x in t]

    @staticmethod
    def body_len(head: list[int]) -> int:
        return 2 * head[4] + head[5] + 3 * head[6] + 2 * head[7] + 3 * head[8]

    @staticmethod
    def unpack(msg: torch.Tensor, device: torch.device) -> "Batch":
        op, step, version, sync, nt, nd, npre, ncp, _ = msg[:HEAD].tolist()
        t = msg[HEAD : HEAD + 2 * nt].to(device)
        rest = msg[HEAD + 2 * nt :].tolist()
        pre, cps, ups = (
            rest[nd : nd + 3 * npre],
            rest[nd + 3 * npre : nd + 3 * npre + 2 * ncp],
            rest[nd + 3 * npre + 2 * ncp :],
        )
        dec_pos = msg[HEAD + nt : HEAD + nt + nd].tolist()
        return Batch(
            op,
            step,
            version,
            bool(sync),
            t[:nt],
            t[nt:],
            rest[:nd],
            max(dec_pos) + 1 if nd else 0,
            min(dec_pos) + 1 if nd else 0,
            [tuple(pre[i : i + 3]) for i in range(0, len(pre), 3)],
            [tuple(cps[i : i + 2]) for i in range(0, len(cps), 2)],
            [tuple(ups[i : i + 3]) for i in range(0, len(ups), 3)],
        )


class Shard:
    """What every rank holds and does: its copy of the block table, the pool of its KV heads, its
    share of attention."""

    def __init__(
        self,
        cfg: EngineConfig,
        rank: int,
        world: int,
        device: torch.device,
        table: VirtualRank,
        scale: float,
        pool: torch.Tensor | None = None,
    ) -> None:
        mc, cc = cfg.model, cfg.cache
        self.rank, self.world, self.device, self.table, self.scale = (
            rank,
            world,
            device,
            table,
            scale,
        )
        self.hkv = mc.num_kv_heads // world
        self.h = self.hkv * (mc.num_heads // mc.num_kv_heads)
        self.bs, self.layers = cc.block_size, mc.num_layers
        self.pool = (
            pool
            if pool is not None
            else torch.zeros(
                mc.num_layers,
                2,
                cc.num_blocks,
                cc.block_size,
                self.hkv,
                mc.head_dim,
                dtype=mc.torch_dtype,
                device=device,
            )
        )
        self.decode_attention = _decode_backend(cfg.resolved_backend())

    def receive(self, wire: Wire, b: Batch) -> None:
        """Apply, in order, the table updates rank 0 sends this rank this step."""
        for r, version, numel in b.updates:
            if r == self.rank and numel:
                self.table.apply(version, wire.recv_table(numel))
            elif r == self.rank:
                self.table.version = version

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([c[0] for c in copies], device=self.device)
            dst = torch.tensor([c[1] for c in copies], device=self.device)
            self.pool[:, :, dst] = self.pool[:, :, src]

    def acknowledge(self, wire: Wire, b: Batch) -> tuple[list[int], list[int]]:
        """Every rank reports [version, crc] of the table it is about to compute with."""
        mine = torch.tensor(
            [self.table.version, self.table.crc()], dtype=torch.int64, device=wire.dev
        )
        got = torch.stack(wire.gather(mine, "ack")).tolist()
        versions, crcs = [g[0] for g in got], [g[1] for g in got]
        stale = [r for r, v in enumerate(versions) if v != b.version]
        if b.sync and stale:
            raise StaleTable(
                f"step {b.step}: ranks {stale} hold table versions {[versions[r] for r in stale]}, "
                f"the step's is {b.version}: refusing to compute on a stale table"
            )
        return versions, crcs

    def resolve(self, b: Batch):
        """Slot mapping and attention tables through this rank's own table. Flat addressing: an
        overlong row reads on into the next one, as a kernel would (as Engine._build_batch)."""
        flat, bs, dev = self.table.table, self.bs, self.device
        last = flat.numel() - 1
        slots, dec, chunks = [], None, []
        nd = len(b.bases)
        if nd:
            nblk = -(-b.max_len // bs)
            base = torch.tensor(b.bases, device=dev)
            p = b.positions[:nd]
            idx, ent = (
                (base[:, None] + torch.arange(nblk, device=dev)[None, :]).view(-1),
                base + p // bs,
            )
            if max(b.bases) + nblk - 1 > last:
                idx, ent = idx.clamp(max=last), ent.clamp(max=last)
            tables = flat.index_select(0, idx).view(nd, nblk)
            slots.append(flat.index_select(0, ent).long() * bs + p % bs)
            lens = (p + 1).to(torch.int32)
            plan = (
                plan_decode(tables, lens, bs, b.max_len, b.min_len)
                if self.decode_attention is paged_decode_torch
                else None
            )
            dec = (tables, lens, plan)
        off = nd
        for base, start, n in b.prefill:
            nblk = -(-(start + n) // bs)
            trow = flat[(base + torch.arange(nblk, device=dev)).clamp_(max=last)]
            p = b.positions[off : off + n]
            slots.append(trow[p // bs].long() * bs + p % bs)
            chunks.append((off, n, start, trow))
            off += n
        return torch.cat(slots) if len(slots) > 1 else slots[0], dec, chunks

    def attend(self, wire: Wire, b: Batch, meta):
        slots, dec, chunks = meta
        r, h, hkv, nd, pool, scale = (
            self.rank,
            self.h,
            self.hkv,
            len(b.bases),
            self.pool,
            self.scale,
        )

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc, vc = pool[layer, 0], pool[layer, 1]
            qr = q[:, r * h : (r + 1) * h]
            write_kv(kc, vc, slots, k[:, r * hkv : (r + 1) * hkv], v[:, r * hkv : (r + 1) * hkv])
            parts = (
                [
                    self.decode_attention(
                        qr[:nd], kc, vc, dec[0], dec[1], scale, b.max_len, plan=dec[2]
                    )
                ]
                if nd
                else []
            )
            for off, n, start, trow in chunks:
                parts.append(paged_prefill_torch(qr[off : off + n], kc, vc, trow, start, scale))
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
            if self.world > 1:
                out = torch.cat(wire.gather(out.contiguous(), "gather"), dim=1)
            wire.busy = layer < self.layers - 1
            return out

        return attend


class Link(VirtualRank):
    """Rank 0's end of the link to another rank: applying an update puts it on the wire, once the
    step's broadcast (which tells the rank what to expect) is out. A table equal to the last one
    sent travels as its version alone."""

    def __init__(self, index: int, device: torch.device, outbox: list) -> None:
        super().__init__(index, device)
        self.outbox, self.last = outbox, None

    def apply(self, version: int, table: torch.Tensor) -> None:
        same = self.last is not None and torch.equal(self.last, table)
        if not same:
            self.last = table.clone()  # the staging buffer is reused
        self.outbox.append((self.index, version, None if same else self.last))
        self.version = version


class DistEngine(Engine):
    """Rank 0 of a real tensor-parallel group. `cluster`: a Cluster to run on (reused across runs);
    None launches one for this engine, shut down by close()."""

    def __init__(
        self, config: EngineConfig, block_manager=None, cluster: "Cluster | None" = None
    ) -> None:
        super().__init__(config, block_manager)
        world = config.tp_size
        self._outbox: list = []
        for r in range(1, world):
            self.ranks.ranks[r] = Link(r, self.device, self._outbox)
        self.kv_pools, self._kv_views = (
            self.kv_pools[:1],
            self._kv_views[:1],
        )  # this rank's heads only
        self.shard = Shard(
            config, 0, world, self.device, self.ranks.ranks[0], self.model.scale, self.kv_pools[0]
        )
        self._own = cluster is None
        self.cluster = cluster if cluster is not None else Cluster()
        self.wire: Wire | None = None
        self._copies: list = []
        self._cap = step_capacity(config, world)
        self.rank_timers: list[dict] = []  # per rank, seconds by kind, filled by close()

    # Engine._upload_table publishes through self.ranks: rank 0's own copy is applied there, the
    # links queue the others' updates (and, with rank_sync, drain every update in flight).
    def step(self):
        if self.wire is None:
            self.wire = self.cluster.begin_run(self.config)
        w = self.wire
        g0 = w.t["gather"]
        try:
            out = super().step()
        except BaseException as e:
            if not w.busy:  # failed before the step's broadcast: the ranks are still in step
                raise
            self._fail(e)
        w.t["compute"] += (
            out.stats.latency_s - out.stats.host_s - (w.t["gather"] - g0)
        )  # model, logits
        return out

    def _fail(self, e: BaseException):
        """The ranks are out of step with us: name the rank at fault if one is, kill the followers."""
        failure = (
            None
            if isinstance(e, StaleTable)
            else self.cluster.diagnose(self.wire.ops, self.step_count)
        )
        self.cluster.abort()
        self.wire = None
        if failure is None:
            raise e
        raise failure from e

    def _copy_blocks(self, copies) -> None:
        self._copies += copies
        super()._copy_blocks(copies)

    def _build_batch(self, decode, prefill):
        width = self.bm.table.width
        rows, tok, pos = self._batch_inputs(decode, prefill)
        copies, self._copies = self._copies, []
        msg = Batch.pack(
            self.step_count,
            self.table_version,
            self.seams.rank_sync,
            tok,
            pos,
            [rows[s.id] * width for s in decode],
            [(rows[s.id] * width, s.num_computed, n) for s, n in prefill],
            copies,
            [(r, v, 0 if table is None else table.numel()) for r, v, table in self._outbox],
        )
        w = self.wire
        w.busy = True
        b = self._batch = Batch.unpack(w.broadcast_step(msg, self._cap), self.device)
        for r, _, table in self._outbox:
            if table is not None:
                w.send_table(r, table)
        self._outbox.clear()
        versions, crcs = self.shard.acknowledge(w, b)
        w.settle()
        links = self.ranks.ranks
        sent = [r.version for r in links]
        if versions != sent:  # the wire lost or reordered an update: nothing below could be trusted
            raise RuntimeError(
                f"step {b.step}: ranks acknowledged table versions {versions}, were sent {sent}"
            )
        if len(links) > 1:
            self._crcs = crcs
        return b.tokens, b.positions, self.shard.resolve(b)

    def _attend(self, nd: int, metas):
        return self.shard.attend(self.wire, self._batch, metas)

    def close(self) -> None:
        super().close()
        try:
            if self.wire is not None:
                try:
                    self.rank_timers = self.cluster.end_run(self.wire, self._cap)
                    self.wire = None
                except BaseException as e:
                    self._fail(e)
        finally:
            if self._own:
                self.cluster.close()


class Cluster:
    """The ranks of one group, seen from rank 0: the followers (child processes it launches, or
    torchrun's), the process group, and a store that starts runs and holds what followers report
    (readiness, progress, errors). Launched on the first run and reused by later ones; relaunched
    when a run needs another world size or device, or after a failure."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.key: tuple | None = None  # (world, backend, first GPU's index) while up
        self.procs: dict[int, subprocess.Popen] = {}
        self.runs = 0

    def begin_run(self, cfg: EngineConfig) -> Wire:
        dev = _rank_device(cfg.device, 0)
        if self.key != (cfg.tp_size, _backend(dev), dev.index):  # rank r sits on GPU index + r
            self.close()
            self._start(cfg.tp_size, dev)
        self.runs += 1
        self.store.set(f"run/{self.runs}", json.dumps(cfg.to_dict()))
        self.wire.t = dict.fromkeys(TIMERS, 0.0)
        return self.wire

    def end_run(self, wire: Wire, cap: int) -> list[dict]:
        """Ends the run on every rank; returns each rank's seconds by kind of work."""
        wire.broadcast_step([END] + [0] * (HEAD - 1), cap)
        mine = torch.tensor([wire.t[k] for k in TIMERS], dtype=torch.float64, device=wire.dev)
        return [dict(zip(TIMERS, t.tolist())) for t in wire.gather(mine, "ack")]

    def _start(self, world: int, dev: torch.device) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "a torch.distributed process group is already up in this process: "
                "one kvchaos Cluster at a time"
            )
        backend = _backend(dev)
        timeout = dt.timedelta(seconds=self.timeout_s)
        if external_launch():
            if int(os.environ["RANK"]) != 0 or int(os.environ["WORLD_SIZE"]) != world:
                raise ValueError(
                    f"the launcher started rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}; "
                    f"this run needs rank 0 of {world} (--world-size)"
                )
            base = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=dt.timedelta(seconds=STARTUP_S),
            )
        else:
            if backend == "nccl" and dev.index + world > torch.cuda.device_count():
                raise ConfigError(
                    f"{world} NCCL ranks need one GPU each from cuda:{dev.index}; "
                    f"this machine has {torch.cuda.device_count()} (use --tp-mode simulated)"
                )
            base = dist.TCPStore(
                "127.0.0.1",
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=dt.timedelta(seconds=STARTUP_S),
            )
            env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(base.port),
                "WORLD_SIZE": str(world),
                "KVCHAOS_PARENT_PID": str(os.getpid()),
                "KVCHAOS_RANK_TIMEOUT": str(self.timeout_s),
            }
            for r in range(1, world):
                self.procs[r] = subprocess.Popen(
                    [sys.executable, "-m", "kvchaos.engine.distributed"],
                    env={**env, "RANK": str(r), "LOCAL_RANK": str((dev.index or 0) + r)},
                )
        atexit.register(self.close)
        self._base, self.store = base, dist.PrefixStore("kvchaos", base)
        self.key, self.runs = (world, backend, dev.index), 0
        try:
            self.store.set("group", backend)
            deadline = time.monotonic() + STARTUP_S
            while world > 1 and not self.store.check([f"ready/{r}" for r in range(1, world)]):
                dead = self._exited()
                if dead or time.monotonic() > deadline:
                    raise RankFailure(
                        f"{'; '.join(f'rank {r} {w}' for r, w in dead.items()) or 'ranks did not start'}"
                        f" before joining the group",
                        sorted(dead),
                    )
                time.sleep(0.02)
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("pg", base),
                rank=0,
                world_size=world,
                timeout=timeout,
            )
        except BaseException:
            self.abort()
            raise
        self.wire = Wire(dev if backend == "nccl" else torch.device("cpu"), world)

    def _exited(self) -> dict[int, str]:
        out = {}
        for r, p in self.procs.items():
            rc = p.poll()
            if rc is not None:
                out[r] = f"died ({signal.Signals(-rc).name})" if rc < 0 else f"exited (code {rc})"
        return out

    def diagnose(self, ops: int, step: int) -> RankFailure | None:
        """Which ranks are at fault: those that died without a word (crashed, killed), else those
        alive whose progress is behind ours (hung), else those that posted an error. A rank that
        errored because a peer went away is listed after the cause. None if every rank looks
        healthy: the fault is rank 0's own."""
        deadline = (
            time.monotonic() + 2.0
        )  # a dead peer's closed connection is seen before its exit status
        while self.procs and not self._exited() and time.monotonic() < deadline:
            time.sleep(0.02)
        exited, errors, seen = self._exited(), {}, {}
        for r in range(1, self.key[0]):
            try:  # the store lives in this process (or the launcher): if it is gone, so is the group
                if self.store.check([f"error/{r}"]):
                    errors[r] = self.store.get(f"error/{r}").decode()
                if self.store.check([f"progress/{r}"]):
                    seen[r] = int(self.store.get(f"progress/{r}"))
            except Exception:
                pass
        cause = {r: w for r, w in exited.items() if r not in errors}
        if (
            not cause
        ):  # progress is posted a beat late: only judged once the group's timeout has passed
            cause = {
                r: f"hung: no answer within {self.timeout_s:g} s (it reached collective {n}, rank 0 "
                f"collective {ops})"
                for r, n in seen.items()
                if r not in exited and n < ops
            }
        then = {r: f"{exited.get(r, 'failed')}: {e}" for r, e in errors.items()}
        if not cause:
            cause, then = then, {}
        if not cause:
            return None
        msg = "; ".join(f"rank {r} {w}" for r, w in sorted(cause.items())) + f", at step {step}"
        if then:
            msg += " (then " + "; ".join(f"rank {r} {w}" for r, w in sorted(then.items())) + ")"
        return RankFailure(msg, sorted(cause))

    def abort(self) -> None:
        """Kill the followers (they may be mid-collective) and drop the group."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        self._teardown()

    def close(self) -> None:
        """Tell the followers to exit, wait for them (killing any that linger), drop the group."""
        if self.key is None:
            return
        try:
            self.store.set(f"run/{self.runs + 1}", "shutdown")
        except Exception:
            pass
        deadline = time.monotonic() + 10.0
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        self._teardown()

    def _teardown(self) -> None:
        for p in self.procs.values():
            p.wait()
        self.procs = {}
        if dist.is_initialized():
            dist.destroy_process_group()
        self.key, self.store, self._base = None, None, None
        atexit.unregister(self.close)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- a follower rank -----------------------------------------------------------------------------
def _watch(
    parent: int | None, store_args: tuple, rank: int, wire_of, stop: threading.Event
) -> None:
    """Post this rank's progress for rank 0's diagnosis; exit if the parent is gone (no orphans)."""
    store = dist.PrefixStore("kvchaos", dist.TCPStore(*store_args, is_master=False))
    last = -1
    while not stop.wait(0.2):
        if parent is not None and os.getppid() != parent:
            os._exit(1)
        ops = wire_of().ops if wire_of() else 0
        if ops != last:
            try:
                store.set(f"progress/{rank}", str(ops))
            except Exception:
                return
            last = ops


def _test_fault(rank: int):
    kind, r, s = (os.environ.get(TEST_FAULT_ENV, "::").split(":") + ["", ""])[:3]
    if not kind or int(r) != rank:
        return lambda step: None

    def hook(step: int) -> None:
        if step == int(s):
            if kind == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(1e6)  # hang

    return hook


def serve() -> int:
    """A follower's life: join the group, then serve runs until rank 0 says shutdown."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    parent = int(os.environ["KVCHAOS_PARENT_PID"]) if "KVCHAOS_PARENT_PID" in os.environ else None
    if parent is not None and os.getppid() != parent:
        return 1
    torch.set_num_threads(
        int(os.environ.get("KVCHAOS_CPU_THREADS", "1"))
    )  # two spinning threads per rank thrash
    timeout = float(os.environ.get("KVCHAOS_RANK_TIMEOUT", DEFAULT_TIMEOUT_S))
    store_args = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    base = dist.TCPStore(
        *store_args, is_master=False, timeout=dt.timedelta(days=7)
    )  # idle between runs
    store = dist.PrefixStore("kvchaos", base)
    holder: dict = {}
    stop = threading.Event()
    threading.Thread(
        target=_watch,
        args=(parent, store_args, rank, lambda: holder.get("wire"), stop),
        daemon=True,
    ).start()
    try:
        store.wait(["group"])
        backend = store.get("group").decode()
        if backend == "nccl":
            torch.cuda.set_device(_rank_device("cuda", rank))
        store.set(f"ready/{rank}", "1")
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg", base),
            rank=rank,
            world_size=world,
            timeout=dt.timedelta(seconds=timeout),
        )
        wire = holder["wire"] = Wire(
            _rank_device("cuda", rank) if backend == "nccl" else torch.device("cpu"), world
        )
        n = 0
        while True:
            n += 1
            store.wait([f"run/{n}"])
            msg = store.get(f"run/{n}").decode()
            if msg == "shutdown":
                return 0
            cfg = config_from_dict(json.loads(msg))
            _serve_run(cfg, rank, world, _rank_device(cfg.device, rank), wire)
    except BaseException as e:
        try:
            store.set(f"error/{rank}", f"{type(e).__name__}: {e}")
        except Exception:
            pass
        raise
    finally:
        stop.set()
        if dist.is_initialized():
            dist.destroy_process_group()


@torch.inference_mode()
def _serve_run(cfg: EngineConfig, rank: int, world: int, dev: torch.device, wire: Wire) -> None:
    model = Model(cfg.model, cfg.seed, dev)
    shard = Shard(cfg, rank, world, dev, VirtualRank(rank, dev), model.scale)
    wire.t = dict.fromkeys(TIMERS, 0.0)
    hook = _test_fault(rank)
    cap = step_capacity(cfg, world)
    while True:
        b = Batch.unpack(wire.broadcast_step(None, cap), dev)
        if b.op == END:
            mine = torch.tensor([wire.t[k] for k in TIMERS], dtype=torch.float64, device=wire.dev)
            wire.gather(mine, "ack")
            return
        hook(b.step)
        shard.receive(wire, b)
        shard.copy_blocks(b.copies)
        shard.acknowledge(wire, b)
        t0, g0 = time.perf_counter(), wire.t["gather"]
        model.forward(b.tokens, b.positions, shard.attend(wire, b, shard.resolve(b)))
        wire.t["compute"] += time.perf_counter() - t0 - (wire.t["gather"] - g0)


if __name__ == "__main__":
    sys.exit(serve())
