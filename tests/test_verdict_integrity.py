"""Verdicts follow from evidence, on real runs: each repro that once gave a wrong verdict, with
the verdict it must give now; refusals are answers the engine schedules around; an exception from
the block manager is a finding; switching off a detect scenario's expected checkers gives MISSED."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvchaos.harness.check.evaluate import evaluate
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario, parse_scenario
from kvchaos.harness.scenario.toml_writer import dumps

sys.path.insert(0, str(Path(__file__).parent))  # tests/managers.py, named by spec

DETECT = {
    "table-overflow-detect": "table_overflow",
    "refcount-leak-detect": "refcount_leak",
    "staging-stall-detect": "staging_stall",
    "ordering-race-detect": "ordering_race",
}
# a decode-path table upload that never writes the new block: the selftest's canary
STALE_DECODE_TABLE = "kvchaos.harness.tools.canaries:DecodeTableNotUploaded"
CLEAN = ["baseline-clean", "mixed-clean", "refcount-leak-clean", "table-overflow-clean"]


def run(name_or_sc, seed=0, manager=None, **kw):
    sc = load_scenario(name_or_sc) if isinstance(name_or_sc, str) else name_or_sc
    spec = (manager if ":" in manager else f"managers:{manager}") if manager else None
    return run_scenario(sc, seed, "cpu", None, block_manager_spec=spec, **kw)


def edited(name: str, edit) -> object:
    """A built-in scenario with one change, as a user would write it."""
    import tomllib

    from kvchaos.harness.scenario.spec import BUILTIN_DIR

    data = tomllib.loads((BUILTIN_DIR / f"{name}.toml").read_text())
    edit(data)
    return parse_scenario(json.loads(json.dumps(data)), f"<{name} edited>")


# -- 1. every finding explained --------------------------------------------------------------
@pytest.mark.timing  # FAIL needs the stall caught by latency (measured time): MISSED under load
def test_a_stale_decode_table_fails_a_detect_scenario_it_cannot_be_credited_to():
    """Before: staging-stall-detect said PASS (latency caught the stall) while the oracle
    diverged from step 3 under a manager whose decode-path table upload is stale."""
    r = run("staging-stall-detect", manager=STALE_DECODE_TABLE)
    assert r.verdict == "FAIL", r.summary
    assert "explained by no planted fault" in r.summary


def test_rows_left_behind_after_free_fail_table_overflow_detect():
    """Before: PASS, though table_integrity fired at steps 17, 23, 26 - long before the planted
    overflow fired at step 51."""
    r = run("table-overflow-detect", manager="LeavesRowsBehind")
    assert r.verdict == "FAIL", r.summary
    first = min(f.step for f in r.findings if f.checker == "table_integrity")
    assert first < r.results["fault_verify"]["table_overflow"]["first_step"]


@pytest.mark.parametrize("seed", range(4))
def test_refcount_leak_detect_has_its_starvation_explained(seed):
    r = run("refcount-leak-detect", seed)
    assert r.verdict == "PASS", r.summary
    credits = r.results["credits"]
    assert all(c["fault"] == "refcount_leak" for c in credits)
    assert all(c["how"] == "consequence" for c in credits if c["checker"] == "liveness")


# -- 2. fired from ground truth -----------------------------------------------------------------
def test_the_race_fires_from_what_the_engine_did_not_from_the_checkers_crc(monkeypatch):
    """If the CRC observation breaks, cross_rank sees nothing: the verdict must blame the
    harness (MISSED), never the trigger (INCONCLUSIVE "never fired")."""
    from kvchaos.engine import ranks

    monkeypatch.setattr(ranks.VirtualRank, "crc", lambda self: 0)
    monkeypatch.setattr("kvchaos.engine.upload.zlib.crc32", lambda b: 0)
    sc = edited("ordering-race-detect", lambda d: d["expect"].update(checkers=["cross_rank"]))
    r = run(sc, 0)
    assert r.results["fault_verify"]["ordering_race"]["fired"]
    assert r.verdict == "MISSED", r.summary


# -- 3. clean runs prove their triggers -----------------------------------------------------------
@pytest.mark.parametrize(
    "name, edit",
    [
        ("staging-stall-bursts-clean", lambda d: d["faults"][0]["params"].update(at_step=5000)),
        ("ordering-race-clean", lambda d: d["faults"][0]["params"].update(probability=0.0)),
        (
            "table-overflow-clean",
            lambda d: (
                d["faults"][0].setdefault("params", {}).update(long_requests=0, boundary=False)
            ),
        ),
    ],
)
def test_a_clean_run_whose_trigger_never_fired_is_inconclusive(name, edit):
    # latency's limit out of reach: the verdicts are the triggers', not a busy machine's timing
    calm = lambda d: d.setdefault("run", {}).update(latency_slo_ratio=1e9)  # noqa: E731
    assert run(edited(name, calm)).verdict == "PASS"
    r = run(edited(name, lambda d: (calm(d), edit(d))))
    assert r.verdict == "INCONCLUSIVE", r.summary
    assert "trigger never pulled" in r.summary


def test_a_run_that_exercised_nothing_is_inconclusive():
    sc = edited("baseline-clean", lambda d: d["workload"].update(num_requests=0))
    r = run(sc)
    assert r.verdict == "INCONCLUSIVE" and "exercised nothing" in r.summary


def test_checkers_with_nothing_to_judge_say_so():
    r = run("baseline-clean")  # one rank: cross_rank has nothing to judge
    status = {c["checker"]: c["status"] for c in r.results["checkers"]}
    assert status["cross_rank"] == "not judged" and "not judged" in r.summary


# -- 4. the block manager's exceptions are findings; refusals are answers --------------------------
@pytest.mark.parametrize(
    "manager, call, error",
    [
        ("DoubleFreeGuard", "release(", "RuntimeError"),
        ("IndexErrorOnGrowth", "append(", "IndexError"),
    ],
)
def test_an_exception_from_the_block_manager_is_a_fail_naming_the_call(manager, call, error):
    r = run("baseline-clean", manager=manager)
    assert r.verdict == "FAIL", r.summary
    f = next(f for f in r.findings if f.checker == "manager_calls")
    assert f.evidence["call"].startswith(call) and f.evidence["error"] == error
    assert "Traceback" in f.evidence["traceback"] and r.results["error"] is None


def test_findings_before_a_crash_are_kept():
    r = run("refcount-leak-detect", manager="DoubleFreeGuard")
    assert r.verdict == "FAIL"
    assert {"block_accounting", "manager_calls"} <= {f.checker for f in r.findings}


@pytest.mark.parametrize("manager", ["Preallocating", "RefusesWhenLow", "Watermark", "NoFork"])
@pytest.mark.parametrize("name", CLEAN)
def test_managers_that_refuse_or_preallocate_pass_the_clean_scenarios(manager, name):
    r = run(name, 0, manager)
    assert r.verdict == "PASS", f"{manager} on {name}: {r.summary}"
    counters = next(e for e in r.events if e["e"] == "run_end")["counters"]
    assert counters["refusals"] >= 0 and "refusals_with_room" in counters


def test_refusals_are_counted():
    r = run("refcount-leak-clean", 0, "Watermark")
    counters = next(e for e in r.events if e["e"] == "run_end")["counters"]
    assert counters["refusals"] > 0 and counters["refusals_with_room"] > 0
    assert any(e["e"] == "engine" and e["kind"] == "refusal" for e in r.events)


def test_a_refusal_that_leaves_a_trace_is_caught():
    r = run("refcount-leak-clean", 0, "TracedRefusal")
    # the refusal heads the story; the wrong counts it left are listed under it
    assert r.verdict == "FAIL" and "refused, yet changed the manager" in r.summary
    assert any(f.checker == "block_accounting" for f in r.findings)


# -- the catch itself: without the expected checkers, every detect scenario is MISSED ---------
@pytest.mark.parametrize(
    "name",
    # the stall's PASS is latency catching it: measured time (timing)
    [pytest.param(n, marks=[pytest.mark.timing] * (n == "staging-stall-detect")) for n in DETECT],
)
def test_switching_off_the_expected_checkers_gives_missed(name):
    sc = load_scenario(name)
    r = run(sc)
    assert r.verdict == "PASS", r.summary
    end = next(e for e in r.events if e["e"] == "run_end")
    _, v = evaluate(sc, r.events, end["fault_verify"], None, disabled=sc.expect.checkers)
    assert v.verdict == "MISSED", v.summary


def test_the_scenarios_above_are_valid_files(tmp_path):
    """The edited scenarios round-trip as files a user could keep."""
    sc = edited("staging-stall-clean", lambda d: d["faults"][0]["params"].update(at_step=5000))
    path = tmp_path / "s.toml"
    path.write_text(dumps(sc.model_dump(mode="json", exclude_none=True)))
    assert load_scenario(path).faults[0].params["at_step"] == 5000


# -- 8. the oracle trusts neither the engine's record nor the code it shares with it ---------------
def test_an_engine_that_stores_a_mangled_prompt_is_caught(monkeypatch):
    from kvchaos.engine.engine import Engine

    real = Engine.add_request

    def mangled(self, request_id, prompt, max_new_tokens):
        prompt = list(prompt)
        prompt[0] = (prompt[0] + 1) % self.config.model.vocab_size
        return real(self, request_id, prompt, max_new_tokens)

    monkeypatch.setattr(Engine, "add_request", mangled)
    r = run("baseline-clean")
    assert r.verdict == "FAIL", r.summary
    kinds = {f.kind for f in r.findings if f.checker == "oracle_divergence"}
    assert "prompt" in kinds


def test_a_wrong_sign_in_the_shared_rotary_code_is_caught(monkeypatch):
    """Engine and oracle share the model's forward: only the independent reference sees this."""
    import torch

    from kvchaos.engine.model import Model

    def rope(self, x, cos, sin):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).to(x.dtype)

    assert run("baseline-clean").verdict == "PASS"
    monkeypatch.setattr(Model, "_rope", rope)
    r = run("baseline-clean")
    assert r.verdict == "FAIL", r.summary
    assert [f.kind for f in r.findings] == ["shared_code"]
    ref = next(e for e in r.events if e["e"] == "reference")
    assert not ref["agrees"] and ref["checked"] > 1


# -- 12. the manager's word about itself is checked ------------------------------------------
@pytest.mark.parametrize("manager", ["OutOfRangeSnapshot", "StaleSnapshot", "MiscountsFree"])
def test_a_snapshot_that_lies_is_a_finding_not_an_undecided_checker(manager):
    r = run("baseline-clean", manager=manager)
    assert r.verdict == "FAIL", r.summary
    assert any(f.kind == "bad_snapshot" for f in r.findings), [f.message for f in r.findings]
    assert all(c["status"] != "unknown" for c in r.results["checkers"])


# -- 9. reach ------------------------------------------------------------------------------------
def test_edge_over_really_spills_by_one_block():
    r = run("table-overflow-detect")
    assert {f.evidence["req"] for f in r.findings if f.kind == "overlong"} >= {"edge_over"}


def test_two_sequences_mapped_to_one_row_are_a_finding():
    from kvchaos.harness.check.checkers import check_table_integrity

    snap = {
        "e": "snapshot",
        "step": 4,
        "num_blocks": 8,
        "free": [3, 4, 5, 6, 7],
        "ref_counts": [1, 1, 1, 0, 0, 0, 0, 0],
        "seq_blocks": {"a": [0, 1], "b": [2]},
        "seq_rows": {"a": 0, "b": 0},
        "table": [0, 1, -1, -1, -1, -1, -1, -1],
        "table_width": 4,
        "live": ["a", "b"],
    }
    r = check_table_integrity([snap])
    assert "shared_row" in {f.kind for f in r.findings}


def test_a_request_that_fits_but_is_refused_is_a_finding(monkeypatch):
    """edge_fit is exactly one full row: an off-by-one admission that refuses it is a bug."""
    from kvchaos.engine.engine import Engine
    from kvchaos.engine.errors import RequestRejected

    real = Engine._validate

    def off_by_one(self, request_id, tokens, max_new_tokens):
        if len(tokens) + max_new_tokens >= self.config.cache.max_tokens_per_seq:
            self.counters["overlong_rejected"] += 1
            raise RequestRejected(f"request {request_id!r}: too long")
        return real(self, request_id, tokens, max_new_tokens)

    monkeypatch.setattr(Engine, "_validate", off_by_one)
    r = run("table-overflow-clean")
    assert r.verdict == "FAIL", r.summary
    wrong = [f for f in r.findings if f.kind == "wrong_refusal"]
    assert "edge_fit" in {f.evidence["req"] for f in wrong}  # the neighbours fill a row too
    assert all(f.evidence["blocks"] <= f.evidence["width"] for f in wrong)


def test_a_pass_says_which_manager_paths_it_exercised():
    r = run("mixed-clean")
    paths = r.results["exercised"]
    assert paths["forks"] > 0 and paths["copy_on_write_copies"] > 0 and paths["row_reuses"] > 0
    assert r.verdict == "PASS" and all(p in r.summary for p in paths["not_exercised"])
    r = run("baseline-clean", manager="NoFork")
    assert r.results["exercised"]["forks"] > 0 and r.results["exercised"]["fork_calls"] > 0


def test_a_write_into_a_shared_block_is_seen_from_the_token_counts():
    r = run("mixed-clean", manager="SkipsCopyOnWrite")
    assert r.verdict == "FAIL", r.summary
    shared = [f for f in r.findings if f.kind == "shared_write"]
    assert shared and all(f.evidence["refs"] > 1 for f in shared)


# -- 6. known-at: when the harness knew ----------------------------------------------------------
@pytest.mark.parametrize("name, seed", [("table-overflow-detect", 0), ("ordering-race-detect", 1)])
def test_a_divergence_is_known_within_eight_steps_whatever_the_batching(name, seed):
    r = run(name, seed)
    diverged = [f for f in r.findings if f.checker == "oracle_divergence"]
    assert diverged and all(0 <= f.known - f.step < 8 for f in diverged), [
        (f.step, f.known) for f in diverged
    ]
    reported = [f.evidence["req"] for f in diverged]
    assert len(reported) == len(set(reported))  # one finding a request


def test_a_refusal_that_changed_the_manager_is_named_as_such():
    r = run("refcount-leak-clean", 0, "TracedRefusal")
    changed = [f for f in r.findings if f.kind == "refusal_changed_state"]
    assert changed and "free" in changed[0].evidence["changed"]


def test_a_refusal_that_changed_only_a_ref_count_is_caught():
    # the free count is unchanged: only the snapshots before and after the refused call differ
    r = run("refcount-leak-clean", 0, "RefusalBumpsRef")
    changed = [f for f in r.findings if f.kind == "refusal_changed_state"]
    assert r.verdict == "FAIL" and changed, r.summary
    assert "ref counts" in changed[0].evidence["changed"]


# -- 11. every protocol addition is optional ------------------------------------------------------
def test_a_manager_without_fork_runs_with_its_fork_paths_not_applicable():
    r = run("mixed-clean", manager="WithoutFork")
    assert r.verdict == "PASS", r.summary
    paths = r.results["exercised"]
    assert set(paths["not_applicable"]) == {
        "fork_calls",
        "copy_on_write_copies",
        "frees_of_shared_blocks",
    }
    assert paths["forks"] > 0 and paths["fork_calls"] == 0
    assert not set(paths["not_applicable"]) & set(paths["not_exercised"])
    start = next(e for e in r.events if e["e"] == "run_start")
    assert start["capabilities"] == []


def test_writes_are_checked_against_the_blocks_the_snapshot_lists():
    """The engine's own slot mapping (where rank 0 wrote each sequence's KV) against the
    manager's snapshot of the same step: a stale decode table sends writes into a block the
    sequence does not hold (an unused entry lands in the pool's last block)."""
    r = run("baseline-clean", manager=STALE_DECODE_TABLE)
    stray = [f for f in r.findings if f.kind == "foreign_write"]
    assert stray and r.verdict == "FAIL"
    assert all(set(f.evidence["blocks"]).isdisjoint(f.evidence["owned"]) for f in stray)
    assert not [f for f in run("baseline-clean").findings if f.kind == "foreign_write"]


# -- 12. the slot mapping of every rank, not rank 0 alone ------------------------------------------
def test_a_stale_rank_writing_into_blocks_it_does_not_hold_is_caught_and_credited_to_the_race():
    r = run("ordering-race-detect", 0)
    stray = [f for f in r.findings if f.kind == "foreign_write"]
    assert stray and all(f.evidence["ranks"] == [1] for f in stray), [f.message for f in stray]
    credited = {(c["step"], c["checker"]) for c in r.results["credits"]}
    assert all((f.step, "table_integrity") in credited for f in stray)
    # the same write by a rank that was not stale at that step is no consequence of the race
    from dataclasses import asdict

    from kvchaos.faults.ordering_race import OrderingRace

    truth = r.results["fault_verify"]["ordering_race"]
    f = asdict(stray[0])
    assert OrderingRace.explains(f, truth) == "cause"
    assert OrderingRace.explains({**f, "evidence": {**f["evidence"], "ranks": [0]}}, truth) is None
