"""A run's plan: every submit, fork and cancel, by step. The workload builds it from a seed; each
fault's trigger adds its own actions before the run. Shared vocabulary of faults and harness."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Action:
    step: int  # earliest step; with `when`, it waits until the request is in that phase
    op: str  # submit | fork | cancel | turn | pause (max_new: the steps it stays idle)
    req: str
    prompt: list[int] = field(default_factory=list)  # a turn: only its new user tokens
    max_new: int = 0
    parent: str | None = None  # fork source; a turn's previous turn
    # waiting | prefill | decode | preempted | shared | finished | loading (waiting, holding)
    when: str | None = None
    origin: str = "workload"  # or the fault that added it
    after: str | None = None  # a submit that waits until this request is in phase `when`

    def to_dict(self) -> dict:
        d = {"step": self.step, "op": self.op, "req": self.req, "origin": self.origin}
        if self.op in ("submit", "fork", "turn"):
            d.update(prompt_len=len(self.prompt), max_new=self.max_new)
        elif self.op == "pause":
            d["idle"] = self.max_new
        if self.parent:
            d["parent"] = self.parent
        if self.when:
            d["when"] = self.when
        if self.after:
            d["after"] = self.after
        return d


class Plan:
    """Every action of a run, by step. Request ids are r0, r1, ... (forks f0, ...; a request's
    samples r0s1, ..., its turns r0t1, ...)."""

    def __init__(self, vocab: int, rng: random.Random) -> None:
        self.vocab, self.rng = vocab, rng
        self.actions: list[Action] = []

    def prompt(self, n: int, rng: random.Random | None = None) -> list[int]:
        rng = rng or self.rng
        return [rng.randrange(self.vocab) for _ in range(n)]

    def add(self, action: Action) -> None:
        self.actions.append(action)

    def by_step(self) -> dict[int, list[Action]]:
        out: dict[int, list[Action]] = {}
        for a in sorted(self.actions, key=lambda a: a.step):  # stable: same-step order kept
            out.setdefault(a.step, []).append(a)
        return out
