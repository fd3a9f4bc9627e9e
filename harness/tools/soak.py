"""Soak: run randomised scenarios until a time budget is spent.

Each seed picks a mix of triggers, planted defects and workload parameters within the ranges in
SPACE (soak_space.py) and runs it as `kvchaos run` does (isolate.py: a fresh worker per run, a
hang stopped at --per-run-timeout), and the soak goes on. Every run goes into a seed ledger
(SQLite) that persists across nights. A sample of runs (5%, from the first run that is not an
ERROR) is replayed as `kvchaos replay` does: a mismatch is NONDETERMINISM, never retried. At
the end: soak-summary.md / .html in the soak's folder, incidents deduplicated by fingerprint
(label, failure mode, checker, finding kind) with the first and fastest seed of each,
INCONCLUSIVE runs by cause, runs and findings over time, and links to every kept run's report.

Disk: every run with a finding (a verdict other than PASS, the first or fastest run of an
incident, a replay mismatch) keeps its folder; of the passing runs a seeded reservoir sample of
--keep (default 20); the others are deleted once the ledger has them (its row keeps the seed,
verdict, digest and a replay command). What the soak writes (its folder, the ledger's growth)
stays under --max-disk (default 500MB): past 80% of it no new passing run is kept; when the next
run might not fit, the soak stops with exit 15, its summary and ledger written.

Any block manager (--block-manager SPEC, `vllm`, `sglang`): checked once before the first run (one
that fails the check ends the soak at once, that FAIL its incident); the mix leaves out what it
declares it cannot do (the summary says what). Runs go --workers N at once on this machine, or
as Ray tasks over a cluster (--executor ray, soak_ray.py): one ledger, one summary. --resume
continues the ledger's latest soak: no seed run twice, none skipped.

A seed whose own draw is invalid (the scenario it built fails validation) is the harness's
ERROR: recorded with the seed, the param and the message, never run, and the soak goes on.

Exit codes: 0 nothing unexpected (PASS / INCONCLUSIVE only), 10 MISSED, 11 FAIL,
14 nondeterminism, 13 ERROR, 15 stopped at the disk cap (in that order of precedence),
2 bad input (the user's: flags, --block-manager; at once, nothing run).

  kvchaos soak --budget 30m --device cuda --shard 1/4 --per-run-timeout 120 --max-disk 2GB
  kvchaos soak --budget 8h --block-manager mypkg.bm:MyManager --executor ray --ray-address HOST:6379
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import re
import shutil
import sys
import time
from array import array
from collections import Counter
from pathlib import Path

from kvchaos.harness.report.paths import make_report_dir, report_dir_problem
from kvchaos.harness.tools.ledger import (
    Keeper,
    Ledger,
    du_bytes,
    ledger_bytes,
    parse_keep,
    parse_size,
    size_text,
)
from kvchaos.harness.tools.soak_args import add_arguments as add_arguments  # the command's
from kvchaos.harness.tools.soak_exec import (
    MARKER,
    Context,
    LocalExecutor,
    attempt,
    invalid_result,
    lost_result,
    make_job,
    replay_one,
    run_one,
)
from kvchaos.harness.tools.soak_html import render_html
from kvchaos.harness.tools.soak_progress import Progress
from kvchaos.harness.tools.soak_space import Fit, parse_shard
from kvchaos.harness.tools.soak_summary import render_md, summary_of
from kvchaos.harness.tools.soak_tally import Tally

REPLAY_EVERY = 20  # every 20th run (the first included; an ERROR passes it on) is replayed: 5%


# -- input ------------------------------------------------------------------------------------
def parse_budget(text: str) -> float:
    """'90s', '5m', '1h30m', '2h15m30s' -> seconds."""
    m = re.fullmatch(r"\s*(?:(\d+)h)?\s*(?:(\d+)m)?\s*(?:(\d+)s)?\s*", text or "")
    if not m or not any(m.groups()):
        raise ValueError(f"--budget {text!r}: expected a duration such as 90s, 5m or 1h30m")
    h, mi, s = (int(g or 0) for g in m.groups())
    total = h * 3600 + mi * 60 + s
    if total <= 0:
        raise ValueError(f"--budget {text!r}: must be longer than zero")
    return float(total)


RESUMED = ("seed_start", "shard", "block_manager", "inject_hang_every")  # the soak's own


# -- the soak ---------------------------------------------------------------------------------
class Soak(Tally):
    def __init__(self, args) -> None:
        from kvchaos.harness.run.device import resolve_device
        from kvchaos.harness.run.runner import git_commit

        self.budget = parse_budget(args.budget)
        self.keep, self.cap = parse_keep(args.keep), parse_size(args.max_disk)
        for flag, n in (
            ("--inject-hang-every", args.inject_hang_every),
            ("--max-runs", args.max_runs),
            ("--workers", args.workers),
        ):
            if n is not None and n < 1:
                raise ValueError(f"{flag} {n}: must be >= 1")
        self.args = args
        report_dir = Path(args.report_dir)
        if problem := report_dir_problem(report_dir):
            raise ValueError(f"--report-dir {report_dir}: {problem}")
        self.ledger_file = Path(args.ledger) if args.ledger else report_dir / "ledger.sqlite"
        resumed = self._resumed() if args.resume else None
        self.shard = parse_shard(args.shard)
        if args.executor == "ray":
            from kvchaos.harness.tools.soak_ray import require_ray

            require_ray()  # one line saying how to install it, before anything is made
        # each worker gets this: a matplotlib figure per incident run would triple a soak's cost
        os.environ["KVCHAOS_PLOTS"] = args.plots
        # a Ray driver without a GPU may drive GPU nodes: the nodes resolve cuda
        ray_gpu = args.executor == "ray" and args.device == "cuda"
        self.device = "cuda" if ray_gpu else resolve_device(args.device)
        self.fit, self.door = self._door(args.block_manager)
        self.commit = git_commit()
        make_report_dir(report_dir)
        ledger_base = ledger_bytes(self.ledger_file)  # only its growth counts against the cap
        self.ledger = Ledger(self.ledger_file)
        if resumed:
            self.id, self.dir, self.started = (
                resumed["id"],
                Path(resumed["folder"]),
                resumed["started"],
            )
            self.seed_start = args.seed_start
            (self.dir / "runs").mkdir(parents=True, exist_ok=True)
        else:
            self.seed_start = (
                args.seed_start
                if args.seed_start is not None
                else self.ledger.next_seed(self.shard[1])
            )
            self._new_folder(report_dir)
        self.keeper = Keeper(
            self.dir,
            self.ledger,
            self.ledger_file,
            ledger_base,
            self.keep,
            self.cap,
            self.seed_start,
        )
        self.counts: Counter = Counter()
        self.incidents: dict[tuple, dict] = {}
        self.unexpected: list[dict] = []  # capped: the ledger has them all
        self.nondet: list[dict] = []
        self.runs = self.steps = self.replays = self.cut = self.new_incidents = 0
        self.session_runs = 0  # this session's (a resumed soak counts its earlier runs too)
        self.hit_rates: list[dict] = []  # runs with a prefix cache: their metrics
        self.performance: dict[str, dict] = {}  # a performance finding's kind -> runs, first
        self.first_seed = self.last_seed = None
        self.rss: dict = {}
        self.t0 = time.monotonic()
        # the timeline, compactly: a night is 10**5 runs
        self.run_t, self.run_v = array("f"), array("B")
        self.fp_t, self.nondet_t = array("f"), array("f")
        self.causes: dict[str, dict] = {}  # INCONCLUSIVE cause -> count, first seed, runs
        self._superseded: list[str] = []  # runs no longer the fastest of their fingerprint
        self.stopped: str | None = None
        self.capped = False  # stopped at the disk cap
        self.done: set[int] = set()  # the run indices the ledger has
        self.lost = 0  # runs resubmitted after their worker or node was lost
        self.replay_due = True
        self.executor = None
        self.ctx = self._context()
        if resumed:
            self._restore(self.ledger.rows("WHERE soak = ?", (self.id,)))

    def _resumed(self) -> dict:
        """The ledger's latest soak, to continue: its own seeds, shard and manager."""
        if not self.ledger_file.is_file():
            raise ValueError(f"--resume: {self.ledger_file} holds no soak to resume")
        ledger = Ledger(self.ledger_file)
        row = ledger.soak_row()
        ledger.close()
        if row is None or not row.get("args_json"):
            raise ValueError(f"--resume: {self.ledger_file} holds no soak this kvchaos can resume")
        for name, value in json.loads(row["args_json"]).items():
            if name in RESUMED:
                setattr(self.args, name, value)
        return row

    def _door(self, spec: str | None):
        """(the mix's fit, the check's failure or None): the manager checked once, as `kvchaos
        run --block-manager` does; what is not a manager is bad input (exit 2)."""
        if not spec:
            return None, None
        from kvchaos.harness.run import isolate
        from kvchaos.harness.run.door import door_check
        from kvchaos.harness.run.user_code import SmokeFailure

        isolate.start_server(spec)  # a shipped adapter's engine imported once, in the server
        try:
            got = door_check(spec, self.args.check_timeout)
        except SmokeFailure as failed:
            return Fit(spec=spec), failed
        return Fit(spec=spec, block_sizes=got.block_sizes, capabilities=got.capabilities), None

    def _new_folder(self, report_dir: Path) -> None:
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.id = f"soak-{stamp}" + (
            f"-shard{self.shard[0]}of{self.shard[1]}" if self.shard[1] > 1 else ""
        )
        self.dir = report_dir / self.id
        n = 1
        while self.dir.exists():
            n += 1
            self.dir = report_dir / f"{self.id}-{n}"
        (self.dir / "runs").mkdir(parents=True)
        self.started = dt.datetime.now().isoformat(timespec="seconds")

    def _context(self) -> Context:
        marker = os.urandom(8).hex()
        (self.dir / "runs" / MARKER).write_text(marker)  # a node that reads it shares runs/
        return Context(
            device=self.device,
            runs_dir=str(self.dir / "runs"),
            batch=f"soak-{self.dir.name}",  # the report index groups the soak's runs
            block_manager=self.args.block_manager,
            per_run_timeout=self.args.per_run_timeout,
            deadline=time.time() + self.budget,
            marker=marker,
            # a node's environment is its own: the driver's KVCHAOS_* travel with each task
            env={k: v for k, v in os.environ.items() if k.startswith("KVCHAOS_")}
            | {"KVCHAOS_PLOTS": self.args.plots},
        )

    def executor_line(self) -> str:
        return self.executor.describe() if self.executor else f"{self.args.executor} executor"

    # -- one run ----------------------------------------------------------------------------
    def _job(self, k: int) -> dict:
        return make_job(k, self.seed_start, self.shard, self.fit, self.args.inject_hang_every)

    def _run(self, job: dict, timeout_s: float, tick) -> dict:
        return run_one(job, self.ctx, timeout_s, tick)

    def _replay(self, job: dict, r: dict, row: int, end: float) -> None:
        """Replay the run as `kvchaos replay` does and note what it found."""
        deadline = time.time() + (end - time.monotonic())
        got = replay_one(r["run_dir"], self.device, deadline, self.args.per_run_timeout)
        self._note_replay(job, r, row, got)

    def _settle(self, job: dict, r: dict) -> None:
        """A run back from its executor: recorded once, its replay noted, its folder settled."""
        if r.get("lost"):  # its worker or node was lost: once more elsewhere, then an ERROR
            if job["attempt"] == 1:
                self.lost += 1
                self.executor.submit({**job, "attempt": 2, "resubmitted": r["lost"]})
                return
            r = lost_result(job, r["lost"])
        if r["cut"] or job["k"] in self.done:  # the budget's end stopped it: not its fault
            self.cut += r["cut"]
            if r["run_dir"] and job["k"] not in self.done:
                shutil.rmtree(r["run_dir"], ignore_errors=True)
            return
        self.done.add(job["k"])
        self.session_runs += 1
        row = self._record(job, r, r.get("duration_s", 0.0))
        if r.get("replay"):
            self._note_replay(job, r, row, r["replay"])
        elif job["replay"]:  # an ERROR, or a history without a digest: the next run's turn
            self.replay_due = True
        self._keep(job, r, row)
        if self.keeper.full() and not self.stopped:
            self.capped = True
            self.stopped = (
                f"stopped at the disk cap after {self.runs} runs: "
                f"{size_text(self.keeper.used())} of --max-disk {size_text(self.cap)} "
                "written, and the next run might not fit"
            )

    def _attempt(self, job: dict, tick) -> dict:
        t0 = time.monotonic()
        r = attempt(job, self.ctx, self._run, tick)
        r["duration_s"] = time.monotonic() - t0
        return r

    def _next_k(self, k: int) -> int:
        while k in self.done:
            k += 1
        return k

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> int:
        self.t0 = time.monotonic()
        end = self.t0 + self.budget
        self.ctx = self._context()  # the budget starts now
        self._soak_row(None)
        progress = Progress(self, self.args.quiet)
        if self.door is not None:  # the check before any run failed: that FAIL, nothing else
            return self._door_failed(progress)
        self.executor = self._executor()
        k, submitted, out_of_time = self._next_k(0), 0, False
        progress.start()
        try:
            while True:
                while (
                    self.executor.free() > 0
                    and not (self.stopped or out_of_time)
                    and time.monotonic() < end
                    and submitted != self.args.max_runs
                ):
                    job = self._job(k)
                    job["replay"] = self.replay_due or k % REPLAY_EVERY == 0
                    self.replay_due = self.replay_due and not job["replay"]
                    if job.get("invalid"):  # the soak's own draw: its ERROR, and on to the next
                        self._settle(job, invalid_result(job))
                    else:
                        self.executor.submit(job)
                    submitted += 1
                    k = self._next_k(k + 1)
                if not self.executor.in_flight():
                    break
                for job, r in self.executor.wait(progress.tick):
                    out_of_time = out_of_time or r.get("cut", False)
                    self._settle(job, r)
                progress.tick()
        except KeyboardInterrupt:
            self.stopped = f"interrupted after {self.runs} runs"
            self._finish(progress)
            raise
        return self._finish(progress)

    def _executor(self):
        if self.args.executor == "ray":
            from kvchaos.harness.tools.soak_ray import RayExecutor

            ex = RayExecutor(self)
            self.device = ex.device  # GPU nodes: cuda, whatever the driver has
            self.ctx = dataclasses.replace(self.ctx, device=ex.device)
            return ex
        return LocalExecutor(self.args.workers or 1, self._attempt)

    def _door_failed(self, progress) -> int:
        from kvchaos.harness.run.door import door_run
        from kvchaos.harness.tools.fingerprint import fingerprints

        r = door_run(self.door, self.dir / "runs", index=False, batch=self.ctx.batch)
        res = r.results
        desc = f"the check before any run: {r.summary}"
        job = {"k": None, "seed": "door check"}
        job["scenario"] = {"scenario": {"name": res["scenario"], "description": desc}}
        got = {
            "run_dir": str(r.run_dir),
            "verdict": r.verdict,
            "summary": r.summary,
            "steps": res.get("steps", 0),
            "digest": res.get("history_digest"),
            "command": res.get("replay", ""),
            "fingerprints": fingerprints(res, []),
            "node": None,
        }
        self._keep(job, got, self._record(job, got, 0.0))
        self.stopped = f"{r.summary}; the soak ended there, nothing else ran"
        return self._finish(progress)

    def _soak_row(self, code: int | None) -> None:
        a = self.args
        own = {"seed_start": self.seed_start, "shard": a.shard, "block_manager": a.block_manager}
        own["inject_hang_every"] = a.inject_hang_every
        self.ledger.soak(
            id=self.id,
            started=self.started,
            finished=None if code is None else dt.datetime.now().isoformat(timespec="seconds"),
            commit_sha=self.commit,
            device=self.device,
            budget_s=self.budget,
            shard=f"{self.shard[0]}/{self.shard[1]}",
            seed_start=self.seed_start,
            runs=self.runs,
            exit_code=code,
            folder=str(self.dir),
            block_manager=a.block_manager or "reference",
            executor=a.executor,
            workers=self.executor.workers if self.executor else a.workers or 1,
            args_json=json.dumps(own),
        )

    def _finish(self, progress) -> int:
        self.elapsed = time.monotonic() - self.t0  # the soak's time: its runs, not what follows
        if self.executor is not None:
            self.executor.shutdown()
        if self.lost:  # folders a lost worker left: no ledger row names them
            for d in (self.dir / "runs").iterdir():
                if d.is_dir() and not d.is_symlink() and str(d) not in self.keeper.kept:
                    shutil.rmtree(d, ignore_errors=True)
        progress.stop()
        code = self.exit_code()
        self._soak_row(code)
        self.ledger.close()
        runs = self.dir / "runs"
        if runs.is_dir():  # the kept runs' index, once (not after every run of the night)
            from kvchaos.harness.report.index import update_index

            try:
                update_index(runs)
            except Exception as e:  # the summary and runs are written; only their listing is not
                print(
                    f"could not write {runs / 'index.html'}: {type(e).__name__}: {e}",
                    file=sys.stderr,
                )
        summary = self.write_summary(final=True)
        print(render_md(summary, brief=True))
        print(f"summary: {self.dir / 'soak-summary.md'}  ({self.dir / 'soak-summary.html'})")
        if self.capped:
            print(
                f"kvchaos soak: {self.stopped}; the summary and the ledger are written "
                f"(exit {code}). Raise --max-disk or lower --keep to soak longer.",
                file=sys.stderr,
            )
        return code

    def write_summary(self, final: bool) -> dict:
        """soak.json and soak-summary.md (and, at the end, .html); before the end, as it stands."""
        elapsed = self.elapsed if final else time.monotonic() - self.t0
        summary = summary_of(self, elapsed, self.exit_code())
        summary["in_progress"] = not final
        for _ in range(2 if final else 1):  # the second pass counts the summary itself in the disk
            tmp = self.dir / ".soak-summary.md.tmp"  # a reader never sees half a summary
            tmp.write_text(render_md(summary), encoding="utf-8")
            (self.dir / "soak.json").write_text(json.dumps(summary, indent=1, default=str))
            tmp.replace(self.dir / "soak-summary.md")
            if final:
                (self.dir / "soak-summary.html").write_text(render_html(summary), encoding="utf-8")
            summary["disk"]["used_bytes"] = self.disk_used()
        return summary

    def disk_used(self) -> int:
        """What this soak wrote: its folder and the ledger's growth (as du counts)."""
        ledger = max(0, ledger_bytes(self.ledger_file) - self.keeper.ledger_base)
        return du_bytes(self.dir) + ledger


def main(args) -> int:
    if args.summary:
        from kvchaos.harness.tools.soak_fleet import main_summary

        return main_summary(Path(args.summary))
    if not args.budget:
        raise ValueError("--budget is required (how long to soak: 90s, 5m, 1h30m)")
    return Soak(args).run()
