"""The index across runs (report_dir/index.html, index.json) and the `latest` link."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from kvchaos.harness.check.verdict import current
from kvchaos.harness.history.results import write_atomic
from kvchaos.harness.report.render import template_env
from kvchaos.harness.scenario.managers import REFERENCES, canonical_spec

# -- index across runs ----------------------------------------------------------------------

INDEX_CACHE = "index.json"
INDEX_ROWS = 500  # index.html lists the newest runs; index.json keeps them all
INDEX_VERSION = 2  # cached entries of another version are read again from results.json
# runs with no recorded batch id: one that starts within this many seconds of the previous one's
# end belongs to its batch (a `kvchaos run`, a pytest session, a soak leave gaps of a report's time)
BATCH_GAP_S = 60.0


def _entry(d: Path) -> dict:
    r = json.loads((d / "results.json").read_text(encoding="utf-8"))
    bm = canonical_spec(r.get("block_manager"))
    return {
        "v": INDEX_VERSION,
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
        "batch": r.get("batch"),
        "device": r.get("device"),
        "tp_mode": r.get("tp_mode"),
        "world_size": r.get("world_size"),
        "block_manager": bm,
        "own_block_manager": bool(bm) and bm not in REFERENCES,
        "faults": _faults(d, r),
    }


def _faults(d: Path, r: dict) -> list[dict]:
    """The run's faults and whether each had its defect planted: from the resolved scenario.toml
    (a run that broke before arming any still lists them), else from fault_verify."""
    try:
        sc = tomllib.loads((d / "scenario.toml").read_text(encoding="utf-8"))
        return [{"name": f["name"], "planted": bool(f.get("defect"))} for f in sc.get("faults", [])]
    except (OSError, ValueError, KeyError, TypeError):
        fv = r.get("fault_verify") or {}
        return [{"name": n, "planted": bool(x.get("planted"))} for n, x in fv.items()]


def _start_ts(e: dict) -> float:
    """When a run started (seconds): its recorded start, else its end less its wall time."""
    try:
        return dt.datetime.fromisoformat(e["time"]).timestamp()
    except (TypeError, ValueError):
        return e["order"] / 1e9 - (e.get("wall_s") or 0)


def batches(rows: list[dict]) -> list[dict]:
    """Rows (newest first) grouped into batches, newest batch first: by the recorded batch id, or
    for runs without one by time, a run joining the previous run's batch when it started within
    BATCH_GAP_S of that one's end."""
    groups: dict[str, list[dict]] = {}
    key, last_end = None, None
    for e in sorted(rows, key=lambda e: (_start_ts(e), e["dir"])):
        if e.get("batch"):
            groups.setdefault(f"id:{e['batch']}", []).append(e)
            continue
        start = _start_ts(e)
        if key is None or last_end is None or start - last_end > BATCH_GAP_S:
            key = f"t:{e['dir']}"
        groups.setdefault(key, []).append(e)
        last_end = max(last_end or 0.0, e["order"] / 1e9)
    out = []
    for k, rs in groups.items():
        rs.sort(key=lambda e: (e["order"], e["dir"]), reverse=True)
        counts: dict[str, int] = {}
        for e in rs:
            counts[e["verdict"]] = counts.get(e["verdict"], 0) + 1
        times = sorted(e["time"] for e in rs if e.get("time"))
        first, last = (times[0], times[-1]) if times else ("?", "?")
        span = first.replace("T", " ") + (f" to {last.split('T')[-1]}" if last != first else "")
        out.append(
            {
                "id": k.split(":", 1)[1] if k.startswith("id:") else None,
                "key": k,
                "span": span,
                "rows": rs,
                "counts": counts,
                "newest": rs[0]["order"],
            }
        )
    out.sort(key=lambda g: g["newest"], reverse=True)
    return out


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
        if not c or c.get("stamp") != stamp or c.get("v") != INDEX_VERSION:
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
    shown = rows[:INDEX_ROWS]
    write_atomic(
        report_dir / "index.html",
        template_env()
        .get_template("index.html.j2")
        .render(
            rows=shown,
            groups=batches(shown),
            counts=counts,
            total=len(rows),
            verdicts=sorted({e["verdict"] for e in shown}),
            scenarios=sorted({e["scenario"] for e in shown if e["scenario"]}),
            faults=sorted({f["name"] for e in shown for f in e["faults"]}),
        ),
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
