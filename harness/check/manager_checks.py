"""Checkers of the block manager's conduct at its boundary with the engine: exceptions escaping
its calls, snapshots that fail their own shape, and admission answers the harness can recompute."""

from __future__ import annotations

from kvchaos.harness.check.findings import CheckResult, Finding, judged_result, of_kind


def check_manager_calls(events: list[dict]) -> CheckResult:
    """Every call into the block manager returned or refused: an exception escaping one is a bug
    in the system under test (the call, its arguments and the traceback are its evidence), as is a
    call that hung or ended the process; so is a snapshot that fails its own shape or the
    harness's record (snapshot_invalid events)."""
    found = (
        [_call_failure(e) for e in of_kind(events, "sut_error")]
        + [
            Finding(
                checker="manager_calls",
                step=e["step"],
                message=f"snapshot() at step {e['step']} cannot be trusted: {e['problem']}",
                evidence={"problem": e["problem"]},
                manifest=None,
                kind="bad_snapshot",
            )
            for e in of_kind(events, "snapshot_invalid")
        ]
        + [
            Finding(
                checker="manager_calls",
                step=e["step"],
                message=f"{e['data']['call']}({e['data']['seq']!r}, {e['data']['tokens']}) "
                f"refused, yet "
                f"changed the manager: {e['data']['changed']}",
                evidence={k: e["data"][k] for k in ("call", "seq", "tokens", "changed")},
                manifest=None,
                kind="refusal_changed_state",
            )
            for e in of_kind(events, "engine")
            if e.get("kind") == "refusal" and e["data"].get("changed")
        ]
    )
    calls = sum(1 for e in events if e.get("e") in ("step", "snapshot"))
    return judged_result("manager_calls", found, calls)


def _call_failure(e: dict) -> Finding:
    """A sut_error event: an exception escaping a call, or (with "how": "hang" | "died", written
    by an isolated run's parent, kvchaos.harness.run.isolate) a call that never returned."""
    evidence = {k: e.get(k) for k in ("call", "args", "error", "message", "traceback")}
    if e.get("how"):  # "append('r3', 16) did not return within 5 s"
        return Finding(
            checker="manager_calls",
            step=e["step"],
            message=f"{e['call']} {e['message']}",
            evidence=evidence,
            manifest=None,
            kind=e["how"],
        )
    said = "" if e["error"] == "BadAnswer" else f"raised {e['error']}: "  # it returned, wrongly
    message = f"{e['call']} {said}{e['message']}"
    return Finding(
        checker="manager_calls",
        step=e["step"],
        message=message,
        evidence=evidence,
        manifest=None,
        kind="exception",
    )


def check_admission(events: list[dict]) -> CheckResult:
    """A request refused as too long ("429") must really be: past the model's positions, the
    pool, or (refusing, not resizing) a table row. One that fits must be admitted (and served:
    liveness sees that)."""
    start = next(iter(of_kind(events, "run_start")), {})
    cfg = start.get("config", {})
    cache, model = cfg.get("cache", {}), cfg.get("model", {})
    bs, width = cache.get("block_size", 16), cache.get("max_blocks_per_seq", 0)
    plan = {a["req"]: a for a in start.get("plan", []) if a.get("op") == "submit"}
    found, judged = [], 0
    for e in of_kind(events, "reject"):
        a = plan.get(e["req"])
        if e.get("error") != "RequestRejected" or a is None:
            continue
        judged += 1
        total = a["prompt_len"] + a["max_new"]
        blocks = -(-total // bs)
        too_long = (
            total > model.get("max_position", total)
            or blocks > cache.get("num_blocks", blocks)
            or (blocks > width and cache.get("overflow_policy", "reject") == "reject")
        )
        if not too_long:
            found.append(
                Finding(
                    checker="admission",
                    step=e["step"],
                    message=f"request {e['req']} ({total} tokens, {blocks} blocks of a "
                    f"{width}-block "
                    f"row) was refused as too long, yet it fits: {e.get('message', '')}",
                    evidence={"req": e["req"], "tokens": total, "blocks": blocks, "width": width},
                    manifest=None,
                    kind="wrong_refusal",
                )
            )
    return judged_result("admission", found, judged)
