"""A command's cold start: `kvchaos --help` in a fresh process against `python -c pass`, the same
interpreter, interleaved, so both see the same machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvchaos.harness.bench.timing import perf


def kvchaos_argv() -> list[str]:
    """The console script beside this interpreter, as a user starts it; else `python -m`."""
    script = Path(sys.executable).with_name("kvchaos")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kvchaos"]


def _once(argv: list[str]) -> float:
    t0 = perf()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return perf() - t0


def bench_cold_start(repeats: int) -> dict[str, float]:
    """Seconds to start and exit, each the fastest of `repeats` (a start is only ever slowed by
    the machine, so its floor is its cost): {"help": ..., "python": ...}."""
    argv = {"help": [*kvchaos_argv(), "--help"], "python": [sys.executable, "-c", "pass"]}
    best = {k: float("inf") for k in argv}
    for _ in range(repeats):
        for k, a in argv.items():
            best[k] = min(best[k], _once(a))
    return best
