"""The verdict of one run: the scenario's expectation x the checkers' findings x each fault's
ground truth (its verify(): what it injected, what the engine did).

The rules (the architecture doc's table):
- fired: from ground truth only, never from a checker's signal;
- explained: a finding is credited to a planted fault that fired only by cause (the requests,
  rows, blocks or ranks it touched) and time (at or after it fired), or as a consequence the fault
  declares with a computable test; a finding no planted fault explains is a bug found: FAIL;
- caught: an expected checker's finding that the fault explains as its cause, known (when the
  check that found it ran) within `within_steps` of the fault's first firing; a consequence never
  counts as the catch;
- a clean run proves its planted triggers were pulled and that it exercised something, else it is
  INCONCLUSIVE; a checker that had nothing to judge is "not judged", never "held";
- ERROR only when the harness itself broke; the findings made before it are kept."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvchaos.harness.check.story import order_key, story

VerdictName = Literal["PASS", "MISSED", "FAIL", "INCONCLUSIVE", "ERROR"]
PASS, MISSED, FAIL, INCONCLUSIVE, ERROR = "PASS", "MISSED", "FAIL", "INCONCLUSIVE", "ERROR"
# Verdict names recorded by older releases: FALSE_ALARM read as "the harness was wrong", yet it is
# what a real bug in the system under test gets.
LEGACY = {"FALSE_ALARM": FAIL}
EXIT_CODES = {PASS: 0, MISSED: 10, FAIL: 11, INCONCLUSIVE: 12, ERROR: 13}
# For many runs: the exit code of the most serious verdict seen.
SEVERITY = [MISSED, FAIL, ERROR, INCONCLUSIVE, PASS]
MEANING = {
    PASS: "as expected: clean and clean with its triggers pulled, or planted, fired and caught",
    MISSED: "a planted defect fired and no expected checker caught it in time: the harness failed",
    FAIL: "bug found: a finding no planted fault explains, or the remediation failed",
    INCONCLUSIVE: "a planted trigger or defect never fired, or the run exercised nothing",
    ERROR: "the harness itself broke (its own exception, a checker that could not decide, a kill)",
}


@dataclass
class Verdict:
    verdict: VerdictName
    summary: str
    time_to_detect: dict  # fault name -> steps from its first firing to when a catch was known
    # per finding: (checker, step, fault, how); one row for each fault it is a cause of
    credits: list = field(default_factory=list)
    exercised: dict = field(default_factory=dict)  # the manager paths the run exercised

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def credit_rows(self) -> list[dict]:
        """Each finding and the planted fault that explains it (results.json's "credits")."""
        return [{"checker": c, "step": s, "fault": f, "how": h} for c, s, f, h in self.credits]


def current(verdict: str | None) -> str | None:
    """A recorded verdict in today's names."""
    return LEGACY.get(verdict, verdict)


def worst(verdicts: list[str]) -> str:
    return min(verdicts, key=SEVERITY.index) if verdicts else PASS


def _as_dict(f) -> dict:
    return {"checker": f.checker, "step": f.step, "kind": f.kind, "evidence": f.evidence}


def attribute(sc, findings: list, verify: dict) -> list[list[tuple[str, str]]]:
    """Per finding: every planted fault that fired and explains it, as (fault, "cause" |
    "consequence"), causes first (each such fault may count it as its catch); [] if none."""
    from kvchaos.faults import REGISTRY

    fired = [f.name for f in sc.faults if f.defect and verify.get(f.name, {}).get("fired")]
    out, reads = [], {}
    dicts = [_as_dict(f) for f in findings]
    for d in dicts:
        hows = [(n, REGISTRY[n].explains(d, verify[n])) for n in fired]
        out.append(sorted(((n, h) for n, h in hows if h), key=lambda x: x[1] != "cause"))
        if d["checker"] == "kv_reads" and out[-1]:
            reads.setdefault((d.get("evidence") or {}).get("req"), []).append((d["step"], out[-1]))
    # a poisoned read took KV computed from another request's wrong read (its origin, by the
    # writer record): one a fault leaves unexplained is its consequence when the origin's own
    # wrong read, at or before it, is the fault's; in step order, so chains of them resolve
    for d, e in sorted(zip(dicts, out), key=lambda x: x[0]["step"]):
        ev = d.get("evidence") or {}
        if d["checker"] == "kv_reads" and not e and ev.get("origin"):
            took = reads.get(ev["origin"], ())
            names = {n for step, ex in took if step <= d["step"] for n, _ in ex}
            if names:
                e.extend((n, "consequence") for n in sorted(names))
                reads.setdefault(ev.get("req"), []).append((d["step"], e))
    # a divergence is the output of what its request read: one a fault leaves unexplained is
    # still its consequence when that request's own wrong read, at or before it, is the fault's
    # (a prefix hit on a block the fault corrupted, by a request that was not live then)
    for d, e in zip(dicts, out):
        if d["checker"] == "oracle_divergence" and not e:
            req = (d.get("evidence") or {}).get("req")
            names = {n for step, ex in reads.get(req, ()) if step <= d["step"] for n, _ in ex}
            e.extend((n, "consequence") for n in sorted(names))
        elif d["checker"] == "offload" and d["kind"] == "store_content" and not e:
            e.extend((n, "consequence") for n in _written_in_flight(d, dicts, out))
    return out


def _written_in_flight(d: dict, dicts: list, out: list) -> list[str]:
    """A store's host copy differs from its device blocks at completion because other requests
    wrote them while the copy was taken as current (from the store's issue, or the restore whose
    copy it kept): the faults those foreign writes, or writes through an unused entry landing in
    the block, are the cause of (table_integrity's findings), when every differing block was so
    written; else none."""
    ev = d.get("evidence") or {}
    blocks = ev.get("blocks") or []
    since = ev.get("since") or [ev.get("issued", d["step"])] * len(blocks)
    writes = [
        (w["step"], set((w.get("evidence") or {}).get("blocks") or ()), ex)
        for w, ex in zip(dicts, out)
        if w["checker"] == "table_integrity" and w["kind"] in ("foreign_write", "unslotted_write")
    ]
    names: set[str] = set()
    for b, lo in zip(blocks, since):
        hits = [ex for t, bs, ex in writes if lo <= t <= d["step"] and b in bs]
        by = {n for ex in hits for n, how in ex if how == "cause"}
        if not by:
            return []
        names |= by
    return sorted(names)


def truth_problem(sc, verify) -> str | None:
    """What a stored run's ground truth (run_end's fault_verify) lacks for sc's verdict, in words,
    or None: each fault of sc has its entry, shaped as the fault's Truth declares, and a defect
    that fired says when. Judged otherwise, a finding it cannot credit would read as a bug."""
    from pydantic import TypeAdapter, ValidationError

    from kvchaos.faults import REGISTRY

    if verify is None:
        return "no fault_verify (each fault's ground truth)"
    if not isinstance(verify, dict):
        return f"fault_verify: expected an object, got {type(verify).__name__}"
    for f in sc.faults:
        if f.name not in verify:
            return f"fault_verify: no {f.name!r} entry (the scenario's fault {f.name})"
        try:
            truth = TypeAdapter(REGISTRY[f.name].truth).validate_python(verify[f.name], strict=True)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in ("fault_verify", f.name, *err["loc"]))
            got = "" if err["type"] == "missing" else f", got {err['input']!r:.40}"
            return f"{where}: {err['msg'].lower()}{got}"
        if truth["fired"] and truth["first_step"] is None:
            return f"fault_verify.{f.name}: fired, but first_step is null"
    return None


def _named(name: str, verify: dict) -> str:
    why = verify.get("not_applicable")
    return f"{name} ({why})" if why else name


def _expected(sc, name: str) -> list[str]:
    """The checkers a planted fault is judged by: the scenario's, narrowed to the fault's own
    detectors when several faults are planted (each is credited only with its own findings)."""
    from kvchaos.faults import REGISTRY

    params = next((f.params for f in sc.faults if f.name == name), {})
    own = [c for c in sc.expect.checkers if c in REGISTRY[name].detectors_for(params)]
    return own or list(sc.expect.checkers)


def decide(
    sc, checks: list, verify: dict, error: dict | None, exercised: dict | None = None
) -> Verdict:
    findings = sorted((f for c in checks for f in c.findings), key=order_key)
    explained = attribute(sc, findings, verify)
    credits = [e[0] if e else (None, None) for e in explained]  # the best: a cause first
    # a row per finding (its best explanation), and one more per other fault it is a cause of
    tally = [
        (f.checker, f.step, fault, how)
        for f, e in zip(findings, explained)
        for fault, how in (e[:1] + [x for x in e[1:] if x[1] == "cause"]) or [(None, None)]
    ]
    kept = f"; {len(findings)} findings kept" if findings else ""
    if error:
        return Verdict(ERROR, f"run error: {error['error']}: {error['message']}{kept}", {}, tally)
    unknown = [c.checker for c in checks if c.valid is None and c.error]
    if unknown:
        return Verdict(ERROR, f"checker(s) could not decide: {', '.join(unknown)}", {}, tally)
    unexplained = [f for f, (fault, _) in zip(findings, credits) if fault is None]
    planted = {f.name: verify.get(f.name, {}) for f in sc.faults if f.defect}
    ttd, missed = {}, []
    for name, v in planted.items():
        if not v.get("fired"):
            continue
        expected = _expected(sc, name)
        known = [
            f.known - v["first_step"]
            for f, e in zip(findings, explained)
            if (name, "cause") in e and f.checker in expected
        ]
        window = sc.expect.within_steps
        window = (
            window.get(name, max(window.values(), default=0))
            if isinstance(window, dict)
            else window
        )
        if known and min(known) <= window:
            ttd[name] = min(known)
        else:
            late = f" (first known after {min(known)} steps)" if known else ""
            missed.append(f"{name}{late}")
    bug = ""
    if unexplained:
        first = story(unexplained)[0][0]  # the root: a bystander never heads the summary
        bug = (
            f"{first.checker} at step {first.step} is explained by no planted fault: "
            f"{first.message}"
            + (f" (+{len(unexplained) - 1} more unexplained)" if len(unexplained) > 1 else "")
        )
    if missed:
        return Verdict(
            MISSED,
            f"fired but not caught by {sc.expect.checkers} within {sc.expect.within_steps} "
            f"steps: {', '.join(missed)}" + (f"; and a bug found: {bug}" if bug else ""),
            ttd,
            tally,
        )
    if unexplained:
        return Verdict(FAIL, f"bug found: {bug}", ttd, tally)
    # a fault that could not plant in this block manager says why (its verify's not_applicable)
    not_fired = [_named(n, v) for n, v in planted.items() if not v.get("fired")]
    if not_fired:
        return Verdict(
            INCONCLUSIVE, f"planted defect never fired: {', '.join(not_fired)}", {}, tally
        )
    if not planted and sc.expect.outcome == "detect":
        return Verdict(INCONCLUSIVE, "expected a detection but no defect is planted", {}, tally)
    idle = [
        _named(f.name, verify.get(f.name, {}))
        for f in sc.faults
        if not f.defect and not verify.get(f.name, {}).get("triggered")
    ]
    if idle:
        return Verdict(INCONCLUSIVE, f"trigger never pulled: {', '.join(idle)}", {}, tally)
    if exercised is not None and not exercised.get("tokens"):
        return Verdict(INCONCLUSIVE, "the run exercised nothing: no token was generated", {}, tally)
    judged = [c for c in checks if c.valid is not None]
    not_judged = [c.checker for c in checks if c.valid is None]
    extra = f", not judged: {', '.join(not_judged)}" if not_judged else ""
    if not planted:
        pulled = ", ".join(
            f"{f.name} pulled {verify[f.name]['triggered']}x, remediated "
            f"{verify[f.name].get('remediated', 0)}x"
            for f in sc.faults
        )
        return Verdict(
            PASS,
            f"clean: {len(judged)} checkers held{extra}" + (f"; {pulled}" if pulled else ""),
            {},
            tally,
        )
    caught = sorted({f.checker for f, (fault, how) in zip(findings, credits) if how == "cause"})
    return Verdict(
        PASS,
        f"planted, fired and caught by {', '.join(caught)} "
        f"(time to detect: {', '.join(f'{k} {v} steps' for k, v in ttd.items())})",
        ttd,
        tally,
    )
