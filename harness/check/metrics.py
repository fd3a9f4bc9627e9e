"""A run's metrics, read from its history: steps, tokens, latency quantiles, the pool's low
water mark, the prefix cache's hits."""

from __future__ import annotations


def run_metrics(events: list[dict]) -> dict:
    steps = [e for e in events if e.get("e") == "step"]
    if not steps:
        return {}
    lat = sorted(e["latency_s"] for e in steps)
    toks = sum(len(e["tokens"]) for e in steps)
    metrics = {
        "steps": len(steps),
        "tokens": toks,
        "requests": sum(1 for e in events if e.get("e") == "submit"),
        "rejected": sum(1 for e in events if e.get("e") == "reject"),
        "cancelled": sum(1 for e in events if e.get("e") == "cancel"),
        "latency_p50_ms": lat[len(lat) // 2] * 1e3,
        "latency_p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
        "min_free_blocks": min(e["free_blocks"] for e in steps),
        "engine_s": sum(e["latency_s"] for e in steps),
    }
    cache = prefix_cache_metrics(events)
    return {**metrics, "prefix_cache": cache} if cache else metrics


def prefix_cache_metrics(events: list[dict]) -> dict | None:
    """Admissions and the tokens their cache hits served (None: the manager has no cache)."""
    end = next((e for e in reversed(events) if e.get("e") == "run_end"), {})
    c = end.get("counters", {})
    if "admissions" not in c:
        return None
    known, hit = c["known_tokens"], c["hit_tokens"]
    return {
        "admissions": c["admissions"],
        "known_tokens": known,
        "hit_tokens": hit,
        "hit_rate": round(hit / known, 4) if known else 0.0,
        "hits_capped": c["hits_capped"],
    }
