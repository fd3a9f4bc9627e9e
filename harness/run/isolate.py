"""Isolated runs: each scenario run in a fresh worker process that can be killed, forked from a
server that imported torch and kvchaos once (multiprocessing's forkserver), so a run leaves nothing
(a block manager's module-level state, a CUDA context, a stuck thread) to the next, and the import
is paid once. Workers start with a fixed PYTHONHASHSEED (recorded in results.json), so a manager
that iterates a set of strings answers the same in every run and in its replay.

Before each call into the block manager the worker writes the call on a shared page
(Boundary.watch); the parent waits for the run's record up to the time limit. A worker still
running then is stopped (SIGUSR1: its Python stack is written out and its history flushed) and,
if that does not end it, killed; one that ends without a record (os._exit, a segfault, the
kernel's OOM killer) is named by its exit status or signal. Either way the parent writes the record
the worker could not, from the history on disk, and re-checks it as `kvchaos analyze` does: inside
a call into the manager, a FAIL finding naming the call ("append('r3', 16) did not return within
5 s"); anywhere else, ERROR ("timed out after 5 s in step 7"); earlier findings kept."""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvchaos.harness.history.results import write_results
from kvchaos.harness.scenario.options import DEFAULT_TIMEOUT_S

STOP_GRACE_S = 3.0  # after SIGUSR1, before SIGKILL
REPORT_LIMIT_S = 120.0  # once the run's record is written: for its reports
INTERRUPT_GRACE_S = 30.0  # after Ctrl-C: for the worker to record the run as interrupted
WAIT_TICK_S = 0.5  # how often on_wait is called while a worker runs
HASH_SEED = "0"
PRELOAD = ["kvchaos.harness.run.isolate_preload"]  # what the fork server imports once
PAGE_SIZE = 4096
_HEAD = struct.Struct("<Id")  # the call's length in bytes (0: none in progress), its start time
clock = time.monotonic  # the parent's clock for a run's time limit (tests drive it by events)
_STARTING = threading.Lock()  # runs started from several threads (a soak's --workers) start in turn


class CallPage:
    """The call into the block manager in progress, on a page shared with the parent: written
    before each call and cleared after it (Boundary.watch), read when the worker hangs or dies."""

    def __init__(self, path: Path) -> None:
        from kvchaos.engine.boundary import describe  # not at the top: it imports torch

        self.describe = describe
        fd = os.open(path, os.O_RDWR)
        try:
            self.page = mmap.mmap(fd, PAGE_SIZE)
        finally:
            os.close(fd)

    def __call__(self, call: tuple | None) -> None:
        page = self.page
        page[:4] = b"\0\0\0\0"  # cleared first: a worker killed mid-write leaves no torn call
        if call is not None:
            text = self.describe(*call).encode("utf-8", "replace")[: PAGE_SIZE - _HEAD.size]
            page[_HEAD.size : _HEAD.size + len(text)] = text
            _HEAD.pack_into(page, 0, len(text), time.monotonic())

    @staticmethod
    def read(path: Path) -> tuple[str | None, float]:
        """(the call in progress, or None; seconds it had been running)."""
        data = path.read_bytes()
        n, started = _HEAD.unpack_from(data)
        if not n:
            return None, 0.0
        call = data[_HEAD.size : _HEAD.size + n].decode("utf-8", "replace")
        return call, time.monotonic() - started


@dataclass
class Job:
    """One run for a worker, and what the parent's process would have given it."""

    scenario: object  # a Scenario
    seed: int
    device: str
    run_dir: Path
    scratch: Path  # the call page and the worker's stack dump
    block_manager_spec: str | None = None
    tp_mode: str | None = None
    world_size: int | None = None
    batch: str | None = None
    env: dict = dataclasses.field(default_factory=dict)
    inject_hang: bool = False  # the soak's --inject-hang-every: sleep before the run until stopped


# -- the worker --------------------------------------------------------------------------------

_history = None  # the run's history, flushed when the parent stops the worker


def _keep_history(history) -> None:
    global _history
    _history = history


def _stopped(signum, frame) -> None:
    """SIGUSR1 from the parent at the time limit (faulthandler wrote the stack first): what the
    history holds goes to disk, then the worker ends; the parent writes the run's record."""
    try:
        if _history is not None:
            _history.flush()
    finally:
        os._exit(124)


def _worker(job: Job, conn) -> None:
    import faulthandler
    import sys
    import traceback

    from kvchaos.engine.boundary import Boundary
    from kvchaos.harness.report.render import publish
    from kvchaos.harness.run.runner import run_scenario

    seed = os.environ.get("PYTHONHASHSEED")
    os.environ.clear()  # the parent's environment as of this run (KVCHAOS_PLOTS, ...)
    os.environ.update(job.env)
    if seed is not None:  # the one this interpreter started with
        os.environ["PYTHONHASHSEED"] = seed
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C comes through the parent (SIGUSR2)
    signal.signal(signal.SIGUSR2, signal.default_int_handler)
    signal.signal(signal.SIGUSR1, _stopped)
    stack = open(job.scratch / "stack.txt", "w")  # open until the process ends
    faulthandler.enable(stack, all_threads=True)  # a segfault's Python stack
    faulthandler.register(signal.SIGUSR1, stack, all_threads=True, chain=True)
    Boundary.watch = CallPage(job.scratch / "call")
    while job.inject_hang:  # a hang outside any call into the manager: only the stop ends it
        time.sleep(3600)
    try:
        r = run_scenario(
            job.scenario,
            job.seed,
            job.device,
            None,
            block_manager_spec=job.block_manager_spec,
            tp_mode=job.tp_mode,
            world_size=job.world_size,
            run_dir=job.run_dir,
            on_history=_keep_history,
        )
        Boundary.watch = None
        conn.send(("ran", dataclasses.replace(r, events=[])))
        r = publish(r, index=False, batch=job.batch)
        conn.send(("published", dataclasses.replace(r, events=[])))
    except BaseException:
        traceback.print_exc(file=stack)  # the parent's record of this run quotes it
        stack.flush()
        sys.exit(1)


# -- the parent --------------------------------------------------------------------------------


def start_server(block_manager: str | None = None):
    """The fork server, started (once a process) with the fixed hash seed; it imports in the
    background while the caller goes on. A shipped adapter the runs name (`--block-manager vllm`)
    is imported there too: its engine's import takes seconds, paid once instead of per run (a
    user's own module is not: its import stays inside each run). Returns the forkserver
    context."""
    from multiprocessing import forkserver

    from kvchaos.harness.scenario.managers import ALIASES

    ctx = mp.get_context("forkserver")
    adapter = [ALIASES[block_manager].partition(":")[0]] if block_manager in ALIASES else []
    with _STARTING:
        ctx.set_forkserver_preload(PRELOAD + adapter)  # one that fails to import is skipped there
        before = os.environ.get("PYTHONHASHSEED")
        os.environ["PYTHONHASHSEED"] = HASH_SEED  # the server's interpreter, and so every worker's
        try:
            forkserver.ensure_running()  # a no-op when it runs; restarts one that died
        finally:
            if before is None:
                os.environ.pop("PYTHONHASHSEED")
            else:
                os.environ["PYTHONHASHSEED"] = before
    return ctx


@contextlib.contextmanager
def main_not_rerun():
    """multiprocessing re-runs the caller's __main__ in each new process; a worker needs nothing
    from it (a pytest script would cost an import per run, a script without the `if __name__ ==
    "__main__"` guard would start itself again)."""
    from multiprocessing import spawn

    real = spawn.get_preparation_data

    def data(name):
        d = real(name)
        d.pop("init_main_from_name", None)
        d.pop("init_main_from_path", None)
        return d

    spawn.get_preparation_data = data
    try:
        yield
    finally:
        spawn.get_preparation_data = real


def in_process_reason() -> str | None:
    """Why runs cannot be isolated here, or None."""
    from kvchaos.engine.cluster import external_launch

    if external_launch():
        return "launched by torchrun: the launcher's ranks serve this process's runs"
    return None


def run(sc, seed: int, *, isolated: bool = True, cluster=None, batch=None, **kw):
    """One run with its reports written (and report_dir/latest pointed at it): in a fresh worker
    (run_isolated) unless isolated=False, the run keeps nothing on disk (report_dir=None: no
    history for the parent to read), or in_process_reason() says it cannot be; else in this
    process (cluster: a distributed Cluster to reuse there). kw: run_isolated's."""
    if isolated and kw.get("report_dir") is not None and in_process_reason() is None:
        return run_isolated(sc, seed, batch=batch, **kw)
    from kvchaos.harness.report.render import publish
    from kvchaos.harness.run.runner import run_scenario

    return publish(run_scenario(sc, seed, cluster=cluster, **kw), index=False, batch=batch)


def run_isolated(
    sc,
    seed: int,
    device: str = "cpu",
    report_dir: Path | str = "reports",
    block_manager_spec: str | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    tp_mode: str | None = None,
    world_size: int | None = None,
    batch: str | None = None,
    on_wait=None,
    inject_hang: bool = False,
):
    """Run one scenario with one seed in a fresh worker; returns its RunResult (without the
    events: they are in run_dir/history.jsonl), its reports written. timeout_s=None: no limit.
    on_wait(): called about every WAIT_TICK_S while the worker runs (a live display)."""
    from kvchaos.harness.run.device import resolve_device
    from kvchaos.harness.run.runner import make_run_dir

    ctx = start_server()
    device = resolve_device(device)
    run_dir = make_run_dir(report_dir, sc, seed)
    scratch = Path(tempfile.mkdtemp(prefix="kvchaos-worker-"))
    (scratch / "call").write_bytes(bytes(PAGE_SIZE))
    job = Job(
        sc, seed, device, run_dir, scratch, block_manager_spec, tp_mode, world_size, batch,
        dict(os.environ), inject_hang,
    )  # fmt: skip
    t0 = time.perf_counter()
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker, args=(job, theirs), name=f"kvchaos-run-{sc.name}-s{seed}")
    with _STARTING, main_not_rerun():
        proc.start()
    theirs.close()
    try:
        result, ending = _wait(proc, ours, timeout_s, on_wait)
        if result is None:
            return _record_lost(job, ending, timeout_s, time.perf_counter() - t0)
        if ending[0] != "published":  # the run's record stands; its reports were not written
            result.results["report_error"] = f"the worker {_said(ending)} while writing reports"
            write_results(run_dir, result.results)
            if ending[0] == "interrupted":  # Ctrl-C: the batch stops here
                raise KeyboardInterrupt
        if ending[1] == "interrupted":  # the run ended whole, but the user has stopped the batch
            raise KeyboardInterrupt
        return result
    finally:
        proc.join(5)  # a worker that sent its result ends at once
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        ours.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _wait(proc, conn, timeout_s: float | None, on_wait=None):
    """Wait for the worker: (its latest result: None until the run's record is written, then
    the run's, then the published one; how it ended: ("published", None or "interrupted") |
    ("exit", code) | ("interrupted", code) |
    ("timeout", None) | ("interrupted", None)). Stops the worker at the limit."""
    deadline = clock() + timeout_s if timeout_s else float("inf")
    ran = None
    interrupted = False
    while True:
        left = deadline - clock()
        if left <= 0:
            _stop(proc)
            return ran, ("interrupted" if interrupted else "timeout", None)
        try:
            ready = mp.connection.wait(
                [conn, proc.sentinel], min(left, WAIT_TICK_S if on_wait else 3600)
            )
            if not ready and on_wait is not None:
                on_wait()
                continue
            if conn in ready:
                try:
                    kind, result = conn.recv()
                except (EOFError, OSError):  # it ended without a word: the sentinel tells how
                    ready = [proc.sentinel]
                else:
                    if kind == "published":  # a Ctrl-C seen meanwhile still stops the batch
                        return result, ("published", "interrupted" if interrupted else None)
                    ran, deadline = result, clock() + REPORT_LIMIT_S
                    continue
            if proc.sentinel in ready:
                proc.join()
                return ran, ("interrupted" if interrupted else "exit", proc.exitcode)
        except KeyboardInterrupt:
            if interrupted or ran is not None:  # a second Ctrl-C, or only the reports were left
                _stop(proc, grace=0)
                return ran, ("interrupted", None)
            interrupted = True  # the worker records the run as interrupted, as in-process
            os.kill(proc.pid, signal.SIGUSR2)
            deadline = clock() + INTERRUPT_GRACE_S


def _stop(proc, grace: float = STOP_GRACE_S) -> None:
    """SIGUSR1 (the worker writes its stack and flushes its history), then SIGKILL."""
    if grace and proc.is_alive():
        os.kill(proc.pid, signal.SIGUSR1)
        proc.join(grace)
    if proc.is_alive():
        proc.kill()
    proc.join(10)


def exit_status(code: int | None) -> str:
    if code is None:
        return "no exit status"
    if code < 0:
        name = signal.Signals(-code).name
        why = " (as the kernel's OOM killer does)" if -code == signal.SIGKILL else ""
        return f"killed by signal {name}{why}"
    return f"exit status {code}"


def _said(ending: tuple) -> str:
    kind, code = ending
    if kind == "exit":
        return f"ended ({exit_status(code)})"
    return "was stopped at the time limit" if kind == "timeout" else "was interrupted"


def _record_lost(job: Job, ending: tuple, timeout_s: float | None, wall_s: float):
    """The record of a run whose worker gave none: the history on disk, the event that ended it
    (a finding when inside a call into the manager, else an error), re-checked as analyze does."""
    import json

    from kvchaos.harness.check.findings import Finding
    from kvchaos.harness.history.log import read_history
    from kvchaos.harness.report.analyze import analyze
    from kvchaos.harness.report.index import point_latest
    from kvchaos.harness.run.provenance import kvchaos_version, manager_version
    from kvchaos.harness.run.runner import RunResult, git_commit, replay_command
    from kvchaos.harness.scenario.managers import REFERENCE

    run_dir, sc = job.run_dir, job.scenario
    history = run_dir / "history.jsonl"
    _cut_torn_line(history)
    events = read_history(history) if history.exists() else []
    started = any(e.get("e") == "run_start" for e in events)
    steps = [e["step"] for e in events if e.get("e") == "step"]
    step = (steps[-1] if steps else 0) + 1 if started else 0
    call, running_s = CallPage.read(job.scratch / "call")
    stack = job.scratch / "stack.txt"
    trace = stack.read_text(errors="replace") if stack.exists() else ""
    kind, code = ending
    if kind == "interrupted":
        call = None  # the user stopped it: no finding against the manager
        name, message = "KeyboardInterrupt", "interrupted by the user"
    elif kind == "timeout":
        name = "Timeout"
        message = (
            f"did not return within {timeout_s:g} s"
            if call
            else f"timed out after {timeout_s:g} s in step {step}"
        )
    else:
        name = "WorkerDied"
        message = (
            f"ended the worker process: {exit_status(code)}"
            if call
            else f"the worker process ended in step {step}: {exit_status(code)}"
        )
    if call:
        event = {"e": "sut_error", "step": step, "call": call, "args": [], "error": name}
        event.update(message=message, how="hang" if kind == "timeout" else "died")
        event.update(running_s=round(running_s, 3), traceback=trace)
    else:
        event = {"e": "error", "step": step, "error": name, "message": message, "traceback": trace}
    with open(history, "a", encoding="utf-8") as f:
        f.write(json.dumps(event) + "\n")
    tp = {k: v for k, v in (("tp_mode", job.tp_mode), ("tp_size", job.world_size)) if v}
    stored = {
        "scenario": sc.name,
        "seed": job.seed,
        "device": job.device,
        "commit": git_commit(),
        "kvchaos_version": kvchaos_version(),
        "block_manager": job.block_manager_spec or REFERENCE,
        "manager_version": manager_version(job.block_manager_spec),
        "tp_mode": job.tp_mode,
        "world_size": job.world_size,
        "wall_s": round(wall_s, 3),
        "python_hash_seed": HASH_SEED,
        "worker": {"ended": kind, "status": exit_status(code) if kind == "exit" else None},
        "replay": replay_command(sc, job.seed, job.device, job.block_manager_spec, tp, run_dir),
        "batch": job.batch,
    }
    write_results(run_dir, stored)
    try:
        results = analyze(run_dir, plots=None, index=False)
        point_latest(run_dir.parent, run_dir.name)
    except Exception as e:  # the history and the event are on disk: analyze can be run again
        results = json.loads((run_dir / "results.json").read_text(encoding="utf-8"))
        results.update(verdict="ERROR", summary=f"run error: {name}: {message}")
        results["report_error"] = f"{type(e).__name__}: {e}"
        write_results(run_dir, results)
    if kind == "interrupted":
        results["reason"] = "interrupted"
        write_results(run_dir, results)
    findings = [Finding(**f) for c in results.get("checkers", []) for f in c["findings"]]
    return RunResult(
        scenario=sc.name,
        seed=job.seed,
        verdict=results["verdict"],
        run_dir=run_dir,
        summary=results["summary"],
        findings=findings,
        results=results,
    )


def _cut_torn_line(history: Path) -> None:
    """A worker killed mid-write leaves half a line: cut it, so the lines after it are read."""
    if not history.exists():
        return
    with open(history, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
