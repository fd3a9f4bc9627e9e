"""refcount_leak's variants: each fires from ground truth and is caught on its detect scenario;
its clean scenario pulls the trigger, holds, and exercises the manager path the variant breaks.
The article's case ("any") describes itself as it always did."""

from __future__ import annotations

import pytest

from kvchaos.faults import REGISTRY
from kvchaos.faults.leak_variants import RATE_STRIDE
from kvchaos.harness.check import reach
from kvchaos.harness.check.reach import REACH as ALL_REACH
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario

VARIANTS = REGISTRY["refcount_leak"].variant_names()
# variant -> the path of results.json["exercised"] its clean trigger must reach (> 0)
REACH = {v: p for v, p in ALL_REACH["refcount_leak"].items() if v != "any"}


def _passes(r) -> bool:
    """PASS, or FAIL on the latency checker alone (time measured on a loaded machine is no
    assertion: the verdict on blocks is)."""
    return r.verdict == "PASS" or (
        r.verdict == "FAIL"
        and {f.checker for f in r.findings} <= {"latency", "block_accounting"}
        and any(f.checker == "latency" for f in r.findings)
    )


def _scenario(variant: str, outcome: str):
    return load_scenario(f"refcount-leak-{variant.replace('_', '-')}-{outcome}")


@pytest.mark.parametrize("variant", sorted(REACH))
def test_detect_fires_and_is_caught(variant):
    r = run_scenario(_scenario(variant, "detect"), 0, report_dir=None)
    truth = r.results["fault_verify"]["refcount_leak"]
    assert truth["fired"] and truth["variant"] == variant and truth["leaked_blocks"] > 0
    assert _passes(r), r.summary
    assert any(f.checker == "block_accounting" for f in r.findings)
    assert truth["free_trend"][-1][1] == truth["leaked_blocks"]  # the drain, step by step


@pytest.mark.parametrize("variant", sorted(REACH))
def test_clean_pulls_the_trigger_holds_and_reaches_the_path(variant):
    r = run_scenario(_scenario(variant, "clean"), 0, report_dir=None)
    truth = r.results["fault_verify"]["refcount_leak"]
    assert not [f for f in r.findings if f.checker != "latency"], r.summary
    assert truth["triggered"] > 0 and not truth["fired"] and truth["remediated"] > 0
    assert reach.reached(r.results["exercised"], REACH[variant])


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


@pytest.mark.parametrize("variant", ["waiting", "engine_abort"])
def test_an_engine_path_variant_plants_under_another_manager(variant):
    """Their trigger and defect are the engine's (kv_load_steps, on_sample, free_on_exit): under
    a manager of another kind they apply, leak and are caught, or hold."""
    from tests.managers import Delegate

    for defect in ("detect", "clean"):
        sc = _scenario(variant, defect)
        r = run_scenario(sc, 1, report_dir=None, block_manager=Delegate)
        truth = r.results["fault_verify"]["refcount_leak"]
        assert truth["not_applicable"] is None and truth["triggered"] > 0, truth
        assert truth["fired"] == (defect == "detect") and _passes(r), r.summary


def test_engine_abort_fails_each_request_at_its_seeded_token():
    """The exception comes from the fault's schedule: the same seed, the same tokens; another
    seed, another schedule."""
    sc = load_scenario("refcount-leak-engine-abort-clean")
    runs = [run_scenario(sc, s, report_dir=None) for s in (0, 0, 3)]
    failed = [
        [(e["step"], e["data"]["error"]) for e in r.events if e.get("kind") == "request_failed"]
        for r in runs
    ]
    assert failed[0] == failed[1] and failed[0] != failed[2] and len(failed[0]) == 4
    assert runs[0].results["history_digest"] == runs[1].results["history_digest"]


def test_the_engine_abort_leak_is_named_by_how_the_request_ended():
    r = run_scenario(_scenario("engine_abort", "detect"), 0, report_dir=None)
    leaks = [f for f in r.findings if f.kind == "leak"]
    assert leaks and all(f.evidence.get("failed") for f in leaks)
    assert all("ended in error" in f.message for f in leaks)
    waiting = run_scenario(_scenario("waiting", "detect"), 0, report_dir=None)
    leaks = [f for f in waiting.findings if f.kind == "leak"]
    assert leaks and all("in phase waiting" in f.message for f in leaks)
    assert not any("failed" in f.evidence for f in leaks)


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


def test_the_soak_leaves_waiting_out_under_another_prefix_cache():
    """waiting's requests hold blocks whose KV lands later: a prefix cache keying blocks as it
    allocates them (vLLM's) would cache them unwritten, so the mix leaves it out there, and
    says so; a manager without a cache still draws it."""
    from kvchaos.harness.tools.soak_space import Fit, generate_scenario

    plain = Fit(spec="m:M", capabilities=frozenset({"fork"}))
    cached = Fit(spec="m:M", capabilities=frozenset({"fork", "prefix_cache"}))

    def drawn(fit) -> set[str]:
        out = set()
        for seed in range(200):
            for f in generate_scenario(seed, fit).get("faults", []):
                if f["name"] == "refcount_leak":
                    out.add(f["params"].get("variant", "any"))
        return out

    assert {"waiting", "engine_abort"} <= drawn(plain)
    got = drawn(cached)
    assert "waiting" not in got and "engine_abort" in got
    assert any("variant waiting" in x for x in cached.left_out())
    assert not any("variant waiting" in x for x in plain.left_out())


def test_the_adapter_lane_leaves_out_the_leak_variants_an_adapter_cannot_be_asked():
    """.ci/adapter-lane's exclusions (grep -E patterns: SGLang's lane, then vLLM's) against each
    variant's clean scenario: left out exactly when planted on the reference's own seams, and
    under vLLM (which keys blocks as it allocates them) when its KV lands later."""
    import re
    from pathlib import Path

    from kvchaos.faults.leak_variants import DELAYED_KV, REFERENCE_ONLY

    root = Path(__file__).resolve().parents[1]
    lane = (root / ".ci" / "adapter-lane").read_text()
    sglang, vllm = re.findall(r"^\s*reference_only='(.*)'$", lane, re.M)
    for v in sorted(set(VARIANTS) - {"any"}):
        text = _scenario_path(root, v).read_text()
        assert (re.search(sglang, text, re.M) is not None) == (v in REFERENCE_ONLY), v
        assert (re.search(vllm, text, re.M) is not None) == (v in REFERENCE_ONLY + DELAYED_KV), v


def _scenario_path(root, variant: str):
    return root / "scenarios" / f"refcount-leak-{variant.replace('_', '-')}-clean.toml"
