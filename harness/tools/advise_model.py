"""The block-size advisor's arithmetic: a traffic's length histogram and a model's KV shape in,
one row per candidate block size and a recommendation out. Pure: plain data, no torch, no I/O.

Per candidate block size b, over the histogram (count-weighted, n(L) = ceil(L / b) blocks):
  slot fill        = sum L / sum n(L) b               tokens stored per allocated KV slot
  last-block fill  = mean (L - (n(L) - 1) b) / b      how full the last block is (the JSON's fill)
  fragmentation    = mean (n(L) b - L) x KV bytes a token x concurrency   the padding, in bytes
  table bytes      = concurrency x ceil(max L / b) x 4                    int32 rows, one a request

The cost model (replaced by measured step times with --measure), its constants below:
  memory factor    = (allocated KV bytes + table bytes) / stored KV bytes, per request: the pool a
                     served token takes, so concurrent requests at a full pool go as 1 / memory
  attention time   = sum over requests of L x 2 x head_dim x dtype bytes + n(L) x
                     BLOCK_OVERHEAD_BYTES: one KV head's program streams its K and V and pays once
                     a block for the table entry it must load before it can address the block; the
                     padding costs no bandwidth (the loads past a sequence's end are masked)
  step-time ratio  = attention time / the best candidate's
  score            = memory factor x ((1 - s) + s x step-time ratio), s the attention share
The recommendation is the lowest score (a tie: the smaller block). A smaller block always fills
better; it wins only while its fill is worth the block lookups it adds."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

# Bytes an element of each KV dtype takes (the article's "1.5 bytes, quantized" is no dtype).
DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
}
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
DTYPE_ALIASES |= {"fp8": "float8_e4m3fn", "float": "float32"}
CANDIDATES = (8, 16, 32, 64, 128)
DEFAULT_CONCURRENCY = 256  # vLLM's default max_num_seqs
TABLE_ENTRY_BYTES = 4  # an int32 block id, as the engine's flat table (and vLLM's) holds it
# A block's table entry is a dependent load: its KV cannot be addressed before it arrives. About
# one L2 round trip (~150 ns) not hidden, at one program's share of HBM bandwidth (an H100's
# 3.35 TB/s over 132 SMs is ~25 B/ns an SM, two programs an SM): ~2 KiB of KV streaming time.
BLOCK_OVERHEAD_BYTES = 2048
# The share of a decode step's time that paged attention takes at a full pool. 0: the step reads
# mostly weights, only fill counts (the smallest block wins); 1: only attention time counts. A
# half: the pool sized near the weights' bytes, as a serving engine sizes it on a 7B-13B model.
ATTENTION_SHARE = 0.5

Cost = Literal["model", "measured"]


def dtype_name(text: str) -> str:
    """A KV dtype's canonical name; ValueError naming the known ones."""
    name = text.strip().lower().removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"{text!r}: unknown dtype (known: {', '.join(DTYPE_BYTES)})")
    return name


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A model's KV cache shape. heads: query heads (only a measurement reads them)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    heads: int
    source: str  # where it came from: a config file, or "flags"

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def token_bytes(self) -> int:
        """KV bytes one token takes in the pool: K and V of every layer and KV head."""
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes

    @property
    def head_token_bytes(self) -> int:
        """What one KV head's program reads a token: its K and V."""
        return 2 * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """A length histogram: (length, count) pairs, lengths ascending, counts > 0."""

    source: str
    histogram: tuple[tuple[int, int], ...]

    @property
    def requests(self) -> int:
        return sum(c for _, c in self.histogram)

    @property
    def tokens(self) -> int:
        return sum(n * c for n, c in self.histogram)

    @property
    def mean(self) -> float:
        return self.tokens / self.requests

    @property
    def max(self) -> int:
        return self.histogram[-1][0]

    def quantile(self, q: float) -> int:
        """The smallest length at least a share q of the requests do not exceed."""
        need, seen = q * self.requests, 0
        for n, c in self.histogram:
            seen += c
            if seen >= need:
                return n
        return self.max

    @property
    def median(self) -> int:
        return self.quantile(0.5)


def traffic_of(source: str, counts: dict[int, int]) -> Traffic:
    return Traffic(source=source, histogram=tuple(sorted((n, c) for n, c in counts.items() if c)))


@dataclass(frozen=True, kw_only=True)
class Candidate:
    block_size: int
    slot_fill: float  # tokens stored per allocated slot
    fill: float  # the mean fill of the last block, 0-1
    blocks_per_request: float
    padding_tokens: float  # empty slots a request, on average
    fragmentation_bytes: int  # padding at the concurrency
    fragmentation_share: float  # of the KV pool the requests hold: 1 - slot fill
    table_bytes: int  # the block table at the concurrency
    memory_factor: float
    step_time: float  # model: bytes-equivalent; measured: seconds
    step_time_ratio: float
    score: float


@dataclass(frozen=True, kw_only=True)
class RuleOfThumb:
    """The article's sqrt(median x head_dim x heads x 2 x dtype bytes), its heads read as KV
    heads: a reference line, not the answer."""

    median: int
    value: float
    text: str


@dataclass(frozen=True, kw_only=True)
class Advice:
    traffic: Traffic
    shape: Shape
    concurrency: int
    attention_share: float
    cost: Cost
    cost_note: str  # how the step times were had
    candidates: tuple[Candidate, ...]
    recommended: int
    reason: str
    rule_of_thumb: RuleOfThumb

    def at(self, block_size: int) -> Candidate:
        return next(c for c in self.candidates if c.block_size == block_size)


def geometry(t: Traffic, b: int) -> tuple[float, float, float, float]:
    """(slot fill, last-block fill, blocks a request, empty slots a request) at block size b."""
    blocks = sum(-(-n // b) * c for n, c in t.histogram)
    last = sum((n - (-(-n // b) - 1) * b) / b * c for n, c in t.histogram)
    r = t.requests
    return t.tokens / (blocks * b), last / r, blocks / r, (blocks * b - t.tokens) / r


def model_step_times(t: Traffic, shape: Shape, sizes) -> dict[int, float]:
    """The cost model's attention time at each block size, in bytes of KV streaming time."""
    return {
        b: sum(
            (n * shape.head_token_bytes + -(-n // b) * BLOCK_OVERHEAD_BYTES) * c
            for n, c in t.histogram
        )
        for b in sizes
    }


def rule_of_thumb(t: Traffic, shape: Shape) -> RuleOfThumb:
    m = t.median
    value = math.sqrt(m * shape.head_dim * shape.kv_heads * 2 * shape.dtype_bytes)
    text = (
        f"the article's rule of thumb, a reference, not the answer: sqrt(median {m} x head_dim "
        f"{shape.head_dim} x kv_heads {shape.kv_heads} x 2 x {shape.dtype_bytes} bytes) = "
        f"{value:.0f} (units unstated; its own example does not compute: sqrt(500 x 128 x 32 x "
        f"2 x 2) is 2862, not 1280, and 1280 bytes are not 25 tokens of 16384)"
    )
    return RuleOfThumb(median=m, value=value, text=text)


def advise(
    t: Traffic,
    shape: Shape,
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    attention_share: float = ATTENTION_SHARE,
    sizes=CANDIDATES,
    measured: dict[int, float] | None = None,
    cost_note: str = "",
) -> Advice:
    """measured: step times (seconds) at each size, replacing the cost model's."""
    times = measured if measured is not None else model_step_times(t, shape, sizes)
    best_time = min(times[b] for b in sizes)
    s = attention_share
    rows = []
    for b in sizes:
        slot_fill, last, per_req, pad = geometry(t, b)
        row_bytes = -(-t.max // b) * TABLE_ENTRY_BYTES
        stored = t.mean * shape.token_bytes
        memory = (stored + pad * shape.token_bytes + row_bytes) / stored
        ratio = times[b] / best_time
        rows.append(
            Candidate(
                block_size=b,
                slot_fill=slot_fill,
                fill=last,
                blocks_per_request=per_req,
                padding_tokens=pad,
                fragmentation_bytes=round(pad * shape.token_bytes * concurrency),
                fragmentation_share=1 - slot_fill,
                table_bytes=concurrency * row_bytes,
                memory_factor=memory,
                step_time=times[b],
                step_time_ratio=ratio,
                score=memory * ((1 - s) + s * ratio),
            )
        )
    best = min(rows, key=lambda c: (round(c.score, 12), c.block_size))
    cost: Cost = "measured" if measured is not None else "model"
    if not cost_note:
        cost_note = (
            f"cost model: a block costs {BLOCK_OVERHEAD_BYTES} bytes of KV streaming time, "
            f"attention share {s:g}"
        )
    return Advice(
        traffic=t,
        shape=shape,
        concurrency=concurrency,
        attention_share=s,
        cost=cost,
        cost_note=cost_note,
        candidates=tuple(rows),
        recommended=best.block_size,
        reason=reason(rows, best, cost),
        rule_of_thumb=rule_of_thumb(t, shape),
    )


def reason(rows: list[Candidate], best: Candidate, cost: Cost) -> str:
    """One line: why the winner beats its neighbours, a smaller and a larger block."""
    i = rows.index(best)
    kind = "modelled" if cost == "model" else "measured"
    parts = []
    if i > 0:
        a = rows[i - 1]
        parts.append(
            f"{a.block_size} fills {a.slot_fill:.1%} vs {best.slot_fill:.1%} but steps "
            f"{a.step_time_ratio / best.step_time_ratio:.2f}x"
        )
    if i + 1 < len(rows):
        c = rows[i + 1]
        parts.append(
            f"{c.block_size} steps {c.step_time_ratio / best.step_time_ratio:.2f}x but fills "
            f"{c.slot_fill:.1%}"
        )
    return (
        f"{best.block_size}: the best trade of fill and {kind} step time (memory x ((1 - s) + "
        f"s x step ratio) = {best.score:.3f}, the lowest); "
        + "; ".join(parts or ["the only candidate"])
    )


def compare(a: Advice, b: Advice) -> tuple[bool, str]:
    """Whether the recommendation changes from traffic a to traffic b, and why, in one line."""
    ta, tb = a.traffic, b.traffic
    shape = "shorter" if tb.mean < ta.mean else "longer" if tb.mean > ta.mean else "as long"
    lengths = (
        f"{tb.source} is {shape} (mean {tb.mean:.1f} vs {ta.mean:.1f}, median {tb.median} vs "
        f"{ta.median})"
    )
    ra, rb = a.recommended, b.recommended
    if ra == rb:
        return False, (
            f"unchanged at {ra}: {lengths}; at {ra} it fills {b.at(ra).slot_fill:.1%} "
            f"({ta.source}: {a.at(ra).slot_fill:.1%}) and still scores best"
        )
    return True, (
        f"{ra} -> {rb}: {lengths}: at {ra} it fills {b.at(ra).slot_fill:.1%} ({ta.source}: "
        f"{a.at(ra).slot_fill:.1%}), at {rb} {b.at(rb).slot_fill:.1%} for a "
        f"{b.at(rb).step_time_ratio / b.at(ra).step_time_ratio:.2f}x step"
    )


def advice_doc(a: Advice) -> dict:
    """The JSON document: candidates (block_size, fill, fragmentation_bytes, table_bytes,
    step_time_ratio, and the rest of each row) and recommended, with what they were had from."""
    t, sh = a.traffic, a.shape
    return {
        "recommended": a.recommended,
        "reason": a.reason,
        "cost": a.cost,
        "cost_note": a.cost_note,
        "candidates": [
            {
                "block_size": c.block_size,
                "fill": round(c.fill, 6),
                "slot_fill": round(c.slot_fill, 6),
                "fragmentation_bytes": c.fragmentation_bytes,
                "fragmentation_share": round(c.fragmentation_share, 6),
                "blocks_per_request": round(c.blocks_per_request, 4),
                "table_bytes": c.table_bytes,
                "memory_factor": round(c.memory_factor, 6),
                "step_time": c.step_time,
                "step_time_ratio": round(c.step_time_ratio, 6),
                "score": round(c.score, 6),
            }
            for c in a.candidates
        ],
        "traffic": {
            "source": t.source,
            "requests": t.requests,
            "mean": round(t.mean, 3),
            "median": t.median,
            "p90": t.quantile(0.9),
            "max": t.max,
            "histogram": [list(p) for p in t.histogram],
        },
        "shape": {
            "layers": sh.layers,
            "kv_heads": sh.kv_heads,
            "head_dim": sh.head_dim,
            "dtype": sh.dtype,
            "heads": sh.heads,
            "token_bytes": sh.token_bytes,
            "source": sh.source,
        },
        "concurrency": a.concurrency,
        "attention_share": a.attention_share,
        "model_constants": {
            "block_overhead_bytes": BLOCK_OVERHEAD_BYTES,
            "table_entry_bytes": TABLE_ENTRY_BYTES,
        },
        "rule_of_thumb": {
            "median": a.rule_of_thumb.median,
            "value": round(a.rule_of_thumb.value, 3),
            "text": a.rule_of_thumb.text,
        },
    }
