"""Telemetry's cost: the built-in suite with and without it.

python -m kvchaos.harness.bench.telemetry [--seeds N] [--rounds R]"""

from __future__ import annotations

import os
import time

from kvchaos.harness.run.device import resolve_device
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.run.telemetry import Telemetry
from kvchaos.harness.scenario.spec import builtin_scenarios


def measure_overhead(seeds_per_scenario: int | None = None, rounds: int = 1) -> dict:
    """Wall time of the built-in suite with telemetry on (as KVCHAOS_TELEMETRY_* say) and off,
    run by run alternately so both see the same machine noise; the time spent sampling, counted
    exactly; and one sample's cost in isolation."""
    jobs = [
        (sc, seed) for sc in builtin_scenarios() for seed in sc.scenario.seeds[:seeds_per_scenario]
    ]
    wall = {"on": 0.0, "off": 0.0}
    spent = {"samples": 0, "s": 0.0}
    sample = Telemetry.sample

    def counted(
        self,
    ):  # the exact time spent sampling, which the wall-time ratio only bounds through noise
        t0 = time.perf_counter()
        try:
            return sample(self)
        finally:
            spent["samples"] += 1
            spent["s"] += time.perf_counter() - t0

    saved = {k: os.environ.get(k) for k in ("KVCHAOS_TELEMETRY",)}
    Telemetry.sample = counted
    try:
        for r in range(rounds):
            for i, (sc, seed) in enumerate(jobs):
                order = ("on", "off") if (i + r) % 2 == 0 else ("off", "on")
                for mode in order:
                    os.environ["KVCHAOS_TELEMETRY"] = "1" if mode == "on" else "0"
                    t0 = time.perf_counter()
                    run_scenario(sc, seed, device="cpu", report_dir=None)
                    wall[mode] += time.perf_counter() - t0
    finally:
        Telemetry.sample = sample
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    tel = Telemetry("cpu")
    t0 = time.perf_counter()
    for _ in range(2000):
        tel.sample()
    per_sample = (time.perf_counter() - t0) / 2000
    on = Telemetry.from_env("cpu")
    return {
        "every_steps": on.every_steps,
        "min_interval_s": on.min_interval_s,
        "runs_per_mode": len(jobs) * rounds,
        "wall_on_s": round(wall["on"], 3),
        "wall_off_s": round(wall["off"], 3),
        "ratio_on_off": round(wall["on"] / wall["off"], 4),
        "samples": spent["samples"],
        "sampling_s": round(spent["s"], 4),
        "sampling_share_of_wall_on": round(spent["s"] / wall["on"], 5),
        "sample_cost_us_isolated": round(per_sample * 1e6, 1),
    }


if __name__ == "__main__":
    import argparse
    import json

    p = argparse.ArgumentParser(
        description="Telemetry overhead: the built-in suite with and without it."
    )
    p.add_argument(
        "--seeds", type=int, default=None, help="seeds per scenario (default: each scenario's own)"
    )
    p.add_argument("--rounds", type=int, default=1)
    a = p.parse_args()
    resolve_device("cpu")
    print(json.dumps(measure_overhead(a.seeds, a.rounds), indent=1))
