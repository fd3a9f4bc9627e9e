"""The ordering race's variants (faults/ordering_variants.py) on simulated ranks: each one's defect
fires (ground truth) and is caught by its own checkers on a seed, its clean twin holds with the
trigger pulled and the remediation acting, the latent one is reported and never manifest, and the
default variant is recorded as it always was."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvchaos.engine.wire import Batch
from kvchaos.faults import REGISTRY, ParamError
from kvchaos.faults.ordering_variants import REACH
from kvchaos.harness.report.incident import build_incidents
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario
from kvchaos.harness.tools.soak_space import generate_scenario

VARIANTS = REGISTRY["ordering_race"].variant_names()
NEW = [v for v in VARIANTS if v != "lagged"]


def _scenario(v: str, kind: str) -> str:
    return f"ordering-race-{v.replace('_', '-')}-{kind}"


@pytest.mark.parametrize("variant", NEW)
def test_each_variant_fires_and_is_caught_by_its_checkers(variant):
    run = run_scenario(load_scenario(_scenario(variant, "detect")), 0, report_dir=None)
    truth = run.results["fault_verify"]["ordering_race"]
    assert run.verdict == "PASS", run.summary
    assert truth["fired"] and truth["variant"] == variant
    caught = {c["checker"] for c in run.results["credits"] if c["how"] == "cause"}
    own = REGISTRY["ordering_race"].detectors_for({"variant": variant})[:1]
    assert caught & set(own), caught  # the variant's own structural checker
    if variant in ("cow_lag", "scrambled"):  # the table stayed in sync: the pool is what differs
        cross = next(c for c in run.results["checkers"] if c["checker"] == "cross_rank")
        assert not cross["findings"]
        assert truth["late_copies" if variant == "cow_lag" else "scrambled"]
    else:  # the rank's table held other content than the scheduler's
        assert truth["stale"] and all(x["ranks"] == [1] for x in truth["stale"])
    titles = [i["title"] for i in build_incidents(run.results, run.events)]
    assert any(t.startswith(f"ordering_race/{variant} caught by") for t in titles), titles


@pytest.mark.parametrize("variant", NEW)
def test_each_clean_twin_holds_with_its_trigger_pulled(variant):
    run = run_scenario(load_scenario(_scenario(variant, "clean")), 0, report_dir=None)
    truth = run.results["fault_verify"]["ordering_race"]
    assert run.verdict == "PASS", run.summary
    assert truth["triggered"] > 0 and truth["remediated"] > 0 and not truth["fired"]
    assert run.results["exercised"][REACH[variant]] > 0  # the manager path the variant breaks


def test_cow_lag_under_a_manager_without_forks_says_it_does_not_apply():
    from tests.managers import WithoutFork

    r = run_scenario(
        load_scenario(_scenario("cow_lag", "clean")), 0, report_dir=None, block_manager=WithoutFork
    )
    truth = r.results["fault_verify"]["ordering_race"]
    assert truth["not_applicable"] == (
        "cow_lag needs forks (copy-on-write): WithoutFork declares no 'fork'"
    )
    assert r.verdict == "INCONCLUSIVE" and "cow_lag needs forks" in r.summary
    on_ref = run_scenario(load_scenario(_scenario("cow_lag", "clean")), 0, report_dir=None)
    assert "not_applicable" not in on_ref.results["fault_verify"]["ordering_race"]


def test_a_stale_row_never_read_is_reported_latent_never_manifest():
    run = run_scenario(load_scenario(_scenario("stale_unread", "detect")), 0, report_dir=None)
    assert run.verdict == "PASS", run.summary
    checks = {c["checker"]: c for c in run.results["checkers"]}
    cross = checks["cross_rank"]["findings"]
    assert cross and all(f["manifest"] is False for f in cross)  # latent: no output changed
    assert not checks["oracle_divergence"]["findings"] and not checks["kv_reads"]["findings"]
    rows_at = {e["step"]: set(e["seq_rows"].values()) for e in run.events if e["e"] == "snapshot"}
    stale = run.results["fault_verify"]["ordering_race"]["stale"]
    for x in stale:  # every row that differed was held by nobody that step
        assert x["rows"] and not set(x["rows"]) & rows_at[x["step"]]


def test_the_default_variant_is_recorded_as_before_variants():
    f = REGISTRY["ordering_race"](True, {}, 0)
    d = f.describe()
    assert d["label"] == "ordering_race" and "variant" not in d["params"]
    assert d["detectors"] == ["cross_rank", "oracle_divergence"]
    assert REGISTRY["ordering_race"].label({"variant": "torn"}) == "ordering_race/torn"
    assert REGISTRY["ordering_race"].detectors_for({"variant": "cow_lag"}) == (
        "kv_reads",
        "oracle_divergence",
    )


def test_cow_lag_is_refused_on_real_ranks_in_one_line():
    cfg = load_scenario(_scenario("cow_lag", "detect")).engine_config()
    with pytest.raises(ParamError, match="params.variant: cow_lag plants in simulated ranks"):
        REGISTRY["ordering_race"].check_params(
            {"variant": "cow_lag"}, dataclasses.replace(cfg, tp_mode="distributed")
        )


def test_the_wire_carries_the_ranks_that_write_out_of_order():
    msg = Batch.pack(7, 3, False, [5, 6], [0, 1], [0], [(4, 0, 1)], [(2, 9)], [(1, 3, 0)], [1])
    b = Batch.unpack(torch.tensor(msg), torch.device("cpu"))
    assert (b.step, b.copies, b.updates, b.scrambled) == (7, [(2, 9)], [(1, 3, 0)], [1])


def test_the_soak_draws_every_variant_and_leaves_the_default_as_drawn():
    seen = set()
    for seed in range(200):
        for f in generate_scenario(seed).get("faults", []):
            if f["name"] == "ordering_race":
                seen.add(f["params"].get("variant", "lagged"))
                assert f["params"].get("variant") != "lagged"  # the default's params as before
    assert seen == set(VARIANTS)
