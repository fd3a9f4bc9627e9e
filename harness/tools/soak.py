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

Exit codes: 0 nothing unexpected (PASS / INCONCLUSIVE only), 10 MISSED, 11 FAIL,
14 nondeterminism, 13 ERROR, 15 stopped at the disk cap (in that order of precedence),
2 bad input.

  kvchaos soak --budget 30m --device cuda --shard 1/4 --per-run-timeout 120 --max-disk 2GB
"""

from __future__ import annotations

import argparse
import contextlib
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

import psutil

from kvchaos.harness.check.verdict import ERROR, EXIT_CODES, FAIL, MISSED, PASS
from kvchaos.harness.report.paths import make_report_dir, rel_command, report_dir_problem
from kvchaos.harness.scenario import inputs, options
from kvchaos.harness.tools.fingerprint import fingerprints
from kvchaos.harness.tools.ledger import (
    Keeper,
    Ledger,
    du_bytes,
    ledger_bytes,
    parse_keep,
    parse_size,
    size_text,
)
from kvchaos.harness.tools.soak_html import render_html
from kvchaos.harness.tools.soak_space import generate_scenario, parse_shard, shard_seed
from kvchaos.harness.tools.soak_summary import (
    EXIT_DISK_CAP,
    EXIT_NONDETERMINISM,
    NONDETERMINISM,
    VERDICT_CODE,
    inconclusive_causes,
    live_panel,
    render_md,
    summary_of,
)

REPLAY_EVERY = 20  # every 20th run (the first included; an ERROR passes it on) is replayed: 5%
RSS_SAMPLE_EVERY_S = 5.0
RSS_BASELINE_S = 60.0  # "after the first minute"


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


def _incident(seed: int, run_dir: str, step: int, count: int) -> dict:
    return {
        "count": count,
        "first_seed": seed,
        "first_run": run_dir,
        "fastest_seed": seed,
        "fastest_step": step,
        "fastest_run": run_dir,
    }


# -- the soak ---------------------------------------------------------------------------------
class Soak:
    def __init__(self, args) -> None:
        from kvchaos.harness.run.device import resolve_device
        from kvchaos.harness.run.runner import git_commit

        self.budget = parse_budget(args.budget)
        self.shard = parse_shard(args.shard)
        self.keep, self.cap = parse_keep(args.keep), parse_size(args.max_disk)
        for flag, n in (
            ("--inject-hang-every", args.inject_hang_every),
            ("--max-runs", args.max_runs),
        ):
            if n is not None and n < 1:
                raise ValueError(f"{flag} {n}: must be >= 1")
        self.args = args
        # each worker gets this: a matplotlib figure per incident run would triple a soak's cost
        os.environ["KVCHAOS_PLOTS"] = args.plots
        self.device = resolve_device(args.device)
        self.commit = git_commit()
        report_dir = Path(args.report_dir)
        if problem := report_dir_problem(report_dir):
            raise ValueError(f"--report-dir {report_dir}: {problem}")
        make_report_dir(report_dir)
        self.ledger_file = Path(args.ledger) if args.ledger else report_dir / "ledger.sqlite"
        ledger_base = ledger_bytes(self.ledger_file)  # only its growth counts against the cap
        self.ledger = Ledger(self.ledger_file)
        self.seed_start = (
            args.seed_start if args.seed_start is not None else self.ledger.next_seed(self.shard[1])
        )
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
        self.keeper = Keeper(
            self.dir,
            self.ledger,
            self.ledger_file,
            ledger_base,
            self.keep,
            self.cap,
            self.seed_start,
        )
        self.proc = psutil.Process()
        self.counts: Counter = Counter()
        self.incidents: dict[tuple, dict] = {}
        self.unexpected: list[dict] = []  # capped: the ledger has them all
        self.nondet: list[dict] = []
        self.runs = self.steps = self.replays = self.cut = 0
        self.hit_rates: list[dict] = []  # runs with a prefix cache: their metrics
        self.performance: dict[str, dict] = {}  # a performance finding's kind -> runs, first
        self.first_seed = self.last_seed = None
        self.rss: dict = {}
        self._last_rss = 0.0
        self.t0 = time.monotonic()
        # the timeline, compactly: a night is 10**5 runs
        self.run_t, self.run_v = array("f"), array("B")
        self.fp_t, self.nondet_t = array("f"), array("f")
        self.causes: dict[str, dict] = {}  # INCONCLUSIVE cause -> count, first seed, runs
        self._superseded: list[str] = []  # runs no longer the fastest of their fingerprint
        self.stopped: str | None = None

    # -- one run ----------------------------------------------------------------------------
    def _job(self, k: int) -> dict:
        from kvchaos.harness.scenario.spec import parse_scenario

        seed = shard_seed(self.seed_start, k, self.shard)
        data = generate_scenario(seed)
        sc = parse_scenario(data, f"<soak seed {seed}>")  # the generator's output must be valid
        hang = (
            self.args.inject_hang_every is not None and (k + 1) % self.args.inject_hang_every == 0
        )
        return {"seed": seed, "scenario": data, "sc": sc, "hang": hang}

    def _limit(self, end: float) -> tuple[float, bool]:  # (limit, is it the run's own)
        left = max(end - time.monotonic(), 0.01)  # 0 would be no limit
        return min(self.args.per_run_timeout, left), self.args.per_run_timeout <= left

    def _run(self, job: dict, timeout_s: float, tick) -> dict:
        """One run, as `kvchaos run` makes it (the run folder's scenario.toml its one copy): what
        the ledger keeps of it; "ended": how its worker ended when it gave no record, else None."""
        from kvchaos.harness.run.isolate import run_isolated

        batch = f"soak-{self.dir.name}"  # the report index groups the soak's runs
        r = run_isolated(
            job["sc"], job["seed"], self.device, self.dir / "runs", timeout_s=timeout_s,
            batch=batch, on_wait=tick, inject_hang=job["hang"],
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
            # results.json's paths are the report folder's (its runs/); the soak's reader's here
            "command": rel_command(res["replay"], base=r.run_dir.parent),
            "fingerprints": fingerprints(res, job["scenario"].get("faults", [])),
            "ended": ended,
            "prefix_cache": (res.get("metrics") or {}).get("prefix_cache"),
            "performance": [f["kind"] for f in (res.get("performance") or {}).get("findings", ())],
        }

    def _record(self, job: dict, r: dict, duration: float) -> int:
        seed = job["seed"]
        self.runs += 1
        self.steps += r["steps"]
        if r.get("prefix_cache"):
            self.hit_rates.append(r["prefix_cache"])
        for kind in r.get("performance", ()):  # warnings: the verdict is as it was
            p = self.performance.setdefault(kind, {"runs": 0, "first_seed": seed})
            p["runs"] += 1
            p.setdefault("first_run", r["run_dir"])
        self.counts[r["verdict"]] += 1
        self.first_seed = seed if self.first_seed is None else self.first_seed
        self.last_seed = seed
        t = time.monotonic() - self.t0
        self.run_t.append(t)
        self.run_v.append(VERDICT_CODE.get(r["verdict"], VERDICT_CODE[ERROR]))
        for x in r["fingerprints"]:
            fp = tuple(x["fp"])
            inc = self.incidents.get(fp)
            if inc is None:
                self.fp_t.append(t)
                self.incidents[fp] = _incident(seed, r["run_dir"], x["step"], 1)
            else:
                inc["count"] += 1
                if x["step"] < inc["fastest_step"]:
                    self._superseded.append(inc["fastest_run"])
                    inc.update(fastest_seed=seed, fastest_step=x["step"], fastest_run=r["run_dir"])
        if r["verdict"] in (MISSED, FAIL, ERROR) and len(self.unexpected) < 200:
            self.unexpected.append(
                {
                    "seed": seed,
                    "verdict": r["verdict"],
                    "summary": r["summary"],
                    "run_dir": r["run_dir"],
                    "mix": job["scenario"]["scenario"]["description"],
                }
            )
        if r["verdict"] == "INCONCLUSIVE":
            for cause in inconclusive_causes(r["summary"]):
                c = self.causes.setdefault(cause, {"count": 0, "first_seed": seed, "runs": []})
                c["count"] += 1
                if len(c["runs"]) < 3:  # examples to link, kept; the others are sampled
                    c["runs"].append(r["run_dir"])
        return self.ledger.add_run(
            soak=self.id,
            time=dt.datetime.now().isoformat(timespec="seconds"),
            commit_sha=self.commit,
            scenario=job["scenario"]["scenario"]["name"],
            scenario_json=json.dumps(job["scenario"], sort_keys=True),
            seed=seed,
            device=self.device,
            verdict=r["verdict"],
            duration_s=round(duration, 3),
            steps=r["steps"],
            command=r["command"],
            history_digest=r["digest"],
            run_dir=r["run_dir"],
            fingerprints=json.dumps([x["fp"] for x in r["fingerprints"]]),
        )

    def _replay(self, job: dict, r: dict, row: int, end: float) -> None:
        """Replay the run as `kvchaos replay` does: a fresh worker with the same hash seed."""
        from kvchaos.harness.tools import replay

        timeout_s, own = self._limit(end)
        got = replay.replay(r["run_dir"], self.device, timeout_s)
        ended = (got.get("replay_worker") or {}).get("ended")
        if ended == "timeout" and not own:  # the budget ran out mid-replay
            self.ledger.set_determinism(row, "cut")
            return
        self.replays += 1
        same = got["identical"]
        self.ledger.set_determinism(row, "identical" if same else "mismatch")
        if not same:
            self.nondet.append(
                {
                    "seed": job["seed"],
                    "run_dir": r["run_dir"],
                    "digest": got["recorded_digest"],
                    "replay_digest": f"replay {ended}" if ended else got["replay_digest"],
                    "replay_verdict": got["replay_verdict"],
                    "verdict": r["verdict"],
                }
            )
            self.counts[NONDETERMINISM] += 1
            self.nondet_t.append(time.monotonic() - self.t0)
            mix = "+".join(sorted(f["name"] for f in job["scenario"].get("faults", []))) or "-"
            fp = (NONDETERMINISM, mix, "replay", "digest_mismatch")
            inc = self.incidents.setdefault(fp, _incident(job["seed"], r["run_dir"], r["steps"], 0))
            inc["count"] += 1

    def _keep(self, job: dict, r: dict, row: int) -> None:
        """Keep or delete the run's folder (after its replay: a mismatch is a finding)."""
        cited = {i[k] for i in self.incidents.values() for k in ("first_run", "fastest_run")}
        run_dir = r["run_dir"]
        # INCONCLUSIVE is no finding: keep the examples its cause links to, sample the rest
        examples = {d for c in self.causes.values() for d in c["runs"]}
        if r["verdict"] == "INCONCLUSIVE" and run_dir not in examples:
            why = "passing"
        elif r["verdict"] != PASS or any(m["run_dir"] == run_dir for m in self.nondet[-1:]):
            why = "finding"
        else:
            why = "cited" if run_dir in cited else "passing"
        info = {
            "seed": job["seed"],
            "verdict": r["verdict"],
            "summary": r["summary"],
            "command": r["command"],
            "mix": job["scenario"]["scenario"]["description"].split(": ", 1)[-1],
        }
        self.keeper.settle(run_dir, row, why, info)
        for old in self._superseded:  # a passing run kept only for being the fastest
            if old not in cited:
                self.keeper.release(old, only_cited=True)
        self._superseded.clear()

    # -- the loop ---------------------------------------------------------------------------
    def _sample_rss(self, t: float) -> None:
        if t - self._last_rss < RSS_SAMPLE_EVERY_S and self.rss:
            return
        self._last_rss = t
        soak, worker = self.proc.memory_info().rss, self._worker_rss()
        self.rss.setdefault("start_mb", soak / 2**20)
        self.rss["peak_mb"] = max(self.rss.get("peak_mb", 0), soak / 2**20)
        self.rss["worker_peak_mb"] = max(self.rss.get("worker_peak_mb", 0), worker / 2**20)
        # the baseline is the first sample after the first minute (or a fifth of a shorter budget)
        if "baseline_mb" not in self.rss and t >= min(RSS_BASELINE_S, self.budget / 5):
            self.rss.update(
                baseline_mb=soak / 2**20,
                baseline_at_s=round(t, 1),
                worker_baseline_mb=worker / 2**20,
            )
        self.rss.update(end_mb=soak / 2**20, worker_end_mb=worker / 2**20)

    def _worker_rss(self) -> int:
        """The largest child: the run's worker while one runs, else the fork server."""
        sizes = [0]
        for p in self.proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):  # it ended meanwhile
                sizes.append(p.memory_info().rss)
        return max(sizes)

    def run(self) -> int:
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True)
        t0 = self.t0 = time.monotonic()
        end = t0 + self.budget
        started = dt.datetime.now().isoformat(timespec="seconds")
        live = (
            Live(
                live_panel(self, 0.0),
                console=console,
                refresh_per_second=2,
                transient=False,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            if not self.args.quiet
            else None
        )

        def tick() -> None:
            t = time.monotonic() - t0
            self._sample_rss(t)
            if live is not None:
                live.update(live_panel(self, t))

        if live is not None:
            live.start()
        try:
            k, replay_due = 0, True
            while time.monotonic() < end and k != self.args.max_runs:
                job = self._job(k)
                k += 1
                t_run = time.monotonic()
                timeout_s, own = self._limit(end)
                r = self._run(job, timeout_s, tick)
                if r["ended"] == "timeout" and not own:  # the budget ran out mid-run: not its fault
                    self.cut += 1
                    shutil.rmtree(r["run_dir"], ignore_errors=True)
                    break
                row = self._record(job, r, time.monotonic() - t_run)
                replay_due = replay_due or (k - 1) % REPLAY_EVERY == 0
                # an ERROR run may have stopped on a clock (its timeout): not the seed's alone;
                # a run its worker did not finish has no digest to compare
                if replay_due and r["verdict"] != ERROR and r["digest"] and time.monotonic() < end:
                    self._replay(job, r, row, end)
                    replay_due = False
                self._keep(job, r, row)
                tick()
                if self.keeper.full():
                    self.stopped = (
                        f"stopped at the disk cap after {self.runs} runs: "
                        f"{size_text(self.keeper.used())} of --max-disk {size_text(self.cap)} "
                        "written, and the next run might not fit"
                    )
                    break
        finally:
            tick()
            if live is not None:
                live.stop()
        elapsed = time.monotonic() - t0
        code = self.exit_code()
        self.ledger.soak(
            id=self.id,
            started=started,
            finished=dt.datetime.now().isoformat(timespec="seconds"),
            commit_sha=self.commit,
            device=self.device,
            budget_s=self.budget,
            shard=f"{self.shard[0]}/{self.shard[1]}",
            seed_start=self.seed_start,
            runs=self.runs,
            exit_code=code,
            folder=str(self.dir),
        )
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
        summary = summary_of(self, elapsed, code)
        for _ in range(2):  # the second pass counts the summary itself in the disk used
            (self.dir / "soak.json").write_text(json.dumps(summary, indent=1, default=str))
            (self.dir / "soak-summary.md").write_text(render_md(summary), encoding="utf-8")
            (self.dir / "soak-summary.html").write_text(render_html(summary), encoding="utf-8")
            summary["disk"]["used_bytes"] = self.disk_used()
        print(render_md(summary, brief=True))
        print(f"summary: {self.dir / 'soak-summary.md'}  ({self.dir / 'soak-summary.html'})")
        if self.stopped:
            print(
                f"kvchaos soak: {self.stopped}; the summary and the ledger are written "
                f"(exit {code}). Raise --max-disk or lower --keep to soak longer.",
                file=sys.stderr,
            )
        return code

    def disk_used(self) -> int:
        """What this soak wrote: its folder and the ledger's growth (as du counts)."""
        ledger = max(0, ledger_bytes(self.ledger_file) - self.keeper.ledger_base)
        return du_bytes(self.dir) + ledger

    def exit_code(self) -> int:
        for v in (MISSED, FAIL):
            if self.counts[v]:
                return EXIT_CODES[v]
        if self.nondet:
            return EXIT_NONDETERMINISM
        if self.counts[ERROR]:
            return EXIT_CODES[ERROR]
        return EXIT_DISK_CAP if self.stopped else 0


# -- the command ------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--budget", required=True, help="how long to soak: 90s, 5m, 1h30m")
    options.add(p, "device", default="auto")
    p.add_argument(
        "--shard",
        default="1/1",
        metavar="I/N",
        help="take every N-th seed, offset I-1 (default 1/1)",
    )
    options.add(p, "timeout", default=120.0, flag="--per-run-timeout")
    options.add(p, "report_dir", default=options.DEFAULT_REPORT_DIR, lead="the soak's folder")
    p.add_argument(
        "--seed-start",
        type=inputs.flag(inputs.seed),
        default=None,
        metavar="N",
        help="first seed (default: after the highest seed in the ledger)",
    )
    p.add_argument(
        "--ledger",
        type=options.PATH,
        default=None,
        metavar="PATH",
        help="SQLite seed ledger (default: REPORT_DIR/ledger.sqlite)",
    )
    p.add_argument(
        "--keep",
        default="20",
        metavar="N",
        help="passing runs whose folders are kept, a seeded sample over the soak (default 20; "
        "0: none; all: every one, within --max-disk); runs with findings are always kept",
    )
    p.add_argument(
        "--max-disk",
        default="500MB",
        metavar="SIZE",
        help="the most this soak may write, its folder and the ledger's growth: 500MB, 2GB, "
        "750MiB (default 500MB); past 80%% only findings are kept, then the soak stops (exit 15)",
    )
    p.add_argument(
        "--plots",
        choices=("none", "incidents", "all"),
        default=os.environ.get("KVCHAOS_PLOTS", "none"),
        help="plots in each run's report.html (default: none, or $KVCHAOS_PLOTS; "
        "`kvchaos analyze RUN_DIR` draws them later)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no live display, only the summary")
    # tests the hang kill; and bound a soak by its runs, so a busy machine runs the same ones
    p.add_argument("--inject-hang-every", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-runs", type=int, default=None, help=argparse.SUPPRESS)


def main(args) -> int:
    return Soak(args).run()
