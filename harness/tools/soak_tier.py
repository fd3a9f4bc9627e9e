"""The soak's host-tier scenarios: a seed that draws the tier (soak_space.py SPACE["offload"])
stands for one of these instead of a mix, shaped as the built-in offload scenarios are: the
plain reference manager (the tier is its capability), sessions that pause long enough to go
cold, a pool the requests outgrow (preemptions store out), the offload fault's variant, and
sometimes async_free's abort while a restore is in flight."""

from __future__ import annotations

import random
from collections.abc import Callable


def tier_scenario(seed: int, r: random.Random, spec: dict, draw: Callable) -> dict:
    """The scenario dict (the TOML file's shape) of a tier seed; r: the tier's own stream."""
    from kvchaos.faults import REGISTRY

    bs = draw(r, spec["block_size"])
    prompt, out = draw(r, spec["prompt_max"]), draw(r, spec["output_max"])
    width = -(-(prompt + out) // bs) + 2  # every request fits a row
    variant = r.choice(spec["variant"])
    faults = [{"name": "offload", "defect": r.random() < 0.5, "params": {"variant": variant}}]
    if r.random() < spec["load_abort"]:
        cancels = draw(r, spec["cancels"])
        faults.append(
            {
                "name": "async_free",
                "defect": r.random() < 0.5,
                "params": {"variant": "load_abort", "cancels": cancels},
            }
        )
    num_blocks = width * draw(r, spec["pool_rows"])
    engine = {
        "max_prefill_tokens": 32,
        "async_scheduling": variant == "store_before_compute" or r.random() < 0.5,
        "cache": {
            "prefix_caching": False,
            "block_size": bs,
            "num_blocks": num_blocks,
            "max_blocks_per_seq": width,
            "max_num_seqs": 8,
        },
        "offload": {
            "host_blocks": 6 * num_blocks,
            "cold_steps": draw(r, spec["cold_steps"]),
            "latency_steps": draw(r, spec["latency_steps"]),
        },
    }
    think = draw(r, spec["think_steps"])
    workload = {
        "num_requests": draw(r, spec["num_requests"]),
        "arrival_rate": draw(r, spec["arrival_rate"]),
        "prompt_len": {"dist": "uniform", "min": 8, "max": prompt},
        "output_len": {"dist": "uniform", "min": 8, "max": out},
        "think": {
            "share": draw(r, spec["think_share"]),
            "think_steps": {"dist": "uniform", "min": max(1, think // 2), "max": think},
        },
    }
    planted = [f for f in faults if f["defect"]]
    expect: dict = {"outcome": "clean"}
    if planted:
        checkers = {d for f in planted for d in REGISTRY[f["name"]].detectors_for(f["params"])}
        expect = {
            "outcome": "detect",
            "checkers": sorted(checkers),
            "within_steps": {f["name"]: 2 for f in planted},
        }
    mix = ", ".join(f"{f['name']} ({'defect' if f['defect'] else 'trigger'})" for f in faults)
    return {
        "scenario": {
            "name": f"soak-{seed}",
            "description": f"soak seed {seed}: a host KV tier: {mix}",
            "tags": ["soak", "offload"],
            "seeds": [seed],
        },
        "engine": engine,
        "workload": workload,
        "faults": faults,
        "expect": expect,
    }
