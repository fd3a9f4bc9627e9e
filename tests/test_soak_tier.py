"""The soak's host-tier seeds (harness/tools/soak_tier.py): a share of the seeds, on a stream of
their own, stand for a tier scenario instead of a mix; they load, plant in the plain reference
manager's tier, and a planted one is caught."""

from __future__ import annotations

from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import parse_scenario
from kvchaos.harness.tools.soak_space import SPACE, Fit, generate_scenario


def _tier_seeds(n: int) -> list[int]:
    return [s for s in range(n) if "offload" in generate_scenario(s)["engine"]]


def test_a_share_of_the_seeds_draws_the_tier_and_each_loads_on_the_plain_manager():
    seeds = _tier_seeds(400)
    share = len(seeds) / 400
    assert abs(share - SPACE["offload"]["probability"]) < 0.06, share
    variants = set()
    for s in seeds:
        d = generate_scenario(s)
        sc = parse_scenario(d, f"<soak {s}>")
        cfg = sc.engine_config()
        assert cfg.offload is not None and not cfg.cache.prefix_caching
        assert sc.workload.think is not None
        names = [f.name for f in sc.faults]
        assert names[0] == "offload" and set(names) <= {"offload", "async_free"}
        variants.add(sc.faults[0].params["variant"])
        if sc.faults[0].params["variant"] == "store_before_compute":
            assert cfg.async_scheduling
    assert variants == set(SPACE["offload"]["variant"])


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
