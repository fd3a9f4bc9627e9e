"""Paged-attention decode in Triton (flash-decoding, split-KV): attention.paged_decode_torch's twin.

Kernel 1 runs on a (batch, kv_head, split) grid. Each program takes every query head of its KV-head
group as one [G_PAD, D_PAD] tile, walks its share of the sequence BLOCK_N tokens at a time (reading
the block table inside the kernel, so any block_size works: one tile may span several blocks or part
of one), and keeps an online softmax in float32. With one split it writes the output directly;
otherwise it writes a partial output and log-sum-exp per split, and kernel 2 combines them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


# max_len and s_tb (the table's row stride) change from step to step in the engine: specializing on
# them (== 1, % 16 == 0) would compile a new variant of the kernel mid-run each time they cross one.
@triton.jit(do_not_specialize=["max_len", "s_tb"])
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    scale_log2,
    max_len,
    s_qb,
    s_qh,
    s_qd,
    s_kb,
    s_kt,
    s_kh,
    s_kd,
    s_vb,
    s_vt,
    s_vh,
    s_vd,
    s_tb,
    s_tw,
    s_ob,
    s_oh,
    s_od,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PREC: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kvh * G + offs_g

    seq_len = tl.minimum(tl.load(lens_ptr + b), max_len)
    # Split this sequence's own chunks evenly; trailing splits of a short sequence may be empty.
    num_chunks = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(num_chunks, NUM_SPLITS)
    c_start = split * per_split
    c_end = tl.minimum(c_start + per_split, num_chunks)

    q = tl.load(
        q_ptr + b * s_qb + heads[:, None] * s_qh + offs_d[None, :] * s_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)

    table_row = table_ptr + b.to(tl.int64) * s_tb
    for c in range(c_start, c_end):
        pos = c * BLOCK_N + offs_n
        n_mask = pos < seq_len
        blk = tl.load(table_row + (pos // BLOCK_SIZE) * s_tw, mask=n_mask, other=0)
        # -1 entries read block 0 (masked or not), like the reference and never out of bounds.
        blk = tl.maximum(blk, 0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr
            + blk[:, None] * s_kb
            + slot[:, None] * s_kt
            + kvh * s_kh
            + offs_d[None, :] * s_kd,
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_ptr
            + blk[:, None] * s_vb
            + slot[:, None] * s_vt
            + kvh * s_vh
            + offs_d[None, :] * s_vd,
            mask=kv_mask,
            other=0.0,
        )
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = (
            tl.dot(q, tl.trans(k), input_precision=PREC) * scale_log2
        )  # [G_PAD, BLOCK_N], log2 units
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every chunk holds >= 1 valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new

    nonempty = l_i > 0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + b * s_ob + heads[:, None] * s_oh + offs_d[None, :] * s_od,
            o.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        # Scratch is contiguous [B, H, NUM_SPLITS, D_PAD] / [B, H, NUM_SPLITS]; lse in log2 units.
        row = (b * (tl.num_programs(1) * G) + heads) * NUM_SPLITS + split
        tl.store(part_ptr + row[:, None] * D_PAD + offs_d[None, :], o, mask=g_mask[:, None])
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _combine_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    s_ob,
    s_oh,
    s_od,
    H,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < NUM_SPLITS
    row = (b * H + h) * NUM_SPLITS
    lse = tl.load(lse_ptr + row + offs_s, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    part = tl.load(
        part_ptr + (row + offs_s)[:, None] * D_PAD + offs_d[None, :],
        mask=s_mask[:, None],
        other=0.0,
    )
    o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + b * s_ob + h * s_oh + offs_d * s_od,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < D,
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def auto_splits(q: torch.Tensor, work_items: int, num_chunks: int) -> int:
    if q.is_cuda and not _interpreting():
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        want = triton.cdiv(2 * sms, max(work_items, 1))  # ~2 waves of programs
        # Keep >= 4 chunks per split so the combine pass and scratch traffic stay negligible.
        return max(1, min(want, triton.cdiv(num_chunks, 4), 64))
    return max(1, min(2, num_chunks))


def paged_decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    *,
    plan=None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as paged_decode_torch: q [B, H, D]; caches [num_blocks, block_size, H_kv, D];
    block_tables int32 [B, W] (any row stride); seq_lens int [B] (>= 1, includes the current
    token). Attends to min(seq_len, max_seq_len) tokens. Returns [B, H, D] in q's dtype. plan is
    the torch path's per-step gather plan: unused, the kernel reads the table itself."""
    b, h, d = q.shape
    _, block_size, hkv, dk = k_cache.shape
    if dk != d or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"cache shape {tuple(k_cache.shape)}/{tuple(v_cache.shape)} vs head_dim {d}"
        )
    if h % hkv:
        raise ValueError(f"num_heads {h} not a multiple of num_kv_heads {hkv}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if block_tables.dim() != 2 or block_tables.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError("block_tables must be [B, W] and seq_lens [B]")
    out = torch.empty_like(q)
    if b == 0 or h == 0:
        return out

    g = h // hkv
    g_pad = max(16, triton.next_power_of_2(g))  # tl.dot wants every dim >= 16
    d_pad = max(16, triton.next_power_of_2(d))
    native = q.is_cuda and not _interpreting()
    block_n = max(block_size, 32 if native else 16)
    cap = block_tables.shape[1] * block_size  # bound without a device->host sync on seq_lens
    if max_seq_len is not None:
        cap = min(cap, max_seq_len)
    if num_splits is None:
        num_splits = auto_splits(q, b * hkv, triton.cdiv(max(cap, 1), block_n))
    num_splits = max(1, int(num_splits))

    seq_lens = seq_lens.to(torch.int32)
    if block_tables.dtype != torch.int32:
        block_tables = block_tables.to(torch.int32)
    if num_splits > 1:
        part = torch.empty(b, h, num_splits, d_pad, device=q.device, dtype=torch.float32)
        lse = torch.empty(b, h, num_splits, device=q.device, dtype=torch.float32)
    else:
        part = lse = out  # unused placeholders
    prec = "ieee" if q.dtype == torch.float32 else None  # fp32 must not silently drop to tf32
    # The interpreter's tl.dot multiplies bf16 tiles as their raw uint16 bits; upcast there only.
    dot_f32 = not native and q.dtype == torch.bfloat16

    _decode_split_kernel[(b, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part,
        lse,
        scale * _LOG2E,
        cap,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        G=g,
        G_PAD=g_pad,
        D=d,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        PREC=prec,
        DOT_F32=dot_f32,
        num_warps=4,
        num_stages=2,
    )
    if num_splits > 1:
        _combine_kernel[(b, h)](
            part,
            lse,
            out,
            *out.stride(),
            h,
            D=d,
            D_PAD=d_pad,
            NUM_SPLITS=num_splits,
            S_PAD=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
