"""Paged attention in PyTorch: every read goes through a block table.

Cache layout (one pool per layer and per K/V): [num_blocks, block_size, num_kv_heads, head_dim].
A token at logical position p of a sequence lives at physical slot
table[p // block_size] * block_size + p % block_size.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import NamedTuple

import torch
import torch.nn.functional as F


@contextmanager
def deterministic_writes():
    """Scatters where several writes hit one slot (a spilled row writing over a neighbour's) land in
    an unspecified order on CUDA; PyTorch's deterministic index_put keeps replays byte-identical.
    On the CPU the engine's writes are a few rows on one thread (kvchaos pins torch to one): in
    order."""
    was, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Scatter new K/V ([n, kv_heads, head_dim]) into their slots. A negative slot (an unmapped
    table entry read by a buggy caller) wraps to the end of the pool, as a raw kernel would."""
    nb, bs, hkv, d = k_cache.shape
    with deterministic_writes() if k_cache.is_cuda else nullcontext():
        k_cache.view(nb * bs, hkv, d)[slots] = k
        v_cache.view(nb * bs, hkv, d)[slots] = v


def reversed_in_blocks(slots: torch.Tensor, positions: torch.Tensor, block_size: int):
    """The slots a rank writes when its tokens land in reverse order within each block: position
    p at offset block_size - 1 - p % block_size of its block (the field report's scrambled
    order)."""
    return slots + (block_size - 1) - 2 * (positions % block_size)


def _gather(cache: torch.Tensor, table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[..., blocks] table -> [..., num_tokens, kv_heads, head_dim]. Unused (-1) entries read
    block 0 and are masked by the caller."""
    bs = cache.shape[1]
    nblk = (num_tokens + bs - 1) // bs
    idx = table[..., :nblk].clamp(min=0)
    blocks = cache.index_select(0, idx.reshape(-1).long()).view(*idx.shape, *cache.shape[1:])
    return blocks.flatten(-4, -3)[
        ..., :num_tokens, :, :
    ]  # [..., nblk, bs, hkv, d] -> [..., T, hkv, d]


class DecodePlan(NamedTuple):
    """What every layer's decode attention shares within a step, built once per step (per rank)."""

    blocks: torch.Tensor  # [B * nblk] the block ids to gather; an unmapped (-1) entry reads block 0
    max_len: int  # T: the longest context in the batch
    mask: torch.Tensor | None  # additive float32 [B, 1, 1, T]; None when every row is T long


def decode_blocks(block_tables: torch.Tensor, block_size: int, max_len: int) -> torch.Tensor:
    """The block ids a step's decode gathers: [B * nblk], an unmapped (-1) entry read as block 0."""
    nblk = -(-max_len // block_size)
    return (
        (block_tables if block_tables.shape[1] == nblk else block_tables[:, :nblk])
        .clamp(min=0)
        .view(-1)
    )


def decode_mask(
    seq_lens: torch.Tensor, max_len: int, min_len: int | None = None
) -> torch.Tensor | None:
    """Additive float32 [B, 1, 1, max_len], -inf past each row's length; None when min_len (the
    shortest length, known on the host) says every row is max_len long."""
    if min_len is not None and min_len >= max_len:
        return None
    past_end = torch.arange(max_len, device=seq_lens.device)[None, :] >= seq_lens[:, None]
    return torch.zeros(past_end.shape, device=seq_lens.device).masked_fill_(
        past_end, float("-inf")
    )[:, None, None]


def plan_decode(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int | None = None,
    min_seq_len: int | None = None,
) -> DecodePlan:
    """max_seq_len / min_seq_len: the longest / shortest seq_len when the caller knows them on the
    host; with neither, both are read from seq_lens (a device sync); with max_seq_len alone the
    mask is built whatever the lengths (no sync)."""
    if max_seq_len is None:
        max_seq_len, min_seq_len = int(seq_lens.max()), int(seq_lens.min())
    return DecodePlan(
        decode_blocks(block_tables, block_size, max_seq_len),
        max_seq_len,
        decode_mask(seq_lens, max_seq_len, min_seq_len),
    )


def paged_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    *,
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """One query token per sequence. q: [B, H, D]; block_tables: int32 [B, W];
    seq_lens: int [B], context length including the current token. Returns [B, H, D].
    plan: one plan for a step's layers (plan_decode, or DecodePlan from decode_blocks and
    decode_mask): when given, block_tables, seq_lens and max_seq_len are not read again."""
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    if plan is None:
        plan = plan_decode(block_tables, seq_lens, k_cache.shape[1], max_seq_len)
    t = plan.max_len
    # index_select on flat block ids: the same copy as cache[table], about 3x faster on the CPU
    k = k_cache.index_select(0, plan.blocks).view(b, -1, hkv, d)[:, :t]  # [B, T, Hkv, D]
    v = v_cache.index_select(0, plan.blocks).view(b, -1, hkv, d)[:, :t]
    # GQA without repeating K/V: each KV head's group of query heads acts as that head's queries.
    qg = q.reshape(b, hkv, h // hkv, d).float()
    out = F.scaled_dot_product_attention(
        qg, k.float().transpose(1, 2), v.float().transpose(1, 2), attn_mask=plan.mask, scale=scale
    )  # [B, Hkv, G, D]
    return out.reshape(b, h, d).to(q.dtype)


def paged_prefill_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table_row: torch.Tensor,
    start: int,
    scale: float,
) -> torch.Tensor:
    """A chunk of one sequence's queries at positions start..start+n-1 (their K/V already written),
    attending causally to everything before them through the table. q: [n, H, D]."""
    n, h, d = q.shape
    hkv = k_cache.shape[2]
    g, t = h // hkv, start + n
    k = _gather(k_cache, table_row, t)  # [T, Hkv, D]
    v = _gather(v_cache, table_row, t)
    # GQA as in decode: a KV head's g query heads x n positions are its g * n queries (head, pos).
    qg = q.view(n, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * n, d).float()
    keep = (
        torch.arange(t, device=q.device)[None, :]
        <= torch.arange(start, t, device=q.device)[:, None]
    )  # [n, T]
    out = F.scaled_dot_product_attention(
        qg,
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        attn_mask=keep.repeat(g, 1),
        scale=scale,
    )  # [1, Hkv, g * n, D]
    return out[0].view(hkv, g, n, d).permute(2, 0, 1, 3).reshape(n, h, d).to(q.dtype)
