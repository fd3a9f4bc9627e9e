"""decide(): every verdict from an expectation, checker results and each fault's ground truth
(verify()), with the boundaries: caught exactly within the window, one step too late, before the
defect fired; findings explained by cause and time or the run FAILs, in detect scenarios too;
clean runs prove their triggers were pulled; checkers with nothing to judge never hold."""

from __future__ import annotations

import pytest

from kvchaos.harness.check.checkers import CHECKERS, CheckResult, Finding
from kvchaos.harness.check.verdict import (
    ERROR,
    EXIT_CODES,
    FAIL,
    INCONCLUSIVE,
    MEANING,
    MISSED,
    PASS,
    SEVERITY,
    decide,
    worst,
)
from kvchaos.harness.scenario.spec import parse_scenario


def scenario(outcome="clean", faults=(), checkers=(), within=2):
    data = {
        "scenario": {"name": "t"},
        "faults": [{"name": n, "defect": d} for n, d in faults],
        "expect": {"outcome": outcome},
    }
    if outcome == "detect":
        data["expect"].update(checkers=list(checkers), within_steps=within)
    return parse_scenario(data, "<test>")


def checks(*findings, unknown=(), not_judged=()):
    """One CheckResult per checker: findings given as (checker, step[, kind, evidence[, known]])."""
    out = []
    for name in CHECKERS:
        fs = [
            Finding(
                checker=f[0],
                step=f[1],
                message=f"{f[0]} saw something at step {f[1]}",
                evidence=f[3] if len(f) > 3 else {"req": "r1"},
                kind=f[2] if len(f) > 2 else "leak",
                known_at=f[4] if len(f) > 4 else None,
            )
            for f in findings
            if f[0] == name
        ]
        if name in unknown:
            out.append(
                CheckResult(
                    checker=name, valid=None, findings=[], error="Traceback ...\nKeyError: 'table'"
                )
            )
        elif name in not_judged:
            out.append(CheckResult(checker=name, valid=None, findings=[], error=None, checked=0))
        else:
            out.append(CheckResult(checker=name, valid=not fs, findings=fs, error=None, checked=10))
    return out


LEAK = scenario("detect", [("refcount_leak", True)], ["block_accounting"], within=2)
LEAKS = [{"req": "r1", "path": "decode", "blocks": [1, 2], "step": 10}]
FIRED_AT_10 = {"refcount_leak": {"fired": True, "first_step": 10, "times": 1, "leaks": LEAKS}}
PULLED = {"triggered": 2, "remediated": 2, "fired": False}


def test_pass_clean():
    v = decide(scenario(), checks(), {}, None, {"tokens": 5})
    assert (v.verdict, v.exit_code, v.time_to_detect) == (PASS, 0, {})


def test_pass_clean_with_trigger_only_faults_whose_triggers_were_pulled():
    sc = scenario(faults=[("table_overflow", False), ("refcount_leak", False)])
    verify = {"table_overflow": PULLED, "refcount_leak": PULLED}
    v = decide(sc, checks(), verify, None, {"tokens": 5})
    assert v.verdict == PASS and "pulled 2x" in v.summary


@pytest.mark.parametrize("idle", ["table_overflow", "refcount_leak"])
def test_a_clean_run_whose_trigger_never_fired_is_inconclusive(idle):
    """staging_stall at step 5000, ordering_race with probability 0, no long request: the trigger
    was never pulled, so "clean" proves nothing."""
    sc = scenario(faults=[("table_overflow", False), ("refcount_leak", False)])
    verify = {"table_overflow": PULLED, "refcount_leak": PULLED, idle: {"triggered": 0}}
    v = decide(sc, checks(), verify, None, {"tokens": 5})
    assert v.verdict == INCONCLUSIVE and idle in v.summary


def test_a_run_that_exercised_nothing_is_inconclusive():
    v = decide(scenario(), checks(), {}, None, {"tokens": 0})
    assert v.verdict == INCONCLUSIVE and "exercised nothing" in v.summary


def test_a_checker_with_nothing_to_judge_is_not_judged_never_held():
    v = decide(scenario(), checks(not_judged=["cross_rank", "latency"]), {}, None, {"tokens": 5})
    assert v.verdict == PASS and "not judged: latency, cross_rank" in v.summary
    assert (
        CheckResult(checker="cross_rank", valid=None, findings=[], error=None, checked=0).status
        == "not judged"
    )
    assert CheckResult(checker="x", valid=None, findings=[], error="Traceback").status == "unknown"


@pytest.mark.parametrize("step, ttd", [(10, 0), (11, 1), (12, 2)])
def test_pass_detect_within_steps(step, ttd):
    v = decide(LEAK, checks(("block_accounting", step)), FIRED_AT_10, None)
    assert v.verdict == PASS and v.time_to_detect == {"refcount_leak": ttd}
    assert "block_accounting" in v.summary


def test_time_to_detect_runs_to_when_the_harness_knew():
    """An oracle divergence at step 3 known when the request was checked at step 13."""
    sc = scenario("detect", [("table_overflow", True)], ["oracle_divergence"], within=5)
    truth = {"fired": True, "first_step": 3, "touched": {"requests": ["r1"], "rows": [1]}}
    f = ("oracle_divergence", 3, "divergence", {"req": "r1"}, 13)
    v = decide(sc, checks(f), {"table_overflow": truth}, None)
    assert v.verdict == MISSED and "first known after 10 steps" in v.summary
    ok = ("oracle_divergence", 3, "divergence", {"req": "r1"}, 7)
    v = decide(sc, checks(ok), {"table_overflow": truth}, None)
    assert v.verdict == PASS and v.time_to_detect == {"table_overflow": 4}


def test_missed_fired_but_nothing_caught_it():
    v = decide(LEAK, checks(), FIRED_AT_10, None)
    assert v.verdict == MISSED and v.exit_code == 10 and "refcount_leak" in v.summary


def test_missed_caught_too_late():
    v = decide(LEAK, checks(("block_accounting", 13)), FIRED_AT_10, None)
    assert v.verdict == MISSED and "first known after 3 steps" in v.summary


def test_a_consequence_never_counts_as_the_catch():
    """Starvation the leak explains (it shrank the pool below the queue's need) is credited, but
    it is not the catch: without block_accounting's own finding the run is MISSED, not FAIL."""
    sc = scenario("detect", [("refcount_leak", True)], ["liveness"], within=50)
    starved = ("liveness", 12, "starvation", {"req": "r9", "blocked_need": 47, "num_blocks": 48})
    v = decide(sc, checks(starved), FIRED_AT_10, None)
    assert v.verdict == MISSED and v.credits[0][2:] == ("refcount_leak", "consequence")


def test_starvation_the_leak_cannot_cover_is_a_bug_found():
    """Measured before: liveness flagged requests the leak never touched. A starved request is
    explained only while the blocks leaked so far shrink the pool below what the queue needs."""
    starved = ("liveness", 12, "starvation", {"req": "r9", "blocked_need": 20, "num_blocks": 48})
    v = decide(LEAK, checks(("block_accounting", 10), starved), FIRED_AT_10, None)
    assert v.verdict == FAIL and "liveness at step 12" in v.summary


def test_a_finding_no_planted_fault_explains_fails_a_detect_run():
    """A stale decode upload diverging at step 3, a row left behind after free at step 17: the
    planted defect was caught too, but a detect run must not hide a bug it cannot credit."""
    stray = ("table_integrity", 17, "foreign_block", {"row": 5, "owner": None})
    v = decide(LEAK, checks(("block_accounting", 10), stray), FIRED_AT_10, None)
    assert v.verdict == FAIL and "table_integrity at step 17" in v.summary
    early = ("block_accounting", 9)  # before the defect fired: not its doing
    v = decide(LEAK, checks(early, ("block_accounting", 10)), FIRED_AT_10, None)
    assert v.verdict == FAIL and "step 9" in v.summary


def test_a_finding_about_another_request_is_not_credited():
    other = ("block_accounting", 11, "leak", {"req": "r7"})
    v = decide(LEAK, checks(("block_accounting", 10), other), FIRED_AT_10, None)
    assert v.verdict == FAIL and v.credits[1][2] is None


def test_missed_when_only_a_non_expected_checker_fires():
    v = decide(LEAK, checks(("liveness", 10, "starvation", {})), FIRED_AT_10, None)
    assert v.verdict == MISSED


def test_missed_names_the_one_of_two_planted_faults_not_caught():
    sc = scenario(
        "detect", [("refcount_leak", True), ("ordering_race", True)], ["block_accounting"]
    )
    stale = [{"step": 3, "ranks": [1], "requests": ["r1"]}]
    verify = {**FIRED_AT_10, "ordering_race": {"fired": True, "first_step": 3, "stale": stale}}
    v = decide(sc, checks(("block_accounting", 10)), verify, None)
    assert v.verdict == MISSED and "ordering_race" in v.summary.split(":")[-1]
    assert "refcount_leak" not in v.summary.split(":")[-1]


def test_each_planted_fault_is_judged_by_its_own_detectors():
    """Two planted faults: the race is caught by cross_rank, the leak by block_accounting; neither
    is credited with the other's finding."""
    sc = scenario(
        "detect",
        [("refcount_leak", True), ("ordering_race", True)],
        ["block_accounting", "cross_rank"],
    )
    stale = [{"step": 3, "ranks": [1], "requests": ["r2"]}]
    verify = {**FIRED_AT_10, "ordering_race": {"fired": True, "first_step": 3, "stale": stale}}
    race = ("cross_rank", 3, "stale_table", {"ranks": [1]})
    v = decide(sc, checks(("block_accounting", 10), race), verify, None)
    assert v.verdict == PASS and v.time_to_detect == {"refcount_leak": 0, "ordering_race": 0}


def test_fail_with_nothing_planted_names_the_earliest_finding():
    v = decide(
        scenario(), checks(("liveness", 40), ("table_integrity", 7)), {}, None, {"tokens": 5}
    )
    assert v.verdict == FAIL and v.exit_code == 11
    assert "table_integrity" in v.summary and "step 7" in v.summary


def test_fail_with_trigger_only_faults():
    """The remediation failed under the trigger: a real engine bug."""
    sc = scenario(faults=[("refcount_leak", False)])
    v = decide(sc, checks(("block_accounting", 12)), {"refcount_leak": PULLED}, None)
    assert v.verdict == FAIL


@pytest.mark.parametrize("verify", [{"refcount_leak": {"fired": False, "first_step": None}}, {}])
def test_inconclusive_planted_but_never_fired(verify):
    v = decide(LEAK, checks(), verify, None)
    assert v.verdict == INCONCLUSIVE and v.exit_code == 12 and "refcount_leak" in v.summary


def test_any_finding_outranks_inconclusive():
    v = decide(LEAK, checks(("block_accounting", 3)), {}, None)
    assert v.verdict == FAIL


def test_error_on_run_error_keeps_the_findings():
    err = {"error": "RuntimeError", "message": "boom at step 5", "traceback": "..."}
    v = decide(LEAK, checks(("block_accounting", 10)), FIRED_AT_10, err)
    assert v.verdict == ERROR and v.exit_code == 13 and "RuntimeError: boom at step 5" in v.summary
    assert "1 findings kept" in v.summary and v.credits


@pytest.mark.parametrize("sc", [scenario(), LEAK])
def test_error_when_a_checker_could_not_decide_never_pass(sc):
    # on a clean scenario an unknown checker must not read as "clean"; on a detect scenario,
    # not even when an expected checker caught the defect
    v = decide(sc, checks(("block_accounting", 10), unknown=["table_integrity"]), FIRED_AT_10, None)
    assert v.verdict == ERROR and "table_integrity" in v.summary


def test_exit_codes_are_distinct_and_not_usage_or_pytest_codes():
    assert (
        set(EXIT_CODES)
        == {PASS, MISSED, FAIL, INCONCLUSIVE, ERROR}
        == set(MEANING)
        == set(SEVERITY)
    )
    codes = list(EXIT_CODES.values())
    assert len(set(codes)) == len(codes)
    assert EXIT_CODES[PASS] == 0 and not {1, 2, 130} & set(codes)


@pytest.mark.parametrize(
    "verdicts, expected",
    [
        ([], PASS),
        ([PASS, PASS], PASS),
        ([PASS, INCONCLUSIVE], INCONCLUSIVE),
        ([INCONCLUSIVE, ERROR, PASS], ERROR),
        ([ERROR, FAIL], FAIL),
        ([FAIL, MISSED, ERROR], MISSED),
        ([PASS, MISSED], MISSED),
    ],
)
def test_worst(verdicts, expected):
    assert worst(verdicts) == expected
    assert worst(list(reversed(verdicts))) == expected


def test_each_planted_fault_is_judged_against_its_own_window():
    """The soak plants several faults: a slow stall gets its 20 steps, the leak only its 2."""
    sc = parse_scenario(
        {
            "scenario": {"name": "t"},
            "faults": [{"name": "refcount_leak"}, {"name": "staging_stall"}],
            "expect": {
                "outcome": "detect",
                "checkers": ["block_accounting", "latency"],
                "within_steps": {"refcount_leak": 2, "staging_stall": 20},
            },
        },
        "<t>",
    )
    verify = {**FIRED_AT_10, "staging_stall": {"fired": True, "first_step": 10}}
    stall = ("latency", 25, "latency_climb", {})
    v = decide(sc, checks(("block_accounting", 11), stall), verify, None)
    assert v.verdict == PASS and v.time_to_detect == {"refcount_leak": 1, "staging_stall": 15}
    v = decide(sc, checks(("block_accounting", 15), stall), verify, None)
    assert v.verdict == MISSED and "refcount_leak (first known after 5 steps)" in v.summary


RACE = scenario("detect", [("ordering_race", True)], ["cross_rank", "oracle_divergence"])
STALE_AT_9 = {
    "ordering_race": {
        "fired": True,
        "first_step": 9,
        "stale": [{"step": 9, "ranks": [1], "requests": ["r7"]}],
        "touched": {"blocks": [0]},
    }
}


def test_a_divergence_fed_by_a_wrong_read_the_fault_explains_is_its_consequence():
    """Soak seed 595: r7 wrote block 0 through rank 1's stale table at step 9; r10, not live then,
    hit block 0 at step 15 and diverged. Its wrong read is the race's, so its divergence is too;
    with no such read, or one only after it diverged, the divergence stays unexplained."""
    stale = ("cross_rank", 9, "stale_table", {"ranks": [1]})
    read = ("kv_reads", 15, "wrong_read", {"req": "r10", "rank": 1, "block": 0, "writer": "r7"})
    diverged = ("oracle_divergence", 15, "divergence", {"req": "r10"})
    v = decide(RACE, checks(stale, read, diverged), STALE_AT_9, None)
    assert v.verdict == PASS, v.summary
    assert ("oracle_divergence", 15, "ordering_race", "consequence") in v.credits
    v = decide(RACE, checks(stale, diverged), STALE_AT_9, None)
    assert v.verdict == FAIL and "oracle_divergence at step 15" in v.summary
    late = ("kv_reads", 16, "wrong_read", {"req": "r10", "rank": 1, "block": 0, "writer": "r7"})
    v = decide(RACE, checks(stale, late, diverged), STALE_AT_9, None)
    assert v.verdict == FAIL and "oracle_divergence at step 15" in v.summary


# -- a host tier beside another failure mode (the soak's tier mixes) ---------------------------
TIER = parse_scenario(
    {
        "scenario": {"name": "t"},
        "engine": {"offload": {}},
        "faults": [
            {"name": "offload", "defect": False, "params": {"variant": "restore_race"}},
            {"name": "table_overflow", "defect": True},
        ],
        "expect": {"outcome": "detect", "checkers": ["table_integrity"], "within_steps": 2},
    },
    "<test>",
)
OVERFLOW_AT_33 = {
    "offload": PULLED,
    "table_overflow": {
        "fired": True,
        "first_step": 33,
        "times": 1,
        "touched": {"requests": ["long0"], "rows": [0], "blocks": [13]},
    },
}


def _store(blocks, since, step=35, issued=33):
    ev = {"req": "r9", "blocks": blocks, "issued": issued, "since": since}
    return ("offload", step, "store_content", ev)


def _foreign(step, blocks):
    return ("table_integrity", step, "foreign_write", {"req": "long0", "blocks": blocks})


def test_a_store_whose_blocks_a_planted_write_changed_in_flight_is_its_consequence():
    """Soak seed 156: long0's spilled write landed in block 13 at step 33 while r9's store of it
    was in flight (issued 33, completed 35): the host copy differs, the overflow's doing. A write
    before the copy was taken, into another block, or into one of two differing blocks only, is
    no explanation: the run FAILs."""
    v = decide(TIER, checks(_foreign(33, [13]), _store([13], [33])), OVERFLOW_AT_33, None)
    assert v.verdict == PASS, v.summary
    assert ("offload", 35, "table_overflow", "consequence") in v.credits
    for bad in (
        checks(_foreign(33, [12]), _store([13], [33])),  # another block
        checks(_foreign(33, [13]), _store([13], [34], issued=34)),  # before the copy was taken
        checks(_foreign(33, [13]), _store([13, 14], [33, 33])),  # 14 differs unexplained
    ):
        v = decide(TIER, bad, OVERFLOW_AT_33, None)
        assert v.verdict == FAIL and "offload at step 35" in v.summary, v.summary


def test_a_kept_host_copy_a_planted_write_made_stale_is_its_consequence():
    """Soak seed 1307: nb1's restore landed at step 26 and its host copy was kept as current; a
    spilled write into block 13 at step 33 made it stale, and the store at step 73 used it."""
    kept = _store([13], [26], step=73, issued=73)
    v = decide(TIER, checks(_foreign(33, [13]), kept), OVERFLOW_AT_33, None)
    assert v.verdict == PASS and ("offload", 73, "table_overflow", "consequence") in v.credits
    fresh = _store([13], [73], step=73, issued=73)  # copied at 73: a write at 33 is no cause
    assert decide(TIER, checks(_foreign(33, [13]), fresh), OVERFLOW_AT_33, None).verdict == FAIL


def test_a_leaked_requests_tier_map_is_the_leaks_consequence():
    """Soak seed 1862: r1's cancel while restoring skipped the free; the manager still names the
    device blocks its restore gave it, so the tier map has it stored out holding them."""
    caught = ("block_accounting", 10, "leak", {"req": "r1"})
    held = ("offload", 11, "tier_map", {"req": "r1", "blocks": [1, 2]})
    v = decide(LEAK, checks(caught, held), FIRED_AT_10, None)
    assert v.verdict == PASS and ("offload", 11, "refcount_leak", "consequence") in v.credits
    other = ("offload", 11, "tier_map", {"req": "r1", "blocks": [1, 3]})  # 3 never leaked
    assert decide(LEAK, checks(caught, other), FIRED_AT_10, None).verdict == FAIL
