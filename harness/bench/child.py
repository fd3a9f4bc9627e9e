"""Child processes of the GPU check: run one under a time limit in its own process group, killing
the whole group when it runs past the limit."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root


def tail(s: str, n: int) -> str:
    return s if len(s) <= n else "..." + s[-n:]


def run_limited(
    cmd: list[str], timeout: float, env=None, cwd=None
) -> subprocess.CompletedProcess | None:
    """Runs cmd in its own process group; on timeout kills the whole group and returns None."""
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd or ROOT,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        kill_group(p)
        return None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def kill_group(p: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        try:
            p.communicate(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
