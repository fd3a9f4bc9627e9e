"""The reference prefix cache's hit rate on a run's own admissions, from its history alone: the
reference manager (kvchaos.engine.prefix_manager) is driven, without a model, through the lives
of the run's requests as the history tells them, and answers each admission the engine made.

What the history tells: each request's prompt ids (a submit's `prompt_ids`, recorded with a
prefix cache), the tokens it generated (the steps' `tokens`), when it entered the engine's
running list (the snapshots' `live`: an admission, or a readmission after a preemption, known
tokens = prompt + what it generated), when it left it (finished, cancelled, preempted). On that
timeline the replay admits with every known token at once, keys a request's prompt blocks once
its prefill is done (the step it produced its first token) and each generated token's block as
it is computed, and releases as the run released. A forked child sharing its parent's blocks is
not admitted (as in the run): the reference forks it too. The replay is checked against the
engine's own counts (admissions, known tokens): when they differ it did not see the run's
admissions, and the comparison is not judged.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TypedDict

from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.prefix_manager import PrefixCachingManager


class HitReplay(TypedDict, total=False):
    judged: bool
    why: str  # not judged: why
    admissions: int
    known_tokens: int
    hit_tokens: int  # the run's manager
    hit_rate: float
    reference_hit_tokens: int  # the reference, on the same admissions
    reference_hit_rate: float
    reference_refused: int  # admissions or growth the reference had no room for in the replay


def _not_judged(why: str) -> HitReplay:
    return {"judged": False, "why": why}


class _Replay:
    def __init__(self, start: dict, used: dict) -> None:
        cache = start["config"]["cache"]
        self.ref = PrefixCachingManager(cache["num_blocks"], cache["block_size"])
        self.max_seqs = cache.get("max_num_seqs")
        self.budget = start["config"].get("max_prefill_tokens")
        self.forks = "fork" in start.get("capabilities", ())
        self.used = used  # (step, req) -> the tokens the run's cache served at that admission
        self.tokens: dict[str, list[int]] = {}  # every request's tokens as the engine has them
        self.running: set[str] = set()  # in the engine's running list
        self.held: set[str] = set()  # holding blocks in the reference
        self.done: dict[str, int] = {}  # prefilling: tokens the run has computed
        self.hit: dict[str, int] = {}  # prefilling: tokens the reference served
        self.admissions = self.known = self.hits = self.refused = 0

    def release(self, req: str) -> None:
        self.running.discard(req)
        self.done.pop(req, None)
        if req in self.held:
            self.held.discard(req)
            self.ref.release(req, "aborted")

    def submit(self, ev: dict, fork_refused: bool) -> None:
        req, parent = ev["req"], ev.get("parent")
        self.tokens[req] = list(ev["prompt_ids"])
        full = self.max_seqs is not None and len(self.running) >= self.max_seqs
        if parent is None or not self.forks or parent not in self.running or fork_refused or full:
            return
        # shares its parent's blocks: running, never admitted; it computes what the parent had
        # not (its last token) and its own extra tokens
        self.running.add(req)
        if parent in self.held:
            self.ref.fork(parent, req)
            self.held.add(req)
        done = len(self.tokens[parent]) - 1
        if len(self.tokens[req]) - done > 1:
            self.done[req] = done

    def admit(self, step: int, req: str) -> None:
        known = self.tokens[req]
        self.admissions += 1
        self.known += len(known)
        self.running.add(req)
        self.done[req] = self.used.get((step, req), 0)
        self.hit[req] = 0
        try:  # the smallest reservation; the prefill's chunks grow it as the run computed them
            self.hit[req] = self.ref.admit(req, known, 1, len(known) - 1)
            self.hits += self.hit[req]
            self.held.add(req)
        except OutOfBlocks:
            self.refused += 1

    def _reach(self, req: str, n: int) -> bool:
        """Slots in the reference for req's first n tokens."""
        have = len(self.ref.tokens[req])
        if n <= have:
            return True
        try:
            self.ref.append(req, self.tokens[req][have:n])
            return True
        except OutOfBlocks:
            return False

    def step(self, t: int, ev: dict, live: list[str]) -> None:
        for req in ev["preempted"]:
            self.release(req)
        out, computed = ev["tokens"], {}
        for req in out:  # decodes: the token produced last is appended and computed now
            if req in self.held and req not in self.done:
                if self._reach(req, len(self.tokens[req])):
                    computed[req] = len(self.tokens[req])
                else:
                    self.refused += 1
                    self.release(req)
                    self.running.add(req)
        budget, left = self.budget, ev["prefill_tokens"]  # given out, and what was computed
        for req in live:  # in the running list's order, as the scheduler gives out its budget
            new = req not in self.running
            if new:
                self.admit(t, req)
            if req in self.done:
                n, was = len(self.tokens[req]), self.done[req]
                # a chunk takes min(uncomputed, budget) of the budget; an admission's hit only
                # shortens what it computes
                take = min(n if new else n - was, budget)
                budget -= take
                done = n if req in out else min(n - 1, was + take, was + left)
                left -= done - was
                self.done[req] = done
                if req in self.held:
                    self._reach(req, done)
                    computed[req] = max(done, self.hit.get(req, 0))
        for req in out:
            self.done.pop(req, None)  # its prefill is done: it decodes
        if computed:
            self.ref.end_step(computed)
        for req, tok in out.items():
            self.tokens[req].append(tok)
        for req in (*ev["finished"], *ev.get("failed", ())):
            self.release(req)


def replay_hits(events: list[dict]) -> HitReplay:
    """The run's hit rate and the reference's on the same admissions (see the module's doc)."""
    start = next((e for e in events if e.get("e") == "run_start"), None)
    end = next((e for e in reversed(events) if e.get("e") == "run_end"), None)
    if start is None or end is None:
        return _not_judged("the history has no run_start or no run_end")
    c = end.get("counters", {})
    if "admissions" not in c:
        return _not_judged("the manager offers no prefix cache")
    submits = [e for e in events if e.get("e") == "submit"]
    if any("prompt_ids" not in e for e in submits):
        return _not_judged("the history records no prompt ids (recorded before kvchaos kept them)")
    used = {
        (e["step"], e["data"]["req"]): e["data"]["used"]
        for e in events
        if e.get("e") == "engine" and e["kind"] == "hit"
    }
    r = _Replay(start, used)
    live: dict[int, list[str]] = {}
    between: dict[int, list[dict]] = defaultdict(list)  # step -> submits and cancels before it
    steps, fork_refusals = [], set()
    for e in events:
        kind = e.get("e")
        if kind == "snapshot":
            live.setdefault(e["step"], e["live"])
        elif kind in ("submit", "cancel"):
            between[e["step"]].append(e)
        elif kind == "step":
            steps.append(e)
        elif kind == "engine" and e["kind"] == "refusal" and e["data"].get("call") == "fork":
            fork_refusals.add((e["step"], e["data"]["seq"]))
    for ev in steps:
        t = ev["step"]
        if t not in live:
            return _not_judged(f"no snapshot of step {t}: the engine's running list is not known")
        for a in between.pop(t, ()):
            if a["e"] == "cancel":
                r.release(a["req"])
            else:
                r.submit(a, (t - 1, a["req"]) in fork_refusals)
        r.step(t, ev, live[t])
    if (r.admissions, r.known) != (c["admissions"], c["known_tokens"]):
        return _not_judged(
            f"the replay saw {r.admissions} admissions of {r.known} known tokens, the engine "
            f"counted {c['admissions']} of {c['known_tokens']}"
        )
    known = c["known_tokens"]
    return {
        "judged": True,
        "admissions": c["admissions"],
        "known_tokens": known,
        "hit_tokens": c["hit_tokens"],
        "hit_rate": round(c["hit_tokens"] / known, 4) if known else 0.0,
        "reference_hit_tokens": r.hits,
        "reference_hit_rate": round(r.hits / known, 4) if known else 0.0,
        "reference_refused": r.refused,
    }
