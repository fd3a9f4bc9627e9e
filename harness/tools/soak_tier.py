"""The soak's host-tier scenarios: a seed that draws the tier (soak_space.py SPACE["offload"])
stands for one of these instead of a mix, shaped as the built-in offload scenarios are: the
plain reference manager (the tier is its capability), sessions that pause long enough to go
cold, a pool the requests outgrow (preemptions store out), the offload fault's variant, and
sometimes async_free's abort while a restore is in flight. A share of them (own stream: the
others stay as they were) also draw one or two of the other failure modes beside the tier's,
each planted or remediated on its own, fitted as a mix's (soak_fits.py); a share of those (own
stream again) run on the prefix-caching reference, prompts sharing system prompts (a hit may
find its blocks on the host tier alone), and may add prefix_cache."""

from __future__ import annotations

import random
from collections.abc import Callable


def tier_scenario(seed: int, r: random.Random, space: dict, draw: Callable) -> dict:
    """The scenario dict (the TOML file's shape) of a tier seed; r: the tier's own stream,
    space: the soak's SPACE (its "offload" the tier's ranges, its "faults" a mix's)."""
    from kvchaos.faults import REGISTRY

    spec = space["offload"]
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
    m = random.Random(f"{seed}/soak/offload/mix")
    if m.random() < spec["mix"]["share"]:
        _mix(seed, m, engine, workload, faults, space, draw)
        engine["offload"]["host_blocks"] = 6 * engine["cache"]["num_blocks"]  # as fitted
    planted = [f for f in faults if f["defect"]]
    expect: dict = {"outcome": "clean"}
    if planted:
        checkers = {d for f in planted for d in REGISTRY[f["name"]].detectors_for(f["params"])}
        expect = {
            "outcome": "detect",
            "checkers": sorted(checkers),
            "within_steps": {f["name"]: space["within_steps"][f["name"]] for f in planted},
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


def _mix(
    seed: int, r: random.Random, engine: dict, workload: dict, faults: list, space: dict, draw
) -> None:
    """One or two of the failure modes the tier runs beside (SPACE["offload"]["mix"]), each with
    its params as a mix draws them and planted on its own, fitted so the draw is valid."""
    from kvchaos.harness.tools import soak_fits

    spec = space["offload"]["mix"]
    p = random.Random(f"{seed}/soak/offload/prefix")  # its own stream: the mixes stay as drawn
    prefix = p.random() < spec["prefix"]
    left_out = spec["prefix_left_out" if prefix else "left_out"]
    if prefix:  # the prefix-caching reference, its host tier a prefix cache too
        shared = draw(p, spec["prefix_len"])
        engine["cache"]["prefix_caching"] = True
        engine["cache"]["max_blocks_per_seq"] += -(-shared // engine["cache"]["block_size"])
        len_ = {"dist": "uniform", "min": max(1, shared // 2), "max": shared}
        workload["prefix"] = {"groups": 2, "prefix_len": len_, "share": 0.7}
    can = [n for n in spec["faults"] if n not in {f["name"] for f in faults}]
    names = set(r.sample(can, min(len(can), draw(r, spec["count"]))))
    if prefix and p.random() < spec["prefix_share"]:
        names.add("prefix_cache")
    order = spec["faults"] + spec["prefix_faults"]
    added = {}
    for name in (n for n in order if n in names):  # in the mix's order
        q = p if name == "prefix_cache" else r
        ranges = space["faults"][name]
        params = {k: draw(q, v) for k, v in ranges.items() if k != "variant"}
        v = _variant(q, name, space, draw, left_out)
        params = v if name == "refcount_leak" and v else params | v  # a leak class: its own
        added[name] = {"name": name, "defect": q.random() < space["defect_probability"]}
        added[name]["params"] = params
    faults += added.values()
    engine["tp_size"] = 2 if "ordering_race" in added else 1
    if "table_overflow" in added:
        soak_fits.fit_table_overflow(engine, added["table_overflow"])
    if "prefix_cache" in added:
        soak_fits.fit_prefix_cache(engine, workload, added["prefix_cache"])
    if "variant" in added.get("ordering_race", {}).get("params", {}):
        fault = added["ordering_race"]
        fault["params"].update(space["ordering_race_variants"][fault["params"]["variant"]])
    if "async_free" in added:
        soak_fits.fit_async_free(engine, workload, added["async_free"], False)
    if "variant" in added.get("refcount_leak", {}).get("params", {}):
        soak_fits.fit_leak_variant(engine, added["refcount_leak"])
    preempts = {("async_free", "preempt"), ("refcount_leak", "preempted")}
    if any((f["name"], f["params"].get("variant")) in preempts for f in faults):
        engine["offload"]["preempt"] = False  # a preemption releases (else it stores out)


def _variant(r: random.Random, name: str, space: dict, draw, left_out: dict) -> dict:
    """The fault's variant (its params over the drawn ones), among those the tier runs with
    (left_out: the others), the default's share as a mix's."""
    out = left_out.get(name, ())
    if name == "refcount_leak":
        spec = space["leak_variant"]
        if r.random() < spec["any"]:
            return {}
        v = r.choice([v for v in spec["variant"] if v not in out])
        return {"variant": v, "cancels": draw(r, spec["cancels"])}
    if name == "table_overflow":
        if r.random() < space["table_overflow_default_share"]:
            return {}
        geo = space["table_overflow_geometry"]
        v = r.choice(space["faults"][name]["variant"])
        return {"variant": r.choice(geo["variant"]) if r.random() < geo["share"] else v}
    if name == "ordering_race":  # the default (the first) as the mix leaves it: no param
        v = r.choice([v for v in space["ordering_race_variants"] if v not in out])
        return {} if v == next(iter(space["ordering_race_variants"])) else {"variant": v}
    return {"variant": r.choice([v for v in space["faults"][name]["variant"] if v not in out])}
