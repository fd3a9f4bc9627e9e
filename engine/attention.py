"""Paged attention in PyTorch: every read goes through a block table.

Cache layout (one pool per layer and per K/V): [num_blocks, block_size, num_kv_heads, head_dim].
A token at logical position p of a sequence lives at physical slot
table[p // block_size] * block_size + p % block_size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter new K/V ([n, kv_heads, head_dim]) into their slots. A negative slot (an unmapped
    table entry read by a buggy caller) wraps to the end of the pool, as a raw kernel would."""
    nb, bs, hkv, d = k_cache.shape
    k_cache.view(nb * bs, hkv, d)[slots] = k
    v_cache.view(nb * bs, hkv, d)[slots] = v


def _gather(cache: torch.Tensor, table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[..., blocks] table -> [..., num_tokens, kv_heads, head_dim]. Unused (-1) entries read block 0
    and are masked by the caller."""
    bs = cache.shape[1]
    nblk = (num_tokens + bs - 1) // bs
    idx = table[..., :nblk].clamp(min=0)
    # index_select on the flattened ids: the same copy as cache[idx], about 3x faster on the CPU
    blocks = cache.index_select(0, idx.reshape(-1).long()).view(*idx.shape, *cache.shape[1:])
    return blocks.flatten(-4, -3)[..., :num_tokens, :, :]  # [..., nblk, bs, hkv, d] -> [..., T, hkv, d]


def paged_decode_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                       max_seq_len: int | None = None) -> torch.Tensor:
    """One query token per sequence. q: [B, H, D]; block_tables: int32 [B, W];
    seq_lens: int32 [B], context length including the current token. Returns [B, H, D]."""
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    t = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    k = _gather(k_cache, block_tables, t)  # [B, T, Hkv, D]
    v = _gather(v_cache, block_tables, t)
    # GQA without repeating K/V: each KV head's group of query heads acts as that head's queries.
    qg = q.reshape(b, hkv, h // hkv, d).float()
    keep = torch.arange(t, device=q.device)[None, :] < seq_lens[:, None]  # [B, T]: False past a row's length
    out = F.scaled_dot_product_attention(qg, k.float().transpose(1, 2), v.float().transpose(1, 2),
                                         attn_mask=keep[:, None, None, :], scale=scale)  # [B, Hkv, G, D]
    return out.reshape(b, h, d).to(q.dtype)


def paged_prefill_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        table_row: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """A chunk of one sequence's queries at positions start..start+n-1 (their K/V already written),
    attending causally to everything before them through the table. q: [n, H, D]."""
    n, h, d = q.shape
    hkv = k_cache.shape[2]
    t = start + n
    k = _gather(k_cache, table_row, t)  # [T, Hkv, D]
    v = _gather(v_cache, table_row, t)
    qg = q.view(n, hkv, h // hkv, d)
    scores = torch.einsum("nkgd,tkd->kgnt", qg.float(), k.float()) * scale
    qpos = torch.arange(start, t, device=q.device)
    future = torch.arange(t, device=q.device)[None, :] > qpos[:, None]  # [n, T]
    scores.masked_fill_(future, float("-inf"))
    out = torch.einsum("kgnt,tkd->nkgd", scores.softmax(-1), v.float())
    return out.reshape(n, h, d).to(q.dtype)
