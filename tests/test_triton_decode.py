"""paged_decode_triton vs the PyTorch reference.

Without a GPU the kernels run in the Triton interpreter. TRITON_INTERPRET is read when a kernel is
decorated, so it is useless once kvchaos.engine.triton_decode was imported by this pytest process:
the interpreter checks therefore run in one subprocess (this file run as a script), which prints
JSON results that the tests below assert per case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvchaos.engine.attention import paged_decode_torch  # noqa: E402

TOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 2e-2}

# table: "plain" [B, W] tensor, or "view": rows of a wider flat buffer (row stride > W).
# q_view: q is a non-contiguous slice of a bigger tensor.
CASES = [
    dict(
        name="mha_f32_bs4_d16", H=2, Hkv=2, D=16, bs=4, dtype="float32", lens=[1, 7, 13], splits=1
    ),
    dict(
        name="gqa2_f32_bs4_d32_split3",
        H=4,
        Hkv=2,
        D=32,
        bs=4,
        dtype="float32",
        lens=[5, 33, 1],
        splits=3,
    ),
    dict(
        name="gqa8_f32_bs16_d16_split2",
        H=8,
        Hkv=1,
        D=16,
        bs=16,
        dtype="float32",
        lens=[17, 40, 16],
        splits=2,
    ),
    dict(
        name="gqa2_f16_bs16_d32",
        H=4,
        Hkv=2,
        D=32,
        bs=16,
        dtype="float16",
        lens=[30, 1, 48],
        splits=1,
    ),
    dict(
        name="gqa8_bf16_bs4_d16_split2",
        H=8,
        Hkv=1,
        D=16,
        bs=4,
        dtype="bfloat16",
        lens=[9, 26],
        splits=2,
    ),
    dict(
        name="mha_bf16_bs16_d32_split4",
        H=2,
        Hkv=2,
        D=32,
        bs=16,
        dtype="bfloat16",
        lens=[50, 3],
        splits=4,
    ),
    dict(
        name="gqa2_f32_bs4_view_table",
        H=4,
        Hkv=2,
        D=16,
        bs=4,
        dtype="float32",
        lens=[11, 2, 20],
        splits=2,
        table="view",
    ),
    dict(
        name="gqa2_f16_bs16_view_table_maxlen_auto",
        H=4,
        Hkv=2,
        D=16,
        bs=16,
        dtype="float16",
        lens=[40, 18],
        splits=None,
        table="view",
        max_seq_len=35,
    ),
    dict(
        name="more_splits_than_chunks",
        H=4,
        Hkv=1,
        D=16,
        bs=4,
        dtype="float32",
        lens=[1, 3],
        splits=4,
    ),
    dict(
        name="bs1_f32_d16_split2", H=4, Hkv=2, D=16, bs=1, dtype="float32", lens=[1, 21], splits=2
    ),
    dict(name="bs32_f32_d32", H=4, Hkv=4, D=32, bs=32, dtype="float32", lens=[33, 64, 5], splits=2),
    dict(
        name="odd_headdim24_q_view",
        H=6,
        Hkv=2,
        D=24,
        bs=8,
        dtype="float32",
        lens=[13, 6],
        splits=2,
        q_view=True,
    ),
]


def make_inputs(
    B,
    H,
    Hkv,
    D,
    bs,
    dtype,
    lens,
    table="plain",
    q_view=False,
    max_seq_len=None,
    device="cpu",
    seed=0,
    **_,
):
    """Returns (q, k_clean, v_clean, k_dirty, v_dirty, table, lens). Blocks get random physical ids
    (block 0 never used); the dirty caches hold NaN in every slot the kernel must not read."""
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    W = max((n + bs - 1) // bs for n in lens) + 2  # spare -1 columns
    num_blocks = sum((n + bs - 1) // bs for n in lens) + 5
    k = torch.randn(num_blocks, bs, Hkv, D, generator=g)
    v = torch.randn(num_blocks, bs, Hkv, D, generator=g)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    if table == "view":
        flat = torch.full((B + 3, W + 5), -1, dtype=torch.int32)
        tab = flat[2 : 2 + B, :W]
        assert tab.stride(0) > W
    else:
        tab = torch.full((B, W), -1, dtype=torch.int32)
    read = torch.zeros(num_blocks, bs, dtype=torch.bool)
    for i, n in enumerate(lens):
        nblk = (n + bs - 1) // bs
        ids = [perm.pop() for _ in range(nblk)]
        tab[i, :nblk] = torch.tensor(ids, dtype=torch.int32)
        attended = n if max_seq_len is None else min(n, max_seq_len)
        for p in range(attended):
            read[ids[p // bs], p % bs] = True
    k_clean = k.masked_fill(~read[:, :, None, None], 0.0).to(dt)
    v_clean = v.masked_fill(~read[:, :, None, None], 0.0).to(dt)
    k_dirty = k.masked_fill(~read[:, :, None, None], float("nan")).to(dt)
    v_dirty = v.masked_fill(~read[:, :, None, None], float("nan")).to(dt)
    q = torch.randn(B, H, D * 2 if q_view else D, generator=g).to(dt)
    if q_view:
        q = q[:, :, ::2]
        assert not q.is_contiguous()
    lens_t = torch.tensor(lens, dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return (
        to(q),
        to(k_clean),
        to(v_clean),
        to(k_dirty),
        to(v_dirty),
        tab.to(device) if device != "cpu" else tab,
        to(lens_t),
    )


def run_case(case: dict) -> dict:
    from kvchaos.engine.triton_decode import paged_decode_triton

    c = dict(case)
    c.setdefault("table", "plain")
    q, kc, vc, kd, vd, tab, lens = make_inputs(B=len(c["lens"]), **c)
    scale = c["D"] ** -0.5
    ref = paged_decode_torch(q, kc, vc, tab, lens, scale, max_seq_len=c.get("max_seq_len"))
    out = paged_decode_triton(
        q, kd, vd, tab, lens, scale, max_seq_len=c.get("max_seq_len"), num_splits=c["splits"]
    )
    err = (out.float() - ref.float()).abs().max().item()
    return dict(
        name=c["name"],
        err=err if err == err else float("inf"),
        dtype_ok=out.dtype == q.dtype and out.shape == q.shape,
    )


@pytest.fixture(scope="module")
def interp_results():
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"interpreter checker failed:\n{proc.stdout}\n{proc.stderr}"
    return {r["name"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_reference_interpreter(interp_results, case):
    r = interp_results[case["name"]]
    assert "error" not in r, r.get("error")
    assert r["dtype_ok"]
    assert r["err"] <= TOL[case["dtype"]], f"max abs err {r['err']:.3g} > {TOL[case['dtype']]}"


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs the compiled kernel natively)"
)
@pytest.mark.parametrize("splits", [None, 1, 7])
def test_matches_reference_cuda(splits):
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set; this test is for the compiled kernel")
    from kvchaos.engine.triton_decode import paged_decode_triton

    g = torch.Generator().manual_seed(1)
    lens = torch.randint(1, 2049, (8,), generator=g).tolist()
    lens[0], lens[1] = 1, 2048
    q, kc, vc, kd, vd, tab, lens_t = make_inputs(
        B=8, H=32, Hkv=8, D=128, bs=16, dtype="bfloat16", lens=lens, device="cuda", seed=1
    )
    ref = paged_decode_torch(q, kc, vc, tab, lens_t, 128**-0.5)
    out = paged_decode_triton(q, kd, vd, tab, lens_t, 128**-0.5, num_splits=splits)
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 2e-2, f"max abs err {err:.3g}"


if __name__ == "__main__":  # the interpreter checker run by interp_results
    results = []
    for case in CASES:
        try:
            results.append(run_case(case))
        except Exception as e:  # report per case rather than losing all results
            results.append(dict(name=case["name"], error=f"{type(e).__name__}: {e}"))
    print(json.dumps(results))
