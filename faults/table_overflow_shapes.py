"""The table_overflow variants' triggers (their requests) and planted defects (their seams). The
default variant's trigger is TableOverflow.shape's own; each here keeps its requests few and short,
so a scenario at the article's shape (rows of 128 blocks of 16) runs in seconds on the CPU."""

from __future__ import annotations

from kvchaos.engine.block_table import kernel_view
from kvchaos.faults.plan import Action


def _submit(f, plan, step: int, req: str, prompt: int, out: int, over: bool = False) -> None:
    """One of the trigger's requests, after those it added before and ahead of the workload's of
    the same step (so its rows follow in order); over: only a defect lets it in."""
    a = Action(step, "submit", req, plan.prompt(max(1, prompt), f.rng), max(1, out), origin=f.name)
    plan.actions.insert(f.front, a)
    f.front += 1
    if over:
        f.overlong.append(req)


def _outlive(cfg, prompt: int, margin: int = 16) -> int:
    """Output tokens that keep a neighbour decoding until a request of `prompt` tokens has been
    prefilled and decoded a few tokens (so a spill has a live victim), within a row."""
    cap = cfg.cache.max_tokens_per_seq
    return max(1, min(cap - 8, -(-prompt // cfg.max_prefill_tokens) + margin))


def _neighbours(f, plan, cfg, step: int, prompt: int, n=None, margin: int = 16) -> None:
    cap = cfg.cache.max_tokens_per_seq
    for i in range(f.p["neighbours"] if n is None else n):
        _submit(f, plan, step, f"nb{i}", min(8, cap // 2), _outlive(cfg, prompt, margin))


def article(f, plan, cfg) -> None:
    """width x block_size + 2 tokens (2050 on 128 x 16), a few generated: its KV needs one block
    more than a row; the neighbours after it hold the next rows."""
    cap, step = cfg.cache.max_tokens_per_seq, f.p["at_step"]
    for i in range(f.p["long_requests"]):
        _submit(f, plan, step, f"long{i}", cap - 2, 4, over=True)
    # they outlive the spill (its 3rd decode step) by a few steps: at the article's shape a long
    # decode-only tail is all the run would add
    _neighbours(f, plan, cfg, step, cap - 2, margin=8)


def off_by_one(f, plan, cfg) -> None:
    """Right at the row's end: exactly a full row (fits), one block over (the off-by-one admits
    it) and two blocks over (rejected even so)."""
    cap, bs, step = cfg.cache.max_tokens_per_seq, cfg.cache.block_size, f.p["at_step"]
    _submit(f, plan, step, "edge_fit", cap - 2, 2)
    # the last generated token's KV is never stored: cap + 2 tokens store cap + 1
    _submit(f, plan, step, "edge_over", cap - 2, 4, over=True)
    _submit(f, plan, step, "far_over", cap - 2, bs + 4)
    _neighbours(f, plan, cfg, step, cap - 2)


def floor_width(f, plan, cfg) -> None:
    """max_model_len = width x block_size + r (2 <= r < block_size): the row holds
    floor(max_model_len / block_size) blocks; one request of max_model_len tokens."""
    limit = max_model_len(cfg.cache)
    _submit(f, plan, f.p["at_step"], "fw_edge", limit - 4, 4, over=True)
    _neighbours(f, plan, cfg, f.p["at_step"], limit - 4)


def max_model_len(cache) -> int:
    """floor_width's token limit: past the row's tokens by 2 or more, inside one more block."""
    return cache.max_tokens_per_seq + max(2, cache.block_size // 2)


def stride_mismatch(f, plan, cfg) -> None:
    """The neighbours hold rows first; a request over the row arrives a step later, and its
    admission resizes the table wider while they decode."""
    cap, step = cfg.cache.max_tokens_per_seq, f.p["at_step"]
    total = int(cap * f.p["overshoot"])
    _neighbours(f, plan, cfg, step, total)
    for i in range(f.p["long_requests"]):
        _submit(f, plan, step + 1, f"long{i}", total - 8, 8, over=True)


def last_row(f, plan, cfg) -> None:
    """Every row but the last held first: the over-long request takes the last one."""
    cap, step = cfg.cache.max_tokens_per_seq, f.p["at_step"]
    _neighbours(f, plan, cfg, step, cap - 2, n=cfg.cache.max_num_seqs - 1)
    _submit(f, plan, step, "long0", cap - 2, 4, over=True)


def chunked_growth(f, plan, cfg) -> None:
    """A prompt longer than a row, prefilled in chunks that do not end at the row's end (one
    crosses it mid-chunk), and one that fills the row exactly in chunks."""
    cap, bs, step = cfg.cache.max_tokens_per_seq, cfg.cache.block_size, f.p["at_step"]
    _submit(f, plan, step, "chunk_over", cap + bs + 2, 2, over=True)
    _submit(f, plan, step, "edge_fit", cap - 2, 2)
    _neighbours(f, plan, cfg, step, cap + bs + 2)


SHAPES = {
    "article": article,
    "off_by_one": off_by_one,
    "floor_width": floor_width,
    "stride_mismatch": stride_mismatch,
    "last_row": last_row,
    "chunked_growth": chunked_growth,
}


def plant(f, engine) -> None:
    """The variant's defect on the engine's seams (the default's: admission and bound check off)."""
    v, seams, table = f.variant, engine.seams, engine.table.table
    bs, mpt = engine.bm.block_size, engine.config.max_prefill_tokens
    if v in ("slot_past_pool", "kernel_block_size"):  # the rows stay checked: the pool is not
        seams.geometry_check = False
        return
    if v not in ("off_by_one", "floor_width", "stride_mismatch", "chunked_growth"):
        seams.admission_check = False
    if v != "stride_mismatch":
        table.bound_check = False
    if v == "off_by_one":  # the last block's index compared with > instead of >=
        seams.admission_blocks = lambda total, prompt: -(-total // bs) - 1
    elif v == "floor_width":  # a token limit, over rows of floor(max_model_len / block_size)
        width, limit = table.width, max_model_len(engine.config.cache)
        seams.admission_blocks = lambda total, prompt: width if total <= limit else width + 1
    elif v == "chunked_growth":  # the first chunk's blocks, not the request's
        seams.admission_blocks = lambda total, prompt: -(-min(prompt, mpt) // bs)
    elif v == "stride_mismatch":  # the stride the kernels were first launched with, kept
        seams.kernel_stride = table.width


def slot_past_pool(f, plan, cfg) -> None:
    """The neighbours first (they hold the pool's first blocks, block 0 among them), then requests
    of a row each, more blocks than the pool holds in all: the pool runs dry, and the manager
    hands out its last block."""
    cc, step = cfg.cache, f.p["at_step"]
    cap, width = cc.max_tokens_per_seq, cc.max_blocks_per_seq
    _neighbours(f, plan, cfg, step, cap, margin=cap)
    n = min(cc.max_num_seqs - f.p["neighbours"], -(-cc.num_blocks // width) + 1)
    for i in range(max(1, n)):
        _submit(f, plan, step, f"fill{i}", cap - 16, 14)


def kernel_block_size(f, plan, cfg) -> None:
    """Neighbours whose contexts span several blocks, read by the kernels every step."""
    bs = cfg.cache.block_size
    _neighbours(f, plan, cfg, f.p["at_step"], 3 * bs)
    _submit(f, plan, f.p["at_step"], "span0", min(6 * bs, cfg.cache.max_tokens_per_seq - 8), 8)


SHAPES["slot_past_pool"] = slot_past_pool
SHAPES["kernel_block_size"] = kernel_block_size


def ask_geometry(f, engine) -> None:
    """The worker's / backend's ask, on the defect's engine and the remediated one alike: a pool
    one block short of the manager's (slot_past_pool), kernels in blocks twice its block size
    (kernel_block_size). The remediated engine aligns it (engine/geometry.py)."""
    if f.variant == "slot_past_pool":
        engine.size_kv_pool(engine.bm.num_blocks - 1)
    else:
        engine.launch_block_size(2 * engine.bm.block_size)


def kernel_reading(snap, stride: int, geometry: dict) -> tuple[int, int, int | None]:
    """(row stride, table blocks per kernel block, the pool in kernel blocks or None) the kernels
    read the snapshot's table with, given their geometry (engine.kernel_geometry())."""
    ratio = geometry.get("kernel_block_size", 1) // geometry.get("block_size", 1)
    if not geometry:
        return stride, 1, None
    return stride, ratio, geometry.get("pool_blocks", snap.num_blocks) // ratio


def would_misread(f, snap) -> set[str]:
    """The sequences the asked geometry reads wrong, whether the engine aligned it or not: one
    holding the pool's last block (slot_past_pool: past a pool one block short), one holding
    a block but block 0 alone (kernel_block_size: kernel blocks twice the manager's)."""
    if f.variant == "slot_past_pool":
        last = snap.num_blocks - 1
        return {req for req, blocks in snap.seq_blocks.items() if last in blocks}
    return {
        req
        for req, row in snap.seq_rows.items()
        if (blocks := snap.seq_blocks.get(req, []))
        and kernel_view(snap.table, row, snap.table_width, len(blocks), 2, snap.num_blocks // 2)
        != blocks
    }
