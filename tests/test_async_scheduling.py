"""Asynchronous scheduling (engine/inflight.py) and the async_free fault (faults/async_free.py):
off, a run's history is the one it always was; on, a seed gives one history, replay holds; each
variant fires (from the engine's record of late writes) and is caught; remediated, the trigger is
pulled and every checker holds."""

from __future__ import annotations

from array import array
from pathlib import Path

import pytest
import tomllib
import torch

import kvchaos
from kvchaos.engine import EngineConfig
from kvchaos.engine.inflight import InFlight
from kvchaos.faults import REGISTRY
from kvchaos.faults.async_free import AsyncFree
from kvchaos.faults.base import ParamError
from kvchaos.harness.history.events import ENGINE_DATA, KINDS
from kvchaos.harness.history.log import deterministic_digest
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario, parse_scenario
from kvchaos.harness.tools.replay import replay

# the default config's hash before async scheduling existed: every stored run's
DEFAULT_HASH = "6e4f4b7c1571"
SCENARIOS = Path(kvchaos.__file__).parent / "scenarios"


# the variants planted under asynchronous scheduling (load_abort is the host tier's:
# tests/test_offload.py)
ASYNC = [v for v in AsyncFree.variant_names() if v != "load_abort"]


def scenario(variant: str, outcome: str):
    return load_scenario(f"async-free-{variant}-{outcome}")


@pytest.fixture(scope="module")
def runs() -> dict:
    """Each variant's detect and clean scenario on seed 0, once for the module."""
    return {
        (v, o): run_scenario(scenario(v, o), 0, "cpu", None)
        for v in ASYNC
        for o in ("detect", "clean")
    }


def async_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e["e"] == "engine" and e["kind"].startswith("async_")]


def test_off_the_config_and_the_history_are_as_they_were():
    assert EngineConfig().config_hash() == DEFAULT_HASH
    assert "async_scheduling" not in EngineConfig().to_dict()
    sc = load_scenario("refcount-leak-detect")
    data = tomllib.loads((SCENARIOS / "refcount-leak-detect.toml").read_text())
    data["engine"]["async_scheduling"] = False
    said_off = parse_scenario(data, "off.toml")
    a, b = run_scenario(sc, 1, "cpu", None), run_scenario(said_off, 1, "cpu", None)
    assert deterministic_digest(a.events) == deterministic_digest(b.events)
    start = a.events[0]
    assert start["e"] == "run_start" and "async_scheduling" not in start["config"]
    assert not async_events(a.events)
    assert "async_fences" not in a.events[-1]["counters"]


def test_on_a_seed_gives_one_history_with_what_is_in_flight(runs):
    sc = scenario("finish", "clean")
    again = run_scenario(sc, 0, "cpu", None)
    first = runs[("finish", "clean")]
    assert deterministic_digest(again.events) == deterministic_digest(first.events)
    kinds = {e["kind"] for e in async_events(first.events)}
    assert {"async_step", "async_fence"} <= kinds and "async_landed" not in kinds
    steps = [e["data"] for e in async_events(first.events) if e["kind"] == "async_step"]
    # one step in flight at a time: each completes in the next
    assert all(b["completed"] in (None, a["inflight"]) for a, b in zip(steps, steps[1:]))
    assert first.events[0]["config"]["async_scheduling"] is True


FREES = [v for v in ASYNC if v != "staging"]


@pytest.mark.parametrize("variant", FREES)
def test_each_variant_fires_and_is_caught(runs, variant):
    r = runs[(variant, "detect")]
    assert r.verdict == "PASS", r.summary
    truth = r.results["fault_verify"]["async_free"]
    assert truth["fired"] and truth["landed"] and truth["freed_early"]
    # the late writes went into blocks their writer no longer held: table_integrity names them
    found = [f for c in r.results["checkers"] for f in c.get("findings", [])]
    writes = [f for f in found if f.get("kind") == "foreign_write"]
    assert writes and writes[0]["evidence"]["req"] in truth["freed_early"]
    assert {x["req"] for x in truth["landed"]} <= set(truth["freed_early"])


def test_a_restaged_buffer_mixes_two_steps_and_is_caught(runs):
    r = runs[("staging", "detect")]
    assert r.verdict == "PASS", r.summary
    truth = r.results["fault_verify"]["async_free"]
    assert truth["fired"] and truth["mixed"] and not truth["landed"]
    mixed = {q for x in truth["mixed"] for q in x["seqs"]}
    found = [f for c in r.results["checkers"] for f in c.get("findings", [])]
    # sequences computing through the step before's rows wrote where they hold no slot
    table = [f for f in found if f["checker"] == "table_integrity"]
    assert table and {f["evidence"]["req"] for f in table} <= mixed
    events = [e for e in async_events(r.events) if e["kind"] == "async_mixed"]
    assert [e["data"]["seqs"] for e in events] == [x["seqs"] for x in truth["mixed"]]


@pytest.mark.parametrize("variant", ASYNC)
def test_remediated_the_hazard_window_occurs_and_everything_holds(runs, variant):
    r = runs[(variant, "clean")]
    assert r.verdict == "PASS", r.summary
    truth = r.results["fault_verify"]["async_free"]
    assert truth["triggered"] > 0 and truth["remediated"] == truth["triggered"]
    assert not truth["fired"] and not truth["landed"] and not truth["mixed"]
    if variant == "staging":  # double-buffered: no table mixes two steps
        assert not [e for e in async_events(r.events) if e["kind"] == "async_mixed"]
        return
    fences = [e["data"] for e in async_events(r.events) if e["kind"] == "async_fence"]
    reason = {"finish": "finish", "abort": "cancel", "preempt": "preempt"}[variant]
    assert sum(f["why"] == reason for f in fences) == truth["triggered"]


def test_replay_of_an_async_run_is_identical(tmp_path):
    r = run_scenario(scenario("abort", "detect"), 1, "cpu", tmp_path)
    out = replay(r.run_dir, isolated=False)
    assert out["identical"] and out["history_compared"]


def test_the_fault_needs_async_scheduling_and_names_its_variant():
    with pytest.raises(ParamError, match=r"async_scheduling = true"):
        AsyncFree.check_params({"variant": "finish"}, EngineConfig())
    AsyncFree.check_params({"variant": "preempt"}, EngineConfig(async_scheduling=True))
    with pytest.raises(ParamError, match=r"params.variant: expected one of \['finish'"):
        AsyncFree.check_params({"variant": "later"})
    assert REGISTRY["async_free"].label({"variant": "abort"}) == "async_free/abort"


def test_writes_kept_for_an_early_free_land_when_their_step_completes():
    pool = torch.zeros(1, 2, 4, 2, 1, 1)  # [layers, K/V, blocks, block_size, heads, dim]
    pool[0, 0, 3, 1] = 7.0  # step 5 wrote slot 7 (block 3, offset 1) for "a"
    f = InFlight(counters={"async_fences": 0, "async_freed": 0, "async_landed": 0})
    f.begin(5, ["a", "b"], [9, 0], [11, 12], [torch.tensor([7, 0])])
    assert f.wrote("a") and f.wrote("b")
    freed = f.keep("a", [pool])
    assert freed["slots"] == [7] and not f.wrote("a")
    pool[0, 0, 3, 1] = -1.0  # the block's next holder writes it

    class Table:
        class table:
            host, width = array("i", [3, -1, -1, -1]), 2

        rows = {"b": 0}

    landed = f.complete([pool], Table)
    assert pool[0, 0, 3, 1].item() == 7.0  # the late write is over the new holder's
    assert landed[0]["blocks"] == [3] and landed[0]["holders"] == {"3": ["b"]}
    assert f.step is None and f.counters["async_landed"] == 1


def test_the_events_are_as_their_types_say(runs):
    for key in (("preempt", "detect"), ("abort", "clean")):
        events = runs[key].events
        assert {e["e"] for e in events} <= set(KINDS)
        for e in async_events(events):
            t = ENGINE_DATA[e["kind"]]
            assert (
                t.__required_keys__ <= set(e["data"]) <= t.__required_keys__ | t.__optional_keys__
            )
        kinds = {e["kind"] for e in async_events(events)}
        assert kinds >= ({"async_freed", "async_landed"} if key[1] == "detect" else {"async_fence"})


SOAK_142 = {  # soak seed 142 (under SGLang's manager and the reference alike), its draws as given
    "scenario": {"name": "soak-142-staging", "seeds": [142]},
    "engine": {
        "max_prefill_tokens": 22,
        "async_scheduling": True,
        "cache": {"block_size": 4, "max_blocks_per_seq": 13, "max_num_seqs": 4, "num_blocks": 39},
    },
    "workload": {
        "num_requests": 14,
        "arrival_rate": 2.309,
        "cancel": {"rate": 0.01, "phases": ["preempted", "prefill", "decode"]},
        "prompt_len": {"dist": "uniform", "min": 1, "max": 25},
        "output_len": {"dist": "uniform", "min": 1, "max": 14},
        "prefix": {
            "groups": 2,
            "prefix_len": {"dist": "uniform", "min": 1, "max": 13},
            "share": 0.496,
            "repeat": 0.055,
        },
    },
    "faults": [{"name": "async_free", "defect": True, "params": {"variant": "staging"}}],
    "expect": {
        "outcome": "detect",
        "checkers": ["kv_reads", "oracle_divergence", "prefix_cache", "table_integrity"],
        "within_steps": 2,
    },
}


def test_a_finished_sequences_blocks_keyed_through_a_mixed_table_are_the_race_s():
    """A sequence computed through a mixed table and finished in that step: the prefix cache keys
    its blocks, which it never wrote (its writes went to the step before's rows). Its row is gone
    by the fault's look, so the mixed record's own blocks (as staged) are what names them."""
    r = run_scenario(parse_scenario(SOAK_142, "<test>"), 142, "cpu", None)
    truth = r.results["fault_verify"]["async_free"]
    assert truth["fired"] and any(m["blocks"] for m in truth["mixed"])
    never = [
        f
        for c in r.results["checkers"]
        if c["checker"] == "prefix_cache"
        for f in c["findings"]
        if f["evidence"].get("written") == 0
    ]
    assert never, "the shape this guards: a cached block nobody wrote"
    assert r.verdict == "PASS", r.summary
