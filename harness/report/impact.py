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
    "leak_failed": "ended in error by the engine, but its blocks were never freed",
    "divergence": "outputs diverged from the oracle",
    "starvation": "starved: produced nothing",
    "unfinished": "never finished",
    "latency_climb": "in the batch while latency climbed",
    "stale_table": "in a batch computed on a stale table",
    "wrong_read": "read KV written for other tokens",
    "unwritten_read": "read KV never written",
    "poisoned_read": "read KV computed from a wrong read",
}
# findings whose request's output was wrong: it diverged, or its attention read wrong KV
WRONG_OUTPUT = ("divergence", "wrong_read", "unwritten_read", "poisoned_read")


MIN_LATENCY_STEPS = 3  # decode-only steps each side of a comparison: fewer is no median


def latency_change(v: RunView, start: int | None, signal: str) -> dict | None:
    """Median of `signal` over the decode-only steps from `start` on, against its median over the
    decode-only steps before `start`: two windows that never overlap, each of at least
    MIN_LATENCY_STEPS steps (else None: too few to compare). Steps that decode nothing (an idle
    or starved engine) are counted apart, never in either median."""
    if start is None:
        return None
    dec = [
        s
        for s in v.steps
        if s.get("prefill_tokens", 0) == 0 and s.get("decode_tokens", 0) > 0 and signal in s
    ]
    before = [s[signal] for s in dec if s["step"] < start]
    after = [s[signal] for s in dec if s["step"] >= start]
    if min(len(before), len(after)) < MIN_LATENCY_STEPS:
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
        # steps from `start` on left out: a prefill in them, or nothing to decode
        "other_steps_after": sum(1 for s in v.steps if s["step"] >= start) - len(after),
    }


def blocks_leaked(v: RunView, findings: list[dict], planted_fv: dict) -> dict:
    """Blocks leaked, one number (`count`): the blocks out of the pool with no live holder at the
    end of the run when that was judged (an end_leak finding), else the blocks the leak findings
    name. `blocks`: those named, by the requests that ended holding them; `returned`: those of
    them back in the pool by the end. planted_fv: a planted defect's verify() (else {})."""
    leaks = [f for f in findings if f["kind"] == "leak"]
    named = sorted({b for f in leaks for b in f["evidence"].get("blocks", [])})
    ends = [
        f["evidence"]["total"] - f["evidence"]["free"]
        for f in findings
        if f["kind"] == "end_leak" and {"total", "free"} <= set(f["evidence"])
    ]
    at_end = max(ends, default=None)
    last = v.snaps[-1] if v.snaps and at_end is not None else None
    returned = sorted(set(named) & set(last["free"])) if last else []
    # the end's count covers every block still out; a named block back in the pool is not in it
    count = max(at_end, len(named) - len(returned)) if at_end is not None else len(named)
    verified = (
        sorted({b for x in planted_fv["leaks"] for b in x["blocks"]})
        if "leaks" in planted_fv
        else None
    )
    return {
        "count": count,
        "blocks": named,
        "requests": sorted({f["evidence"]["req"] for f in leaks if "req" in f["evidence"]}),
        "returned": returned,
        "never_returned_at_end": at_end,
        "fault_verify_blocks": verified,
        "fault_verify_skipped_frees": planted_fv.get("skipped_frees") if planted_fv else None,
        "matches_fault_verify": None if verified is None else set(verified) == set(named),
        # [step, blocks lost so far] at each leak (refcount_leak's variants): the pool's drain
        "drain": planted_fv.get("free_trend") if planted_fv else None,
    }


def impact_of(
    v: RunView, results: dict, fault: str | None, findings: list[dict], start: int | None
) -> dict:
    affected: dict[str, set[str]] = {}
    wrong: set[str] = set()  # requests whose output was wrong: diverged, or read wrong KV
    for f in findings:
        ev = f["evidence"]
        reqs = [ev[k] for k in ("req", "owner") if ev.get(k)] + list(ev.get("requests", []))
        if not reqs and f["kind"] in ("latency_climb", "stale_table"):
            reqs = sorted(v.requests_at(ev.get("window") or [f["step"]]))
        kind = f["kind"]
        if kind == "leak" and not ev.get("cancel"):
            kind = "leak_failed" if ev.get("failed") else "leak_ended"
        for r in reqs:
            affected.setdefault(r, set()).add(HOW.get(kind, f"named by {f['checker']}"))
        if f["kind"] in WRONG_OUTPUT and ev.get("req"):
            wrong.add(ev["req"])  # the reader, never a request that only holds the block
    for o in v.diverged:
        affected.setdefault(o["req"], set()).add(HOW["divergence"])
        wrong.add(o["req"])
    tokens = sum(o["checked"] - o["first_divergence"] for o in v.diverged)

    fv = (results.get("fault_verify") or {}).get(fault, {}) if fault else {}
    # a trigger-only fault leaks nothing itself: its verify() is no yardstick for what leaked
    planted = bool(fault) and bool(v.armed.get(fault, {}).get("defect", fv.get("planted")))
    leaked = blocks_leaked(v, findings, fv if planted else {})
    leaked["trigger_only_fault"] = (
        fault if fault and not planted and "leaks" in fv and leaked["count"] else None
    )

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
        # each request once, with how; output_wrong: diverged from the oracle or read wrong KV
        # (the others held blocks, starved, never finished: no wrong output seen)
        "requests_affected": [
            {"req": r, "how": sorted(h), "output_wrong": r in wrong}
            for r, h in sorted(affected.items())
        ],
        "requests_output_wrong": sorted(wrong & set(affected)),
        "requests_checked": len(v.oracle),
        "requests_diverged": [o["req"] for o in v.diverged],
        "tokens_diverged": tokens,
        "blocks_leaked": leaked,
        "latency": latency,
        "latency_wall": wall,
        "manifest": manifest,
        "manifest_note": note,
    }
