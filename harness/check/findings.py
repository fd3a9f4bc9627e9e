"""Findings and check results: what every checker returns. Tri-state, Jepsen-style: held,
fired (findings), or unknown (the checker raised); and "not judged" when it had nothing to see."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)  # records are built by keyword
class Finding:
    checker: str
    step: int
    message: str
    evidence: dict = field(default_factory=dict)
    manifest: bool | None = (
        None  # True: outputs diverged; False: latent (structure only); None: n/a
    )
    kind: str = ""  # short tag, part of the incident fingerprint
    known_at: int | None = None  # the step the check that found it ran (None: at `step`)

    @property
    def known(self) -> int:
        return self.step if self.known_at is None else self.known_at


@dataclass(kw_only=True)
class CheckResult:
    checker: str
    # True held, False findings, None: could not decide (error set) or had nothing to judge
    valid: bool | None
    findings: list[Finding] = field(default_factory=list)
    error: str | None = None
    checked: int = 0  # how many things it looked at (steps, snapshots, requests)

    @property
    def status(self) -> Literal["held", "fired", "unknown", "not judged"]:
        if self.valid is None:
            return "unknown" if self.error else "not judged"
        return "held" if self.valid else "fired"

    def to_dict(self) -> dict:  # evidence is plain data, shared (asdict's deep copy costs more)
        findings = [dict(f.__dict__) for f in self.findings]
        return {**self.__dict__, "findings": findings, "status": self.status}


def judged_result(name: str, findings: list[Finding], checked: int) -> CheckResult:
    """A checker that looked at nothing never held: it was not judged."""
    findings.sort(key=lambda f: f.step)
    return CheckResult(
        checker=name,
        valid=not findings if checked or findings else None,
        findings=findings,
        error=None,
        checked=checked,
    )


def of_kind(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e.get("e") == kind]
