"""Seeded workloads: arrivals, prompt and output lengths, shared-prefix forks, cancel schedules.
The same seed gives the same plan. Faults add their triggers to the plan before the run."""

from __future__ import annotations

import math
import random

from kvchaos.faults.plan import Action, Plan
from kvchaos.harness.judge.scenario import LengthDist, Workload, read_lengths


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


def build_plan(w: Workload, vocab: int, seed: int) -> Plan:
    rng = random.Random(f"{seed}/workload")
    plan = Plan(vocab, rng)
    lengths = read_lengths(w.lengths_file) if w.lengths_file else None
    n = len(lengths) if lengths else w.num_requests
    t = 1.0
    submitted: list[Action] = []
    for i in range(n):
        t += rng.expovariate(w.arrival_rate)
        p, o = (
            lengths[i]
            if lengths
            else (sample_length(w.prompt_len, rng), sample_length(w.output_len, rng))
        )
        a = Action(int(t), "submit", f"r{i}", plan.prompt(p), o)
        plan.add(a)
        submitted.append(a)
    for g in range(min(w.fork_groups, len(submitted))):
        parent = submitted[rng.randrange(len(submitted))]
        plan.add(
            Action(
                parent.step + 1,
                "fork",
                f"f{g}",
                plan.prompt(w.fork_extra_tokens),
                sample_length(w.output_len, rng),
                parent=parent.req,
                when="decode",
            )
        )
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
