"""The soak's scenario space: the declared ranges SPACE, the scenario a seed draws from it, and
which seeds a shard takes.

Each seed picks a mix of triggers, planted defects and workload parameters within SPACE; the
result is a scenario dict in the TOML file's shape, with the expectation its planted defects imply.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from kvchaos.harness.tools import soak_fits, soak_tier

# The declared ranges every soak scenario is drawn from: (lo, hi) is an inclusive range (ints
# stay ints), a list is a choice, {"subset": [...], "min": k} a random subset of at least k.
# The shapes follow what each failure mode needs to be provoked.
SPACE = {
    "engine": {
        "block_size": [2, 4, 8],
        "max_blocks_per_seq": (8, 24),
        "max_num_seqs": (4, 8),
        "pool_rows": (3, 8),  # num_blocks = pool_rows x max_blocks_per_seq
        "max_prefill_tokens": (16, 64),
        "tp_size": [1, 2],
    },
    "workload": {
        "num_requests": (2, 16),
        "arrival_rate": (0.5, 3.0),
        "prompt_max": (4, 40),
        "output_max": (4, 32),
        "fork_groups": (0, 3),
        "cancel_rate": (0.0, 0.2),
        "cancel_phases": {
            "subset": ["waiting", "prefill", "decode", "preempted", "shared"],
            "min": 0,
        },
    },
    # a stall needs a steady decode-only stretch to measure a trend against its own baseline
    "stall_workload": {"num_requests": (1, 4), "output_len": (70, 100), "prompt_max": (4, 12)},
    # refcount_leak's variant (own stream): "any" (the article's case, as first drawn) or one
    # of the leak classes; the shapes prefix-cache bugs need, rounds each, with a prefix cache
    "leak_variant": {
        "any": 0.4,
        "variant": [
            "prefill",
            "decode",
            "shared",
            "preempted",
            "retry",
            "partial",
            "rate",
            "waiting",
            "engine_abort",
        ],
        "cancels": (1, 3),
    },
    "prefix_shapes": {"probability": 0.5, "rounds": (0, 1)},
    # the stall's variant, drawn from its own stream (the fault's own params stay as drawn)
    "staging_variant": {
        "variant": ["ramp", "from_start", "bursts"],
        "burst_steps": (5, 8),
        "burst_every": (15, 25),
    },
    "prefix_probability": 0.5,  # a workload's prompts share prefixes (system prompts, templates)
    "fault_probability": 0.4,  # each failure mode's trigger is in the mix with this probability
    "defect_probability": 0.5,  # and, when it is, its defect is planted with this one
    "faults": {
        "table_overflow": {
            "at_step": (1, 6),
            "long_requests": (1, 2),
            "overshoot": (1.1, 2.0),
            "boundary": [True, False],
            "neighbours": (1, 4),
            # drawn on its own stream (OWN_STREAM_PARAMS), the default this share of the time
            "variant": [
                "article",
                "off_by_one",
                "floor_width",
                "stride_mismatch",
                "last_row",
                "chunked_growth",
            ],
        },
        "refcount_leak": {
            "cancel_phases": {"subset": ["prefill", "decode", "shared"], "min": 1},
            "fraction": (0.5, 1.0),
            "storm_step": (4, 16),
            "storm_fraction": (0.2, 0.8),
        },  # phase cancels alone rarely land
        "staging_stall": {
            "at_step": (20, 30),
            "ramp_steps": (6, 16),
            "plateau_us": (2000.0, 5000.0),
        },
        "ordering_race": {"lag_steps": (1, 2), "probability": (0.2, 0.6), "from_step": (2, 5)},
        "prefix_cache": {
            "variant": ["partial_key", "weak_key", "evict_referenced", "stale_revive"],
            "pairs": (1, 2),
            "pressure_tokens": [0],
        },
        "async_free": {"variant": ["finish", "abort", "preempt", "staging"], "cancels": (2, 6)},
    },
    # the table_overflow variant: its default (unchecked) this share of the time
    "table_overflow_default_share": 0.4,
    # the kernel-geometry variants (added later), drawn on a stream of their own in this share of
    # a non-default draw: every other seed's variant stays what it was
    "table_overflow_geometry": {
        "variant": ["slot_past_pool", "kernel_block_size"],
        "share": 0.25,
    },
    # the ordering race's variants, drawn from a stream of their own, each with the params it
    # sets over the drawn ones: the triggers of cow_lag (a copy-on-write, so forks: never in a
    # stall's workload) and stale_unread (a step that changes freed rows alone) are rare, so
    # they take every chance
    "ordering_race_variants": {
        "lagged": {},
        "torn": {},
        "reordered": {},
        "cow_lag": {"probability": 1.0, "from_step": 1},
        "scrambled": {},
        "stale_unread": {"probability": 1.0},
    },
    # the host tier (added later): this share of the seeds, on a stream of their own, draw a
    # tier scenario (harness/tools/soak_tier.py) instead of a mix: every other seed stays
    "offload": {
        "probability": 0.15,
        # this share of them (a stream of their own) draw count of these failure modes beside
        # the tier's, in all but these variants: its workload has no forks (cow_lag); without a
        # prefix cache no writer record (kv_reads, scrambled's catch in time) and no leak retry.
        # This share of the mixes run on the prefix-caching reference, prompts sharing system
        # prompts (a prefix hit may find its blocks on the host tier alone), prefix_cache a
        # failure mode they may draw
        "mix": {
            "share": 0.5,
            "count": (1, 2),
            "faults": ["table_overflow", "refcount_leak", "ordering_race", "async_free"],
            "left_out": {"refcount_leak": ["retry"], "ordering_race": ["cow_lag", "scrambled"]},
            "prefix": 0.5,
            "prefix_faults": ["prefix_cache"],
            "prefix_share": 0.5,  # of those, beside the others
            "prefix_left_out": {"ordering_race": ["cow_lag"]},
            "prefix_len": (8, 24),
        },
        "variant": ["store_before_compute", "restore_race", "stale_host", "host_slot_freed"],
        "load_abort": 0.25,  # async_free's abort during a restore beside it, this share
        "block_size": [2, 4, 8],
        "num_requests": (8, 16),
        "arrival_rate": (0.5, 1.5),
        "prompt_max": (16, 28),
        "output_max": (12, 24),
        "pool_rows": (2, 3),  # num_blocks = pool_rows x a row: the pool preempts
        "cold_steps": (1, 4),
        "latency_steps": (1, 2),
        "think_share": (0.5, 1.0),
        "think_steps": (4, 12),
        "cancels": (2, 6),
    },
    # expect.within_steps per planted failure mode: each fault is judged against its own window
    "within_steps": {
        "table_overflow": 2,
        "refcount_leak": 2,
        "staging_stall": 20,
        "ordering_race": 2,
        "prefix_cache": 2,
        "async_free": 2,
        "offload": 2,
    },
}
# Failure modes added after the soak's first draws take their own random stream: every seed's
# draws for the others stay what they were.
OWN_STREAM = ("prefix_cache", "async_free")
# Params added after a failure mode's first draws: each on a stream of its own, drawn after the
# others (every seed's draws of the rest stay what they were)
OWN_STREAM_PARAMS = {"table_overflow": ("variant",)}
STAGED_ENTRIES = 102400  # a real-cost staging stall's table: 400 KiB, 100 pages of 4 KiB


def _draw(rng: random.Random, spec):
    if isinstance(spec, dict):
        return rng.sample(spec["subset"], rng.randint(spec["min"], len(spec["subset"])))
    if isinstance(spec, list):
        return _draw(rng, rng.choice(spec))
    if isinstance(spec, tuple):
        lo, hi = spec
        return rng.randint(lo, hi) if isinstance(lo, int) else round(rng.uniform(lo, hi), 3)
    return spec


@dataclass(frozen=True, kw_only=True)
class Fit:
    """A block manager other than the reference, as its check before any run found it: the mix
    leaves out what it declares it cannot do (block sizes, capabilities) and the failure modes
    that plant in the reference manager only. Every seed's other draws stay as they were."""

    spec: str
    block_sizes: tuple[int, ...] | None = None  # None: any
    capabilities: frozenset[str] = frozenset()

    def faults_left_out(self) -> list[str]:
        from kvchaos.faults import REGISTRY

        return [n for n, f in REGISTRY.items() if not f.any_manager]

    def block_size_choices(self) -> list[int]:
        sizes = SPACE["engine"]["block_size"]
        if self.block_sizes is None:
            return sizes
        return [b for b in sizes if b in self.block_sizes] or [min(self.block_sizes)]

    def left_out(self) -> list[str]:
        """What the mix leaves out for this manager, one line each (the summary says them)."""
        out = [
            f"fault {n}: it plants in the reference manager only" for n in self.faults_left_out()
        ]
        if self.block_size_choices() != SPACE["engine"]["block_size"]:
            out.append(
                f"block sizes other than {', '.join(map(str, self.block_size_choices()))}: "
                f"it supports {', '.join(map(str, self.block_sizes or ()))} (its block_sizes)"
            )
        from kvchaos.faults.leak_variants import DELAYED_KV, REFERENCE_ONLY

        out.append(
            f"refcount_leak variants {', '.join(REFERENCE_ONLY)}: they plant in the reference"
            " managers only"
        )
        if "prefix_cache" in self.capabilities:
            out.append(
                f"refcount_leak variant {', '.join(DELAYED_KV)}: its requests hold blocks whose KV"
                " lands later, which a prefix cache keying blocks as it allocates them caches"
                " unwritten (protocol v2 cannot ask it to wait)"
            )
        if "fork" not in self.capabilities:
            out.append("fork groups: it does not declare the fork capability")
        out.append("the host KV tier's scenarios: they plant in the reference's tier")
        return out


def generate_scenario(seed: int, fit: Fit | None = None) -> dict:
    """The scenario dict (the TOML file's shape) that this seed stands for (fit: under a block
    manager other than the reference, what it can be asked; None: the reference)."""
    from kvchaos.faults import REGISTRY

    tier = random.Random(f"{seed}/soak/offload")
    if fit is None and tier.random() < SPACE["offload"]["probability"]:
        return soak_tier.tier_scenario(seed, tier, SPACE, _draw)
    rng = random.Random(f"{seed}/soak")
    e, w = SPACE["engine"], SPACE["workload"]
    faults = []
    skip = fit.faults_left_out() if fit else []
    for name in REGISTRY:
        if name in skip or name not in SPACE["faults"]:  # offload: soak_tier's
            continue
        r = random.Random(f"{seed}/soak/{name}") if name in OWN_STREAM else rng
        if r.random() < SPACE["fault_probability"] and not _excluded(name, faults):
            own = OWN_STREAM_PARAMS.get(name, ())
            params = {k: _draw(r, v) for k, v in SPACE["faults"][name].items() if k not in own}
            if name == "table_overflow":
                params.update(_table_overflow_variant(seed))
            faults.append(
                {
                    "name": name,
                    "defect": r.random() < SPACE["defect_probability"],
                    "params": params,
                }
            )
    names = [f["name"] for f in faults]
    leak = next((f for f in faults if f["name"] == "refcount_leak"), None)
    if leak is not None:
        _leak_variant(leak, random.Random(f"{seed}/soak/refcount_leak/variant"), fit)
    run = _staging_variant(seed, faults)
    width = _draw(rng, e["max_blocks_per_seq"])
    engine = {
        "max_prefill_tokens": _draw(rng, e["max_prefill_tokens"]),
        "tp_size": 2 if "ordering_race" in names else _draw(rng, e["tp_size"]),
        "cache": {
            "block_size": _draw(rng, fit.block_size_choices() if fit else e["block_size"]),
            "max_blocks_per_seq": width,
            "max_num_seqs": _draw(rng, e["max_num_seqs"]),
            "num_blocks": width * _draw(rng, e["pool_rows"]),
        },
    }
    cache = engine["cache"]
    if "staging_stall" in names:
        sw = SPACE["stall_workload"]
        out, prompt = _draw(rng, sw["output_len"]), _draw(rng, sw["prompt_max"])
        # every request must fit a row, or nothing decodes long enough to show a trend
        cache["max_blocks_per_seq"] = max(width, -(-(out + prompt) // cache["block_size"]))
        cache["num_blocks"] = max(cache["num_blocks"], 2 * cache["max_blocks_per_seq"])
        if run:  # a real page-fault cost needs a serving-size table: rows enough for 100 pages
            rows = -(-STAGED_ENTRIES // cache["max_blocks_per_seq"])
            cache["max_num_seqs"] = max(cache["max_num_seqs"], rows)
        workload = {
            "num_requests": _draw(rng, sw["num_requests"]),
            "arrival_rate": 4.0,
            "prompt_len": {"dist": "uniform", "min": 1, "max": prompt},
            "output_len": {"dist": "fixed", "value": out, "min": 1, "max": out},
        }
    else:
        # the workload's own requests fit a row: over-long ones are the table_overflow trigger's job
        cap = width * cache["block_size"]
        prompt = min(_draw(rng, w["prompt_max"]), cap // 2)
        out = min(_draw(rng, w["output_max"]), cap - prompt)
        workload = {
            "num_requests": _draw(rng, w["num_requests"]),
            "arrival_rate": _draw(rng, w["arrival_rate"]),
            "prompt_len": {"dist": "uniform", "min": 1, "max": prompt},
            "output_len": {"dist": "uniform", "min": 1, "max": out},
            "fork_groups": _draw(rng, w["fork_groups"]) * (not fit or "fork" in fit.capabilities),
            "cancel": {
                "rate": _draw(rng, w["cancel_rate"]),
                "phases": _draw(rng, w["cancel_phases"]),
            },
        }
    drawn = {f["name"]: f for f in faults}
    if "table_overflow" in names:
        soak_fits.fit_table_overflow(engine, drawn["table_overflow"])
    if "ordering_race" in names:
        _fit_ordering_race(seed, workload, drawn["ordering_race"])
    if "prefix_cache" in names:
        soak_fits.fit_prefix_cache(engine, workload, drawn["prefix_cache"])
    elif "cancel" in workload:  # served traffic shares prefixes: cache hits under every fault
        _share_prefixes(cache, workload, random.Random(f"{seed}/soak/prefix"))
    if "async_free" in names:
        soak_fits.fit_async_free(engine, workload, drawn["async_free"], "staging_stall" in names)
    if leak is not None and "variant" in leak["params"]:  # after async_free's: retry's pool
        soak_fits.fit_leak_variant(engine, leak)  # floor wins over a preempt draw's small pool
    if cache.get("prefix_caching") and "cancel" in workload:
        _prefix_shapes(workload, random.Random(f"{seed}/soak/shapes"))
    planted = [f["name"] for f in faults if f["defect"]]
    if planted:
        params = {f["name"]: f["params"] for f in faults}
        detectors = sorted({d for n in planted for d in REGISTRY[n].detectors_for(params[n])})
        expect = {
            "outcome": "detect",
            "checkers": detectors,
            "within_steps": {n: SPACE["within_steps"][n] for n in planted},  # each its own
        }
    else:
        expect = {"outcome": "clean"}
    mix = (
        ", ".join(f"{f['name']} ({'defect' if f['defect'] else 'trigger'})" for f in faults)
        or "no faults"
    )
    data = {
        "scenario": {
            "name": f"soak-{seed}",
            "description": f"soak seed {seed}: {mix}",
            "tags": ["soak"],
            "seeds": [seed],
        },
        "engine": engine,
        "workload": workload,
        "faults": faults,
        "expect": expect,
    }
    if run:
        data["run"] = run
    if not faults:
        del data["faults"]
    return data


def _staging_variant(seed: int, faults: list[dict]) -> dict:
    """The staging stall's variant, from its own stream; the [run] settings its real cost needs
    (every variant's: its pages really fault in, about a microsecond each): a floor for a stall
    of ~0.1 ms, a snapshot every 10th step (each holds the serving-size table), so it is drawn
    alone. In a mix (whose other checks want every step's snapshot) the stall is the ramp's
    trigger alone: the remediated engine re-allocates, and no defect is planted that the mix's
    small table could not show. {} for no stall, or a stall in a mix."""
    f = next((f for f in faults if f["name"] == "staging_stall"), None)
    if f is None:
        return {}
    if len(faults) > 1:
        f["defect"] = False
        return {}
    r = random.Random(f"{seed}/soak/staging_stall/variant")
    drawn = {k: _draw(r, spec) for k, spec in SPACE["staging_variant"].items()}
    f["params"]["variant"] = drawn["variant"]
    if drawn["variant"] == "bursts":
        f["params"].update(burst_steps=drawn["burst_steps"], burst_every=drawn["burst_every"])
    return {"latency_floor_ms": 0.05, "snapshot_every": 10}


def _excluded(name: str, faults: list[dict]) -> bool:
    """A stall is judged on a steady decode-only stretch, which the prefix_cache trigger's
    prefills would break: the two are never drawn together."""
    return name == "prefix_cache" and any(f["name"] == "staging_stall" for f in faults)


def _leak_variant(fault: dict, rng: random.Random, fit: Fit | None = None) -> None:
    """Most draws take one of the leak classes; the rest keep the article's case (no param).
    Under another manager, only the classes that plant on the engine's seams (and, with a prefix
    cache, none whose KV lands later: DELAYED_KV)."""
    from kvchaos.faults.leak_variants import DELAYED_KV, REFERENCE_ONLY

    spec = SPACE["leak_variant"]
    if rng.random() >= spec["any"]:
        out = () if fit is None else REFERENCE_ONLY
        if fit is not None and "prefix_cache" in fit.capabilities:
            out += DELAYED_KV
        choices = [v for v in spec["variant"] if v not in out]
        v, n = rng.choice(choices), _draw(rng, spec["cancels"])
        fault["params"] = {"variant": v, "cancels": n}


def _prefix_shapes(workload: dict, rng: random.Random) -> None:
    """With a prefix cache, half the draws add the shapes its bugs need (own stream)."""
    spec = SPACE["prefix_shapes"]
    if rng.random() < spec["probability"]:
        workload["shapes"] = {
            k: _draw(rng, spec["rounds"])
            for k in ("boilerplate", "prefill_aborts", "pressure_hits", "whole_blocks")
        }


def _table_overflow_variant(seed: int) -> dict:
    """{} for the default variant (its scenario as before variants), else {"variant": v}."""
    r = random.Random(f"{seed}/soak/table_overflow/variant")
    if r.random() < SPACE["table_overflow_default_share"]:
        return {}
    v = r.choice(SPACE["faults"]["table_overflow"]["variant"])
    g, geo = random.Random(f"{seed}/soak/table_overflow/geometry"), SPACE["table_overflow_geometry"]
    return {"variant": g.choice(geo["variant"]) if g.random() < geo["share"] else v}


def _fit_ordering_race(seed: int, workload: dict, fault: dict) -> None:
    """The variant, from its own stream, with its params over the drawn ones (the default leaves
    them as they were drawn); cow_lag's workload forks every request, and its requests decode
    long enough to be running when their forks come (a copy-on-write needs both writing)."""
    from kvchaos.faults.ordering_variants import DEFAULT

    rng = random.Random(f"{seed}/soak/ordering_race/variant")
    forks = bool(workload.get("fork_groups"))  # 0: none drawn, or a manager that cannot fork
    v = rng.choice([v for v in SPACE["ordering_race_variants"] if forks or v != "cow_lag"])
    if v == DEFAULT:
        return
    fault["params"].update(variant=v, **SPACE["ordering_race_variants"][v])
    if v == "cow_lag":
        workload["fork_groups"] = max(workload["fork_groups"], workload["num_requests"])
        out = workload["output_len"]
        out["min"] = max(out["min"], out["max"] // 2)


def _share_prefixes(cache: dict, workload: dict, rng: random.Random) -> None:
    """With SPACE's prefix_probability, prompts start with shared prefixes (drawn from their own
    stream: the rest of the seed's scenario is as without them), within a table row."""
    if rng.random() >= SPACE["prefix_probability"]:
        return
    cap = cache["max_blocks_per_seq"] * cache["block_size"]
    shared = max(1, min(32, cap // 4))
    out = workload["output_len"]
    out["max"] = max(out["min"], min(out["max"], cap - workload["prompt_len"]["max"] - shared))
    workload["prefix"] = {
        "groups": rng.randint(1, 4),
        "prefix_len": {"dist": "uniform", "min": 1, "max": shared},
        "share": round(rng.uniform(0.3, 0.9), 3),
        "repeat": round(rng.uniform(0.0, 0.2), 3),
    }


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' (1 <= I <= N): this machine takes the seeds s with s % N == I - 1."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ValueError(f"--shard {text!r}: expected I/N with 1 <= I <= N, e.g. 2/4")
    return int(m.group(1)), int(m.group(2))


def shard_seed(seed_start: int, k: int, shard: tuple[int, int]) -> int:
    i, n = shard
    return seed_start + k * n + (i - 1)
