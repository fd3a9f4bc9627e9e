"""Where a run's code came from, for results.json: kvchaos's version, and the block manager's (the
commit of the git checkout its file sits in, else its distribution's version). Never in the
history: a digest judges what ran, not whose build it was."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from kvchaos.harness.scenario.managers import REFERENCES, canonical_spec

UNKNOWN = "unknown"


def kvchaos_version() -> str:
    import kvchaos

    return kvchaos.__version__


def _git(folder: str, *args: str) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(
            ["git", "-C", folder, *args], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=64)
def git_version(file: str) -> tuple[str, bool] | None:
    """("git SHA[-dirty]", tracked) for a file inside a git checkout, None outside one (or
    without git): HEAD, "-dirty" when a tracked file differs from it or the file itself is not
    tracked (then HEAD is not what ran); tracked False for a file git does not know (a package
    in a virtualenv inside the checkout, an untracked module)."""
    folder = str(Path(file).parent)
    head = _git(folder, "rev-parse", "HEAD")
    if head is None or head.returncode != 0 or not head.stdout.strip():
        return None
    known = _git(folder, "ls-files", "--error-unmatch", Path(file).name)
    tracked = known is not None and known.returncode == 0
    status = _git(folder, "status", "--porcelain", "--untracked-files=no")
    changed = status is not None and status.returncode == 0 and bool(status.stdout.strip())
    return f"git {head.stdout.strip()}{'-dirty' if changed or not tracked else ''}", tracked


@functools.lru_cache(maxsize=64)
def distribution_version(top: str) -> str | None:
    """'dist 1.2.3' of the installed distribution that provides the import name top."""
    names = metadata.packages_distributions().get(top) or []
    for name in names:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def _module_file(module: str) -> str | None:
    """The file of a module, loaded or not (finding it imports its parent packages at most)."""
    if module.endswith(".py"):  # a manager named by its file
        return module
    mod = sys.modules.get(module)
    if mod is not None:
        return getattr(mod, "__file__", None)
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec and spec.has_location else None


def manager_version(spec: str | None, obj=None) -> str:
    """The block manager's version: kvchaos's for its own managers (the references, the
    adapters), else the commit of the git checkout its module's file is tracked in ("git
    SHA[-dirty]"), else the version of the distribution its top-level package comes from ("dist
    1.2.3"), else the checkout's commit marked dirty (a file git does not track), else
    "unknown". obj: the loaded class or factory (its module names the file)."""
    spec = canonical_spec(spec)
    module = getattr(obj, "__module__", None) or (spec or "").rpartition(":")[0]
    if not spec or spec in REFERENCES or module == "kvchaos" or module.startswith("kvchaos."):
        return f"kvchaos {kvchaos_version()}"
    file = _module_file(module)
    found = git_version(str(Path(file).resolve())) if file and Path(file).exists() else None
    if found and found[1]:  # a file of the checkout: its commit is what ran
        return found[0]
    dist = None if module.endswith(".py") else distribution_version(module.split(".")[0])
    return dist or (found[0] if found else UNKNOWN)
