"""Seeded workloads: arrivals, prompt and output lengths, shared-prefix forks, cancel schedules,
prompts sharing prefixes ([workload.prefix]). The same seed gives the same plan. Faults add their
triggers to the plan before the run."""

from __future__ import annotations

import math
import random

from kvchaos.faults.plan import Action, Plan
from kvchaos.harness.run.shapes import add_shapes
from kvchaos.harness.scenario.spec import LengthDist, PrefixSpec, Workload, read_lengths


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


class SharedPrompts:
    """Prompts of a [workload.prefix]: a group's prefix (or an earlier prompt repeated) before the
    request's own tokens; then its samples and turns. Its own random stream, so a plan without
    the section draws exactly what it always did."""

    def __init__(self, spec: PrefixSpec, plan: Plan, w: Workload, seed: int, block_size: int):
        self.spec, self.plan, self.w, self.bs = spec, plan, w, block_size
        self.rng = random.Random(f"{seed}/prefix")
        self.segments = [plan.prompt(block_size, self.rng) for _ in range(spec.segments)]
        self.prefixes = [
            self._tokens(sample_length(spec.prefix_len, self.rng)) for _ in range(spec.groups)
        ]
        self.prompts: list[list[int]] = []  # every base request's prompt, for repeats

    def _tokens(self, n: int) -> list[int]:
        """n random tokens; with segments, whole blocks drawn from the shared segments."""
        if not self.spec.segments:
            return self.plan.prompt(n, self.rng)
        return [t for _ in range(-(-n // self.bs)) for t in self.rng.choice(self.segments)]

    def prompt(self, own: int) -> list[int]:
        rng, spec = self.rng, self.spec
        if self.prompts and rng.random() < spec.repeat:
            p = list(rng.choice(self.prompts))
        elif spec.groups and rng.random() < spec.share:
            p = self.prefixes[rng.randrange(spec.groups)] + self._tokens(own)
        else:
            p = self._tokens(own)
        self.prompts.append(p)
        return p

    def follow(self, a: Action) -> None:
        """a's samples (same prompt, once a decodes) and turns (each after the last finished)."""
        spec, rng, out = self.spec, self.rng, self.w.output_len
        for k in range(1, spec.samples):
            o = sample_length(out, rng)
            self.plan.add(
                Action(
                    a.step, "submit", f"{a.req}s{k}", list(a.prompt), o, when="decode", after=a.req
                )
            )
        prev = a.req
        for k in range(1, spec.turns + 1):
            new = self.plan.prompt(sample_length(spec.turn_len, rng), rng)
            turn = Action(
                a.step + k,
                "turn",
                f"{a.req}t{k}",
                new,
                sample_length(out, rng),
                parent=prev,
                when="finished",
            )
            self.plan.add(turn)
            prev = turn.req


def build_plan(
    w: Workload, vocab: int, seed: int, block_size: int = 16, cache=None, chunk: int = 0
) -> Plan:
    """block_size: the engine's (segments of a prefix workload are whole blocks); cache (the
    engine's CacheConfig) and chunk (its max_prefill_tokens): what [workload.shapes] is cut to."""
    rng = random.Random(f"{seed}/workload")
    plan = Plan(vocab, rng)
    shared = SharedPrompts(w.prefix, plan, w, seed, block_size) if w.prefix else None
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
        a = Action(int(t), "submit", f"r{i}", shared.prompt(p) if shared else plan.prompt(p), o)
        plan.add(a)
        submitted.append(a)
        if shared:
            shared.follow(a)
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
    if w.shapes is not None and cache is not None:
        add_shapes(plan, w.shapes, seed, cache, chunk or 2 * block_size)
    if w.think is not None:  # its own stream: a plan without think time draws what it did
        think = random.Random(f"{seed}/think")
        for a in submitted:
            if think.random() < w.think.share:
                at = a.step
                for _ in range(w.think.pauses):  # each waits for its request to decode again
                    idle = sample_length(w.think.think_steps, think)
                    plan.add(Action(at, "pause", a.req, max_new=idle, when="decode"))
                    at += idle + 3
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
