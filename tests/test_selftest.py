"""`kvchaos selftest`: every canary bug planted in the reference block manager is killed by a
checker's finding on a clean scenario, the reference itself passes the same runs, and the command
reports it (kill table, JSON, exit codes)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from kvchaos.engine.block_manager import BlockManager
from kvchaos.engine.prefix_manager import PrefixCachingManager
from kvchaos.harness.cli import main
from kvchaos.harness.scenario.spec import load_scenario
from kvchaos.harness.tools import selftest
from kvchaos.harness.tools.canaries import CANARIES
from kvchaos.harness.tools.selftest import CRASH, FINDING, SURVIVED, Kill, classify, hunt

FAMILIES = {
    "allocate",
    "append",
    "copy-on-write",
    "fork",
    "free",
    "cancel",
    "preempt",
    "resize",
    "table upload",
    "row reuse",
    "admission",
    "snapshot",
    "prefix cache",
}
# The cheapest run (scenario, seed) that kills each canary by a finding, as measured. Most die on
# baseline-clean; a resize only happens under the resize policy; the admission canary's partial
# refusal is seen only when a request cancelled while waiting still holds its blocks.
KILLING_RUN = {c.name: ("baseline-clean", 0) for c in CANARIES}
KILLING_RUN["resize-keeps-first-row"] = ("table-overflow-resize-clean", 0)
KILLING_RUN["admission-floor"] = ("refcount-leak-clean", 2)
PREFIX = [c for c in CANARIES if c.family == "prefix cache"]
for c in PREFIX:  # equal blocks after different prefixes come only with segments
    KILLING_RUN[c.name] = (
        f"prefix-{'segments' if c.name == 'hit-ignores-parent' else 'shared'}-clean",
        0,
    )


def cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse: --help, usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_one_canary_per_family_each_a_distinct_manager():
    assert len(CANARIES) >= 12
    assert {c.family for c in CANARIES} == FAMILIES
    assert len({c.name for c in CANARIES}) == len({c.manager for c in CANARIES}) == len(CANARIES)
    for c in CANARIES:
        ref = PrefixCachingManager if c.family == "prefix cache" else BlockManager
        assert issubclass(c.manager, ref) and c.manager is not ref
        assert c.bug and c.family in c.manager.__doc__, c.name  # says which family it breaks


def test_every_canary_is_killed_by_a_finding_and_the_reference_survives_the_same_runs():
    scenarios = {}
    for c in CANARIES:
        name, seed = KILLING_RUN[c.name]
        sc = scenarios.setdefault(name, load_scenario(name))
        k = hunt(c.name, c.family, c.bug, c.manager, [(sc, seed)])
        assert k.status == FINDING, (c.name, k.status, k.message)
        assert k.checker and not (k.checker == "manager_calls" and k.kind == "exception")
        assert (k.scenario, k.seed, k.runs) == (name, seed, 1)
        assert k.known_at is not None and k.known_at >= k.step >= 0
        assert c.manager.__name__ in k.replay  # the kill can be re-run with its reports
    jobs = sorted(set(KILLING_RUN.values()))
    for ref in (BlockManager, PrefixCachingManager):
        control = hunt("reference", "control", "", ref, [(scenarios[n], s) for n, s in jobs])
        assert control.status == SURVIVED and control.runs == len(jobs), control.message


@pytest.mark.slow
def test_every_prefix_cache_canary_is_caught_on_20_seeds():
    """The issue's bar: 20/20 seeds, over the four prefix workloads (first finding per seed)."""
    scs = [
        load_scenario(f"prefix-{n}-clean") for n in ("shared", "multiturn", "samples", "segments")
    ]
    for c in PREFIX:
        for seed in range(20):
            k = hunt(c.name, c.family, c.bug, c.manager, [(sc, seed) for sc in scs])
            assert k.status == FINDING, (c.name, seed, k.status)


def _run(verdict, *findings):
    fs = [SimpleNamespace(checker=c, kind=k, step=s, known=s, message=c) for c, k, s in findings]
    return SimpleNamespace(verdict=verdict, findings=fs, summary=verdict)


def test_a_fail_through_exceptions_only_is_a_crash_any_other_finding_a_kill():
    crash = ("manager_calls", "exception", 3)
    status, f = classify(_run("FAIL", crash))
    assert status == CRASH and f.kind == "exception"
    status, f = classify(_run("FAIL", crash, ("table_integrity", "shared_row", 9)))
    assert status == FINDING and f.checker == "table_integrity"  # the crash came first, still
    status, f = classify(_run("FAIL", ("manager_calls", "bad_snapshot", 5)))
    assert status == FINDING and f.kind == "bad_snapshot"  # a lying snapshot is no crash
    assert classify(_run("PASS")) == (SURVIVED, None)
    assert classify(_run("INCONCLUSIVE")) == (SURVIVED, None)
    # wall-clock noise kills nothing (and flags no control); beside a real finding it is ignored
    assert classify(_run("FAIL", ("latency", "latency_climb", 2))) == (SURVIVED, None)
    status, f = classify(_run("FAIL", ("latency", "latency_climb", 2), crash))
    assert status == CRASH and f.checker == "manager_calls"
    assert classify(_run("ERROR", crash))[0] == "ERROR"


def test_exit_codes_rank_a_flagged_reference_over_a_surviving_canary():
    killed, alive = Kill("a", "f", "b", status=FINDING), Kill("b", "f", "b", status=CRASH)
    ok, flagged = Kill("reference", "control", ""), Kill("reference", "control", "", FINDING)
    assert selftest.exit_code([killed], ok) == 0
    assert selftest.exit_code([killed, alive], ok) == selftest.EXIT_NOT_KILLED == 1
    assert selftest.exit_code([killed, alive], flagged) == selftest.EXIT_REFERENCE_FLAGGED == 3


def test_help_lists_the_options_and_every_exit_code(capsys):
    rc, out, _ = cli(capsys, "selftest", "--help")
    assert rc == 0
    for flag in ("--seeds", "--scenario", "--canary", "--format", "--device"):
        assert flag in out
    codes = {int(c) for c in re.findall(r"(?m)^ +(\d+)  \S", out.split("exit codes")[-1])}
    defined = {v for k, v in vars(selftest).items() if k.startswith("EXIT_")}
    assert {0, 2, 130} | defined <= codes


def test_json_names_the_killing_checker_and_the_control(capsys):
    rc, out, _ = cli(
        capsys,
        "selftest",
        "--canary",
        "fork-no-incref",
        "--scenario",
        "baseline-clean",
        "--seeds",
        "1",
        "--format",
        "json",
    )
    doc = json.loads(out)
    assert rc == doc["exit_code"] == 0 and doc["killed_by_finding"] == 1
    (k,) = doc["canaries"]
    assert (k["canary"], k["status"], k["scenario"], k["seed"]) == (
        "fork-no-incref",
        FINDING,
        "baseline-clean",
        0,
    )
    assert k["checker"] == "block_accounting" and k["kind"] == "refcount"
    assert doc["reference"]["status"] == SURVIVED and doc["reference"]["runs"] == 1


def test_a_canary_its_runs_never_trigger_survives_and_the_exit_code_says_so(capsys):
    # baseline-clean never resizes the table: the resize canary's bug is never reached there
    rc, out, _ = cli(
        capsys,
        "selftest",
        "--canary",
        "resize-keeps-first-row",
        "--canary",
        "fork-no-incref",
        "--scenario",
        "baseline-clean",
        "--seeds",
        "1",
    )
    assert rc == selftest.EXIT_NOT_KILLED
    assert "┃" not in out and "│" not in out  # a pipe gets plain text, not a box-drawn table
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.strip()}
    assert rows["resize-keeps-first-row"][2] == SURVIVED
    assert rows["fork-no-incref"][2] == FINDING
    assert "killed by a finding: 1/2" in out and "control): survived (1 run)" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--scenario", "table-overflow-detect"], "not a clean scenario"),
        (["--canary", "no-such-canary"], "unknown"),
        (["--seeds", "0"], ">= 1"),
        (["--seeds", "x"], "expected a count"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    rc, out, err = cli(capsys, "selftest", *argv)
    assert rc == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1
