"""Paths as a reader types them: relative to the project (the working directory) when inside it."""

from __future__ import annotations

import shlex
from pathlib import Path


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
