"""The verdict of one run: scenario expectation x checker results x fault.verify()."""

from __future__ import annotations

from dataclasses import dataclass

PASS, MISSED, FAIL, INCONCLUSIVE, ERROR = "PASS", "MISSED", "FAIL", "INCONCLUSIVE", "ERROR"
# Verdict names recorded by older releases: FALSE_ALARM read as "the harness was wrong", yet it is
# what a real bug in the system under test gets.
LEGACY = {"FALSE_ALARM": FAIL}
EXIT_CODES = {PASS: 0, MISSED: 10, FAIL: 11, INCONCLUSIVE: 12, ERROR: 13}
# For many runs: the exit code of the most serious verdict seen.
SEVERITY = [MISSED, FAIL, ERROR, INCONCLUSIVE, PASS]
MEANING = {
    PASS: "as expected: clean and clean, or planted, fired and caught",
    MISSED: "a planted defect fired and no expected checker caught it in time: the harness failed",
    FAIL: "bug found: a checker fired with nothing planted, or the remediation failed",
    INCONCLUSIVE: "the planted defect never fired: the trigger did not provoke it",
    ERROR: "the run itself broke (engine exception, timeout, or a checker that could not decide)",
}


@dataclass
class Verdict:
    verdict: str
    summary: str
    time_to_detect: dict  # fault name -> steps from first firing to the first expected finding

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]


def current(verdict: str | None) -> str | None:
    """A recorded verdict in today's names."""
    return LEGACY.get(verdict, verdict)


def worst(verdicts: list[str]) -> str:
    return min(verdicts, key=SEVERITY.index) if verdicts else PASS


def decide(sc, checks: list, verify: dict, error: dict | None) -> Verdict:
    fired_checks = [c for c in checks if c.valid is False]
    unknown = [c for c in checks if c.valid is None]
    if error:
        return Verdict(ERROR, f"run error: {error['error']}: {error['message']}", {})
    if unknown:
        return Verdict(
            ERROR, f"checker(s) could not decide: {', '.join(c.checker for c in unknown)}", {}
        )
    planted = {f.name: verify.get(f.name, {}) for f in sc.faults if f.defect}
    if not planted:
        if fired_checks:
            first = min((f for c in fired_checks for f in c.findings), key=lambda f: f.step)
            return Verdict(
                FAIL,
                f"{first.checker} fired with nothing planted (step {first.step}): {first.message}",
                {},
            )
        if sc.expect.outcome == "detect":
            return Verdict(INCONCLUSIVE, "expected a detection but no defect is planted", {})
        return Verdict(PASS, f"clean: {len(checks)} checkers held", {})
    not_fired = [n for n, v in planted.items() if not v.get("fired")]
    if not_fired:
        return Verdict(INCONCLUSIVE, f"planted defect never fired: {', '.join(not_fired)}", {})
    ttd, missed = {}, []
    by_name = {c.checker: c for c in checks}
    for name, v in planted.items():
        start = v["first_step"]
        steps = [
            f.step - start
            for c in sc.expect.checkers
            for f in by_name[c].findings
            if f.step >= start
        ]
        if steps and min(steps) <= sc.expect.within_steps:
            ttd[name] = min(steps)
        else:
            late = f" (first after {min(steps)} steps)" if steps else ""
            missed.append(f"{name}{late}")
    if missed:
        return Verdict(
            MISSED,
            f"fired but not caught by {sc.expect.checkers} within {sc.expect.within_steps} "
            f"steps: {', '.join(missed)}",
            ttd,
        )
    caught = sorted({c.checker for c in fired_checks if c.checker in sc.expect.checkers})
    return Verdict(
        PASS,
        f"planted, fired and caught by {', '.join(caught)} "
        f"(time to detect: {', '.join(f'{k} {v} steps' for k, v in ttd.items())})",
        ttd,
    )
