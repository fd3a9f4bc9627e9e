"""Isolated runs (kvchaos.harness.run.isolate): each run in a fresh worker process, so a block
manager that hangs, calls os._exit or segfaults still gets a verdict, with the history up to that
point and the findings made before it, and the batch goes on. Inside a call into the manager it is
a FAIL finding naming the call; anywhere else, ERROR. No run leaves state to the next."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kvchaos.harness.check.verdict import EXIT_CODES
from kvchaos.harness.cli import main
from kvchaos.harness.history.log import read_history
from kvchaos.harness.run import isolate

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # tests/managers.py, named by spec (the workers inherit sys.path)

LIMIT = 2  # seconds: --timeout of the runs that hang, on the clock below
# baseline-clean seed 0 under managers.Fated: table_integrity finds the rows it leaves behind from
# step 14; its fate comes in admit('r9', [...], 35, 34), at step 21, or in the engine's step 22
CALL = "admit('r9', [...], 35, 34)"
CASES = {
    "HangsInAdmit": ("FAIL", 21, f"{CALL} did not return within {LIMIT} s"),
    "DeafHangInAdmit": ("FAIL", 21, f"{CALL} did not return within {LIMIT} s"),
    "ExitsInAdmit": ("FAIL", 21, f"{CALL} ended the worker process: exit status 0"),
    "SegfaultsInAdmit": ("FAIL", 21, f"{CALL} ended the worker process: killed by signal SIGSEGV"),
    "KilledInAdmit": (
        "FAIL",
        21,
        f"{CALL} ended the worker process: killed by signal SIGKILL (as the kernel's OOM killer "
        "does)",
    ),
    "HangsInTheEngine": ("ERROR", 22, f"Timeout: timed out after {LIMIT} s in step 22"),
    "ExitsInTheEngine": (
        "ERROR",
        22,
        "WorkerDied: the worker process ended in step 22: exit status 0",
    ),
}


class HangClock:
    """The parent's clock for the time limit, moved by events instead of seconds: it runs only
    while a worker that has begun its hang (its manager wrote a mark named by its pid) is alive,
    and stands still until then and once the worker's pid is gone. So the limit fires inside
    the hang, never while a busy machine is still starting the run."""

    def __init__(self, marks: Path) -> None:
        self.marks, self.began, self.ended = marks, {}, {}

    def __call__(self) -> float:
        now = time.monotonic()
        for mark in self.marks.iterdir():
            pid = int(mark.name)
            self.began.setdefault(pid, now)
            if pid not in self.ended and not _alive(pid):
                self.ended[pid] = now
        return sum(self.ended.get(pid, now) - t for pid, t in self.began.items())


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def hang_clock(tmp_path, monkeypatch) -> HangClock:
    marks = tmp_path / "hangs"
    marks.mkdir()
    monkeypatch.setenv("KVCHAOS_TEST_HANGS", str(marks))  # the workers get the environment
    clock = HangClock(marks)
    monkeypatch.setattr(isolate, "clock", clock)
    return clock


def run(capsys, tmp_path, *argv) -> tuple[int, dict]:
    rc = main(["run", *map(str, argv), "--report-dir", str(tmp_path / "r"), "--format", "json"])
    return rc, json.loads(capsys.readouterr().out)


def results(run: dict) -> dict:
    return json.loads((Path(run["run_dir"]) / "results.json").read_text())


def findings(res: dict, checker: str) -> list[dict]:
    return next(c["findings"] for c in res["checkers"] if c["checker"] == checker)


@pytest.mark.parametrize("manager", list(CASES))
def test_a_worker_that_hangs_or_dies_gets_a_verdict_with_its_history_and_findings(
    capsys, tmp_path, manager, hang_clock
):
    verdict, step, said = CASES[manager]
    rc, doc = run(
        capsys, tmp_path, "baseline-clean", "--seed", 0, "--timeout", LIMIT,
        "--block-manager", f"managers:{manager}",
    )  # fmt: skip
    assert rc == EXIT_CODES[verdict] != 0
    hang_clock()  # looks again: a hung worker was stopped at the limit and its pid is gone
    hung = "Hang" in manager
    assert len(hang_clock.began) == len(hang_clock.ended) == hung
    (only,) = doc["runs"]
    assert only["verdict"] == verdict and said in only["summary"], only["summary"]
    res = results(only)
    assert res["python_hash_seed"] == "0"
    # the findings made before it are kept and shown
    assert findings(res, "table_integrity")[0]["step"] == 14
    if verdict == "ERROR":
        assert "8 findings kept" in only["summary"]
    # the history up to it is on disk, ended by the event the parent wrote
    events = read_history(Path(only["run_dir"]) / "history.jsonl")
    assert max(e["step"] for e in events if e["e"] == "step") == step - 1
    last = events[-1]
    assert last["e"] == ("sut_error" if verdict == "FAIL" else "error") and last["step"] == step
    if verdict == "FAIL":
        (found,) = findings(res, "manager_calls")
        assert found["message"] == said and found["step"] == step
        assert f"the run ended: {said}" in only["summary"]
    assert (Path(only["run_dir"]) / "report.html").is_file()


def test_the_stack_of_a_hang_and_of_a_segfault_is_the_evidence(capsys, tmp_path, hang_clock):
    """Written by faulthandler: at the stop signal, and at the segfault."""
    heads = (("HangsInAdmit", "Current thread"), ("SegfaultsInAdmit", "Fatal Python error"))
    for manager, head in heads:
        rc, doc = run(
            capsys, tmp_path, "baseline-clean", "--seed", 0, "--timeout", LIMIT,
            "--block-manager", f"managers:{manager}",
        )  # fmt: skip
        (found,) = findings(results(doc["runs"][0]), "manager_calls")
        stack = found["evidence"]["traceback"]
        assert head in stack and "in admit" in stack and "boundary.py" in stack


@pytest.mark.parametrize("mode", [[], ["--in-process"]], ids=["isolated", "in-process"])
def test_sys_exit_inside_a_manager_call_is_a_fail_naming_it(capsys, tmp_path, mode):
    rc, doc = run(
        capsys, tmp_path, "baseline-clean", "--seed", 0,
        "--block-manager", "managers:SysExitsInAdmit", *mode,
    )  # fmt: skip
    assert rc == EXIT_CODES["FAIL"]
    (found,) = findings(results(doc["runs"][0]), "manager_calls")
    assert found["message"] == f"{CALL} raised SystemExit: 0" and found["step"] == 21


def test_the_batch_goes_on_after_a_hang_and_exits_with_the_worst(capsys, tmp_path, hang_clock):
    """Before: `--timeout 5` with a manager looping forever in a call hung until killed."""
    rc, doc = run(
        capsys, tmp_path, "baseline-clean", "--seeds", "0,1", "--timeout", LIMIT,
        "--block-manager", "managers:HangsInAdmit",
    )  # fmt: skip
    assert rc == EXIT_CODES["FAIL"] and [r["seed"] for r in doc["runs"]] == [0, 1]
    for r in doc["runs"]:
        (found,) = findings(results(r), "manager_calls")
        assert found["kind"] == "hang" and "did not return within 2 s" in found["message"]
    hang_clock()
    assert len(hang_clock.began) == len(hang_clock.ended) == 2  # one hang a run, each stopped


def test_os_exit_0_in_the_console_script_is_no_longer_a_silent_green(tmp_path):
    """Before: os._exit(0) inside a block manager ended `kvchaos run` with exit 0 and no
    output."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [Path(sys.executable).with_name("kvchaos"), "run", "baseline-clean", "--seed", "0",
         "--block-manager", "managers:ExitsInAdmit", "--report-dir", tmp_path],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == EXIT_CODES["FAIL"], out.stdout + out.stderr
    assert f"{CALL} ended the worker process: exit status 0" in out.stdout


def test_module_level_state_does_not_carry_from_one_run_to_the_next(capsys, tmp_path):
    """A manager counting its instances in its module: in one process, every one after the first
    leaks; isolated, every run starts afresh."""
    spec = "managers:CountsRunsInItsModule"
    rc, doc = run(capsys, tmp_path, "baseline-clean", "--seeds", "0,1", "--block-manager", spec)
    assert rc == 0 and [r["verdict"] for r in doc["runs"]] == ["PASS", "PASS"]
    rc, doc = run(
        capsys, tmp_path, "baseline-clean", "--seeds", "0,1", "--block-manager", spec,
        "--in-process",
    )  # fmt: skip
    assert rc == EXIT_CODES["FAIL"] and doc["runs"][1]["verdict"] == "FAIL"


def test_the_hash_seed_is_fixed_so_a_set_order_manager_repeats_itself(capsys, tmp_path):
    """Two workers, two interpreters: the same string hashes, so the same history."""
    res = []
    for _ in range(2):
        rc, doc = run(
            capsys, tmp_path, "baseline-clean", "--seed", 0,
            "--block-manager", "managers:OrdersItsPoolByHash",
        )  # fmt: skip
        assert rc == 0
        res.append(results(doc["runs"][0]))
    assert {r["python_hash_seed"] for r in res} == {"0"}
    assert res[0]["history_digest"] == res[1]["history_digest"]


def test_a_replay_that_differs_at_the_managers_first_answer_calls_it_nondeterministic(
    capsys, tmp_path
):
    rc, doc = run(
        capsys, tmp_path, "baseline-clean", "--seed", 0,
        "--block-manager", "managers:ShufflesItsPool",
    )  # fmt: skip
    assert rc == 0
    rc = main(["replay", doc["runs"][0]["run_dir"]])
    out = capsys.readouterr().out
    assert rc == 1 and "first differing event" in out and "(snapshot at step" in out, out
    assert "the block manager is nondeterministic: its first answer differs" in out


def test_ctrl_c_reaches_the_worker_and_its_record_is_kept(tmp_path):
    """Ctrl-C on `kvchaos run` while its worker is inside a call into the manager: the worker is
    told, records the run as interrupted, and the batch stops there with 130."""
    mark = tmp_path / "inside"
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "KVCHAOS_TEST_MARK": str(mark), "PYTHONPATH": path}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvchaos", "run", "baseline-clean", "--seeds", "3",
         "--report-dir", str(tmp_path / "r"), "-q", "--block-manager", "managers:WaitsForCtrlC"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # as from a terminal, even where this test runs with Ctrl-C ignored (a background job)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted" in err, out + err
    (only,) = [d for d in (tmp_path / "r").iterdir() if d.is_dir() and not d.is_symlink()]
    res = json.loads((only / "results.json").read_text())
    assert res["reason"] == "interrupted" and res["verdict"] == "ERROR"


def test_scenario_items_run_under_pytest_xdist(tmp_path):
    """`pytest -n 2`: two scenario items, one per xdist worker, each in its own isolated run."""
    pytest.importorskip("xdist")
    (tmp_path / "tiny.toml").write_text(
        '[scenario]\nname = "tiny"\nseeds = [0, 1]\n'
        "[workload]\nnum_requests = 6\nfork_groups = 1\n"
        "[engine.cache]\nnum_blocks = 48\nblock_size = 4\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    reports = tmp_path / "reports"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-q",
         "tiny.toml", "--kvchaos-report-dir", str(reports)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 passed" in out.stdout
    dirs = [d for d in reports.iterdir() if d.is_dir() and not d.is_symlink()]  # not latest
    runs = [json.loads((d / "results.json").read_text()) for d in dirs]
    assert sorted(r["seed"] for r in runs) == [0, 1] and {r["verdict"] for r in runs} == {"PASS"}
    assert len({r["batch"] for r in runs}) == 1  # the session's runs are one batch


def test_the_check_before_any_run_survives_a_manager_that_hangs_or_exits(tmp_path, capsys):
    from kvchaos.harness.run.door import validate_isolated

    with pytest.raises(ValueError, match="did not finish within 2 s"):
        validate_isolated("managers:HangsWhenBuilt", timeout_s=2)
    argv = ["run", "baseline-clean", "--seed", "0", "--report-dir", str(tmp_path)]
    assert main([*argv, "--block-manager", "managers:ExitsWhenBuilt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ended the process: exit status 3" in err[0], err
    assert not list(tmp_path.iterdir())  # nothing ran
