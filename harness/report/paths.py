"""Paths as a reader types them: relative to the project (the working directory) when inside it."""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

MIN_FREE_BYTES = 1 << 20  # a run's folder takes more than this: less is a full disk


def rel(path: str | Path | None, cwd: Path | None = None) -> str | None:
    """`path` relative to `cwd` (default: the working directory) when it lies inside it, else as
    given. Symlinked temporary folders are compared resolved too."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_absolute():
        return str(path)
    base = Path.cwd() if cwd is None else cwd
    for a, b in ((p, base), (p.resolve(), base.resolve())):
        if a.is_relative_to(b):
            return str(a.relative_to(b)) or "."
    return str(path)


def rel_command(cmd: str | None, cwd: Path | None = None) -> str:
    """A shell command with its absolute path arguments (also `--flag=/path`) made relative."""
    if not cmd:
        return cmd or ""
    try:
        words = shlex.split(cmd)
    except ValueError:  # unbalanced quotes: leave it as recorded
        return cmd
    out, changed = [], False
    for w in words:
        flag, eq, val = w.partition("=") if w.startswith("--") else ("", "", w)
        if val.startswith("/"):
            new = rel(val, cwd)
            changed |= new != val
            w = f"{flag}{eq}{new}"
        out.append(w)
    return shlex.join(out) if changed else cmd


def report_dir_problem(d: str | Path) -> str | None:
    """Why runs cannot be written under d (made when missing), in words, or None: d or a folder
    above it is a file (or a device, /dev/null), is read-only, or its disk is full."""
    d = Path(d)
    if d.is_symlink() and not d.exists():
        return f"a broken link (to {os.readlink(d)})"
    if d.exists() and not d.is_dir():
        return "not a folder"
    there = d
    while not there.exists() and there != there.parent:
        there = there.parent
    if not there.is_dir():
        return f"{there} is not a folder"
    if not os.access(there, os.W_OK | os.X_OK):
        return f"{there} is not writable" if there != d else "not writable"
    free = shutil.disk_usage(there).free
    if free < MIN_FREE_BYTES:
        return f"no space left on its disk ({free >> 10} KiB free)"
    return None
