"""Timing under noise: timed regions with the cyclic GC off, and timing functions run in rotating
order so all see the same machine noise."""

from __future__ import annotations

import gc
import statistics
import time

perf = time.perf_counter


class NoGC:
    """Timed regions run with the cyclic GC off (as timeit does)."""

    def __enter__(self):
        gc.collect()
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc):
        if self.was:
            gc.enable()


def round_robin(fns: dict, repeats: int) -> dict[str, float]:
    """Run every timing function once per repeat, in rotating order so all see the same noise;
    return each one's median."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(fns[n]())
    return {n: statistics.median(v) for n, v in times.items()}
