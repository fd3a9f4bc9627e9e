"""The table_overflow variants' triggers (their requests) and planted defects (their seams). The
default variant's trigger is TableOverflow.shape's own; each here keeps its requests few and short,
so a scenario at the article's shape (rows of 128 blocks of 16) runs in seconds on the CPU."""

from __future__ import annotations

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
