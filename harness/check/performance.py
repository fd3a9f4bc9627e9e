"""Performance findings: what costs throughput, not correctness. A third kind beside held and
FAIL: written to results.json["performance"] and shown as warnings, never part of the verdict.
Pure over the history, so `kvchaos analyze` finds the same.

The rules (RULES, also in results.json):
- an unneeded preemption: the engine's audit (kvchaos.engine.audit) re-checked it after the step
  and the growth it made room for fitted in the free blocks the manager had (its
  "unneeded_preemption" events); any one is a finding
- an estimate that disagrees with what the next call took (its "estimate_off" events: the
  manager's blocks_needed against the free blocks the append took); any one is a finding
- the prefix cache's hit rate below HIT_RATIO of the reference manager's on the same admissions
  (harness/check/hit_replay.py), judged from MIN_ADMISSIONS admissions on and where the
  reference serves at least MIN_REFERENCE_RATE of the known tokens
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from kvchaos.harness.check.hit_replay import replay_hits

HIT_RATIO = 0.8
MIN_ADMISSIONS = 10
MIN_REFERENCE_RATE = 0.05

RULES = {
    "unneeded_preemption": "a preemption whose growth fitted in the manager's free blocks, "
    "re-checked after the step on what that growth took",
    "estimate_off": "a growth call that took other than blocks_needed said",
    "hit_rate_ratio": HIT_RATIO,
    "min_admissions": MIN_ADMISSIONS,
    "min_reference_hit_rate": MIN_REFERENCE_RATE,
}

PerfKind = Literal["unneeded_preemption", "estimate_off", "hit_rate"]


class PerfFinding(TypedDict):
    kind: PerfKind
    message: str
    step: int | None  # the first step it was seen at
    evidence: dict[str, Any]


def _engine(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e.get("e") == "engine" and e.get("kind") == kind]


def _audited(events: list[dict]) -> bool:
    """The engine audits a manager offering estimates (kvchaos.engine.audit)."""
    start = next((e for e in events if e.get("e") == "run_start"), {})
    return "estimates" in start.get("capabilities", ())


def preemptions(events: list[dict]) -> tuple[dict, PerfFinding | None]:
    total = sum(len(e.get("preempted", ())) for e in events if e.get("e") == "step")
    found = _engine(events, "unneeded_preemption")
    by = {w: sum(e["data"]["why"] == w for e in found) for w in ("estimate", "refusal")}
    summary = {"judged": _audited(events), "total": total, "unneeded": len(found), "by": by}
    if not found:
        return summary, None
    first = found[0]
    d = first["data"]
    return summary, {
        "kind": "unneeded_preemption",
        "message": f"{len(found)} of {total} preemptions were not needed: the growth they made "
        f"room for fitted (first at step {first['step']}: {d['victim']} preempted with "
        f"{d['free']} blocks free for a growth that took {d['needed']}, estimated {d['estimate']})",
        "step": first["step"],
        "evidence": {"first": d, "by": by},
    }


def estimates(events: list[dict]) -> tuple[dict, PerfFinding | None]:
    found = _engine(events, "estimate_off")
    over = sum(e["data"]["estimate"] > e["data"]["took"] for e in found)
    summary = {"judged": _audited(events), "off": len(found), "over": over}
    summary["under"] = len(found) - over
    if not found:
        return summary, None
    first = found[0]
    d = first["data"]
    return summary, {
        "kind": "estimate_off",
        "message": f"{len(found)} growth calls took other than blocks_needed said ({over} "
        f"estimated more, {len(found) - over} less; first at step {first['step']}: "
        f"{d['call']} of {d['tokens']} token(s) for {', '.join(d['seqs'][:3])} estimated "
        f"{d['estimate']}, took {d['took']})",
        "step": first["step"],
        "evidence": {"first": d, "over": over, "under": len(found) - over},
    }


def hit_rate(events: list[dict]) -> tuple[dict, PerfFinding | None]:
    try:
        r = dict(replay_hits(events))
    except Exception as e:  # a history the replay cannot follow: not judged, never an ERROR
        r = {"judged": False, "why": f"the replay failed: {type(e).__name__}: {e}"}
    if not r["judged"]:
        return r, None
    ref, own = r["reference_hit_rate"], r["hit_rate"]
    r["ratio"] = round(own / ref, 4) if ref else None
    low = r["admissions"] >= MIN_ADMISSIONS and ref >= MIN_REFERENCE_RATE and own < HIT_RATIO * ref
    if not low:
        return r, None
    return r, {
        "kind": "hit_rate",
        "message": f"prefix-cache hit rate {own:.1%}, {r['ratio']:.2f}x the reference manager's "
        f"{ref:.1%} on the same {r['admissions']} admissions (below {HIT_RATIO}x)",
        "step": None,
        "evidence": {k: r[k] for k in ("hit_tokens", "reference_hit_tokens", "known_tokens")},
    }


def judge_performance(events: list[dict]) -> dict:
    """results.json["performance"]: the rules, the findings, and what each was judged on."""
    pre, pre_f = preemptions(events)
    est, est_f = estimates(events)
    hits, hit_f = hit_rate(events)
    return {
        "rules": RULES,
        "findings": [f for f in (pre_f, est_f, hit_f) if f is not None],
        "preemptions": pre,
        "estimates": est,
        "prefix_cache": hits,
    }
