"""How a soak's runs are made: a job (one seed of the mix) is attempted as `kvchaos run` makes a
run (isolate.py: a fresh worker, stopped at its limit), with its determinism replay when one is
due, wherever it runs; the local executor runs N attempts at once on this machine, each a thread
waiting on its own isolated worker. The Ray executor (soak_ray.py) runs the same attempt as a
remote task. The driver (soak.py) draws the jobs and keeps the records."""

from __future__ import annotations

import concurrent.futures as cf
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvchaos.harness.check.verdict import ERROR
from kvchaos.harness.report.paths import rel_command
from kvchaos.harness.tools.fingerprint import fingerprints
from kvchaos.harness.tools.soak_space import Fit, generate_scenario, shard_seed

WAIT_S = 0.5  # how often the driver looks up from waiting (its display, its clock)


@dataclass(frozen=True, kw_only=True)
class Context:
    """What every run of one soak shares; sent with each remote task, so plain values only."""

    device: str
    runs_dir: str  # the driver's runs/ folder
    batch: str  # the report index groups the soak's runs by it
    block_manager: str | None  # None: the reference
    per_run_timeout: float
    deadline: float  # time.time() at which the soak's budget ends
    marker: str = ""  # the token in runs_dir/MARKER: a node that reads it shares runs_dir
    env: dict = field(default_factory=dict)  # set in the run's worker: the driver's KVCHAOS_*


def make_job(k: int, seed_start: int, shard, fit: Fit | None, hang_every: int | None) -> dict:
    """The soak's k-th run: its seed, the scenario the seed draws (checked: the generator's
    output must be valid; one that is not is the harness's own error, the job's "invalid":
    the soak records it as that seed's ERROR and goes on), whether its worker is made to hang
    (--inject-hang-every)."""
    from kvchaos.engine.errors import KVChaosError
    from kvchaos.harness.scenario.spec import parse_scenario

    seed = shard_seed(seed_start, k, shard)
    hang = hang_every is not None and (k + 1) % hang_every == 0
    job = {"k": k, "seed": seed, "hang": hang, "replay": False, "attempt": 1}
    try:
        job["scenario"] = data = generate_scenario(seed, fit)
        parse_scenario(data, f"<soak seed {seed}>")
    except (KVChaosError, ValueError) as e:  # ValueError: a ParamError, or the draw's own
        job.setdefault("scenario", _undrawn(seed))
        param = getattr(e, "param", None) or getattr(e, "key", None) or "-"
        job["invalid"] = {"seed": seed, "param": param, "message": str(e)}
    return job


def _undrawn(seed: int) -> dict:
    """What the ledger keeps of a seed whose draw raised before it made a scenario."""
    return {"scenario": {"name": f"soak-{seed}", "description": f"soak seed {seed}: no draw"}}


def invalid_result(job: dict) -> dict:
    """A seed whose own draw failed validation: the harness's ERROR, in the ledger and the
    summary's unexpected runs as any other, never run (no folder: no incident to replay, as a
    lost run's)."""
    bad = job["invalid"]
    why = bad["message"].removeprefix(f"<soak seed {bad['seed']}>: ")
    why = why.removeprefix(f"{bad['param']}: ")
    return {
        "run_dir": None,
        "verdict": ERROR,
        "summary": f"the soak's own draw for seed {bad['seed']} is invalid, {bad['param']}: {why}",
        "steps": 0,
        "digest": None,
        "command": "",
        "fingerprints": [],
        "ended": None,
        "cut": False,
        "node": None,
    }


def limit(ctx: Context) -> tuple[float, bool]:
    """(the next run's time limit, is it the run's own and not the budget's end)."""
    left = max(ctx.deadline - time.time(), 0.01)  # 0 would be no limit
    return min(ctx.per_run_timeout, left), ctx.per_run_timeout <= left


def run_one(job: dict, ctx: Context, timeout_s: float, tick=None) -> dict:
    """One run, as `kvchaos run` makes it (the run folder's scenario.toml its one copy): what
    the ledger keeps of it; "ended": how its worker ended when it gave no record, else None."""
    from kvchaos.harness.run import isolate
    from kvchaos.harness.scenario.spec import parse_scenario

    sc = parse_scenario(job["scenario"], f"<soak seed {job['seed']}>")
    r = isolate.run_isolated(
        sc, job["seed"], ctx.device, ctx.runs_dir, ctx.block_manager, timeout_s=timeout_s,
        batch=ctx.batch, on_wait=tick, inject_hang=job["hang"],
    )  # fmt: skip
    res = r.results
    if res.get("reason") == "interrupted":  # Ctrl-C: its record is on disk; the soak stops
        raise KeyboardInterrupt
    ended = (res.get("worker") or {}).get("ended")
    return {
        "run_dir": str(r.run_dir),
        "verdict": r.verdict,
        "summary": r.summary,
        "steps": res.get("steps", 0),
        "digest": None if ended else res["history_digest"],  # a cut history: no digest
        "replay_line": res["replay"],  # as results.json has it: relative to the report folder
        # the soak's reader's command, from here
        "command": rel_command(res["replay"], base=r.run_dir.parent),
        "fingerprints": fingerprints(res, job["scenario"].get("faults", [])),
        "ended": ended,
        "prefix_cache": (res.get("metrics") or {}).get("prefix_cache"),
        "performance": [f["kind"] for f in (res.get("performance") or {}).get("findings", ())],
    }


def replay_one(run_dir: str, device: str, deadline: float, per_run_timeout: float) -> dict:
    """Replay the run as `kvchaos replay` does (a fresh worker with the same hash seed):
    {"cut": True} when the budget ran out mid-replay, else what the replay found."""
    from kvchaos.harness.tools import replay

    left = max(deadline - time.time(), 0.01)
    timeout_s, own = min(per_run_timeout, left), per_run_timeout <= left
    got = replay.replay(run_dir, device, timeout_s)
    ended = (got.get("replay_worker") or {}).get("ended")
    if ended == "timeout" and not own:
        return {"cut": True}
    return {
        "cut": False,
        "identical": got["identical"],
        "recorded_digest": got.get("recorded_digest"),
        "replay_digest": f"replay {ended}" if ended else got.get("replay_digest"),
        "replay_verdict": got.get("replay_verdict"),
    }


def attempt(job: dict, ctx: Context, run=None, tick=None) -> dict:
    """The job's run (run(job, timeout_s, tick): run_one's shape) and, when its replay is due
    and it can be compared, its replay. "cut": the budget ended it, not its own limit."""
    if time.time() >= ctx.deadline:  # queued past the budget's end (a busy cluster): not run
        return {"cut": True, "run_dir": None, "ended": "timeout"}
    timeout_s, own = limit(ctx)
    r = (run or (lambda j, t, w: run_one(j, ctx, t, w)))(job, timeout_s, tick)
    r["cut"] = r["ended"] == "timeout" and not own
    r.setdefault("node", socket.gethostname())
    replayable = r["verdict"] != ERROR and r["digest"]  # an ERROR may have stopped on a clock
    if job["replay"] and not r["cut"] and replayable and time.time() < ctx.deadline:
        r["replay"] = replay_one(r["run_dir"], ctx.device, ctx.deadline, ctx.per_run_timeout)
    return r


class LocalExecutor:
    """N attempts at once on this machine. One: each runs in the caller's thread as it waits
    (a Ctrl-C reaches the run's worker as `kvchaos run`'s does); more: in threads, each waiting
    on its own isolated worker, told to stop (as a Ctrl-C would) when the soak stops."""

    name = "local"

    def __init__(self, workers: int, attempt_fn) -> None:
        self.workers, self.attempt_fn = workers, attempt_fn
        self.queue: list[dict] = []
        self.futures: dict = {}
        self.stopping = threading.Event()
        self.pool = cf.ThreadPoolExecutor(workers) if workers > 1 else None

    def describe(self) -> str:
        return f"this machine, {self.workers} worker{'s' * (self.workers > 1)}"

    def free(self) -> int:
        return self.workers - len(self.queue) - len(self.futures)

    def in_flight(self) -> int:
        return len(self.queue) + len(self.futures)

    def submit(self, job: dict) -> None:
        if self.pool is None:
            self.queue.append(job)
        else:
            self.futures[self.pool.submit(self._threaded, job)] = job

    def _threaded(self, job: dict) -> dict:
        told = False

        def tick() -> None:  # in the run's wait: raised there once, the worker records it
            nonlocal told
            if self.stopping.is_set() and not told:
                told = True
                raise KeyboardInterrupt

        return self.attempt_fn(job, tick)

    def wait(self, tick) -> list[tuple[dict, dict]]:
        """The attempts that ended since the last call: (job, its result)."""
        if self.pool is None:
            if not self.queue:
                return []
            job = self.queue.pop(0)
            return [(job, self.attempt_fn(job, tick))]
        done, _ = cf.wait(list(self.futures), timeout=WAIT_S, return_when=cf.FIRST_COMPLETED)
        tick()
        out = []
        for f in done:
            job = self.futures.pop(f)
            out.append((job, f.result()))  # a KeyboardInterrupt in a run stops the soak
        return out

    def shutdown(self) -> None:
        self.stopping.set()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def lost_result(job: dict, why: str) -> dict:
    """A run whose worker or node was lost twice: an ERROR in the ledger, never lost."""
    return {
        "run_dir": None,
        "verdict": ERROR,
        "summary": f"lost twice, its result never came back: {why}",
        "steps": 0,
        "digest": None,
        "command": "",
        "fingerprints": [],
        "ended": "lost",
        "cut": False,
        "node": None,
    }


def shared(runs_dir: str, marker: str) -> bool:
    """Does this machine see the driver's runs/ folder (its marker file holds our token)?"""
    try:
        return bool(marker) and (Path(runs_dir) / MARKER).read_text().strip() == marker
    except OSError:
        return False


MARKER = ".kvchaos-soak-marker"
