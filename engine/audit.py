"""A step's plan against what the manager's calls then took: the manager's estimates
(`blocks_needed`) and the preemptions the scheduler made on them. Throughput, never correctness.
It speaks only when it finds something, through the engine's event seam, so a manager whose
estimates hold leaves no trace in the history. Only managers offering "estimates" are audited
(without them the engine plans on its own count).

Its two engine events (harness/check/performance.py judges them):
  "estimate_off"         a growth call took other than the manager's estimate for it said
  "unneeded_preemption"  a preemption whose growth fitted after all: what that growth took
                         (measured on the calls after the preemption; a sequence that did not
                         grow, at its estimate) was no more than the manager had free when the
                         victim was chosen

An estimate, or a measured take, stands for another moment only while nothing in between could
have changed it: no copy-on-write was made, and no sequence of the same fork lineage was
released (either takes a share off a block, so a later append copies less).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypedDict

Why = Literal["estimate", "refusal"]


class EstimateOff(TypedDict):
    call: Literal["append", "append_decode"]
    seqs: list[str]
    tokens: int  # per sequence
    estimate: int  # blocks_needed's answer (summed over a decode batch)
    took: int  # free blocks the call took


class UnneededPreemption(TypedDict):
    victim: str
    why: Why  # planned on the estimates, or after a refused growth
    free: int  # free blocks when the victim was chosen
    needed: int  # what the growth it made room for took
    estimate: int  # what the estimates said that growth would take


@dataclass(kw_only=True)
class _Take:
    seqs: tuple[str, ...]  # one sequence, or a decode batch
    took: int
    at: int  # its place in the step's log


@dataclass(kw_only=True)
class _Round:
    why: Why
    free: int
    estimates: dict[str, int]  # the growth it makes room for: sequence -> its estimate
    victim: str
    at: int


@dataclass
class Audit:
    engine: object
    # seq -> (tokens, estimate, log place) of the plan's latest estimate
    estimates: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    takes: list[_Take] = field(default_factory=list)
    rounds: list[_Round] = field(default_factory=list)
    # the step's happenings, in order: a lineage released, None for a copy-on-write, "" otherwise
    log: list[str | None] = field(default_factory=list)

    @property
    def on(self) -> bool:
        return "estimates" in self.engine.capabilities

    def begin(self) -> None:
        """A step's planning starts."""
        self.estimates.clear()
        self.takes.clear()
        self.rounds.clear()
        self.log.clear()

    def lineage(self, seq_id: str) -> str:
        seqs = self.engine.seqs
        s = seqs[seq_id]
        while s.parent is not None and s.parent in seqs:
            s = seqs[s.parent]
        return s.id

    def _clean(self, seq_id: str, since: int, until: int) -> bool:
        """Nothing between the two places of the log could have changed seq_id's growth."""
        between = self.log[since:until]
        return None not in between and self.lineage(seq_id) not in between

    # -- what the scheduler tells it ---------------------------------------------------------
    def asked(self, seq, n: int, estimate: int) -> None:
        """The estimate the plan took for n more tokens of seq (the manager's, for one it holds)."""
        if seq.holds:
            self.estimates[seq.id] = (n, estimate, len(self.log))

    def preempting(self, why: Why, free: int, growth: list, victim) -> None:
        """victim is about to be preempted to make room for growth (sequences), free blocks free."""
        ests = {s.id: self.estimates[s.id][1] for s in growth if s.id in self.estimates}
        if self.on and growth and len(ests) == len(growth):
            self.rounds.append(
                _Round(why=why, free=free, estimates=ests, victim=victim.id, at=len(self.log))
            )

    def release(self, seq) -> None:
        self.log.append(self.lineage(seq.id))

    def grew(self, call, seqs: list, n: int, before: int, after: int, copies: list) -> None:
        """A growth call of n tokens each for seqs returned; free counts before and after it."""
        if not self.on:
            return
        at, took = len(self.log), before - after
        asked = [self.estimates.get(s.id) for s in seqs]
        fresh = all(
            a is not None and a[0] == n and self._clean(s.id, a[2], at) for s, a in zip(seqs, asked)
        )
        est = sum(a[1] for a in asked) if fresh else None
        # a batch that copied may need fewer copies than its members' estimates, each alone
        if fresh and est != took and not (copies and len(seqs) > 1):
            off: EstimateOff = {
                "call": call,
                "seqs": [s.id for s in seqs],
                "tokens": n,
                "estimate": est,
                "took": took,
            }
            self.engine.seams.on_event("estimate_off", dict(off))
        if not (copies and len(seqs) > 1):
            self.takes.append(_Take(seqs=tuple(s.id for s in seqs), took=took, at=at))
        self.log.append(None if copies else "")

    # -- after the step's reservations ---------------------------------------------------------
    def settle(self) -> None:
        """Re-check each preemption against what the growth it made room for took."""
        if not self.on:
            return
        for r in self.rounds:
            left, needed = dict(r.estimates), 0
            for t in self.takes:  # the first clean take after the round of each of its sequences
                if (
                    t.at >= r.at
                    and all(s in left for s in t.seqs)
                    and all(self._clean(s, r.at, t.at) for s in t.seqs)
                ):
                    needed += t.took
                    for s in t.seqs:
                        del left[s]
            if r.why == "refusal" and left:
                continue  # the refused sequence never grew again: nothing to re-check it by
            needed += sum(left.values())  # did not grow (preempted, refused): at its estimate
            if needed <= r.free:
                data: UnneededPreemption = {
                    "victim": r.victim,
                    "why": r.why,
                    "free": r.free,
                    "needed": needed,
                    "estimate": sum(r.estimates.values()),
                }
                self.engine.seams.on_event("unneeded_preemption", dict(data))
