"""A history judged: the checkers, the manifest marks and the verdict. How a run ends, and what
`kvchaos analyze` recomputes from a stored history."""

from __future__ import annotations

from kvchaos.harness.check.checkers import run_checkers
from kvchaos.harness.check.exercised import exercised
from kvchaos.harness.check.findings import CheckResult
from kvchaos.harness.check.verdict import decide
from kvchaos.harness.scenario.spec import Scenario


def evaluate(sc: Scenario, events: list[dict], verify: dict, error: dict | None, disabled=()):
    """Checkers + verdict from a history: how a run ends, and what `kvchaos analyze` recomputes.
    disabled: checkers switched off (what a verdict is without them)."""
    checks = run_checkers(
        events,
        {
            "latency": {
                "slo_ratio": sc.run.latency_slo_ratio,
                "signal": sc.run.latency_signal,
                "floor_s": sc.run.latency_floor_ms * 1e-3,
            },
            "liveness": {"bound_steps": sc.run.liveness_bound_steps},
        },
        disabled,
    )
    if "timing" not in sc.markers:  # measured time is a verdict only where the scenario is timed
        checks = [not_timed(c) if c.checker == "latency" else c for c in checks]
    mark_manifest(checks, events)
    tokens = sum(len(e.get("tokens", {})) for e in events if e.get("e") == "step")
    v = decide(sc, checks, verify, error, {"tokens": tokens})
    v.exercised = exercised(events)
    if v.verdict == "PASS" and v.exercised["not_exercised"]:  # a PASS says what it did not cover
        v.summary += f"; not exercised: {', '.join(v.exercised['not_exercised'])}"
    ended = [f for c in checks for f in c.findings if f.kind in ("hang", "died")]
    if ended and ended[0].message not in v.summary:  # how the run ended, after its first finding
        v.summary += f"; the run ended: {ended[0].message}"
    return checks, v


def not_timed(c: CheckResult) -> CheckResult:
    """The latency checker in a scenario no fault or expectation times: not judged. A shared
    machine's load would be its verdict; a scenario opts in with the tag "timing"."""
    return CheckResult(checker=c.checker, valid=None, findings=[], error=None, checked=0)


def mark_manifest(checks: list, events: list[dict]) -> None:
    """Manifest: a request whose output diverged, at or after the finding, is one the finding
    touches (its request, the owner of its row, the requests live at its step). Otherwise latent:
    findings that name no request (an end-of-run leak, a row nobody owns) stay latent."""
    diverged = {
        e["req"]: e.get("divergence_step") or 0
        for e in events
        if e.get("e") == "oracle" and e.get("first_divergence") is not None
    }
    live = {e["step"]: e.get("live", []) for e in events if e.get("e") == "snapshot"}
    for c in checks:
        for f in c.findings:
            if c.checker in ("oracle_divergence", "latency", "liveness", "manager_calls"):
                continue  # divergence is manifest by definition; the others judge no output
            ev = f.evidence
            reqs = {ev.get(k) for k in ("req", "owner")} - {None}
            if c.checker == "cross_rank":
                reqs |= set(live.get(f.step, []))
            f.manifest = any(diverged.get(r, -1) >= f.step for r in reqs)
