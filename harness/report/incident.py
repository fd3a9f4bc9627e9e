"""Incidents from a run's own history: impact, trigger, evidence, root cause (known or suspected),
timeline, reproduction. Reads results and events; never runs anything."""

from __future__ import annotations

import statistics
from pathlib import Path

from kvchaos.harness.judge.user_code import REFERENCE
from kvchaos.harness.judge.verdict import ERROR, MEANING
from kvchaos.harness.report.evidence import (
    detection,
    error_site,
    run_error,
    trigger_section,
)
from kvchaos.harness.report.timeline import timeline
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
    "divergence": "outputs diverged from the oracle",
    "starvation": "starved: produced nothing",
    "unfinished": "never finished",
    "latency_climb": "in the batch while latency climbed",
    "stale_table": "in a batch computed on a stale table",
}


def _fault_knowledge(name: str | None, armed: dict) -> dict:
    if name is None:
        return {}
    if name in armed:
        return armed[name]
    from kvchaos.faults import REGISTRY

    f = REGISTRY.get(name)
    return (
        {
            "name": name,
            "detectors": list(f.detectors),
            "root_cause": f.root_cause,
            "remediation": f.remediation,
        }
        if f
        else {}
    )


def _subjects(results: dict, v: RunView) -> list[tuple[str, str | None, list[str]]]:
    """(kind, fault, checkers) per incident: a planted defect caught or missed, findings that no
    planted defect explains (grouped by the trigger-only fault they point at), or the run's
    error."""
    checks = results.get("checkers", [])
    fired = [c["checker"] for c in checks if c["valid"] is False]
    if results["verdict"] == ERROR:
        return [("error", None, fired)]
    verify = results.get("fault_verify") or {}
    expected = results.get("expectation", {}).get("checkers", [])
    out, explained = [], set()
    planted = [n for n, d in v.armed.items() if d.get("defect")]
    for name in planted:
        if not verify.get(name, {}).get("fired"):
            continue
        mine = [c for c in fired if c in v.armed[name].get("detectors", []) or c in expected]
        explained.update(mine)
        out.append(
            (
                "detection" if name in results.get("time_to_detect_steps", {}) else "missed",
                name,
                mine,
            )
        )
    groups: dict[str | None, list[str]] = {}
    for c in fired:
        if c not in explained:
            owner = next((n for n, d in v.armed.items() if c in d.get("detectors", [])), None)
            groups.setdefault(owner, []).append(c)
    kind = "unexplained" if planted else "bug"
    out += [(kind, owner, cs) for owner, cs in groups.items()]
    return out


def _findings(results: dict, checkers: list[str]) -> list[dict]:
    fs = [f for c in results.get("checkers", []) if c["checker"] in checkers for f in c["findings"]]
    return sorted(fs, key=lambda f: f["step"])


def _latency_change(v: RunView, start: int | None, signal: str) -> dict | None:
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


def _impact(
    v: RunView, results: dict, fault: str | None, findings: list[dict], start: int | None
) -> dict:
    affected: dict[str, set[str]] = {}
    for f in findings:
        ev = f["evidence"]
        reqs = [ev[k] for k in ("req", "owner") if ev.get(k)] + list(ev.get("requests", []))
        if not reqs and f["kind"] in ("latency_climb", "stale_table"):
            reqs = sorted(v.requests_at(ev.get("window") or [f["step"]]))
        for r in reqs:
            affected.setdefault(r, set()).add(HOW.get(f["kind"], f"named by {f['checker']}"))
    for o in v.diverged:
        affected.setdefault(o["req"], set()).add(HOW["divergence"])
    tokens = sum(o["checked"] - o["first_divergence"] for o in v.diverged)

    fv = (results.get("fault_verify") or {}).get(fault, {}) if fault else {}
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
        sorted({b for x in fv.get("leaks", []) for b in x["blocks"]}) if "leaks" in fv else None
    )
    leaked = {
        "blocks": leak_found,
        "count": len(leak_found),
        "requests": sorted({f["evidence"]["req"] for f in leaks if "req" in f["evidence"]}),
        "never_returned_at_end": never_returned,
        "fault_verify_blocks": verified,
        "fault_verify_skipped_frees": fv.get("skipped_frees"),
        "matches_fault_verify": None if verified is None else set(verified) == set(leak_found),
    }

    lat_f = next((f for f in findings if f["checker"] == "latency"), None)
    signal = lat_f["evidence"].get("signal", "host_s") if lat_f else "host_s"
    latency = _latency_change(v, start, signal)
    wall = _latency_change(v, start, "latency_s") if signal != "latency_s" else None

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


def _root_cause(
    v: RunView, kind: str, fault: str | None, checkers: list[str], results: dict
) -> tuple[dict, str]:
    bm = v.block_manager
    own = bm != REFERENCE
    if kind == "error":
        err = run_error(v, results)
        unknown = [c for c in results.get("checkers", []) if c["valid"] is None]
        if err:
            where = f" (raised at {error_site(err)})" if error_site(err) else ""
            text = f"the run broke with {err['error']}: {err['message']}{where}"
            fix = (
                "fix the exception above (the traceback is in history.jsonl), "
                "then replay the run to confirm"
            )
        else:
            text = "checker(s) could not decide: " + "; ".join(
                f"{c['checker']}: {(c.get('error') or 'no traceback').strip().splitlines()[-1]}"
                for c in unknown
            )
            fix = (
                "fix the checker (its traceback is in results.json), "
                "then `kvchaos analyze` this run again"
            )
        return {"status": "suspected", "text": text, "source": "the run's error"}, fix
    k = _fault_knowledge(fault, v.armed)
    if kind in ("detection", "missed"):
        text = k.get("root_cause", "")
        if own:
            text = (
                f"the run used your block manager {bm}; "
                f"the planted {fault} defect explains the findings "
                f"if your code behaves like the reference: {text}"
            )
        if kind == "missed":
            text += (
                f" The harness then failed: none of "
                f"{results.get('expectation', {}).get('checkers')} caught it in "
                f"time."
            )
        fix = k.get("remediation", "")
        if kind == "missed":
            fix += (
                " Harness: make the expected checker see this failure mode sooner"
                " (the evidence above shows what it saw)."
            )
        return {
            "status": "suspected" if own else "known",
            "text": text,
            "source": f"the planted {fault} defect" + (f" under {bm}" if own else ""),
        }, fix
    if (
        fault is not None
    ):  # a trigger-only fault whose detectors fired: the remediation did not hold
        return {
            "status": "suspected",
            "source": f"the {fault} trigger (no defect planted)",
            "text": f"the engine's remediation for {fault} did not hold under its trigger"
            f"{' in your block manager ' + bm if own else ''}; what that failure looks like: "
            f"{k.get('root_cause', '')} Or the checker is wrong: a harness false positive.",
        }, k.get("remediation", "")
    from kvchaos.faults import REGISTRY

    cands = [f for f in REGISTRY.values() if checkers and checkers[0] in f.detectors]
    text = (
        f"nothing was planted, so the harness cannot know. {', '.join(checkers)} "
        f"{'is' if len(checkers) == 1 else 'are'} built to catch: "
        + " / ".join(f"{f.name}: {f.root_cause}" for f in cands)
        if cands
        else f"nothing was planted and no known failure mode is caught by {', '.join(checkers)}"
    )
    text += " Or the checker is wrong: a harness false positive (check the evidence)."
    return {
        "status": "suspected",
        "text": text,
        "source": "the checkers' findings only",
    }, " / ".join(
        f"if {f.name}: {f.remediation}" for f in cands
    ) or "investigate the evidence above"


def _severity(kind: str, impact: dict, checkers: list[str]) -> tuple[str, str]:
    if impact["tokens_diverged"]:
        return (
            "SEV1",
            f"wrong outputs served: {impact['tokens_diverged']} tokens diverged from the oracle",
        )
    if kind == "missed":
        return "SEV1", "a defect fired and the harness did not catch it in time"
    if kind == "error":
        return "SEV2", "the run itself broke"
    if any(c in STRUCTURAL + ("liveness",) for c in checkers):
        return "SEV2", "latent corruption or lost capacity: outputs still correct"
    return "SEV3", "performance only: outputs correct"


def _summary(kind, fault, det, impact, fv) -> str:
    lat = impact["latency"]
    bits = [
        f"requests affected: {len(impact['requests_affected'])}",
        f"tokens diverged: {impact['tokens_diverged']}",
        f"blocks leaked: {impact['blocks_leaked']['count']}",
    ]
    if lat and lat["ratio"]:
        bits.append(f"{lat['signal']} x{lat['ratio']:.1f} against the run's baseline")
    bits.append(
        {
            "manifest": "wrong outputs served (manifest)",
            "latent": "latent: outputs still matched the oracle",
            "none": "outputs correct",
            "unknown": "outputs not checked",
        }[impact["manifest"]]
    )
    if kind == "detection":
        lead = (
            f"The planted {fault} defect fired first at step {fv.get('first_step')} "
            f"({fv.get('times')} times) and "
            f"{', '.join(det['checkers'])} caught it {det['time_to_detect_steps']} steps later."
        )
    elif kind == "missed":
        lead = (
            f"The planted {fault} defect fired first at step {fv.get('first_step')} "
            f"and was {det['status']}."
        )
    elif kind == "error":
        lead = f"The run broke: {det['status']}."
    else:
        why = (
            "with nothing planted"
            if kind == "bug"
            else "and the planted defect does not explain it"
        )
        lead = f"{', '.join(det['checkers'])} fired {why} (first at step {det['first_step']})."
    return f"{lead} Impact: " + "; ".join(bits) + "."


def _title(kind, fault, det, results) -> str:
    where = f"{results['scenario']} seed {results['seed']}"
    if kind == "detection":
        return (
            f"{fault} caught by {', '.join(det['checkers'])} at step {det['first_step']} ({where})"
        )
    if kind == "missed":
        return f"{fault} fired at step {det['fault_first_step']} and was missed ({where})"
    if kind == "error":
        err = results.get("error") or {}
        return (
            f"run error: {err.get('error', 'checker could not decide')}: "
            f"{str(err.get('message', ''))[:80]} ({where})"
        )
    label = "bug found" if kind == "bug" else "unexplained finding"
    return f"{label}: {', '.join(det['checkers'])} fired at step {det['first_step']} ({where})"


def build_incidents(results: dict, events: list[dict], run_dir: Path | None = None) -> list[dict]:
    """The incidents of one run as plain data (what results.json holds and the templates render)."""
    v = RunView(events)
    steps = None  # the timeline, shared by the run's incidents
    out = []
    for kind, fault, checkers in _subjects(results, v):
        fv = (results.get("fault_verify") or {}).get(fault, {}) if fault else {}
        findings = _findings(results, checkers)
        start = (
            fv.get("first_step") if fv.get("fired") else (findings[0]["step"] if findings else None)
        )
        impact = _impact(v, results, fault, findings, start)
        det = detection(v, results, kind, fault, findings, start)
        root, fix = _root_cause(v, kind, fault, checkers, results)
        sev, why = _severity(kind, impact, checkers)
        steps = steps or timeline(v, results)
        n = len(out) + 1
        replay = results.get("replay", "")
        bm = v.block_manager
        if bm != REFERENCE and "--block-manager" not in replay:
            replay += f" --block-manager {bm}"
        first = det["findings"][0] if det["findings"] else {}
        err = run_error(v, results) if kind == "error" else None
        fingerprint = (
            {"failure_mode": "error", "checker": err["error"], "site": error_site(err)}
            if err
            else {
                "failure_mode": fault or "none",
                "checker": first.get("checker"),
                "site": first.get("kind"),
            }
        )
        out.append(
            {
                "id": f"incident-{n:03d}",
                "file": f"incident-{n:03d}.md",
                "kind": kind,
                "title": _title(kind, fault, det, results),
                "severity": sev,
                "severity_reason": why,
                "fingerprint": fingerprint,
                "verdict": {
                    "run": results["verdict"],
                    "meaning": MEANING.get(results["verdict"], ""),
                    "summary": results.get("summary", ""),
                    "expectation": results.get("expectation", {}),
                },
                "summary": _summary(kind, fault, det, impact, fv),
                "impact": impact,
                "trigger": trigger_section(v, fault, fv),
                "detection": det,
                "root_cause": root,
                "remediation": fix,
                "timeline": steps,
                "reproduction": {
                    "command": replay,
                    "seed": results.get("seed"),
                    "commit": results.get("commit"),
                    "config_hash": results.get("config_hash"),
                    "device": results.get("device"),
                    "block_manager": bm,
                    "analyze": f"kvchaos analyze {run_dir}" if run_dir else None,
                },
                "minimal_reproducer": results.get("minimal_reproducer")
                or {"status": f"not shrunk yet: run `kvchaos shrink {run_dir or 'RUN_DIR'}`"},
                "what_held": [
                    {"checker": c["checker"], "checked": c["checked"]}
                    for c in results.get("checkers", [])
                    if c["valid"] is True
                ],
            }
        )
    return out
