"""The soak's host-tier seeds (harness/tools/soak_tier.py): a share of the seeds, on a stream of
their own, stand for a tier scenario instead of a mix; half of those (a stream of their own
again) draw other failure modes beside the tier's. They load, plant in the plain reference
manager's tier, and a planted one is caught; the seeds the mixes first found engine and harness
gaps with run as the soak's own scenarios."""

from __future__ import annotations

import pytest

from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import parse_scenario
from kvchaos.harness.tools.soak_space import SPACE, Fit, generate_scenario

MIX = SPACE["offload"]["mix"]


def _tier_seeds(n: int) -> list[int]:
    return [s for s in range(n) if "offload" in generate_scenario(s)["engine"]]


def test_a_share_of_the_seeds_draws_the_tier_and_each_loads_on_a_reference_with_it():
    seeds = _tier_seeds(400)
    share = len(seeds) / 400
    assert abs(share - SPACE["offload"]["probability"]) < 0.06, share
    variants = set()
    for s in seeds:
        d = generate_scenario(s)
        sc = parse_scenario(d, f"<soak {s}>")
        cfg = sc.engine_config()
        assert cfg.offload is not None and sc.workload.think is not None
        names = [f.name for f in sc.faults]
        assert cfg.cache.prefix_caching == (sc.workload.prefix is not None)  # (a mix's share)
        allowed = {"offload", *MIX["faults"], "async_free", *MIX["prefix_faults"]}
        assert names[0] == "offload" and set(names) <= allowed
        variants.add(sc.faults[0].params["variant"])
        if sc.faults[0].params["variant"] == "store_before_compute":
            assert cfg.async_scheduling
    assert variants == set(SPACE["offload"]["variant"])


def test_half_the_tier_seeds_draw_other_failure_modes_beside_it():
    """Each mixed in its own variants (none the tier cannot run), planted or not on its own, in
    the mix's order; a share on the prefix-caching reference, prefix_cache among what they may
    draw; the seeds without stay as drawn."""
    from kvchaos.faults import REGISTRY

    seeds, mixed, drawn, planted, prefix = _tier_seeds(1500), 0, set(), set(), 0
    for s in seeds:
        d = generate_scenario(s)
        assert d == generate_scenario(s)  # seeded
        extra = [f for f in d["faults"][1:] if f["params"].get("variant") != "load_abort"]
        mixed += bool(extra)
        assert 0 <= len(extra) <= MIX["count"][1] + len(MIX["prefix_faults"])
        names = [f["name"] for f in extra]
        order = MIX["faults"] + MIX["prefix_faults"]
        assert names == [n for n in order if n in names]  # each once, in order
        on_prefix = d["engine"]["cache"]["prefix_caching"]
        prefix += on_prefix
        assert on_prefix or not set(names) & set(MIX["prefix_faults"]), (s, names)
        assert not on_prefix or extra  # the prefix-caching reference: a mix's
        for f in extra:
            v = f["params"].get("variant")
            left_out = MIX["prefix_left_out" if on_prefix else "left_out"]
            assert v not in left_out.get(f["name"], ()), (s, f)
            drawn.add(REGISTRY[f["name"]].label(f["params"]))
            planted.add((f["name"], f["defect"]))
        if not extra:  # as before the mixes: no tp_size, prefix caching off, the tier as drawn
            assert "tp_size" not in d["engine"] and "preempt" not in d["engine"]["offload"]
        want = {n for f in d["faults"] if f["defect"] for n in [f["name"]]}
        assert set(d["expect"].get("within_steps", {})) == want
    assert abs(mixed / len(seeds) - MIX["share"]) < 0.1, mixed / len(seeds)
    assert planted == {(n, b) for n in order for b in (True, False)}
    assert {"ordering_race/torn", "async_free/staging", "table_overflow/slot_past_pool"} <= drawn
    assert {"prefix_cache/partial_key", "prefix_cache/stale_revive"} <= drawn
    assert "ordering_race/scrambled" in drawn  # with a prefix cache (its writer record)
    assert "ordering_race/cow_lag" not in drawn
    assert abs(prefix / max(1, mixed) - MIX["prefix"]) < 0.15, prefix / mixed


def test_another_manager_draws_no_tier_and_is_told_so():
    fit = Fit(spec="mine:M", capabilities=frozenset({"fork", "offload"}))
    assert not [s for s in range(200) if "offload" in generate_scenario(s, fit)["engine"]]
    assert any("host KV tier" in line for line in fit.left_out())


def test_a_planted_tier_seed_is_caught_by_the_offload_checker():
    seed = next(
        s
        for s in _tier_seeds(200)
        if [f["defect"] for f in generate_scenario(s)["faults"]] == [True]
    )
    d = generate_scenario(seed)
    r = run_scenario(parse_scenario(d, f"<soak {seed}>"), seed, report_dir=None)
    truth = r.results["fault_verify"]["offload"]
    assert truth["fired"], (seed, r.summary)
    assert r.verdict == "PASS", (seed, r.summary)
    assert any(f.checker == "offload" for f in r.findings)


@pytest.mark.parametrize(
    "seed, consequence",
    [
        (156, "async_free"),  # staging's stale row wrote r8's KV into r9's block 13 mid-store
        (1307, "ordering_race"),  # a lagged rank wrote into nb1's restored block, copy kept
        (1862, "refcount_leak"),  # cancels while restoring leaked: the tier map still holds them
        (1935, "table_overflow"),  # block 41 past a pool sized short is block 0, written by its own
        (1015, None),  # an idle victim given back was stored cold: the manager raised KeyError
        (1081, None),  # a store read block 29 of a pool of 29: IndexError (an ERROR)
    ],
)
def test_the_tier_mixes_first_findings_are_the_planted_faults(seed, consequence, monkeypatch):
    """The seeds the first tier mixes FAILed or ERRORed on: a store's host copy a planted fault
    wrote over (in flight, or kept since a restore), a leak's tier map, the engine's own cold
    store of a request it had given back and its copies past a pool sized short. Each now PASSes;
    the offload findings the planted fault caused are credited to it as consequences. (As they
    were drawn then, on the plain manager: the prefix-caching reference's share is a stream of
    its own, so without it each draws as it did.)"""
    monkeypatch.setitem(MIX, "prefix", 0.0)
    d = generate_scenario(seed)
    r = run_scenario(parse_scenario(d, f"<soak {seed}>"), seed, report_dir=None)
    assert r.verdict == "PASS", (seed, r.summary)
    got = {c["fault"] for c in r.results["credits"] if c["checker"] == "offload"}
    got -= {"offload", "async_free"} if consequence != "async_free" else {"offload"}
    assert got == ({consequence} if consequence else set()), (seed, r.results["credits"])
