"""What every fault has: a trigger (workload shape or environment perturbation), a defect that can
be planted on the engine's seams, a schedule, verify() with evidence from counters, the checkers
expected to catch it, and the root cause and remediation an incident report quotes."""
from __future__ import annotations

import random
from typing import Callable

from engine.engine import Engine


class Fault:
    name: str = ""
    detectors: tuple[str, ...] = ()
    root_cause: str = ""
    remediation: str = ""
    defaults: dict = {}

    def __init__(self, defect: bool, params: dict, seed: int) -> None:
        unknown = set(params) - set(self.defaults)
        if unknown:
            raise ValueError(f"fault {self.name}: unknown param {sorted(unknown)[0]!r}; "
                             f"allowed: {sorted(self.defaults)}")
        self.defect = defect
        self.p = {**self.defaults, **params}
        self.rng = random.Random(f"{seed}/fault/{self.name}")
        self.emit: Callable[..., None] = lambda kind, detail, step=None: None
        self.fired_steps: list[int] = []

    def shape(self, plan, engine_config) -> None:
        """Add the trigger's requests and cancels to the workload plan."""

    def arm(self, engine: Engine, emit: Callable[[str, dict], None]) -> None:
        """Attach to the engine's seams. emit(kind, detail, step=None) records a fault event."""
        self.emit = emit

    def before_step(self, engine: Engine, step: int) -> None:
        """Environment perturbations on a schedule."""

    def after_step(self, engine: Engine, step: int, output) -> None:
        """Read counters: record the steps at which the defect fired."""

    def fired(self, step: int, detail: dict) -> None:
        self.fired_steps.append(step)
        self.emit("fired", detail, step)

    def verify(self) -> dict:
        """Evidence, from counters, that the planted defect really fired."""
        return {"fired": bool(self.fired_steps), "first_step": self.fired_steps[0] if self.fired_steps else None,
                "times": len(self.fired_steps)}

    def describe(self) -> dict:
        return {"name": self.name, "defect": self.defect, "params": self.p, "detectors": list(self.detectors),
                "root_cause": self.root_cause, "remediation": self.remediation}
