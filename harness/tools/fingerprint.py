"""Fingerprints: what a run showed, as (label, failure mode, checker, finding kind).

The soak deduplicates incidents by fingerprint; shrink keeps a run's primary fingerprint.
"""

from __future__ import annotations

from kvchaos.harness.check.verdict import ERROR, INCONCLUSIVE, MISSED, PASS


def fingerprints(results: dict, faults: list[dict]) -> list[dict]:
    """What a run showed, as {"fp": (label, failure mode, checker, kind), "step"}: one per distinct
    fingerprint, the run's primary (the one a reproducer must keep) first. label is the verdict,
    or DETECTED for a PASS that caught its planted defect. A finding's failure mode is the fault
    in the run (planted first) whose detectors include its checker, else "-", named with its
    variant where it has one (prefix_cache/weak_key)."""
    from kvchaos.faults import REGISTRY

    named = {f["name"]: REGISTRY[f["name"]].label(f.get("params")) for f in faults}
    dets = {f["name"]: REGISTRY[f["name"]].detectors_for(f.get("params")) for f in faults}

    v = results["verdict"]
    planted = [f["name"] for f in faults if f.get("defect", True)]
    present = planted + [f["name"] for f in faults if not f.get("defect", True)]
    steps = results.get("steps", 0)
    # a broken run is not attributed to a failure mode: the mix would split one cause many ways
    if v == ERROR:
        err = results.get("error") or {}
        unknown = [c["checker"] for c in results.get("checkers", []) if c.get("valid") is None]
        if err or not unknown:
            return [{"fp": (ERROR, "-", "runner", err.get("error", "error")), "step": steps}]
        return [{"fp": (ERROR, "-", c, "unknown"), "step": steps} for c in unknown]
    if v == INCONCLUSIVE:
        return []
    head, out = [], {}
    if v == MISSED:
        verify = results.get("fault_verify", {})
        caught = set(results.get("time_to_detect_steps") or {})
        head = [
            {
                "fp": (MISSED, named[n], "-", "not_caught"),
                "step": (verify.get(n) or {}).get("first_step") or steps,
            }
            for n in planted
            if n not in caught
        ]
    label = "DETECTED" if v == PASS else v
    for c in results.get("checkers", []):
        for f in c.get("findings", []):
            mode = next((named[n] for n in present if f["checker"] in dets[n]), "-")
            fp = (label, mode, f["checker"], f.get("kind") or "-")
            if fp not in out or f["step"] < out[fp]:
                out[fp] = f["step"]
    tail = sorted(
        ({"fp": fp, "step": s} for fp, s in out.items()), key=lambda x: (x["step"], x["fp"])
    )
    # the primary is the earliest finding of a checker the scenario expected (ties: in its order)
    if v == PASS:
        want = results.get("expectation", {}).get("checkers", [])
        tail.sort(
            key=lambda x: (
                x["fp"][2] not in want,
                x["step"],
                want.index(x["fp"][2]) if x["fp"][2] in want else 0,
            )
        )
    return head + tail


def fp_text(fp) -> str:
    return " / ".join(fp)
