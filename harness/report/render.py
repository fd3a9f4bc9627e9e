"""Write one run's reports: incident-NNN.md, results.json (with its incidents) and report.html."""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvchaos.harness.check.verdict import PASS, current
from kvchaos.harness.history.log import read_history
from kvchaos.harness.history.results import write_atomic, write_results
from kvchaos.harness.report.incident import build_incidents
from kvchaos.harness.report.paths import rel_command
from kvchaos.harness.report.plots import plot_run
from kvchaos.harness.report.view import RunView

TEMPLATES = Path(__file__).resolve().parent / "templates"
# KVCHAOS_PLOTS: which runs get the matplotlib figure (about 0.25 s of CPU each) in report.html:
# findings (the default: every run with an incident, caught detections included, or that did not
# PASS), failures (only runs that did not PASS), incidents, all, none.
# `kvchaos analyze` and `kvchaos shrink` always draw it.
PLOTS_ENV = "KVCHAOS_PLOTS"
PLOT_MODES = ("findings", "failures", "incidents", "all", "none")
# KVCHAOS_BATCH: a batch id publish() records in results.json when its caller gives none
BATCH_ENV = "KVCHAOS_BATCH"

# -- rendering ------------------------------------------------------------------------------

_ENV = None


def template_env():
    global _ENV
    if _ENV is None:
        import jinja2
        import markupsafe

        _ENV = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(TEMPLATES)),
            autoescape=lambda n: ".html" in (n or ""),
            trim_blocks=True,
            lstrip_blocks=True,
            undefined=jinja2.StrictUndefined,
        )
        _ENV.filters["ms"] = lambda x: "-" if x is None else f"{x:.2f} ms"
        _ENV.filters["g"] = lambda x: "-" if x is None else f"{x:.3g}"
        _ENV.filters["reqs"] = lambda rs: "; ".join(
            f"{a['req']} ({', '.join(a['how'])})" for a in rs
        )
        _ENV.filters["cell"] = lambda s: str(s).replace("|", "\\|").replace("\n", " ")
        # `code` in plain text (a status line written for the markdown) as <code> in HTML
        _ENV.filters["ticks"] = lambda s: markupsafe.Markup(
            re.sub(r"`([^`]*)`", r"<code>\1</code>", str(markupsafe.escape(s)))
        )
    return _ENV


def write_reports(
    run_dir: Path | str, results: dict, events: list[dict] | None = None, plots: bool | None = None
) -> list[Path]:
    """Incidents (incident-NNN.md and results["incidents"]), results.json and report.html for a run.
    plots=None: as KVCHAOS_PLOTS says (default: a figure for every run with a finding)."""
    run_dir = Path(run_dir)
    mode = os.environ.get(PLOTS_ENV) or "findings"
    if plots is None and mode not in PLOT_MODES:
        raise ValueError(f"{PLOTS_ENV}={mode!r}: expected one of {', '.join(PLOT_MODES)}")
    if events is None:
        events = read_history(run_dir / "history.jsonl")
    v = RunView(events)
    results["verdict"] = current(results["verdict"])  # FALSE_ALARM in older runs reads as FAIL
    incidents = build_incidents(results, events, run_dir)
    results["incidents"] = incidents
    results.setdefault("started", v.start.get("time"))
    for old in run_dir.glob("incident-*.md"):
        old.unlink()
    written = []
    tpl = template_env().get_template("incident.md.j2")
    for inc in incidents:
        p = run_dir / inc["file"]
        write_atomic(p, tpl.render(i=inc, r=results))
        written.append(p)
    written.append(write_results(run_dir, results))
    if plots is None:
        plots = {
            "findings": bool(incidents) or results["verdict"] != PASS,
            "failures": results["verdict"] != PASS,
            "incidents": bool(incidents),
            "all": True,
            "none": False,
        }[mode]
    figure = (
        plot_run(v, results.get("fault_verify") or {}, incidents) if plots and v.steps else None
    )
    samples = [st["telemetry"] for st in v.steps if "telemetry" in st]
    telemetry = {
        "status": v.start.get("telemetry"),
        "summary": (v.end or {}).get("telemetry"),
        "last": samples[-1] if samples else None,
    }
    html = (
        template_env()
        .get_template("report.html.j2")
        .render(
            r=results,
            replay=rel_command(results.get("replay"), base=Path(run_dir).parent),
            incidents=incidents,
            figure=figure,
            checks=results.get("checkers", []),
            plots_env=PLOTS_ENV,
            telemetry=telemetry,
            files=sorted(
                p.name for p in run_dir.iterdir() if p.is_file() and not p.name.startswith(".")
            ),
        )
    )
    write_atomic(run_dir / "report.html", html)
    written.append(run_dir / "report.html")
    return written


def publish(result, index: bool = True, batch: str | None = None):
    """Render a finished run's reports (incidents, report.html) and point report_dir/latest at it;
    index=True also rebuilds report_dir/index.html (a batch does that once at its end). batch (or
    $KVCHAOS_BATCH) names the batch the run belongs to; the index groups by it. A broken report
    never costs the run its history and results: the error is kept in results.json."""
    from kvchaos.harness.report.index import point_latest, update_index

    run_dir = result.run_dir
    if run_dir is None:
        return result
    batch = batch or os.environ.get(BATCH_ENV)
    if batch and not result.results.get("batch"):
        result.results["batch"] = batch
    try:
        write_reports(run_dir, result.results, result.events)
        if index:
            update_index(run_dir.parent, newest=run_dir)
        else:
            point_latest(run_dir.parent, run_dir.name)
    except Exception as ex:
        result.results["report_error"] = f"{type(ex).__name__}: {ex}"
        # atomic: on a full disk the run's own results.json stays whole
        write_results(run_dir, result.results)
    return result
