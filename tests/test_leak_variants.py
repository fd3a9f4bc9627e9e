"""refcount_leak's variants: each fires from ground truth and is caught on its detect scenario;
its clean scenario pulls the trigger, holds, and exercises the manager path the variant breaks.
The article's case ("any") describes itself as it always did."""

from __future__ import annotations

import pytest

from kvchaos.faults import REGISTRY
from kvchaos.faults.leak_variants import RATE_STRIDE, VARIANTS
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario

# variant -> the path of results.json["exercised"] its clean trigger must reach (> 0)
REACH = {
    "prefill": ("cancels_prefill",),
    "decode": ("cancels_decode",),
    "shared": ("leak_paths", "frees_all_shared"),
    "partial": ("leak_paths", "frees_partly_shared"),
    "preempted": ("preemption_releases",),
    "retry": ("leak_paths", "cancels_after_refused_admission"),
    "rate": ("leak_paths", "cancels"),
}


def _passes(r) -> bool:
    """PASS, or FAIL on the latency checker alone (time measured on a loaded machine is no
    assertion: the verdict on blocks is)."""
    return r.verdict == "PASS" or (
        r.verdict == "FAIL"
        and {f.checker for f in r.findings} <= {"latency", "block_accounting"}
        and any(f.checker == "latency" for f in r.findings)
    )


def _reach(exercised: dict, path: tuple) -> int:
    for k in path:
        exercised = exercised[k]
    return exercised


@pytest.mark.parametrize("variant", sorted(REACH))
def test_detect_fires_and_is_caught(variant):
    r = run_scenario(load_scenario(f"refcount-leak-{variant}-detect"), 0, report_dir=None)
    truth = r.results["fault_verify"]["refcount_leak"]
    assert truth["fired"] and truth["variant"] == variant and truth["leaked_blocks"] > 0
    assert _passes(r), r.summary
    assert any(f.checker == "block_accounting" for f in r.findings)
    assert truth["free_trend"][-1][1] == truth["leaked_blocks"]  # the drain, step by step


@pytest.mark.parametrize("variant", sorted(REACH))
def test_clean_pulls_the_trigger_holds_and_reaches_the_path(variant):
    r = run_scenario(load_scenario(f"refcount-leak-{variant}-clean"), 0, report_dir=None)
    truth = r.results["fault_verify"]["refcount_leak"]
    assert not [f for f in r.findings if f.checker != "latency"], r.summary
    assert truth["triggered"] > 0 and not truth["fired"] and truth["remediated"] > 0
    assert _reach(r.results["exercised"], REACH[variant]) > 0


def test_rate_leaks_about_one_cancel_in_twenty():
    r = run_scenario(load_scenario("refcount-leak-rate-detect"), 1, report_dir=None)
    truth = r.results["fault_verify"]["refcount_leak"]
    assert truth["triggered"] >= RATE_STRIDE
    assert truth["times"] <= -(-truth["triggered"] // RATE_STRIDE)


def test_the_article_case_describes_itself_as_before():
    cls = REGISTRY["refcount_leak"]
    f = cls(True, {}, 0)
    d = f.describe()
    assert d["label"] == "refcount_leak" and "variant" not in d["params"]
    assert "cancels" not in d["params"]
    g = cls(True, {"variant": "partial"}, 0)
    assert g.describe()["label"] == "refcount_leak/partial"
    assert g.describe()["params"]["variant"] == "partial"
    assert g.root_cause != f.root_cause and "xllm" in g.root_cause
    assert set(VARIANTS) == {"any", *REACH}


def test_a_manager_variant_says_where_it_does_not_apply():
    from tests.managers import Delegate

    sc = load_scenario("refcount-leak-partial-clean")
    r = run_scenario(sc, 0, report_dir=None, block_manager=Delegate)
    truth = r.results["fault_verify"]["refcount_leak"]
    assert "not in Delegate" in (truth["not_applicable"] or ""), truth


def test_the_soak_draws_every_variant_and_the_prefix_shapes_validly():
    from kvchaos.harness.scenario.spec import parse_scenario
    from kvchaos.harness.tools.soak_space import generate_scenario

    variants, shapes = set(), 0
    for seed in range(110):  # (the first shared draw: seed 105)
        data = generate_scenario(seed)
        sc = parse_scenario(data, f"<soak seed {seed}>")
        for f in sc.faults:
            REGISTRY[f.name].check_params(f.params, sc.engine_config())  # it fits the engine
            if f.name == "refcount_leak":
                variants.add(f.params.get("variant", "any"))
        shapes += "shapes" in data["workload"]
    assert variants == set(VARIANTS) and shapes > 0
