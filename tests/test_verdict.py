"""decide(): every verdict from an expectation, checker results and fault.verify(), with the
boundaries (caught exactly within the window, one step too late, before the defect fired)."""

from __future__ import annotations

import pytest

from kvchaos.harness.judge.checkers import CHECKERS, CheckResult, Finding
from kvchaos.harness.judge.scenario import parse_scenario
from kvchaos.harness.judge.verdict import (
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


def scenario(outcome="clean", faults=(), checkers=(), within=2):
    data = {
        "scenario": {"name": "t"},
        "faults": [{"name": n, "defect": d} for n, d in faults],
        "expect": {"outcome": outcome},
    }
    if outcome == "detect":
        data["expect"].update(checkers=list(checkers), within_steps=within)
    return parse_scenario(data, "<test>")


def checks(*findings, unknown=()):
    """One CheckResult per checker: findings given as (checker, step)."""
    out = []
    for name in CHECKERS:
        fs = [
            Finding(c, s, f"{c} saw something at step {s}", kind="k")
            for c, s in findings
            if c == name
        ]
        if name in unknown:
            out.append(CheckResult(name, None, [], "Traceback ...\nKeyError: 'table'"))
        else:
            out.append(CheckResult(name, not fs, fs, None, 10))
    return out


LEAK = scenario("detect", [("refcount_leak", True)], ["block_accounting"], within=2)
FIRED_AT_10 = {"refcount_leak": {"fired": True, "first_step": 10, "times": 3}}


def test_pass_clean():
    v = decide(scenario(), checks(), {}, None)
    assert (v.verdict, v.exit_code, v.time_to_detect) == (PASS, 0, {})


def test_pass_clean_with_trigger_only_faults():
    sc = scenario(faults=[("table_overflow", False), ("refcount_leak", False)])
    v = decide(sc, checks(), {"table_overflow": {"planted": False, "fired": False}}, None)
    assert v.verdict == PASS


@pytest.mark.parametrize("step, ttd", [(10, 0), (11, 1), (12, 2)])
def test_pass_detect_within_steps(step, ttd):
    v = decide(LEAK, checks(("block_accounting", step)), FIRED_AT_10, None)
    assert v.verdict == PASS and v.time_to_detect == {"refcount_leak": ttd}
    assert "block_accounting" in v.summary


def test_pass_detect_by_any_one_expected_checker():
    sc = scenario("detect", [("table_overflow", True)], ["table_integrity", "oracle_divergence"])
    v = decide(
        sc,
        checks(("oracle_divergence", 5), ("oracle_divergence", 9)),
        {"table_overflow": {"fired": True, "first_step": 4}},
        None,
    )
    assert v.verdict == PASS and v.time_to_detect == {"table_overflow": 1}


def test_missed_fired_but_nothing_caught_it():
    v = decide(LEAK, checks(), FIRED_AT_10, None)
    assert v.verdict == MISSED and v.exit_code == 10 and "refcount_leak" in v.summary


def test_missed_caught_too_late():
    v = decide(LEAK, checks(("block_accounting", 13)), FIRED_AT_10, None)
    assert v.verdict == MISSED and "first after 3 steps" in v.summary


def test_missed_when_only_a_non_expected_checker_fires():
    v = decide(LEAK, checks(("liveness", 10), ("table_integrity", 11)), FIRED_AT_10, None)
    assert v.verdict == MISSED


def test_a_finding_before_the_defect_fired_does_not_count():
    v = decide(LEAK, checks(("block_accounting", 9)), FIRED_AT_10, None)
    assert v.verdict == MISSED


def test_missed_names_the_one_of_two_planted_faults_not_caught():
    sc = scenario(
        "detect", [("refcount_leak", True), ("ordering_race", True)], ["block_accounting"]
    )
    verify = {**FIRED_AT_10, "ordering_race": {"fired": True, "first_step": 3}}
    v = decide(sc, checks(("block_accounting", 10)), verify, None)
    assert (
        v.verdict == MISSED
        and "ordering_race" in v.summary
        and "refcount_leak" not in v.summary.split(":")[-1]
    )


def test_fail_with_nothing_planted_names_the_earliest_finding():
    v = decide(scenario(), checks(("liveness", 40), ("table_integrity", 7)), {}, None)
    assert v.verdict == FAIL and v.exit_code == 11
    assert "table_integrity" in v.summary and "step 7" in v.summary


def test_fail_with_trigger_only_faults():
    """The remediation failed under the trigger: a real engine bug, reported as a bug found of
    the scenario."""
    sc = scenario(faults=[("refcount_leak", False)])
    v = decide(
        sc,
        checks(("block_accounting", 12)),
        {"refcount_leak": {"planted": False, "fired": False}},
        None,
    )
    assert v.verdict == FAIL


@pytest.mark.parametrize("verify", [{"refcount_leak": {"fired": False, "first_step": None}}, {}])
def test_inconclusive_planted_but_never_fired(verify):
    v = decide(LEAK, checks(("block_accounting", 3)), verify, None)
    assert v.verdict == INCONCLUSIVE and v.exit_code == 12 and "refcount_leak" in v.summary


def test_error_on_run_error_even_with_findings():
    err = {"error": "RuntimeError", "message": "boom at step 5", "traceback": "..."}
    v = decide(LEAK, checks(("block_accounting", 10)), FIRED_AT_10, err)
    assert v.verdict == ERROR and v.exit_code == 13 and "RuntimeError: boom at step 5" in v.summary


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
