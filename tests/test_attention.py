"""Paged attention in PyTorch against a per-sequence softmax over the sequence's own K/V, gathered
token by token through the table: uniform and mixed lengths, unmapped (-1) entries past a row's
end, a shared per-step plan, and causal prefill chunks that start mid-sequence."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvchaos.engine.attention import paged_decode_torch, paged_prefill_torch, plan_decode

BS, HKV, G, D = 4, 2, 2, 8


def pool_and_tables(lens: list[int], seed: int, bs: int = BS, hkv: int = HKV, d: int = D):
    """K/V pools and a table whose rows map each sequence's blocks to shuffled pool blocks,
    -1 after."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-n // bs) for n in lens) + 3
    kc, vc = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
    perm = torch.randperm(nb, generator=g).tolist()
    tables = torch.full((len(lens), max(-(-n // bs) for n in lens) + 2), -1, dtype=torch.int32)
    for i, n in enumerate(lens):
        for j in range(-(-n // bs)):
            tables[i, j] = perm.pop()
    return kc, vc, tables


def naive(q, kc, vc, row, n, scale):
    """q [H, D] against the first n tokens of a table row, in float64: softmax(q k^T) v, query head
    h reading KV head h // (H / Hkv)."""
    bs, groups = kc.shape[1], q.shape[0] // kc.shape[2]
    k = (
        torch.stack([kc[row[p // bs], p % bs] for p in range(n)])
        .double()
        .repeat_interleave(groups, dim=1)
    )
    v = (
        torch.stack([vc[row[p // bs], p % bs] for p in range(n)])
        .double()
        .repeat_interleave(groups, dim=1)
    )
    w = torch.einsum("hd,nhd->hn", q.double(), k).mul(scale).softmax(-1)
    return torch.einsum("hn,nhd->hd", w, v)


def assert_matches(out, ref):
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("lens", [[5], [8, 8, 8], [1, 7, 13, 4], [16, 3]])
@pytest.mark.parametrize("shared_plan", [False, True])
def test_decode_matches_naive(lens, shared_plan):
    kc, vc, tables = pool_and_tables(lens, seed=len(lens))
    q = torch.randn(len(lens), HKV * G, D, generator=torch.Generator().manual_seed(7))
    seq_lens = torch.tensor(lens)
    plan = plan_decode(tables, seq_lens, BS, max(lens), min(lens)) if shared_plan else None
    out = paged_decode_torch(q, kc, vc, tables, seq_lens, 0.3, plan=plan)
    for i, n in enumerate(lens):
        assert_matches(out[i], naive(q[i], kc, vc, tables[i].tolist(), n, 0.3))


def test_plan_masks_only_mixed_lengths():
    _, _, tables = pool_and_tables([8, 8], seed=1)
    assert (
        plan_decode(tables, torch.tensor([8, 8]), BS).mask is None
    )  # lengths read from the tensor
    assert plan_decode(tables, torch.tensor([8, 8]), BS, 8, 8).mask is None  # told on the host
    assert (
        plan_decode(tables, torch.tensor([8, 8]), BS, 8).mask is not None
    )  # not told: masked, no sync
    plan = plan_decode(tables, torch.tensor([8, 3]), BS)
    assert plan.max_len == 8 and plan.mask is not None
    assert (
        torch.isinf(plan.mask[1, 0, 0, 3:]).all() and not torch.isinf(plan.mask[1, 0, 0, :3]).any()
    )
    assert (
        plan.blocks.numel() == 2 * 2 and int(plan.blocks.min()) >= 0
    )  # -1 entries clamped to a real block


def test_prefill_chunk_matches_naive():
    n_total, start = 11, 6
    kc, vc, tables = pool_and_tables([n_total], seed=3)
    q = torch.randn(n_total - start, HKV * G, D, generator=torch.Generator().manual_seed(9))
    out = paged_prefill_torch(q, kc, vc, tables[0], start, 0.3)
    row = tables[0].tolist()
    for i in range(n_total - start):
        assert_matches(out[i], naive(q[i], kc, vc, row, start + i + 1, 0.3))


@pytest.mark.parametrize("was", [False, True])
def test_deterministic_writes_restores_the_global_mode(was):
    from kvchaos.engine.attention import deterministic_writes, write_kv

    torch.use_deterministic_algorithms(was)
    try:
        kc, vc = torch.zeros(2, BS, HKV, D), torch.zeros(2, BS, HKV, D)
        k = torch.arange(3 * HKV * D, dtype=torch.float32).view(3, HKV, D)
        with deterministic_writes():
            assert torch.are_deterministic_algorithms_enabled()
            write_kv(
                kc, vc, torch.tensor([5, 1, 5]), k, k
            )  # slot 5 written twice: the last write wins
        assert torch.are_deterministic_algorithms_enabled() is was
        assert torch.equal(kc.view(-1, HKV, D)[5], k[2]) and torch.equal(
            kc.view(-1, HKV, D)[1], k[1]
        )
    finally:
        torch.use_deterministic_algorithms(False)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_paged_attention_matches_naive_on_random_shapes(data):
    """Any GQA grouping, block size and mix of lengths: decode (with and without a shared plan)
    and a prefill chunk starting anywhere agree with the per-token softmax (float64 reference)."""
    hkv, g = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    bs, d = data.draw(st.sampled_from([1, 2, 4, 8])), data.draw(st.sampled_from([2, 4, 8]))
    lens = data.draw(st.lists(st.integers(1, 20), min_size=1, max_size=5))
    seed = data.draw(st.integers(0, 2**16))
    kc, vc, tables = pool_and_tables(lens, seed, bs, hkv, d)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lens), hkv * g, d, generator=gen)
    seq_lens = torch.tensor(lens)
    plans = (
        None,
        plan_decode(tables, seq_lens, bs, max(lens), min(lens)),
        plan_decode(tables, seq_lens, bs, max(lens)),
    )
    for plan in plans:
        out = paged_decode_torch(q, kc, vc, tables, seq_lens, 0.5, plan=plan)
        for i, n in enumerate(lens):
            assert_matches(out[i], naive(q[i], kc, vc, tables[i].tolist(), n, 0.5))
    n_total = lens[0]
    start = data.draw(st.integers(0, n_total - 1))
    qp = torch.randn(n_total - start, hkv * g, d, generator=gen)
    out = paged_prefill_torch(qp, kc, vc, tables[0], start, 0.5)
    for i in range(n_total - start):
        assert_matches(out[i], naive(qp[i], kc, vc, tables[0].tolist(), start + i + 1, 0.5))
