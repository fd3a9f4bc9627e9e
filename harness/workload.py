"""Seeded workloads: arrivals, prompt and output lengths, shared-prefix forks, cancel schedules.
The same seed gives the same plan. Faults add their triggers to the plan before the run."""
from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from harness.scenario import LengthDist, ScenarioError, Workload


@dataclass
class Action:
    step: int                 # earliest step; with `when`, it waits until the request is in that phase
    op: str                   # submit | fork | cancel
    req: str
    prompt: list[int] = field(default_factory=list)
    max_new: int = 0
    parent: str | None = None  # fork source
    when: str | None = None    # waiting | prefill | decode | preempted | shared
    origin: str = "workload"   # or the fault that added it

    def to_dict(self) -> dict:
        d = {"step": self.step, "op": self.op, "req": self.req, "origin": self.origin}
        if self.op in ("submit", "fork"):
            d.update(prompt_len=len(self.prompt), max_new=self.max_new)
        if self.parent:
            d["parent"] = self.parent
        if self.when:
            d["when"] = self.when
        return d


def sample_length(d: LengthDist, rng: random.Random) -> int:
    if d.dist == "fixed":
        return d.value
    if d.dist == "uniform":
        return rng.randint(d.min, d.max)
    if d.dist == "lognormal":
        x = rng.lognormvariate(math.log(d.median), d.sigma)
    else:  # bimodal
        x = d.modes[0] if rng.random() < d.weight else d.modes[1]
        x = rng.gauss(x, max(1.0, 0.1 * x))
    return max(d.min, min(d.max, int(round(x))))


def read_lengths(path: str) -> list[tuple[int, int]]:
    """CSV (prompt_len,output_len per row, header optional) or JSONL ({"prompt_len":, "output_len":})."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ScenarioError(f"cannot read {path}: {e.strerror}") from None
    out = []
    if p.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    r = json.loads(line)
                    out.append((n, int(r["prompt_len"]), int(r["output_len"])))
                except (ValueError, KeyError, TypeError):
                    raise ScenarioError(f"{path}:{n}: expected {{\"prompt_len\": int, \"output_len\": int}}") from None
    else:
        for n, row in enumerate(csv.reader(text.splitlines()), 1):
            if not row or (n == 1 and not row[0].strip().lstrip("+-").isdigit()):
                continue  # blank line or header
            try:
                out.append((n, int(row[0]), int(row[1])))
            except (ValueError, IndexError):
                raise ScenarioError(f"{path}:{n}: expected prompt_len,output_len") from None
    for n, a, b in out:
        if a < 1 or b < 1:
            raise ScenarioError(f"{path}:{n}: lengths must be >= 1, got prompt_len={a} output_len={b}")
    if not out:
        raise ScenarioError(f"{path}: no lengths in the file")
    return [(a, b) for _, a, b in out]


class Plan:
    """Every action of a run, by step. Request ids are r0, r1, ... (forks f0, ...)."""

    def __init__(self, vocab: int, rng: random.Random) -> None:
        self.vocab, self.rng = vocab, rng
        self.actions: list[Action] = []

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def add(self, action: Action) -> None:
        self.actions.append(action)

    def by_step(self) -> dict[int, list[Action]]:
        out: dict[int, list[Action]] = {}
        for a in sorted(self.actions, key=lambda a: a.step):  # stable: same-step order kept
            out.setdefault(a.step, []).append(a)
        return out


def build_plan(w: Workload, vocab: int, seed: int) -> Plan:
    rng = random.Random(f"{seed}/workload")
    plan = Plan(vocab, rng)
    lengths = read_lengths(w.lengths_file) if w.lengths_file else None
    n = len(lengths) if lengths else w.num_requests
    t = 1.0
    submitted: list[Action] = []
    for i in range(n):
        t += rng.expovariate(w.arrival_rate)
        p, o = lengths[i] if lengths else (sample_length(w.prompt_len, rng), sample_length(w.output_len, rng))
        a = Action(int(t), "submit", f"r{i}", plan.prompt(p), o)
        plan.add(a)
        submitted.append(a)
    for g in range(min(w.fork_groups, len(submitted))):
        parent = submitted[rng.randrange(len(submitted))]
        plan.add(Action(parent.step + 1, "fork", f"f{g}", plan.prompt(w.fork_extra_tokens),
                        sample_length(w.output_len, rng), parent=parent.req, when="decode"))
    c = w.cancel
    for a in submitted:
        if rng.random() < c.rate:
            plan.add(Action(a.step + rng.randint(0, 12), "cancel", a.req))
    for i, phase in enumerate(c.phases):
        if phase == "shared" and w.fork_groups:
            plan.add(Action(1, "cancel", f"f{i % w.fork_groups}", when="shared"))
        elif submitted:
            target = submitted[(i * 7 + 3) % len(submitted)]
            plan.add(Action(target.step, "cancel", target.req, when=phase))
    if c.storm_step is not None:
        for a in submitted:
            if a.step <= c.storm_step and rng.random() < c.storm_fraction:
                plan.add(Action(c.storm_step, "cancel", a.req, origin="storm"))
    return plan
