"""The host tier's costs and savings. bench_offload_step: the decode step of the same engine
(the plain manager) with `[engine.offload]` on and off, same weights and requests, stepped
alternately (async_step.paired_steps); their tokens must agree. tier_saving: the peak
device blocks a think-time workload holds with the tier and without it (same scenario, same
seed), from the runs' own step events. hit_saving: the prefill tokens conversations compute on
the prefix-caching reference with the tier (a later turn's hit loaded from the host) and
without it."""

from __future__ import annotations

from dataclasses import replace

from kvchaos.engine.config import OffloadConfig
from kvchaos.harness.bench.async_step import paired_steps

SAVING_SCENARIO = "offload-memory-clean"  # sessions with think time, a pool with room for all
HIT_SCENARIO = "offload-prefix-hit-clean"  # conversations on a pool too small for their caches


def bench_offload_step(
    device: str, steps: int, warmup: int, batch: int = 8, context: int = 128
) -> dict[str, float]:
    def tier(cfg):  # the plain manager (prefix caching off) offers "offload"
        return replace(cfg, offload=OffloadConfig(host_blocks=2 * cfg.cache.num_blocks))

    one, two, agree = paired_steps(device, steps, warmup, tier, batch, context, False)
    return {"one_tier_step_s": one, "tier_step_s": two, "tokens_agree": agree}


def peak_device_blocks(events: list[dict], num_blocks: int) -> int:
    """The most device blocks in use at any step (the step events' free counts)."""
    return max((num_blocks - e["free_blocks"] for e in events if e.get("e") == "step"), default=0)


def _with_and_without(name: str, seed: int):
    """(key, scenario, its run) with the scenario's tier and with its [engine.offload] removed."""
    from kvchaos.harness.run.runner import run_scenario
    from kvchaos.harness.scenario.spec import load_scenario

    sc = load_scenario(name)
    one = sc.model_copy(update={"engine": {k: v for k, v in sc.engine.items() if k != "offload"}})
    for key, s in (("with_tier", sc), ("without_tier", one)):
        yield key, s, run_scenario(s, seed, report_dir=None)


def hit_saving(name: str = HIT_SCENARIO, seed: int = 0) -> dict:
    """Prefill tokens computed with the tier and without it, and the blocks hits loaded."""
    out = {}
    for key, _, r in _with_and_without(name, seed):
        steps = [e for e in r.events if e.get("e") == "step"]
        out[f"{key}_prefill_tokens"] = sum(e["prefill_tokens"] for e in steps)
        out[f"{key}_verdict"] = r.verdict
        out[f"{key}_steps"] = len(steps)
        if key == "with_tier":
            loads = [
                e for e in r.events if e.get("e") == "engine" and e["kind"] == "offload_restore"
            ]
            out["hit_loaded_blocks"] = sum(
                len(e["data"]["pairs"]) for e in loads if e["data"].get("hit")
            )
    out["saving"] = 1 - out["with_tier_prefill_tokens"] / max(1, out["without_tier_prefill_tokens"])
    return out


def tier_saving(name: str = SAVING_SCENARIO, seed: int = 0) -> dict:
    """Peak device blocks with the scenario's tier and with its [engine.offload] removed."""
    out = {}
    for key, s, r in _with_and_without(name, seed):
        n = s.engine_config().cache.num_blocks
        out[key] = peak_device_blocks(r.events, n)
        used = [n - e["free_blocks"] for e in r.events if e.get("e") == "step"]
        out[f"{key}_mean"] = round(sum(used) / max(1, len(used)), 1)
        out[f"{key}_verdict"] = r.verdict
        concurrency = [e["running"] for e in r.events if e.get("e") == "step"]
        out[f"{key}_max_running"] = max(concurrency, default=0)
    out["requests"] = s.workload.num_requests
    out["saving"] = 1 - out["with_tier"] / max(1, out["without_tier"])
    out["mean_saving"] = 1 - out["with_tier_mean"] / max(1.0, out["without_tier_mean"])
    return out
