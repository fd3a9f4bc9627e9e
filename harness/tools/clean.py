"""Clean: delete the run folders older than an age from a report folder, then rebuild its index.

  kvchaos clean --older-than 7d                      # reports/: runs last written 7+ days ago
  kvchaos clean --report-dir ci-reports --older-than 12h --dry-run   # list them, delete nothing

A run folder is a folder right in the report folder that holds results.json or history.jsonl
(what `kvchaos run`, pytest and shrink leave); its age is the time since either was last written.
Nothing else is touched: soak folders, the soak ledger, links and files of your own stay. Each
folder removed is printed with its size, then the count and the space freed. Afterwards
REPORT_DIR/index.html (and index.json) list the runs left, and REPORT_DIR/latest still points at
its run when that was kept, else at the newest run left (removed when none is left).

AGE: a number and a unit, s m h d w (seconds, minutes, hours, days, weeks), or several: 1d12h.
"""

from __future__ import annotations

import argparse
import re
import shutil
import time
from pathlib import Path

from kvchaos.harness.scenario import options

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
RUN_FILES = ("results.json", "history.jsonl")  # a folder with one of them is a run folder


def parse_age(text: str) -> float:
    """'7d', '12h', '1d12h', '90s' -> seconds."""
    parts = re.findall(r"(\d+)\s*([smhdw])", text or "")
    if not parts or re.sub(r"(\d+)\s*([smhdw])|\s", "", text):
        raise ValueError(
            f"--older-than {text!r}: expected an age such as 7d, 12h, 30m or 1d12h "
            f"(units: s m h d w)"
        )
    return float(sum(int(n) * UNITS[u] for n, u in parts))


def last_written(run: Path) -> float | None:
    """When a run folder was last written (its results or history), None when it is not one."""
    stamps = [(run / f).stat().st_mtime for f in RUN_FILES if (run / f).is_file()]
    return max(stamps) if stamps else None


def run_folders(report_dir: Path) -> dict[Path, float]:
    """The run folders right in report_dir (links never: latest is one), with when each was
    last written."""
    out = {}
    for d in report_dir.iterdir():
        if d.is_dir() and not d.is_symlink():
            when = last_written(d)
            if when is not None:
                out[d] = when
    return out


def age_text(s: float) -> str:
    for unit in ("d", "h", "m"):
        if s >= UNITS[unit]:
            return f"{s / UNITS[unit]:.1f}{unit}"
    return f"{s:.0f}s"


def clean(report_dir: Path, older_than_s: float, dry_run: bool = False, now=None) -> dict:
    """Remove (or, dry_run, list) the run folders last written more than older_than_s ago;
    rebuild the index over the rest. {"removed": [(name, bytes, age_s)], "kept": n, "freed": b}."""
    from kvchaos.harness.tools.ledger import du_bytes

    now = time.time() if now is None else now
    runs = run_folders(report_dir)
    old = sorted((d for d, t in runs.items() if now - t > older_than_s), key=lambda d: runs[d])
    removed = []
    for d in old:
        size = du_bytes(d)
        if not dry_run:
            shutil.rmtree(d)
        removed.append((d.name, size, now - runs[d]))
    if removed and not dry_run:
        _reindex(report_dir)
    return {
        "removed": removed,
        "kept": len(runs) - len(removed),
        "freed": sum(s for _, s, _ in removed),
    }


def _reindex(report_dir: Path) -> None:
    """index.html over the runs left; latest kept on its run when that is left, else the newest
    left, else gone."""
    from kvchaos.harness.report.index import update_index

    link, text = report_dir / "latest", report_dir / "LATEST"
    target = None
    if link.is_symlink():
        target = Path(link.readlink()).name
    elif text.is_file():
        target = text.read_text(encoding="utf-8").strip()
    keep = target if target and (report_dir / target).is_dir() else None
    if not run_folders(report_dir):
        for p in (link, text):
            if p.is_symlink() or p.is_file():
                p.unlink()
    update_index(report_dir, newest=report_dir / keep if keep else None)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    options.add(p, "report_dir", default=options.DEFAULT_REPORT_DIR, lead="the report folder")
    p.add_argument(
        "--older-than",
        required=True,
        metavar="AGE",
        help="remove run folders last written longer ago than this: 7d, 12h, 30m, 2w, 1d12h",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="list what would be removed, remove nothing"
    )


def main(args) -> int:
    from kvchaos.harness.tools.ledger import size_text

    age = parse_age(args.older_than)
    d = Path(args.report_dir)
    if not d.is_dir():
        raise ValueError(f"--report-dir {d}: {'not a folder' if d.exists() else 'no such folder'}")
    got = clean(d, age, args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for name, size, old in got["removed"]:
        print(f"{verb} {d / name} ({size_text(size)}, last written {age_text(old)} ago)")
    n = len(got["removed"])
    print(
        f"{d}: {verb} {n} run folder{'s' if n != 1 else ''} older than {args.older_than}, "
        f"{size_text(got['freed'])} {'to free' if args.dry_run else 'freed'}; "
        f"{got['kept']} kept"
        + ("" if args.dry_run or not n else f"; index rebuilt: {d / 'index.html'}")
    )
    return 0
