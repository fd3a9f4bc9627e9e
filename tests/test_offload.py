"""The host KV tier ([engine.offload], engine/offload.py): the plain manager's "offload" calls,
the engine's stores and restores, their checker, the fault's variants, and the config checks."""

from __future__ import annotations

from dataclasses import replace

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from kvchaos.engine.block_manager import BlockManager
from kvchaos.engine.config import CacheConfig, EngineConfig, OffloadConfig
from kvchaos.engine.engine import Engine
from kvchaos.engine.errors import ConfigError, OutOfBlocks
from kvchaos.engine.protocols import capabilities
from kvchaos.harness.check.offload_checks import check_offload
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import ScenarioError, load_scenario, parse_scenario


def _engine_events(r, kind: str) -> list[dict]:
    return [e for e in r.events if e.get("e") == "engine" and e["kind"] == kind]


def _offload_result(r):
    return next(c for c in r.results["checkers"] if c["checker"] == "offload")


# -- the manager -------------------------------------------------------------------------------
def test_the_plain_manager_offers_offload_only_with_a_host_tier():
    assert "offload" not in capabilities(BlockManager(8, 4, 2, 4))
    assert "offload" in capabilities(BlockManager(8, 4, 2, 4, host_blocks=8))


def test_store_done_restore_done_moves_blocks_between_tiers():
    bm = BlockManager(8, 4, 2, 4, host_blocks=4)
    bm.admit("a", list(range(6)), 6, 5)  # 2 blocks
    pairs = bm.offload_store("a", 6)
    assert [b for b, _ in pairs] == [0, 1] and bm.num_free_host_blocks == 2
    assert bm.num_free_blocks == 6  # held until the copy completed
    bm.offload_done("a")
    snap = bm.snapshot()
    assert "a" not in snap.seq_blocks and snap.host_blocks == {"a": [s for _, s in pairs]}
    assert bm.num_free_blocks == 8
    back = bm.offload_restore("a")
    assert [s for s, _ in back] == [s for _, s in pairs] and bm.num_free_blocks == 6
    bm.offload_done("a")
    assert bm.num_free_host_blocks == 4 and bm.snapshot().seq_tokens == {"a": 6}
    assert bm.release("a", "finished") and bm.num_free_blocks == 8


def test_a_store_keeps_only_the_computed_tokens_blocks_and_a_stored_release_frees_the_host():
    bm = BlockManager(8, 4, 2, 4, host_blocks=4)
    bm.admit("a", list(range(9)), 9, 8)  # 3 blocks reserved, 4 tokens computed
    assert len(bm.offload_store("a", 4)) == 1 and bm.num_free_blocks == 7
    bm.offload_done("a")
    assert bm.release("a", "aborted") and bm.num_free_host_blocks == 4
    assert bm.num_free_blocks == 8 and not bm.release("a", "aborted")


def test_a_refused_store_or_restore_changes_nothing():
    bm = BlockManager(4, 4, 2, 4, host_blocks=1)
    bm.admit("a", list(range(8)), 8, 7)
    before = bm.snapshot().to_dict()
    with pytest.raises(OutOfBlocks):
        bm.offload_store("a", 8)  # two blocks, one host slot
    assert bm.snapshot().to_dict() == before
    bm2 = BlockManager(2, 4, 2, 4, host_blocks=4)
    bm2.admit("a", list(range(8)), 8, 7)
    bm2.offload_store("a", 8)
    bm2.offload_done("a")
    bm2.admit("b", list(range(4)), 4, 3)  # one device block left free
    before = bm2.snapshot().to_dict()
    with pytest.raises(OutOfBlocks):
        bm2.offload_restore("a")
    assert bm2.snapshot().to_dict() == before


# -- the engine and its runs ---------------------------------------------------------------------
def test_the_tier_run_stores_restores_and_every_checker_holds():
    r = run_scenario(load_scenario("offload-tier-clean"), 0, report_dir=None)
    assert r.verdict == "PASS", r.summary
    stores, landed = _engine_events(r, "offload_store"), _engine_events(r, "offload_landed")
    assert {s["data"]["why"] for s in stores} == {"cold", "preempt"}
    assert _engine_events(r, "offload_restore") and _offload_result(r)["status"] == "held"
    # every completed store's host copy is the device block as the completed step left it
    issued, compared = {}, 0
    for e in r.events:
        if e.get("e") == "engine" and e["kind"] == "offload_store":
            issued[e["data"]["req"]] = e["data"]["crcs"]
        elif e.get("e") == "engine" and e["kind"] == "offload_landed":
            if e["data"]["kind"] == "store":
                assert e["data"]["crcs"] == issued[e["data"]["req"]]
                compared += 1
    assert compared == len(stores) and len(landed) >= 2 * len(stores) - 1
    assert r.results["exercised"]["offload"]["restores"] > 0


def test_a_seed_gives_the_same_history_with_the_tier_and_async_scheduling():
    sc = load_scenario("offload-store-before-compute-clean")  # tier + async scheduling
    a = run_scenario(sc, 3, report_dir=None).results["history_digest"]
    assert a == run_scenario(sc, 3, report_dir=None).results["history_digest"]


def test_a_manager_without_the_capability_runs_as_without_the_tier():
    from kvchaos.engine.prefix_manager import PrefixCachingManager

    sc = load_scenario("offload-tier-clean")
    cache = {**sc.engine["cache"], "prefix_caching": True}
    sc = sc.model_copy(update={"engine": {**sc.engine, "cache": cache}})
    # a user's manager, built as the engine builds one: without host blocks, no "offload"
    r = run_scenario(sc, 0, report_dir=None, block_manager=PrefixCachingManager)
    assert r.verdict == "PASS", r.summary
    assert not _engine_events(r, "offload_store") and _offload_result(r)["status"] == "not judged"
    assert "offload" in r.results["exercised"]["not_applicable"]


def test_the_tier_saves_device_blocks_on_a_think_time_workload():
    from kvchaos.harness.bench.offload_step import tier_saving

    out = tier_saving(seed=2)
    assert out["with_tier_verdict"] == out["without_tier_verdict"] == "PASS"
    assert out["with_tier"] < out["without_tier"]


def test_the_tier_off_leaves_the_engine_config_as_it_was():
    cfg = EngineConfig()
    assert "offload" not in cfg.to_dict()
    assert replace(cfg, offload=OffloadConfig()).config_hash() != cfg.config_hash()
    assert Engine(replace(cfg, cache=CacheConfig(prefix_caching=False))).tier is None


# -- the fault's variants --------------------------------------------------------------------
@pytest.mark.parametrize(
    "variant", ["store-before-compute", "restore-race", "stale-host", "host-slot-freed"]
)
def test_detect_is_caught_naming_the_restored_request(variant):
    r = run_scenario(load_scenario(f"offload-{variant}-detect"), 0, report_dir=None)
    assert r.verdict == "PASS", r.summary
    findings = _offload_result(r)["findings"]
    restored = {e["data"]["req"] for e in _engine_events(r, "offload_restore")}
    assert findings and findings[0]["evidence"]["req"] in restored


@pytest.mark.parametrize(
    "variant", ["store-before-compute", "restore-race", "stale-host", "host-slot-freed"]
)
def test_clean_holds_with_its_trigger_pulled(variant):
    r = run_scenario(load_scenario(f"offload-{variant}-clean"), 0, report_dir=None)
    assert r.verdict == "PASS", r.summary
    truth = r.results["fault_verify"]["offload"]
    assert truth["triggered"] > 0 and truth["remediated"] == truth["triggered"]
    assert not truth["fired"]


# -- the checker, on histories it is handed ----------------------------------------------------
def _ev(step, event, **data):
    return {"e": "engine", "step": step, "kind": event, "data": data}


def test_the_checker_names_a_store_that_read_early_and_a_read_in_flight():
    events = [
        _ev(1, "offload_store", req="a", why="cold", pairs=[[3, 0]], due=2, crcs=[7], fenced=0),
        _ev(2, "offload_landed", req="a", kind="store", issued=1, pairs=[[3, 0]], crcs=[8]),
        _ev(3, "offload_restore", req="a", pairs=[[0, 5]], due=4, crcs=[7], flipped=True),
        {"e": "tier_read", "step": 3, "req": "a", "blocks": [5], "issued": 3},
        _ev(4, "offload_landed", req="a", kind="restore", issued=3, pairs=[[0, 5]], crcs=[7]),
    ]
    kinds = [(f.kind, f.evidence["req"]) for f in check_offload(events).findings]
    assert kinds == [("store_content", "a"), ("read_in_flight", "a")]
    assert check_offload([]).valid is None  # no tier: not judged


def test_the_checker_names_a_host_slot_held_twice_and_a_block_reused_before_its_store():
    events = [
        _ev(1, "offload_store", req="a", why="cold", pairs=[[3, 0]], due=3, crcs=[7], fenced=0),
        {
            "e": "snapshot",
            "step": 2,
            "seq_blocks": {"a": [3], "b": [3]},
            "host_blocks": {"a": [0], "b": [0]},
            "host_free": [1],
        },
    ]
    kinds = sorted(f.kind for f in check_offload(events).findings)
    assert kinds == ["reuse_before_store", "tier_map"]


# -- configuration ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value", [("host_blocks", 0), ("cold_steps", -1), ("latency_steps", 0)]
)
def test_a_bad_offload_value_is_a_config_error_naming_it(field, value):
    with pytest.raises(ConfigError, match=f"engine.offload.{field}"):
        OffloadConfig(**{field: value})


BAD = """
[scenario]
name = "x"
[engine.offload]
{line}
"""


@pytest.mark.parametrize(
    "line, said",
    [
        ("host_blocks = 0", "engine.offload.host_blocks"),
        ("host_blocks = 'many'", "engine.offload.host_blocks"),
        ("hosts = 3", "engine.offload.hosts: unknown key"),
    ],
)
def test_a_bad_offload_table_is_refused_at_load(line, said):
    with pytest.raises(ScenarioError, match=said):
        parse_scenario(tomllib.loads(BAD.format(line=line)))


def test_the_offload_fault_needs_the_tier():
    text = BAD.format(line="host_blocks = 8").replace(
        "[engine.offload]\nhost_blocks = 8\n",
        '[[faults]]\nname = "offload"\nparams = { variant = "restore_race" }\n'
        '[expect]\noutcome = "detect"\ncheckers = ["offload"]\n',
    )
    with pytest.raises(ScenarioError, match=r"engine.offload"):
        parse_scenario(tomllib.loads(text))


# -- async_free's load_abort: an abort while a restore from the host tier is in flight -----------
def test_load_abort_detect_names_the_aborted_load_and_clean_holds():
    r = run_scenario(load_scenario("async-free-load-abort-detect"), 0, report_dir=None)
    assert r.verdict == "PASS", r.summary
    cancelled = {e["req"] for e in r.events if e.get("e") == "cancel" and e["phase"] == "restoring"}
    late = [f for f in _offload_result(r)["findings"] if f["kind"] == "landed_after_free"]
    assert late and {f["evidence"]["req"] for f in late} <= cancelled
    r = run_scenario(load_scenario("async-free-load-abort-clean"), 0, report_dir=None)
    assert r.verdict == "PASS", r.summary
    assert r.results["fault_verify"]["async_free"]["triggered"] > 0
    assert not _engine_events(r, "offload_late")


def test_the_tier_runs_events_are_as_their_types_say():
    from kvchaos.harness.history.events import ENGINE_DATA, KINDS

    seen = set()
    for name in ("async-free-load-abort-detect", "offload-prefix-hit-clean"):
        r = run_scenario(load_scenario(name), 1, report_dir=None)
        for e in r.events:
            t = KINDS[e["e"]]
            assert t.__required_keys__ <= set(e) <= t.__required_keys__ | t.__optional_keys__, e
            if e["e"] == "engine" and e["kind"] in ENGINE_DATA:
                seen.add(e["kind"])
                t = ENGINE_DATA[e["kind"]]
                assert t.__required_keys__ <= set(e["data"]), e
                assert set(e["data"]) <= t.__required_keys__ | t.__optional_keys__, e
                seen.add("hit") if e["data"].get("hit") else None
    assert {"offload_store", "offload_restore", "offload_landed", "offload_late", "hit"} <= seen


# -- conformance: the offload property ---------------------------------------------------------
class GivesBackAtStore(BlockManager):
    """A planted bug: the store frees the device blocks at once, before the copy completed."""

    def __init__(self, num_blocks, block_size, max_num_seqs, max_blocks_per_seq) -> None:
        super().__init__(num_blocks, block_size, max_num_seqs, max_blocks_per_seq, 2 * num_blocks)

    def offload_store(self, seq_id, num_tokens):
        pairs = super().offload_store(seq_id, num_tokens)
        for b, _ in pairs:  # back to the free list now (and once more at offload_done)
            self.pool.free.append(b)
        return pairs


def test_the_reference_with_a_host_tier_passes_offload_and_a_store_that_frees_early_fails():
    from kvchaos.engine.block_manager import HostTierBlockManager
    from kvchaos.harness.conformance.suite import run_conformance

    # 60 histories: with 15, whether one reaches a store depended on what the process had
    # imported before (the test's neighbours under xdist), never on the manager
    ok = {r.name: r for r in run_conformance(HostTierBlockManager, examples=60)}
    assert ok["offload"].status == "passed", ok["offload"]
    assert all(r.status != "failed" for r in ok.values()), [r for r in ok.values()]
    plain = {r.name: r for r in run_conformance(BlockManager, examples=3)}
    assert plain["offload"].status == "not applicable"
    bad = {r.name: r for r in run_conformance(GivesBackAtStore, examples=60)}
    assert bad["offload"].status == "failed"
    assert "before offload_done" in bad["offload"].message


def test_a_bad_offload_value_on_the_command_line_is_one_line_and_exit_2(tmp_path, capsys):
    from kvchaos.harness.cli import main

    bad = tmp_path / "bad.toml"
    bad.write_text(BAD.format(line="latency_steps = 0"))
    assert main(["run", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "engine.offload.latency_steps" in err and err.count("\n") == 1, err


def test_replay_of_a_tier_run_is_identical(tmp_path):
    from kvchaos.harness.tools.replay import replay

    r = run_scenario(load_scenario("offload-stale-host-detect"), 1, "cpu", tmp_path)
    out = replay(r.run_dir, isolated=False)
    assert out["identical"] and out["history_compared"]


@pytest.mark.parametrize("name", ["offload-restore-race-detect", "async-free-load-abort-detect"])
def test_a_tier_fault_under_a_manager_without_the_tier_says_it_does_not_apply(name):
    from tests.managers import Delegate

    r = run_scenario(load_scenario(name), 0, report_dir=None, block_manager=Delegate)
    fault = "offload" if name.startswith("offload") else "async_free"
    truth = r.results["fault_verify"][fault]
    assert truth["not_applicable"].endswith(
        "plants in the host tier: Delegate declares no 'offload'"
    )
    assert r.verdict == "INCONCLUSIVE" and "declares no 'offload'" in r.summary, r.summary
    assert not truth["fired"] and not truth["triggered"]
