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


def rel_command(
    cmd: str | None, cwd: Path | None = None, base: Path | None = None, absolute: bool = False
) -> str:
    """A shell command with its path arguments (also `--flag=/path` and a manager's FILE.py:ATTR)
    as a reader types them: relative to `cwd` (default: the working directory) when inside it,
    or absolute (absolute=True). base: the folder the command's relative paths are relative to
    (a run's report folder, as results.json records them); a relative word that names nothing
    under base (a built-in scenario's name, a flag's value) is left as it is."""
    if not cmd:
        return cmd or ""
    try:
        words = shlex.split(cmd)
    except ValueError:  # unbalanced quotes: leave it as recorded
        return cmd
    out, changed = [], False
    for w in words:
        flag, eq, val = w.partition("=") if w.startswith("--") else ("", "", w)
        path, colon, attr = val.rpartition(":")
        if not (colon and path.endswith(".py")):  # a manager's FILE.py:ATTR, else the word
            path, colon, attr = val, "", ""
        new = _reader_path(path, cwd, base, absolute)
        if new is not None and new != path:
            changed = True
            w = f"{flag}{eq}{new}{colon}{attr}"
        out.append(w)
    return shlex.join(out) if changed else cmd


def _reader_path(word: str, cwd: Path | None, base: Path | None, absolute: bool) -> str | None:
    if word.startswith("/"):
        return word if absolute else rel(word, cwd)
    pathish = "/" in word or word.endswith((".toml", ".json", ".py"))
    if base is None or not pathish or not (Path(base) / word).exists():
        return None
    full = os.path.normpath(Path(base).absolute() / word)
    return full if absolute else rel(full, cwd)


# what a report folder kvchaos makes holds first: run folders are output, never a project's source
GITIGNORE = "# made by kvchaos: run folders stay out of git (delete this file to keep them)\n*\n"


def make_report_dir(d: str | Path) -> Path:
    """The report folder d, made (with its parents) when missing; one kvchaos makes gets a
    .gitignore that ignores everything in it, so runs written into a project never show up in
    its `git status`. A folder that exists is left as it is."""
    d = Path(d)
    if not d.is_dir():
        d.mkdir(parents=True, exist_ok=True)
        try:
            with open(d / ".gitignore", "x", encoding="utf-8") as f:
                f.write(GITIGNORE)
        except OSError:  # another process made it first, or the folder is read-only
            pass
    return d


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
