"""Soak: run randomised scenarios until a time budget is spent.

Each seed picks a mix of triggers, planted defects and workload parameters within the ranges in
SPACE (soak_space.py), writes the scenario as TOML and runs it in a worker process; a run that
hangs is killed at its timeout and recorded as ERROR, and the soak goes on. Every run goes into a
seed ledger (SQLite) that persists across nights. A sample of runs (5%, from the first run that is
not an ERROR) is replayed and its history digest compared: a mismatch is NONDETERMINISM, never
retried. At the end: soak-summary.md / .html in the soak's folder, incidents deduplicated by
fingerprint (label, failure mode, checker, finding kind) with the first and fastest seed of each.

Exit codes: 0 nothing unexpected (PASS / INCONCLUSIVE only), 10 MISSED, 11 FAIL,
14 nondeterminism, 13 ERROR (in that order of precedence), 2 bad input.

  kvchaos soak --budget 30m --device cuda --shard 1/4 --per-run-timeout 120
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

from kvchaos.harness.judge.verdict import ERROR, EXIT_CODES, FAIL, MISSED, PASS
from kvchaos.harness.tools.ledger import Ledger
from kvchaos.harness.tools.soak_space import generate_scenario
from kvchaos.harness.tools.soak_summary import (
    EXIT_NONDETERMINISM,
    NONDETERMINISM,
    exit_meaning,
    live_panel,
    render_html,
    render_md,
)
from kvchaos.harness.tools.worker import Worker, killed_run

REPLAY_EVERY = 20  # every 20th run (the first included; an ERROR passes it on) is replayed: 5%
KILL_GRACE_S = 5.0  # past the soft per-run timeout, the worker is killed
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


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' (1 <= I <= N): this machine takes the seeds s with s % N == I - 1."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ValueError(f"--shard {text!r}: expected I/N with 1 <= I <= N, e.g. 2/4")
    return int(m.group(1)), int(m.group(2))


def shard_seed(seed_start: int, k: int, shard: tuple[int, int]) -> int:
    i, n = shard
    return seed_start + k * n + (i - 1)


# -- the soak ---------------------------------------------------------------------------------
class Soak:
    def __init__(self, args) -> None:
        import psutil

        from kvchaos.harness.judge.runner import git_commit, resolve_device

        self.budget = parse_budget(args.budget)
        self.shard = parse_shard(args.shard)
        if args.per_run_timeout <= 0:
            raise ValueError(f"--per-run-timeout {args.per_run_timeout}: must be > 0")
        if args.inject_hang_every is not None and args.inject_hang_every < 1:
            raise ValueError(f"--inject-hang-every {args.inject_hang_every}: must be >= 1")
        self.args = args
        # the worker inherits this: a matplotlib figure per incident run would triple a soak's cost
        os.environ["KVCHAOS_PLOTS"] = args.plots
        self.device = resolve_device(args.device)
        self.commit = git_commit()
        report_dir = Path(args.report_dir)
        self.ledger_file = Path(args.ledger) if args.ledger else report_dir / "ledger.sqlite"
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
        (self.dir / "scenarios").mkdir()
        self.worker = Worker()
        self.proc = psutil.Process()
        self.counts: Counter = Counter()
        self.incidents: dict[tuple, dict] = {}
        self.unexpected: list[dict] = []  # capped: the ledger has them all
        self.nondet: list[dict] = []
        self.runs = self.steps = self.replays = self.cut = 0
        self.first_seed = self.last_seed = None
        self.rss: dict = {}
        self._last_rss = 0.0

    # -- one run ----------------------------------------------------------------------------
    def _job(self, k: int) -> dict:
        from kvchaos.harness.judge.scenario import parse_scenario
        from kvchaos.harness.judge.toml_writer import dumps

        seed = shard_seed(self.seed_start, k, self.shard)
        data = generate_scenario(seed)
        path = self.dir / "scenarios" / f"soak-{seed}.toml"
        parse_scenario(data, str(path))  # the generator's output must be a valid scenario
        path.write_text(dumps(data), encoding="utf-8")
        hang = (
            self.args.inject_hang_every is not None and (k + 1) % self.args.inject_hang_every == 0
        )
        return {
            "op": "run",
            "seed": seed,
            "scenario": data,
            "scenario_path": str(path),
            "device": self.device,
            "runs_dir": str(self.dir / "runs"),
            "timeout_s": self.args.per_run_timeout,
            "hang": hang,
        }

    def _deadline(self, end: float) -> tuple[float, bool]:
        own = time.monotonic() + self.args.per_run_timeout + KILL_GRACE_S
        return min(own, end), own <= end

    def _record(self, job: dict, r: dict, duration: float) -> int:
        seed = job["seed"]
        self.runs += 1
        self.steps += r["steps"]
        self.counts[r["verdict"]] += 1
        self.first_seed = seed if self.first_seed is None else self.first_seed
        self.last_seed = seed
        cited = False  # first or fastest of a fingerprint: the summary points at this run
        for x in r["fingerprints"]:
            fp = tuple(x["fp"])
            inc = self.incidents.get(fp)
            if inc is None:
                cited = True
                self.incidents[fp] = {
                    "count": 1,
                    "first_seed": seed,
                    "first_run": r["run_dir"],
                    "fastest_seed": seed,
                    "fastest_step": x["step"],
                    "fastest_run": r["run_dir"],
                }
            else:
                inc["count"] += 1
                if x["step"] < inc["fastest_step"]:
                    cited = True
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
        if self.args.keep == "incidents" and r["verdict"] == PASS and not cited:
            (Path(r["run_dir"]) / "history.jsonl").unlink(
                missing_ok=True
            )  # disk, not memory: nights are long
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

    def _replay(self, job: dict, r: dict, row: int, end: float, tick) -> None:
        if not self.worker.ready(end, tick):
            self.ledger.set_determinism(row, "cut")
            return
        deadline, own = self._deadline(end)
        status, got = self.worker.call({**job, "op": "replay", "hang": False}, deadline, tick)
        if status == "timeout" and not own:
            self.ledger.set_determinism(row, "cut")
            return
        self.replays += 1
        got = got if status == "ok" else None
        same = got is not None and got["digest"] == r["digest"]
        self.ledger.set_determinism(row, "identical" if same else "mismatch")
        if not same:
            self.nondet.append(
                {
                    "seed": job["seed"],
                    "run_dir": r["run_dir"],
                    "digest": r["digest"],
                    "replay_digest": got["digest"] if got else f"replay {status}",
                    "replay_verdict": got["verdict"] if got else ERROR,
                    "verdict": r["verdict"],
                }
            )
            self.counts[NONDETERMINISM] += 1
            mix = "+".join(sorted(f["name"] for f in job["scenario"].get("faults", []))) or "-"
            fp = (NONDETERMINISM, mix, "replay", "digest_mismatch")
            inc = self.incidents.setdefault(
                fp,
                {
                    "count": 0,
                    "first_seed": job["seed"],
                    "first_run": r["run_dir"],
                    "fastest_seed": job["seed"],
                    "fastest_step": r["steps"],
                    "fastest_run": r["run_dir"],
                },
            )
            inc["count"] += 1

    # -- the loop ---------------------------------------------------------------------------
    def _sample_rss(self, t: float) -> None:
        if t - self._last_rss < RSS_SAMPLE_EVERY_S and self.rss:
            return
        self._last_rss = t
        soak, worker = self.proc.memory_info().rss, self.worker.rss()
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

    def run(self) -> int:
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True)
        t0 = time.monotonic()
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
            while time.monotonic() < end:
                if not self.worker.ready(end, tick):
                    break
                job = self._job(k)
                k += 1
                t_run = time.monotonic()
                deadline, own = self._deadline(end)
                status, r = self.worker.call(job, deadline, tick)
                if status == "timeout" and not own:  # the budget ran out mid-run: not its fault
                    self.cut += 1
                    for d in (self.dir / "runs").glob(f"*-soak-{job['seed']}-s{job['seed']}"):
                        shutil.rmtree(d, ignore_errors=True)
                    break
                if status != "ok":
                    detail = (r or {}).get("worker_error", "")
                    limit_s = self.args.per_run_timeout + KILL_GRACE_S
                    r = killed_run(
                        job, status, detail, self.dir / "runs", limit_s, self.commit, self.device
                    )
                row = self._record(job, r, time.monotonic() - t_run)
                replay_due = replay_due or (k - 1) % REPLAY_EVERY == 0
                # an ERROR run may have stopped on a clock (its timeout): not the seed's alone
                if replay_due and r["verdict"] != ERROR and time.monotonic() < end:
                    self._replay(job, r, row, end, tick)
                    replay_due = False
                tick()
        finally:
            self.worker.stop()
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
        summary = self.summary(elapsed, code)
        (self.dir / "soak.json").write_text(json.dumps(summary, indent=1, default=str))
        (self.dir / "soak-summary.md").write_text(render_md(summary), encoding="utf-8")
        (self.dir / "soak-summary.html").write_text(render_html(summary), encoding="utf-8")
        # the kept runs' index, once (not after every run of the night)
        if (self.dir / "runs").is_dir():
            from kvchaos.harness.report.index import update_index

            try:
                update_index(self.dir / "runs")
            except Exception as e:  # the summary and runs are written; only their listing is not
                print(
                    f"could not write {self.dir / 'runs' / 'index.html'}: {type(e).__name__}: {e}",
                    file=sys.stderr,
                )
        print(render_md(summary, brief=True))
        print(f"summary: {self.dir / 'soak-summary.md'}  ({self.dir / 'soak-summary.html'})")
        return code

    def exit_code(self) -> int:
        for v in (MISSED, FAIL):
            if self.counts[v]:
                return EXIT_CODES[v]
        if self.nondet:
            return EXIT_NONDETERMINISM
        return EXIT_CODES[ERROR] if self.counts[ERROR] else 0

    def summary(self, elapsed: float, code: int) -> dict:
        rss = dict(self.rss)
        if "baseline_mb" in rss:
            rss["growth_pct"] = round(
                100 * (rss["end_mb"] - rss["baseline_mb"]) / rss["baseline_mb"], 2
            )
            if rss.get("worker_baseline_mb"):
                rss["worker_growth_pct"] = round(
                    100
                    * (rss["worker_end_mb"] - rss["worker_baseline_mb"])
                    / rss["worker_baseline_mb"],
                    2,
                )
        incidents = [
            {"fingerprint": list(fp), **v}
            for fp, v in sorted(
                self.incidents.items(), key=lambda kv: (kv[0][0] == "DETECTED", -kv[1]["count"])
            )
        ]
        argv = [
            "kvchaos",
            "soak",
            "--budget",
            self.args.budget,
            "--device",
            self.device,
            "--shard",
            f"{self.shard[0]}/{self.shard[1]}",
            "--seed-start",
            str(self.seed_start),
            "--per-run-timeout",
            f"{self.args.per_run_timeout:g}",
        ]
        return {
            "soak": self.id,
            "folder": str(self.dir),
            "commit": self.commit,
            "device": self.device,
            "budget_s": self.budget,
            "elapsed_s": round(elapsed, 1),
            "shard": list(self.shard),
            "seed_start": self.seed_start,
            "first_seed": self.first_seed,
            "last_seed": self.last_seed,
            "runs": self.runs,
            "cut_at_budget_end": self.cut,
            "steps": self.steps,
            "steps_per_s": round(self.steps / elapsed, 1) if elapsed else 0,
            "verdicts": dict(self.counts),
            "determinism": {"replayed": self.replays, "mismatches": self.nondet},
            "incidents": incidents,
            "unexpected": self.unexpected,
            "rss": rss,
            "exit_code": code,
            "exit_meaning": exit_meaning(code),
            "command": " ".join(argv),
            "ledger": str(self.ledger_file),
            "injected_hang_every": self.args.inject_hang_every,
        }


# -- the command ------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--budget", required=True, help="how long to soak: 90s, 5m, 1h30m")
    p.add_argument(
        "--device", default="auto", help="auto (cuda when present, else cpu), cpu, cuda, cuda:N"
    )
    p.add_argument(
        "--shard",
        default="1/1",
        metavar="I/N",
        help="take every N-th seed, offset I-1 (default 1/1)",
    )
    p.add_argument(
        "--per-run-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help=f"a run still going after S s is stopped, and killed {KILL_GRACE_S:g} s later "
        "(default 120)",
    )
    p.add_argument(
        "--report-dir", default="reports", help="the soak's folder goes here (default: reports)"
    )
    p.add_argument(
        "--seed-start",
        type=int,
        default=None,
        metavar="N",
        help="first seed (default: after the highest seed in the ledger)",
    )
    p.add_argument(
        "--ledger",
        default=None,
        metavar="PATH",
        help="SQLite seed ledger (default: REPORT_DIR/ledger.sqlite)",
    )
    p.add_argument(
        "--keep",
        choices=("incidents", "all"),
        default="incidents",
        help="keep every run's history.jsonl (all), or only those of runs that are not PASS or are "
        "the first or fastest of a fingerprint (incidents, the default)",
    )
    p.add_argument(
        "--plots",
        choices=("none", "incidents", "all"),
        default=os.environ.get("KVCHAOS_PLOTS", "none"),
        help="plots in each run's report.html (default: none, or $KVCHAOS_PLOTS; "
        "`kvchaos analyze RUN_DIR` draws them later)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no live display, only the summary")
    # tests the hang kill
    p.add_argument("--inject-hang-every", type=int, default=None, help=argparse.SUPPRESS)


def main(args) -> int:
    return Soak(args).run()
