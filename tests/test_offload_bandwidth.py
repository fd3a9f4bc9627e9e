"""The host tier's copy bandwidth ([engine.offload] blocks_per_step, engine/offload.py): a copy's
blocks land in order over several steps, each its own due step, the copies sharing the bandwidth
first in, first out; the tier map and the checker follow each block; every planted hazard is
still caught with a bandwidth, and the remediated engine holds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvchaos.engine.config import CacheConfig, EngineConfig, OffloadConfig
from kvchaos.engine.engine import Engine
from kvchaos.engine.errors import ConfigError
from kvchaos.engine.offload import HostTier
from kvchaos.harness.check.offload_checks import check_offload
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario


def _engine_events(r, kind: str) -> list[dict]:
    return [e for e in r.events if e.get("e") == "engine" and e["kind"] == kind]


def _offload_result(r):
    return next(c for c in r.results["checkers"] if c["checker"] == "offload")


def _with_bandwidth(name: str, blocks: int = 2):
    sc = load_scenario(name)
    offload = {**sc.engine["offload"], "blocks_per_step": blocks}
    return sc.model_copy(update={"engine": {**sc.engine, "offload": offload}})


# -- configuration -------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [-1, True, 1.5, "2"])
def test_a_bad_bandwidth_is_a_config_error_naming_it(value):
    with pytest.raises(ConfigError, match="engine.offload.blocks_per_step"):
        OffloadConfig(blocks_per_step=value)


def test_a_bad_bandwidth_on_the_command_line_is_one_line_and_exit_2(tmp_path, capsys):
    from kvchaos.harness.cli import main

    bad = tmp_path / "bad.toml"
    bad.write_text('[scenario]\nname = "x"\n[engine.offload]\nblocks_per_step = -2\n')
    assert main(["run", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "engine.offload.blocks_per_step" in err and err.count("\n") == 1, err


def test_unlimited_leaves_the_config_as_it_was_and_a_bandwidth_is_in_its_hash():
    cfg = EngineConfig(offload=OffloadConfig())
    assert "blocks_per_step" not in cfg.to_dict()["offload"]
    bw = replace(cfg, offload=OffloadConfig(blocks_per_step=2))
    assert bw.to_dict()["offload"]["blocks_per_step"] == 2
    assert bw.config_hash() != cfg.config_hash()


# -- the schedule ------------------------------------------------------------------------------
def test_copies_share_the_bandwidth_first_in_first_out():
    tier = HostTier(pools=[], latency=1, bandwidth=2)
    assert tier.book(3, 5, 4) == [5, 5, 6]
    assert tier.book(2, 5, 4) == [6, 7]  # behind the first copy's blocks
    assert tier.book(1, 9, 8) == [9]
    # blocks whose host copy is kept take no bandwidth: due with the block before (or now)
    assert tier.book(4, 10, 9, {0, 2}) == [9, 10, 10, 10]
    assert HostTier(pools=[], latency=1).book(3, 5, 4) == [5, 5, 5]  # unlimited


# -- the engine: the tier map block by block ---------------------------------------------------
def test_a_stored_and_restored_request_moves_block_by_block_and_computes_as_without_the_tier():
    cache = CacheConfig(
        block_size=4, num_blocks=16, max_blocks_per_seq=8, max_num_seqs=2, prefix_caching=False
    )
    cfg = EngineConfig(cache=cache, offload=OffloadConfig(cold_steps=1, blocks_per_step=1))
    prompt = [(7 * i + 3) % 250 for i in range(12)]  # three blocks
    ref = Engine(replace(cfg, offload=None))
    ref.add_request("a", prompt, 6)
    while ref.has_unfinished():
        ref.step()
    e = Engine(cfg)
    e.add_request("a", prompt, 6)
    e.step()  # the prefill and its first token
    assert e.pause("a")
    maps, seen = [], []
    for _ in range(12):
        e.step()
        row = e.tier.tiers.get("a")
        maps.append([b[0] for b in row] if row else None)
        seen.append(e.seqs["a"].tier)
        if e.seqs["a"].tier == "host" and e.seqs["a"].state.value == "idle":
            assert e.resume("a")
    # stored one block a step (flight -> host), then restored one a step (flight -> device)
    assert ["host", "flight", "flight"] in maps and ["host", "host", "flight"] in maps
    assert ["device", "flight", "flight"] in maps and ["device", "device", "flight"] in maps
    assert "storing" in seen and "restoring" in seen and seen[-1] == "device"
    while e.has_unfinished():
        e.step()
    assert e.seqs["a"].tokens == ref.seqs["a"].tokens
    assert e.counters["offload_stores"] == 1 and e.counters["offload_restores"] == 1


# -- the clean run, its events and the checker on them ---------------------------------------
def test_the_bandwidth_run_lands_every_copy_in_order_by_its_dues_and_every_checker_holds():
    r = run_scenario(load_scenario("offload-bandwidth-clean"), 0, report_dir=None)
    assert r.verdict == "PASS", r.summary
    assert _offload_result(r)["status"] == "held"
    issued, landed, spread = {}, {}, 0
    for e in r.events:
        if e.get("e") != "engine":
            continue
        d = e["data"]
        if e["kind"] in ("offload_store", "offload_restore"):
            if d["req"] in issued:  # the one before completed: all its blocks, in order
                assert landed[d["req"]] == issued[d["req"]][0]
            issued[d["req"]] = ([tuple(p) for p in d["pairs"]], d["dues"])
            landed[d["req"]] = []
        elif e["kind"] == "offload_landed":
            pairs, dues = issued[d["req"]]
            at = len(landed[d["req"]])
            landed[d["req"]] += [tuple(p) for p in d["pairs"]]
            assert landed[d["req"]] == pairs[: len(landed[d["req"]])]  # in logical order
            assert all(e["step"] <= due for due in dues[at : len(landed[d["req"]])])
            spread += at > 0
    assert spread > 0  # copies whose blocks landed over several steps
    tiers = _engine_events(r, "offload_tier")
    assert max(t["data"]["blocks_in_flight"] for t in tiers) > 2
    truth = r.results["fault_verify"]
    for name in ("offload", "async_free"):
        assert truth[name]["triggered"] > 0 and not truth[name]["fired"], name
        assert truth[name]["remediated"] == truth[name]["triggered"], name
    from kvchaos.harness.history.events import ENGINE_DATA

    for e in r.events:
        if e.get("e") == "engine" and e["kind"] in ENGINE_DATA:
            t = ENGINE_DATA[e["kind"]]
            assert (
                t.__required_keys__ <= set(e["data"]) <= t.__required_keys__ | t.__optional_keys__
            )


def test_a_seed_gives_the_same_history_with_a_bandwidth():
    sc = load_scenario("offload-bandwidth-clean")
    a = run_scenario(sc, 4, report_dir=None).results["history_digest"]
    assert a == run_scenario(sc, 4, report_dir=None).results["history_digest"]


def _ev(step, event, **data):
    return {"e": "engine", "step": step, "kind": event, "data": data}


def test_the_checker_judges_each_block_as_it_lands():
    store = _ev(1, "offload_store", req="a", why="cold", pairs=[[3, 0], [4, 1]], due=3)
    store["data"].update(crcs=[7, 8], fenced=False, dues=[2, 3])
    events = [
        store,
        _ev(2, "offload_landed", req="a", kind="store", issued=1, pairs=[[3, 0]], crcs=[7]),
        # block 3's copy landed: another holding it is no reuse before its store; block 4 is
        {"e": "snapshot", "step": 2, "seq_blocks": {"a": [3, 4], "b": [3]}, "host_blocks": {}},
        {"e": "snapshot", "step": 2, "seq_blocks": {"a": [3, 4], "c": [4]}, "host_blocks": {}},
        _ev(3, "offload_landed", req="a", kind="store", issued=1, pairs=[[4, 1]], crcs=[9]),
        _ev(5, "offload_restore", req="a", pairs=[[0, 5], [1, 6]], due=7, crcs=[7, 8]),
        _ev(6, "offload_landed", req="a", kind="restore", issued=5, pairs=[[0, 5]], crcs=[7]),
        # it computes once block 5 landed: only block 6 was read in flight
        {"e": "tier_read", "step": 6, "req": "a", "blocks": [5, 6], "issued": 5},
        _ev(7, "offload_landed", req="a", kind="restore", issued=5, pairs=[[1, 6]], crcs=[8]),
    ]
    events[5]["data"]["flipped"] = True
    found = check_offload(events).findings
    got = {(f.kind, f.evidence.get("holder", f.evidence["req"])): f.evidence for f in found}
    assert set(got) == {
        ("reuse_before_store", "c"),
        ("store_content", "a"),
        ("read_in_flight", "a"),
    }
    assert got[("reuse_before_store", "c")]["blocks"] == [4]
    assert got[("store_content", "a")]["blocks"] == [4]  # block 3's copy was what it read
    assert got[("read_in_flight", "a")]["blocks"] == [6]
    # the restore read what the store copied: block 4's host copy, 8, was read at issue
    assert not [f for f in found if f.kind == "restore_content"]


# -- the planted hazards, with a bandwidth -------------------------------------------------
DETECT = [
    "offload-store-before-compute-bandwidth-detect",
    "offload-restore-race-bandwidth-detect",
    "offload-stale-host-bandwidth-detect",
    "offload-host-slot-freed-bandwidth-detect",
]


@pytest.mark.parametrize("name", DETECT)
def test_each_offload_variant_is_caught_with_a_bandwidth_naming_the_restored_request(name):
    r = run_scenario(load_scenario(name), 1, report_dir=None)
    assert r.verdict == "PASS", r.summary
    findings = _offload_result(r)["findings"]
    restored = {e["data"]["req"] for e in _engine_events(r, "offload_restore")}
    assert findings and findings[0]["evidence"]["req"] in restored
    assert r.results["fault_verify"]["offload"]["fired"]
    assert max(len(_engine_events(r, "offload_landed")), 1) > len(
        _engine_events(r, "offload_store") + _engine_events(r, "offload_restore")
    )  # copies landed in parts


def test_restore_race_with_a_bandwidth_flips_before_the_last_block_landed():
    r = run_scenario(load_scenario("offload-restore-race-bandwidth-detect"), 0, report_dir=None)
    assert r.verdict == "PASS", r.summary
    pairs = {}  # (req, the step its restore was issued) -> its device blocks
    partial = 0
    for e in r.events:
        if e.get("e") == "engine" and e["kind"] == "offload_restore":
            pairs[e["data"]["req"], e["step"]] = {b for _, b in e["data"]["pairs"]}
        elif e.get("e") == "tier_read":
            mine = pairs[e["req"], e["issued"]]
            assert set(e["blocks"]) <= mine
            partial += set(e["blocks"]) < mine  # some of its blocks had landed
    assert partial
    reads = [f["evidence"] for f in _offload_result(r)["findings"] if f["kind"] == "read_in_flight"]
    assert reads and all(set(f["blocks"]) <= pairs[f["req"], f["issued"]] for f in reads)


def test_load_abort_with_a_bandwidth_aborts_a_partly_landed_restore_and_is_caught():
    r = run_scenario(load_scenario("async-free-load-abort-bandwidth-detect"), 0, report_dir=None)
    assert r.verdict == "PASS", r.summary
    pairs = {
        e["data"]["req"]: [b for _, b in e["data"]["pairs"]]
        for e in r.events
        if e.get("e") == "engine" and e["kind"] == "offload_restore"
    }
    late = _engine_events(r, "offload_late")
    assert late and all(set(e["data"]["blocks"]) < set(pairs[e["data"]["req"]]) for e in late)
    found = [f for f in _offload_result(r)["findings"] if f["kind"] == "landed_after_free"]
    assert found and {f["evidence"]["req"] for f in found} <= {e["data"]["req"] for e in late}


@pytest.mark.parametrize(
    "name, fault",
    [
        ("offload-store-before-compute-clean", "offload"),
        ("offload-stale-host-clean", "offload"),
        ("offload-host-slot-freed-clean", "offload"),
        ("async-free-load-abort-clean", "async_free"),
    ],
)
def test_each_clean_holds_with_a_bandwidth_its_trigger_pulled(name, fault):
    r = run_scenario(_with_bandwidth(name), 0, report_dir=None)
    assert r.verdict == "PASS", r.summary
    truth = r.results["fault_verify"][fault]
    assert truth["triggered"] > 0 and truth["remediated"] == truth["triggered"]
    assert not truth["fired"]


def test_a_request_flipped_early_and_gone_cold_is_stored_only_once_its_load_landed():
    """restore_flip with a bandwidth: the request runs on a partly landed restore and may pause
    and go cold before the rest lands; its next store waits for the copy (the manager takes one
    copy per sequence at a time)."""
    cache = CacheConfig(
        block_size=4, num_blocks=16, max_blocks_per_seq=8, max_num_seqs=2, prefix_caching=False
    )
    cfg = EngineConfig(cache=cache, offload=OffloadConfig(cold_steps=1, blocks_per_step=1))
    e = Engine(cfg)
    e.seams.restore_flip = lambda seq: True
    e.add_request("a", [(5 * i + 1) % 250 for i in range(16)], 12)  # four blocks
    e.step()
    assert e.pause("a")
    while e.seqs["a"].tier != "host":
        e.step()
    assert e.resume("a")
    while not (e.seqs["a"].tier == "device" and "a" in e.tier.copies):
        e.step()  # flipped at the first landing
    e.step()  # it computes on the blocks still in flight, a token
    assert "a" in e.tier.copies and e.pause("a")
    stores = e.counters["offload_stores"]
    for _ in range(20):
        e.step()
        if getattr(e.tier.copies.get("a"), "kind", None) != "restore":
            break
        assert e.counters["offload_stores"] == stores  # not while its restore is in flight
    assert e.counters["offload_stores"] == stores + 1  # once it landed (cold since)
