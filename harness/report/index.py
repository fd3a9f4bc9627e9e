"""The index across runs (report_dir/index.html, index.json) and the `latest` link."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvchaos.harness.judge.verdict import current
from kvchaos.harness.report.render import template_env, write_atomic

# -- index across runs ----------------------------------------------------------------------

INDEX_CACHE = "index.json"
INDEX_ROWS = 500  # index.html lists the newest runs; index.json keeps them all


def _entry(d: Path) -> dict:
    r = json.loads((d / "results.json").read_text(encoding="utf-8"))
    return {
        "dir": d.name,
        "verdict": current(r.get("verdict")),
        "scenario": r.get("scenario"),
        "seed": r.get("seed"),
        "time": r.get("started"),
        "steps": r.get("steps"),
        "summary": r.get("summary", ""),
        "incidents": len(r.get("incidents", [])),
        "wall_s": r.get("wall_s"),
        "report": (d / "report.html").is_file(),
    }


def update_index(report_dir: Path | str, newest: Path | None = None) -> Path:
    """report_dir/index.html over every run folder, newest first, and report_dir/latest -> the
    newest. Entries are cached in index.json by results.json's mtime, so a folder of thousands of
    runs costs a stat per run, not a parse."""
    report_dir = Path(report_dir)
    cache_path = report_dir / INDEX_CACHE
    try:
        cache = json.loads(cache_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cache = {}
    rows = []
    for d in report_dir.iterdir():
        res = d / "results.json"
        if d.is_symlink() or not d.is_dir() or not res.is_file():
            continue
        hist = d / "history.jsonl"
        stamp = res.stat().st_mtime_ns
        order = hist.stat().st_mtime_ns if hist.is_file() else stamp
        c = cache.get(d.name)
        if not c or c.get("stamp") != stamp:
            try:
                c = {**_entry(d), "stamp": stamp}
            except (OSError, ValueError):  # being written by another process: next time
                continue
        rows.append({**c, "order": order})
    rows.sort(key=lambda e: (e["order"], e["dir"]), reverse=True)
    write_atomic(cache_path, json.dumps({e["dir"]: e for e in rows}, indent=0))
    counts = {}
    for e in rows:
        counts[e["verdict"]] = counts.get(e["verdict"], 0) + 1
    write_atomic(
        report_dir / "index.html",
        template_env()
        .get_template("index.html.j2")
        .render(rows=rows[:INDEX_ROWS], counts=counts, total=len(rows)),
    )
    target = Path(newest).name if newest is not None else (rows[0]["dir"] if rows else None)
    if target:
        point_latest(report_dir, target)
    return report_dir / "index.html"


def point_latest(report_dir: Path, target: str) -> None:
    link = report_dir / "latest"
    tmp = report_dir / f".latest.{os.getpid()}.tmp"
    try:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(target, tmp, target_is_directory=True)
        os.replace(tmp, link)  # atomic: a reader sees the old link or the new one, never none
    except OSError:
        if tmp.is_symlink():
            tmp.unlink()
        write_atomic(report_dir / "LATEST", target + "\n")
