"""Where a soak stands while it runs: on a terminal a live frame; off one (a log, cron, CI) one line
a minute (runs, verdict counts, new incidents, the time left); the summary rewritten as it goes
(a killed soak leaves a readable one); and the memory of the soak and its workers, sampled."""

from __future__ import annotations

import contextlib
import sys
import time

import psutil

from kvchaos.harness.check.verdict import INCONCLUSIVE, PASS
from kvchaos.harness.tools.ledger import size_text
from kvchaos.harness.tools.soak_summary import duration_text

LOG_EVERY_S = 60.0  # one progress line a minute off a terminal
SUMMARY_EVERY_S = 60.0  # the summary rewritten as often
RSS_SAMPLE_EVERY_S = 5.0
RSS_BASELINE_S = 60.0  # "after the first minute"


def live_panel(soak, t: float):
    """The live display's table: where the soak stands t s in."""
    from rich.table import Table

    tab = Table.grid(padding=(0, 2))
    tab.add_column(style="bold")
    tab.add_column()
    colour = {PASS: "green", INCONCLUSIVE: "yellow"}
    tab.add_row(
        "elapsed",
        f"{duration_text(t)} / {duration_text(soak.budget)}  "
        f"({min(100, 100 * t / soak.budget):.0f}%)",
    )
    tab.add_row(
        "runs",
        f"{soak.runs}  (determinism replays {soak.replays}, mismatches {len(soak.nondet)}; "
        f"{soak.executor_line()})",
    )
    tab.add_row(
        "verdicts",
        "  ".join(f"[{colour.get(v, 'red')}]{v} {n}[/]" for v, n in sorted(soak.counts.items()))
        or "-",
    )
    unexpected = sum(1 for fp in soak.incidents if fp[0] != "DETECTED")
    tab.add_row("incidents", f"{len(soak.incidents)} fingerprints ({unexpected} unexpected)")
    tab.add_row("steps/s", f"{soak.steps / t:.0f}" if t > 0 else "-")
    k = soak.keeper
    tab.add_row(
        "disk",
        f"{size_text(k.used())} of {size_text(k.cap)}, {len(k.kept)} runs kept "
        f"({len(k.sample)} passing), {k.deleted} deleted"
        + ("  [yellow]passing runs no longer kept[/]" if k.passing_closed_at else ""),
    )
    tab.add_row(
        "RSS",
        f"soak {soak.rss.get('end_mb', 0):.0f} MiB, "
        f"worker {soak.rss.get('worker_end_mb', 0):.0f} MiB",
    )
    return tab


def log_line(soak, t: float) -> str:
    """One progress line for a log: where the soak stands t s in."""
    verdicts = ", ".join(f"{v} {n}" for v, n in sorted(soak.counts.items())) or "none yet"
    new, soak.new_incidents = soak.new_incidents, 0
    left = max(0.0, soak.budget - t)
    if soak.args.max_runs and soak.runs:  # bounded by its runs: the rate says when it ends
        left = min(left, (soak.args.max_runs - soak.session_runs) * t / max(soak.session_runs, 1))
    return (
        f"kvchaos soak {duration_text(t)}/{duration_text(soak.budget)}: {soak.runs} runs "
        f"({verdicts}), {new} new incidents ({len(soak.incidents)} fingerprints), "
        f"ETA {duration_text(left)}"
    )


class Progress:
    """The soak's display and its summary as it goes; tick() as often as the soak looks up."""

    def __init__(self, soak, quiet: bool) -> None:
        from rich.console import Console

        self.soak = soak
        self.console = Console(stderr=True)
        self.live = None
        self.log = not quiet and not self.console.is_terminal
        self.proc = psutil.Process()
        self._last_rss = 0.0
        self._last_log = self._last_summary = 0.0
        self._wrote = False
        if not quiet and self.console.is_terminal:
            from rich.live import Live

            self.live = Live(
                live_panel(soak, 0.0),
                console=self.console,
                refresh_per_second=2,
                transient=False,
                redirect_stdout=False,
                redirect_stderr=False,
            )

    def start(self) -> None:
        self._last_log = self._last_summary = time.monotonic()
        if self.live is not None:
            self.live.start()

    def tick(self) -> None:
        now = time.monotonic()
        t = now - self.soak.t0
        self.sample_rss(t)
        if self.live is not None:
            self.live.update(live_panel(self.soak, t))
        if self.log and now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            print(log_line(self.soak, t), file=sys.stderr, flush=True)
        if now - self._last_summary >= SUMMARY_EVERY_S or (self.soak.runs and not self._wrote):
            self._last_summary, self._wrote = now, True  # after the first run, then each minute
            self.soak.write_summary(final=False)

    def stop(self) -> None:
        self.tick()
        if self.live is not None:
            self.live.stop()
            self.console.line()  # the frame's last line ends before the summary begins
        elif self.log:
            print(log_line(self.soak, time.monotonic() - self.soak.t0), file=sys.stderr)

    # -- memory ---------------------------------------------------------------------------------
    def sample_rss(self, t: float) -> None:
        rss = self.soak.rss
        if t - self._last_rss < RSS_SAMPLE_EVERY_S and rss:
            return
        self._last_rss = t
        soak, worker = self.proc.memory_info().rss, self._worker_rss()
        rss.setdefault("start_mb", soak / 2**20)
        rss["peak_mb"] = max(rss.get("peak_mb", 0), soak / 2**20)
        rss["worker_peak_mb"] = max(rss.get("worker_peak_mb", 0), worker / 2**20)
        # the baseline is the first sample after the first minute (or a fifth of a shorter budget)
        if "baseline_mb" not in rss and t >= min(RSS_BASELINE_S, self.soak.budget / 5):
            rss.update(
                baseline_mb=soak / 2**20,
                baseline_at_s=round(t, 1),
                worker_baseline_mb=worker / 2**20,
            )
        rss.update(end_mb=soak / 2**20, worker_end_mb=worker / 2**20)

    def _worker_rss(self) -> int:
        """The largest child: the run's worker while one runs, else the fork server."""
        sizes = [0]
        for p in self.proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):  # it ended meanwhile
                sizes.append(p.memory_info().rss)
        return max(sizes)
