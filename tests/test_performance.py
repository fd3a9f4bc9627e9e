"""Performance findings (harness/check/performance.py): warnings for what costs throughput, never
the verdict. Each bug written for one (tests/perf_managers.py) raises it on a built-in clean
scenario, outputs right; the reference managers raise none on the same scenario and seed."""

import sys
from pathlib import Path

import pytest

from kvchaos.engine.block_manager import BlockManager
from kvchaos.harness.check.performance import HIT_RATIO, judge_performance
from kvchaos.harness.history.log import deterministic_digest, read_history
from kvchaos.harness.report.analyze import analyze
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import BUILTIN_DIR, load_scenario

sys.path.insert(0, str(Path(__file__).parent))  # tests/perf_managers.py, named by spec too
from perf_managers import EvictsMostRecent, OvercountsEstimate  # noqa: E402


def run(name: str, manager=None, report_dir=None):
    sc = load_scenario(BUILTIN_DIR / f"{name}.toml", "cpu")
    return run_scenario(sc, 0, "cpu", report_dir, block_manager=manager)


def kinds(r) -> list[str]:
    return [f["kind"] for f in r.results["performance"]["findings"]]


@pytest.fixture(scope="module")
def overcount_runs():
    return {m: run("refcount-leak-clean", m) for m in (None, BlockManager, OvercountsEstimate)}


def test_the_references_raise_no_performance_finding_where_an_overcount_does(overcount_runs):
    for m in (None, BlockManager):  # the scenario's prefix cache, and the plain reference
        r = overcount_runs[m]
        assert r.verdict == "PASS" and kinds(r) == [], (m, r.results["performance"])
        assert r.results["performance"]["preemptions"]["unneeded"] == 0
        assert r.results["performance"]["estimates"]["off"] == 0


def test_an_estimate_counting_a_partly_filled_block_as_full_preempts_for_nothing(overcount_runs):
    ref, bad = overcount_runs[BlockManager], overcount_runs[OvercountsEstimate]
    assert bad.verdict == ref.verdict == "PASS"  # outputs right: the verdict is as it was
    assert kinds(bad) == ["unneeded_preemption", "estimate_off"]
    pre, ref_pre = (x.results["performance"]["preemptions"] for x in (bad, ref))
    assert pre["total"] > ref_pre["total"]  # what the bug costs
    assert 0 < pre["unneeded"] <= pre["total"]
    assert pre["unneeded"] >= pre["total"] - ref_pre["total"]
    est = bad.results["performance"]["estimates"]
    assert est["off"] == est["over"] > 0  # every one asked for more than the append took
    first = bad.results["performance"]["findings"][0]["evidence"]["first"]
    assert first["needed"] <= first["free"] < first["estimate"]


@pytest.fixture(scope="module")
def cache_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("perf")
    return {m: run("prefix-shared-clean", m, d) for m in (None, EvictsMostRecent)}


def test_the_replay_gives_the_reference_its_own_hit_rate(cache_runs):
    r = cache_runs[None]
    pc = r.results["performance"]["prefix_cache"]
    assert pc["judged"] and pc["admissions"] >= 10
    assert pc["hit_rate"] == r.results["metrics"]["prefix_cache"]["hit_rate"]
    assert pc["reference_hit_rate"] == pc["hit_rate"] > 0  # the same admissions, answered alike
    assert kinds(r) == []


def test_an_mru_eviction_serves_fewer_hits_than_the_reference_would(cache_runs):
    ref, bad = cache_runs[None], cache_runs[EvictsMostRecent]
    assert bad.verdict == ref.verdict == "PASS"
    assert kinds(bad) == ["hit_rate"]
    pc = bad.results["performance"]["prefix_cache"]
    assert pc["judged"] and pc["ratio"] < HIT_RATIO
    assert pc["hit_rate"] < ref.results["performance"]["prefix_cache"]["hit_rate"]


def test_analyze_finds_the_same_and_the_prompt_ids_stay_out_of_the_digest(cache_runs):
    bad = cache_runs[EvictsMostRecent]
    again = analyze(bad.run_dir, plots=False, index=False)
    assert again["performance"] == bad.results["performance"]
    assert again["verdict"] == bad.verdict
    assert "warning: prefix-cache hit rate" in (bad.run_dir / "report.html").read_text()
    events = read_history(bad.run_dir / "history.jsonl")
    submits = [e for e in events if e["e"] == "submit"]
    assert submits and all(e["prompt_ids"] for e in submits)
    bare = [{k: v for k, v in e.items() if k != "prompt_ids"} for e in events]
    assert deterministic_digest(bare) == deterministic_digest(events) == again["history_digest"]
    for e in submits:
        e.pop("prompt_ids")  # a history recorded before them: the cache is not compared
    pc = judge_performance(events)["prefix_cache"]
    assert not pc["judged"] and "prompt ids" in pc["why"]


def test_the_soak_summary_counts_the_warnings_by_kind():
    from kvchaos.harness.tools.soak_html import perf_html
    from kvchaos.harness.tools.soak_summary import perf_line

    assert perf_line([]) == perf_html(None) == "none"
    perf = [{"kind": "hit_rate", "runs": 2, "first_seed": 5, "first_link": "runs/x/report.html"}]
    assert perf_line(perf).startswith("hit_rate in 2 runs (first seed 5)")
    assert 'href="runs/x/report.html"' in perf_html(perf)
