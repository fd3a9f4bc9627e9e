"""What `kvchaos run` shows of a batch of runs: the table, the line per run that did not PASS,
where the reports are, and the one JSON document of --format json."""

from __future__ import annotations

from pathlib import Path

import kvchaos
from kvchaos.harness.check.verdict import EXIT_CODES, MEANING, worst
from kvchaos.harness.report.paths import rel_command


def details(r) -> str:
    """A run that is not PASS: what happened and how to see it again."""
    return f"{r.scenario} seed {r.seed}: {r.summary}\n  replay: {replay_of(r)}  run: {r.run_dir}"


def replay_of(r, absolute: bool = False) -> str | None:
    """A run's replay command for its reader: results.json's paths are relative to the report
    folder; here relative to the working directory (or absolute)."""
    base = r.run_dir.parent if r.run_dir else None
    return rel_command(r.results.get("replay"), base=base, absolute=absolute) or None


def where(report_dir: Path, newest, indexed: bool) -> str:
    index = report_dir / "index.html" if indexed else "not updated"
    return f"reports: {report_dir}  index: {index}  latest: {report_dir / 'latest'}" + (
        f" -> {newest.run_dir.name}" if newest.run_dir else ""
    )


def run_doc(results, report_dir: Path, indexed: bool, code: int, interrupted: bool) -> dict:
    """--format json: the batch, one document (paths absolute: CI steps run elsewhere)."""
    where = report_dir.absolute()
    return {
        "kvchaos": kvchaos.__version__,
        "command": "run",
        "verdict": worst([r.verdict for r in results]),
        "exit_code": code,
        "interrupted": interrupted,
        "report_dir": str(where),
        "index": str(where / "index.html") if indexed else None,
        "latest": str(where / "latest"),
        "runs": [
            {
                "scenario": r.scenario,
                "seed": r.seed,
                "verdict": r.verdict,
                "exit_code": EXIT_CODES[r.verdict],
                "summary": r.summary,
                "run_dir": str(r.run_dir.absolute()) if r.run_dir else None,
                "replay": replay_of(r, absolute=True),
                "steps": r.results.get("steps"),
                "time_to_detect_steps": r.results.get("time_to_detect_steps", {}),
                "wall_s": r.results.get("wall_s"),
            }
            for r in results
        ],
    }


def print_table(console, results) -> None:
    from collections import defaultdict

    from rich.markup import escape
    from rich.table import Table

    colour = {"PASS": "green", "INCONCLUSIVE": "yellow"}
    by_sc = defaultdict(list)
    for r in results:
        by_sc[r.scenario].append(r)
    t = Table(title=f"kvchaos: {len(results)} runs")
    for col in ("scenario", "seeds", "verdicts", "time to detect (median steps)", "steps (median)"):
        t.add_column(col)
    for name, rs in by_sc.items():
        counts = defaultdict(int)
        for r in rs:
            counts[r.verdict] += 1
        ttd = sorted(v for r in rs for v in r.results.get("time_to_detect_steps", {}).values())
        steps = sorted(r.results.get("steps", 0) for r in rs)
        t.add_row(
            escape(name),
            str(len(rs)),
            " ".join(f"[{colour.get(k, 'red')}]{k} {v}/{len(rs)}[/]" for k, v in counts.items()),
            str(ttd[len(ttd) // 2]) if ttd else "-",
            str(steps[len(steps) // 2]),
        )
    console.print(t)
    w = worst([r.verdict for r in results])
    console.print(f"overall: [{colour.get(w, 'red')}]{w}[/] ({MEANING[w]})")
