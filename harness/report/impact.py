"""What an incident cost: requests affected, tokens diverged, blocks leaked, latency, and
whether wrong outputs were served (manifest) or not yet (latent). Reads the run; runs nothing."""

from __future__ import annotations

import statistics

from kvchaos.harness.report.view import RunView

STRUCTURAL = (
    "table_integrity",
    "block_accounting",
    "cross_rank",
)  # wrong structure, right outputs: latent
HOW = {
    "overlong": "overflowed its block-table row",
    "foreign_block": "its table row holds blocks it does not own",
    "leak": "cancelled, but its blocks were never freed",
    "leak_ended": "finished, but its blocks were never freed",
    "divergence": "outputs diverged from the oracle",
    "starvation": "starved: produced nothing",
    "unfinished": "never finished",
    "latency_climb": "in the batch while latency climbed",
    "stale_table": "in a batch computed on a stale table",
    "wrong_read": "read KV written for other tokens",
    "unwritten_read": "read KV never written",
    "poisoned_read": "read KV computed from a wrong read",
}


def latency_change(v: RunView, start: int | None, signal: str) -> dict | None:
    """Median of `signal` over decode-only steps from `start` on, against the run's own baseline
    (decode-only steps before `start`, or the first dozen when there are too few)."""
    dec = [
        s
        for s in v.steps
        if s.get("prefill_tokens", 0) == 0 and s.get("decode_tokens", 0) > 0 and signal in s
    ]
    if start is None or len(dec) < 4:
        return None
    before = [s[signal] for s in dec if s["step"] < start]
    after = [s[signal] for s in dec if s["step"] >= start]
    if len(before) < 3:
        before = [s[signal] for s in dec[:12]]
    if not after or not before:
        return None
    b, a = statistics.median(before), statistics.median(after)
    return {
        "signal": signal,
        "from_step": start,
        "baseline_ms": b * 1e3,
        "after_ms": a * 1e3,
        "ratio": a / b if b > 0 else None,
        "baseline_steps": len(before),
        "after_steps": len(after),
    }


def impact_of(
    v: RunView, results: dict, fault: str | None, findings: list[dict], start: int | None
) -> dict:
    affected: dict[str, set[str]] = {}
    for f in findings:
        ev = f["evidence"]
        reqs = [ev[k] for k in ("req", "owner") if ev.get(k)] + list(ev.get("requests", []))
        if not reqs and f["kind"] in ("latency_climb", "stale_table"):
            reqs = sorted(v.requests_at(ev.get("window") or [f["step"]]))
        kind = "leak_ended" if f["kind"] == "leak" and not ev.get("cancel") else f["kind"]
        for r in reqs:
            affected.setdefault(r, set()).add(HOW.get(kind, f"named by {f['checker']}"))
    for o in v.diverged:
        affected.setdefault(o["req"], set()).add(HOW["divergence"])
    tokens = sum(o["checked"] - o["first_divergence"] for o in v.diverged)

    fv = (results.get("fault_verify") or {}).get(fault, {}) if fault else {}
    # a trigger-only fault leaks nothing itself: its verify() is no yardstick for what leaked
    planted = bool(fault) and bool(v.armed.get(fault, {}).get("defect", fv.get("planted")))
    leaks = [f for f in findings if f["kind"] == "leak"]
    leak_found = sorted({b for f in leaks for b in f["evidence"].get("blocks", [])})
    never_returned = max(
        (
            f["evidence"]["total"] - f["evidence"]["free"]
            for f in findings
            if f["kind"] == "end_leak" and {"total", "free"} <= set(f["evidence"])
        ),
        default=None,
    )
    verified = (
        sorted({b for x in fv.get("leaks", []) for b in x["blocks"]})
        if "leaks" in fv and planted
        else None
    )
    leaked = {
        "blocks": leak_found,
        # the blocks the evidence names; only the end-of-run count when no request is named
        "count": len(leak_found) or never_returned or 0,
        "requests": sorted({f["evidence"]["req"] for f in leaks if "req" in f["evidence"]}),
        "never_returned_at_end": never_returned,
        "fault_verify_blocks": verified,
        "fault_verify_skipped_frees": fv.get("skipped_frees") if planted else None,
        "matches_fault_verify": None if verified is None else set(verified) == set(leak_found),
        "trigger_only_fault": fault if fault and not planted and "leaks" in fv else None,
    }

    lat_f = next((f for f in findings if f["checker"] == "latency"), None)
    signal = lat_f["evidence"].get("signal", "host_s") if lat_f else "host_s"
    latency = latency_change(v, start, signal)
    wall = latency_change(v, start, "latency_s") if signal != "latency_s" else None

    if not v.oracle:
        manifest, note = (
            "unknown",
            "no request reached the oracle: whether outputs were right is unknown",
        )
    elif v.diverged:
        manifest = "manifest"
        note = (
            f"outputs diverged from the contiguous-cache oracle: "
            f"{len(v.diverged)} of {len(v.oracle)} checked "
            f"requests, {tokens} tokens from the first divergent one on"
        )
    elif any(f["checker"] in STRUCTURAL for f in findings):
        manifest = "latent"
        note = (
            f"the structure was wrong but all {len(v.oracle)} checked requests "
            f"matched the oracle: latent, "
            f"nothing wrong was served yet"
        )
    else:
        manifest = "none"
        note = f"outputs stayed correct: all {len(v.oracle)} checked requests matched the oracle"
    return {
        "requests_affected": [{"req": r, "how": sorted(h)} for r, h in sorted(affected.items())],
        "requests_checked": len(v.oracle),
        "requests_diverged": [o["req"] for o in v.diverged],
        "tokens_diverged": tokens,
        "blocks_leaked": leaked,
        "latency": latency,
        "latency_wall": wall,
        "manifest": manifest,
        "manifest_note": note,
    }
