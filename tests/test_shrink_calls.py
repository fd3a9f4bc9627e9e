"""The call-level reproducer (`kvchaos shrink` -> minimal/test_*_calls.py): the calls a run made
into its manager, replayed on a fresh one, shortened to those that matter and written as a plain
pytest file that ends in the assertion that fails. It fails on the buggy manager and passes on a
fixed one (the reference): both are run, in process for crafted call logs, under pytest in a
subprocess for a shrunk FAIL run."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvchaos.engine.block_manager import BlockManager
from kvchaos.harness.check.repro import INVARIANTS, Call, holds, released, source
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario
from kvchaos.harness.tools.shrink import add_arguments as shrink_arguments
from kvchaos.harness.tools.shrink import main as shrink_main
from kvchaos.harness.tools.shrink_calls import ending_of, goes_as_logged, shorten

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))  # tests/managers.py, named by spec

import managers  # noqa: E402

DIMS = (16, 4, 16, 8)  # num_blocks, block_size, max_num_seqs, max_blocks_per_seq
REFERENCE_IMPORT = "from kvchaos.engine.block_manager import BlockManager as Manager"


def c(step, name, *args, answer=None) -> Call:
    return Call(step=step, name=name, args=list(args), answer=answer)


def preempt_leak_log() -> list[Call]:
    """What an engine could ask: r1 admitted and grown, r2 admitted, a read, r1 finished, r3
    admitted, then r2 preempted (the release KeepsRefsOnPreempt gets wrong)."""
    return [
        c(1, "admit", "r1", list(range(6)), 6, 5, answer=0),
        c(1, "admit", "r2", [7, 8, 9], 3, 2, answer=0),
        c(2, "append", "r1", [6, 7, 8], answer=[]),
        c(2, "block_ids", "r2", answer=[2]),
        c(3, "release", "r1", "finished", answer=True),
        c(3, "admit", "r3", [1, 2], 2, 1, answer=0),
        c(4, "release", "r2", "preempted", answer=True),
    ]


def run_source(text: str, manager_import: str | None = None) -> BaseException | None:
    """Run the generated file's test function in this process (the import line swapped for
    another manager's when given); the exception it ended with, or None."""
    if manager_import is not None:
        text = re.sub(r"(?m)^from \S+ import \S+ as Manager.*$", manager_import, text)
    ns: dict = {}
    exec(compile(text, "<calls>", "exec"), ns)
    (test,) = [v for k, v in ns.items() if k.startswith("test_")]
    try:
        test()
    except BaseException as e:  # noqa: BLE001  what the test ended with is the subject
        return e
    return None


def write(calls, ending, spec="managers:KeepsRefsOnPreempt") -> str:
    text = source(
        spec=spec,
        folder=str(TESTS),
        dims=DIMS,
        calls=calls,
        ending=ending,
        test_name="test_it_calls",
        header="A reproducer.",
    )
    assert max(len(line) for line in text.splitlines()) <= 100, text
    return text


def test_a_leak_on_preempt_is_the_ref_count_invariant_after_the_release_the_rest_dropped():
    calls = preempt_leak_log()
    finding = {"checker": "block_accounting", "kind": "refcount"}
    ending = ending_of(managers.KeepsRefsOnPreempt, DIMS, calls, finding, "block_accounting/x")
    assert ending.kind == "invariant" and ending.invariant == "refs_match_holders"
    keeps = lambda cs: goes_as_logged(managers.KeepsRefsOnPreempt, DIMS, cs, ending)  # noqa: E731
    kept, _ = shorten(keeps, calls)
    # only r2's life matters: r1 and r3 (and the read) can go, and dropping r2's admit makes
    # the release answer False (no longer as logged)
    assert [(k.name, k.args[0]) for k in kept] == [("admit", "r2"), ("release", "r2")]
    text = write(kept, ending)
    assert "m.release('r2', 'preempted')" in text and INVARIANTS["refs_match_holders"].says in text
    err = run_source(text)
    assert isinstance(err, AssertionError) and "differ" in str(err), err
    assert run_source(text, REFERENCE_IMPORT) is None  # the fixed manager passes
    # the reference, as logged, breaks no invariant: nothing to write
    assert ending_of(BlockManager, DIMS, calls, finding, "") is None


def test_a_row_left_behind_is_the_table_invariant():
    calls = [
        c(1, "admit", "r1", [1, 2, 3, 4, 5], 5, 4, answer=0),
        c(2, "release", "r1", "finished", answer=True),
    ]
    finding = {"checker": "table_integrity", "kind": "stale_row"}
    ending = ending_of(managers.LeavesRowsBehind, DIMS, calls, finding, "table_integrity/x")
    assert ending.invariant == "table_rows"
    err = run_source(write(calls, ending, "managers:LeavesRowsBehind"))
    assert isinstance(err, AssertionError) and "table rows" in str(err)
    assert run_source(write(calls, ending, "managers:LeavesRowsBehind"), REFERENCE_IMPORT) is None


def test_a_raising_call_ends_the_file_as_it_is_and_refusals_stay_refusals():
    # IndexErrorOnGrowth raises in its 15th growth: every growth before it matters, the refused
    # one too (it counts it)
    calls = [c(1, "admit", f"r{i}", [i], 1, 0, answer=0) for i in range(13)]
    calls.insert(3, c(1, "admit", "big", list(range(99)), 99, 98, answer={"refused": "no room"}))
    calls.append(
        c(2, "append", "r0", [5], answer={"raised": "IndexError: list index out of range"})
    )
    finding = {"checker": "manager_calls", "kind": "exception"}
    ending = ending_of(managers.IndexErrorOnGrowth, DIMS, calls, finding, "manager_calls/x")
    assert ending.kind == "raises"
    kept, _ = shorten(
        lambda cs: goes_as_logged(managers.IndexErrorOnGrowth, DIMS, cs, ending), calls
    )
    assert kept == calls
    text = write(kept, ending, "managers:IndexErrorOnGrowth")
    assert "with pytest.raises(OutOfBlocks):  # refused in the run" in text
    assert "raised IndexError" in text
    assert isinstance(run_source(text), IndexError)
    assert run_source(text, REFERENCE_IMPORT) is None


def test_long_token_lists_wrap_and_released_ids_are_those_not_started_again():
    calls = [
        c(1, "admit", "r1", list(range(300)), 300, 299, answer=0),
        c(2, "release", "r1", "aborted", answer=True),
        c(3, "admit", "r2", [1], 1, 0, answer=0),
        c(4, "release", "r2", "finished", answer=True),
        c(5, "admit", "r1", [4], 1, 0, answer=0),
        c(6, "resize_table", "rows=6", answer=None),
    ]
    assert released(calls) == ["r2"]
    ending = ending_of(BlockManager, (128, 4, 4, 80), calls, {"checker": "x"}, "")
    assert ending is None  # the reference keeps every invariant
    from kvchaos.harness.check.repro import Ending

    text = write(calls, Ending(kind="invariant", invariant="released_hold_nothing", finding="x"))
    assert "m.resize_table(rows=6)" in text and "RELEASED = ['r2']" in text
    assert text.count("m.admit(") == 3 and "    [0, 1, 2," in text  # wrapped, one list
    bm = BlockManager(128, 4, 4, 80)
    for call in calls[:-1]:
        getattr(bm, call.name)(*call.args)
    assert holds("released_hold_nothing", bm.snapshot(), ["r2"])
    assert not holds("released_hold_nothing", bm.snapshot(), ["r1"])


@pytest.fixture(scope="module")
def leaky_run(tmp_path_factory):
    """A FAIL run of baseline-clean seed 0 under a manager whose preempting release keeps its
    blocks' refs."""
    d = tmp_path_factory.mktemp("runs")
    r = run_scenario(
        load_scenario("baseline-clean"),
        0,
        "cpu",
        d,
        block_manager_spec="managers:KeepsRefsOnPreempt",
    )
    assert r.verdict == "FAIL", r.summary
    return r.run_dir


def test_shrink_writes_a_calls_file_that_fails_on_the_manager_and_passes_fixed(
    leaky_run, tmp_path, capsys
):
    p = argparse.ArgumentParser()
    shrink_arguments(p)
    assert shrink_main(p.parse_args([str(leaky_run), "--max-runs", "2"])) == 0
    assert "calls:    " + str(leaky_run / "minimal") in capsys.readouterr().out
    m = json.loads((leaky_run / "results.json").read_text())["minimal_reproducer"]
    path = Path(m["calls_test_path"])
    assert path.name == Path(m["test_path"]).stem + "_calls.py" and path.is_file()
    assert 1 < m["calls"] < m["calls_logged"], m  # shortened, but more than the release alone
    incident = (leaky_run / "incident-001.md").read_text()  # the incident points to it
    assert "as a test to paste into yours: `" in incident and path.name in incident
    text = path.read_text()
    assert "from managers import KeepsRefsOnPreempt as Manager" in text
    assert re.search(r"m\.release\('\w+', 'preempted'\)\n    s = m\.snapshot\(\)", text), text
    assert "block_accounting/refcount" in text
    fixed = tmp_path / "test_fixed_calls.py"
    fixed.write_text(
        re.sub(r"(?m)^from managers import .*$", REFERENCE_IMPORT + "  # noqa: E402", text)
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path), str(fixed)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 1 and "1 failed, 1 passed" in report, report
    failed = re.findall(r"FAILED (\S+)::", report)
    assert len(failed) == 1 and failed[0].endswith(path.name), report


def test_a_refusal_that_changes_the_manager_ends_in_the_snapshot_it_changed():
    calls = [
        c(1, "admit", "r1", [1, 2, 3, 4], 4, 3, answer=0),
        c(1, "admit", "r2", list(range(28)), 28, 27, answer=0),
        c(2, "append", "r1", list(range(40)), answer={"refused": "r1: the pool ran dry"}),
    ]
    finding = {"checker": "manager_calls", "kind": "refusal_changed_state"}
    ending = ending_of(managers.NoRollback, DIMS, calls, finding, "manager_calls/x")
    assert ending.kind == "refusal_changes"  # the blocks it took are held: no invariant breaks
    text = write(calls, ending, "managers:NoRollback")
    assert "before = m.snapshot().to_dict()" in text
    err = run_source(text)
    assert isinstance(err, AssertionError) and "refused, yet changed" in str(err), err
    assert run_source(text, REFERENCE_IMPORT) is None


def test_an_answer_the_protocol_does_not_allow_is_judged_as_the_boundary_judges_it():
    calls = [
        c(1, "admit", "r1", [1, 2], 2, 1, answer={"raised": "BadAnswer: answered 3: computed"}),
    ]
    finding = {"checker": "manager_calls", "kind": "exception"}
    ending = ending_of(managers.AdmitAnswersPastItsTokens, DIMS, calls, finding, "manager_calls/x")
    assert ending.kind == "raises"
    text = write(calls, ending, "managers:AdmitAnswersPastItsTokens")
    assert "got = m.admit('r1', [1, 2], 2, 1)" in text and "check_answer('admit', got," in text
    assert type(run_source(text)).__name__ == "BadAnswer"
    assert run_source(text, REFERENCE_IMPORT) is None
