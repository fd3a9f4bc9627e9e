"""Incidents from a run's own history: impact, trigger, evidence, root cause (known or suspected),
timeline, reproduction. Reads results and events; never runs anything."""

from __future__ import annotations

from pathlib import Path

from kvchaos.harness.check.localize import describe as describe_call
from kvchaos.harness.check.story import root_first
from kvchaos.harness.check.verdict import ERROR, FAIL, MEANING, current
from kvchaos.harness.report.evidence import (
    detection,
    error_site,
    run_error,
    trigger_section,
)
from kvchaos.harness.report.impact import STRUCTURAL, impact_of
from kvchaos.harness.report.paths import rel, rel_command
from kvchaos.harness.report.timeline import timeline
from kvchaos.harness.report.view import RunView
from kvchaos.harness.scenario.managers import REFERENCES


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
    credits = results.get("credits")  # the verdict's own: which fault explains which finding
    for name in planted:
        if not verify.get(name, {}).get("fired"):
            continue
        if credits is None:  # recorded before credits: by the fault's detectors
            mine = [c for c in fired if c in v.armed[name].get("detectors", []) or c in expected]
        else:
            mine = sorted({r["checker"] for r in credits if r["fault"] == name})
        explained.update(mine)
        out.append(
            (
                "detection" if name in results.get("time_to_detect_steps", {}) else "missed",
                name,
                mine,
            )
        )
    groups: dict[str | None, list[str]] = {}
    if credits is not None:  # a checker with a finding no fault explains (or none credited)
        explained = {r["checker"] for r in credits} - {
            r["checker"] for r in credits if r["fault"] is None
        }
    for c in fired:
        if c not in explained:
            owner = next((n for n, d in v.armed.items() if c in d.get("detectors", [])), None)
            groups.setdefault(owner, []).append(c)
    kind = "unexplained" if planted else "bug"
    out += [(kind, owner, cs) for owner, cs in groups.items()]
    return out


def _findings(results: dict, checkers: list[str]) -> list[dict]:
    """The incident's findings in the story's order: each root, then what it explains."""
    fs = [f for c in results.get("checkers", []) if c["checker"] in checkers for f in c["findings"]]
    return root_first(fs)


def _call_line(findings: list[dict]) -> str:
    call = next((f["call"] for f in findings if f.get("call")), None)
    return f" The call that broke it: {describe_call(call)}." if call else ""


def _from_call(v: RunView, results: dict, checkers: list[str]) -> tuple[dict, str] | None:
    """The root cause as the replay named it: the call after which the first root finding held,
    read against what the manager declares it offers."""
    first = next((f for f in _findings(results, checkers) if f.get("call")), None)
    if first is None:
        return None
    call, bm = first["call"], v.block_manager
    caps = v.start.get("capabilities") or []
    offers = f"it declares {', '.join(caps)}" if caps else "it declares no optional capability"
    text = (
        f"{describe_call(call)}: the first call after which {first['checker']} "
        f"({first.get('kind')}) held. The bug is in {bm}'s `{call['call']}` ({offers})."
    )
    fix = (
        f"fix `{call['call']}` in {bm} so that it leaves the manager as the protocol says "
        "(docs/protocol-v2.md); `kvchaos shrink` writes the calls as a test, then replay the run"
    )
    return {
        "status": "suspected",
        "text": text,
        "source": "the call a replay of the run found, call by call (kvchaos explain)",
    }, fix


def _root_cause(
    v: RunView, kind: str, fault: str | None, checkers: list[str], results: dict
) -> tuple[dict, str]:
    bm = v.block_manager
    own = bm not in REFERENCES
    if kind == "error":
        err = run_error(v, results)
        unknown = [c for c in results.get("checkers", []) if c["valid"] is None]
        if err:
            where = f" (raised at {error_site(err)})" if error_site(err) else ""
            text = f"the run broke with {err['error']}: {err['message']}{where}"
            fix = (
                "fix the exception (its traceback is under Detection), "
                "then replay the run to confirm"
            )
        else:
            text = "checker(s) could not decide: " + "; ".join(
                f"{c['checker']}: {(c.get('error') or 'no traceback').strip().splitlines()[-1]}"
                for c in unknown
            )
            fix = (
                "fix the checker (its traceback is under Detection), "
                "then `kvchaos analyze` this run again"
            )
        return {"status": "suspected", "text": text, "source": "the run's error"}, fix
    k = _fault_knowledge(fault, v.armed)
    named = _from_call(v, results, checkers) if kind not in ("detection", "missed") else None
    if named is not None:
        return named
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
        who = f"your block manager {bm}" if own else "the engine's remediation"
        return {
            "status": "suspected",
            "source": f"the {fault} trigger (no defect planted)"
            + (f" against {bm}" if own else ""),
            "text": f"nothing was planted: {who} did not hold under the {fault} trigger; "
            f"what that failure looks like: {k.get('root_cause', '')} "
            "Or the checker is wrong: a harness false positive (check the evidence).",
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
    if kind == "detection":  # the harness working as designed, not an outage
        return "CAUGHT", "a planted defect, caught as designed"
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
    if "manager_calls" in checkers:
        return "SEV2", "the block manager broke the protocol: a call raised, hung or answered wrong"
    return "SEV3", "performance only: outputs correct"


def _latency_matters(det) -> bool:
    """Quote the latency change only where a latency checker fired or was expected to."""
    return "latency" in det["checkers"] or "latency" in det["expected"]


def _summary(kind, fault, det, impact, fv, bm) -> str:
    lat = impact["latency"]
    bl = impact["blocks_leaked"]
    bits = [
        f"requests affected: {len(impact['requests_affected'])} "
        f"({len(impact['requests_output_wrong'])} with a wrong output)",
        f"tokens diverged: {impact['tokens_diverged']}",
        f"blocks leaked: {bl['count']}",
    ]
    if bl["fault_verify_blocks"] is not None:
        same = "matches" if bl["matches_fault_verify"] else "does NOT match"
        bits[-1] += f" (the fault's verify(): {len(bl['fault_verify_blocks'])}, {same})"
    if bl.get("drain"):  # the free pool's trend: what a long run loses at this rate
        steps, lost = [x[0] for x in bl["drain"]], bl["drain"][-1][1]
        at = ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else "")
        bits[-1] += (
            f"; the pool lost {lost} blocks in {steps[-1]} steps "
            f"({lost * 1000 / max(1, steps[-1]):.0f} per 1000 steps; leaks at steps {at})"
        )
    if lat and lat["ratio"] and _latency_matters(det):
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
            f"{', '.join(det['caught_by'])} caught it {det['time_to_detect_steps']} steps later"
            + _later(det)
            + "."
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
        lead = f"{', '.join(det['caught_by'])} fired {why} (first at step {det['first_step']})"
        lead += _later(det)
        if bm not in REFERENCES:
            lead += f", against your block manager {bm}"
        lead += "."
    return f"{lead} Impact: " + "; ".join(bits) + "."


def _later(det: dict) -> str:
    later = [c for c in det["checkers"] if c not in det["caught_by"]]
    return f" (then {', '.join(later)})" if later else ""


def _what(impact: dict, det: dict) -> str:
    """The headline number of an incident, from its impact."""
    lat = impact["latency"]
    if impact["blocks_leaked"]["count"]:
        return f"{impact['blocks_leaked']['count']} blocks leaked"
    if impact["tokens_diverged"]:
        return f"{impact['tokens_diverged']} tokens diverged"
    if lat and lat["ratio"] and _latency_matters(det):
        return f"{lat['signal']} x{lat['ratio']:.1f}"
    return f"{det['findings_total']} findings"


def _title(kind, fault, det, results, impact, bm) -> str:
    where = f"{results['scenario']} seed {results['seed']}"
    if kind == "detection":
        return (
            f"{fault} caught by {', '.join(det['caught_by'])} at step {det['first_step']} ({where})"
        )
    if kind == "missed":
        return f"{fault} fired at step {det['fault_first_step']} and was missed ({where})"
    if kind == "error":
        err = results.get("error")
        if not err:  # no exception: checkers that could not decide (the summary names them)
            return f"run error: {results.get('summary', 'a checker could not decide')} ({where})"
        return f"run error: {err.get('error')}: {str(err.get('message', ''))[:80]} ({where})"
    # a FAIL is a bug found in the system under test, whichever kind of incident shows it
    label = "bug found" if kind == "bug" or results["verdict"] == FAIL else "unexplained finding"
    who = f" in {bm}" if bm not in REFERENCES else ""
    return (
        f"{label}: {', '.join(det['caught_by'])} fired at step {det['first_step']}, "
        f"{_what(impact, det)}{who} ({where})"
    )


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
        impact = impact_of(v, results, fault, findings, start)
        det = detection(v, results, kind, fault, findings, start)
        root, fix = _root_cause(v, kind, fault, checkers, results)
        sev, why = _severity(kind, impact, checkers)
        named = _fault_knowledge(fault, v.armed).get("label") or fault  # with its variant
        steps = steps or timeline(v, results)
        n = len(out) + 1
        replay = results.get("replay", "")
        bm = v.block_manager
        if bm not in REFERENCES and "--block-manager" not in replay:
            replay += f" --block-manager {bm}"
        first = det["findings"][0] if det["findings"] else {}
        err = run_error(v, results) if kind == "error" else None
        where = rel(run_dir) if run_dir else None
        fingerprint = (
            {"failure_mode": "error", "checker": err["error"], "site": error_site(err)}
            if err
            else {
                "failure_mode": named or "none",
                "checker": first.get("checker"),
                "site": first.get("kind"),
            }
        )
        out.append(
            {
                "id": f"incident-{n:03d}",
                "file": f"incident-{n:03d}.md",
                "kind": kind,
                "title": _title(kind, named, det, results, impact, bm),
                "severity": sev,
                "severity_reason": why,
                "fingerprint": fingerprint,
                "verdict": {
                    "run": current(results["verdict"]),
                    "meaning": MEANING.get(current(results["verdict"]), ""),
                    "summary": results.get("summary", ""),
                    "expectation": results.get("expectation", {}),
                },
                "summary": _summary(kind, named, det, impact, fv, bm) + _call_line(findings),
                "impact": impact,
                "trigger": trigger_section(v, fault, fv),
                "detection": det,
                "error": _error_of(err, results) if kind == "error" else None,
                "root_cause": root,
                "remediation": fix,
                "timeline": steps,
                "reproduction": {
                    "command": rel_command(replay, base=run_dir.parent if run_dir else None),
                    "seed": results.get("seed"),
                    "commit": results.get("commit"),
                    "config_hash": results.get("config_hash"),
                    "device": results.get("device"),
                    "block_manager": bm,
                    "analyze": f"kvchaos analyze {where}" if where else None,
                },
                "minimal_reproducer": _minimal(results.get("minimal_reproducer"), where),
                "what_held": [
                    {"checker": c["checker"], "checked": c["checked"]}
                    for c in results.get("checkers", [])
                    if c["valid"] is True
                ],
            }
        )
    return out


def _error_of(err: dict | None, results: dict) -> dict | None:
    """The run's error with its traceback (the history's event, else results.json's), or the
    tracebacks of the checkers that could not decide."""
    if not err:
        unknown = [c for c in results.get("checkers", []) if c["valid"] is None and c.get("error")]
        if not unknown:
            return None
        err = {
            "error": "checker error",
            "message": ", ".join(c["checker"] for c in unknown),
            "step": None,
            "traceback": "\n\n".join(f"{c['checker']}:\n{c['error'].rstrip()}" for c in unknown),
        }
    tb = err.get("traceback") or (results.get("error") or {}).get("traceback") or ""
    return {
        "error": err.get("error"),
        "message": err.get("message"),
        "step": err.get("step"),
        "site": error_site({"traceback": tb}),
        "traceback": tb.rstrip() or "(no traceback was recorded)",
    }


def _minimal(found: dict | None, where: str | None) -> dict:
    if not found:
        return {"status": f"not shrunk yet: run `kvchaos shrink {where or 'RUN_DIR'}`"}
    out = dict(found)
    for k in ("scenario_path", "test_path", "calls_test_path"):
        if out.get(k):
            out[k] = rel(out[k])
    if out.get("command"):
        out["command"] = rel_command(out["command"])
    return out
