"""kvchaos bench in quick mode: every metric is there, every number is positive and finite, and the
ratios and target verdicts are computed consistently. Targets are reported, never asserted here:
timings on a shared machine are noisy."""

from __future__ import annotations

import argparse
import io
import json
import math

import pytest
from rich.console import Console

from kvchaos.harness.bench import suite as bench
from kvchaos.harness.run.device import resolve_device

METRICS = {
    "cold_start_help",
    "pool_alloc_free_per_s",
    "pool_vs_nanovllm",
    "pool_scale_1m_vs_1k",
    "pool_scale_1m_vs_1k_shared",
    "prefix_revive_1m_vs_1k",
    "nanovllm_revive_1m_vs_1k",
    "build_1m_blockmanager_s",
    "decode_bookkeeping_us",
    "engine_decode_b1_steps_per_s",
    "engine_host_share_b1",
    "engine_bookkeeping_share_b1",
    "engine_decode_b8_ctx512_steps_per_s",
    "engine_host_share_b8_ctx512",
    "engine_bookkeeping_share_b8_ctx512",
    "paged_vs_contiguous_b8_ctx512",
    "async_scheduling_b8_ctx128",
    "offload_tier_b8_ctx128",
    "harness_checking_suite",
    "call_log",
    "harness_overhead_suite",
}
SHARES = {
    "engine_host_share_b1",
    "engine_host_share_b8_ctx512",
    "engine_bookkeeping_share_b1",
    "engine_bookkeeping_share_b8_ctx512",
}
WITH_BASELINE = METRICS - SHARES - {"engine_decode_b1_steps_per_s"}
WITH_TARGET = METRICS - {
    "pool_vs_nanovllm",
    "nanovllm_revive_1m_vs_1k",
    "engine_decode_b8_ctx512_steps_per_s",
    "engine_host_share_b1",
    "engine_host_share_b8_ctx512",
}


def positive_finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "sub" / "bench.json"  # the parent folder is created
    buf = io.StringIO()
    report = bench.run_bench(quick=True, out_json=str(out), console=Console(file=buf, width=160))
    return report, json.loads(out.read_text()), buf.getvalue()


def test_json_matches_returned_report(quick_run):
    report, on_disk, _ = quick_run
    assert on_disk == json.loads(json.dumps(report))
    assert on_disk["meta"]["quick"] is True and on_disk["meta"]["device"] == "cpu"


def test_every_metric_present_with_positive_finite_numbers(quick_run):
    _, r, _ = quick_run
    assert set(r["metrics"]) == METRICS
    for name, m in r["metrics"].items():
        assert positive_finite(m["measured"]), (name, m["measured"])
        if name in WITH_BASELINE:
            assert positive_finite(m["baseline"]) and positive_finite(m["ratio"]), (name, m)
            assert m["baseline_name"]
        else:
            assert m["baseline"] is None and m["ratio"] is None, name
        if name in WITH_TARGET:
            assert (
                positive_finite(m["target"])
                and m["target_op"] in ("<=", ">=")
                and isinstance(m["met"], bool)
            )
        else:
            assert m["target"] is None and m["met"] is None, name


def test_ratios_and_verdicts_are_consistent(quick_run):
    _, r, _ = quick_run
    ms = r["metrics"]
    for name, m in ms.items():
        if m["ratio"] is not None:
            assert m["ratio"] == pytest.approx(m["measured"] / m["baseline"], rel=1e-9), name
        if m["target"] is not None:
            v = m["measured"] if m["target_on"] == "measured" else m["ratio"]
            assert m["met"] == (v >= m["target"] if m["target_op"] == ">=" else v <= m["target"]), (
                name
            )
    # The same measurements feed several rows: they must agree.
    assert ms["pool_alloc_free_per_s"]["measured"] == ms["pool_vs_nanovllm"]["measured"]
    b8, pvc = ms["engine_decode_b8_ctx512_steps_per_s"], ms["paged_vs_contiguous_b8_ctx512"]
    assert b8["measured"] == pytest.approx(1e3 / pvc["measured"], rel=1e-9)
    assert b8["baseline"] == pytest.approx(1e3 / pvc["baseline"], rel=1e-9)
    assert b8["ratio"] == pytest.approx(1 / pvc["ratio"], rel=1e-9)
    for share in SHARES:
        assert ms[share]["measured"] < 1.0
    for b in (
        "b1",
        "b8_ctx512",
    ):  # bookkeeping is the part of host work that is not building inputs
        assert (
            ms[f"engine_bookkeeping_share_{b}"]["measured"]
            < ms[f"engine_host_share_{b}"]["measured"]
        )


def test_paged_and_contiguous_agree(quick_run):
    _, r, _ = quick_run
    assert r["checks"]["paged_vs_contiguous_max_abs_logit_err"] < 1e-3
    assert r["checks"]["paged_vs_contiguous_first_token_agrees"] is True
    assert r["checks"]["async_scheduling_tokens_agree"] is True  # the lag changes no result


def test_table_printed(quick_run):
    _, r, text = quick_run
    for col in ("metric", "measured", "baseline", "ratio", "target", "met"):
        assert col in text
    for m in r["metrics"].values():
        assert m["label"] in text


def test_cli_helpers(tmp_path, monkeypatch):
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    args = ap.parse_args([])
    assert (args.quick, args.device, args.out) == (False, "cpu", "reports/bench.json")
    args = ap.parse_args(["--quick", "--device", "auto", "--out", str(tmp_path / "b.json")])
    assert args.quick and args.device == "auto"
    with pytest.raises(SystemExit):
        ap.parse_args(["--device", "tpu"])
    calls = {}
    monkeypatch.setattr(bench, "run_bench", lambda **kw: calls.update(kw) or {})
    assert bench.main(args) == 0
    assert calls == dict(quick=True, device="auto", out_json=str(tmp_path / "b.json"))


def test_cuda_unavailable_is_an_error(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")
    args = argparse.Namespace(quick=True, device="cuda", out="-")
    assert bench.main(args) == 2  # bad input: one line, exit 2
    assert "no CUDA device" in capsys.readouterr().err
