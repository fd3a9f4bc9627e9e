"""Writes the advisor's example traffic, the article's day and night windows, as histograms:

  python docs/advise/make_traffic.py docs/advise      # day.csv and night.csv

day:   1000 requests (prompt + output tokens), lognormal with sigma 0.6, its median tuned so the
       mean is 87 tokens.
night: the same 1000 requests' shape for 200 of them (the day's traffic goes on), and 800 short
       queries ("退货", "发货慢" and a system turn) lognormal with sigma 0.5, their median tuned so
       the mean is 23 tokens.
No randomness: each length is the distribution's quantile at (i + 0.5) / n, rounded (at least 1).
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path
from statistics import NormalDist


def lognormal(median: float, sigma: float, n: int) -> list[int]:
    z = NormalDist()
    return [max(1, round(median * math.exp(sigma * z.inv_cdf((i + 0.5) / n)))) for i in range(n)]


def tuned(make, mean: float) -> float:
    """The median for which make(median)'s lengths have the mean `mean` (bisected)."""
    lo, hi = 1.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lens = make(mid)
        if sum(lens) / len(lens) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


DAY_MEDIAN = tuned(lambda m: lognormal(m, 0.6, 1000), 87)


def day() -> list[int]:
    return lognormal(DAY_MEDIAN, 0.6, 1000)


def night() -> list[int]:
    busy = lognormal(DAY_MEDIAN, 0.6, 200)
    return lognormal(tuned(lambda m: lognormal(m, 0.5, 800) + busy, 23), 0.5, 800) + busy


def histogram_csv(lens: list[int], title: str) -> str:
    mean = sum(lens) / len(lens)
    head = f"# {title}: {len(lens)} requests, mean {mean:.2f} tokens (docs/advise/make_traffic.py)"
    counts = sorted(Counter(lens).items())
    return "\n".join([head, "length,count", *(f"{n},{c}" for n, c in counts)]) + "\n"


def files() -> dict[str, str]:
    return {
        "day.csv": histogram_csv(day(), "day: lognormal sigma 0.6"),
        "night.csv": histogram_csv(night(), "night: 800 short queries, 200 day ones"),
    }


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    for name, text in files().items():
        (out / name).write_text(text, encoding="utf-8")
        print(out / name)
