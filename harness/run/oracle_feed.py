"""The requests' logits on their way to the contiguous-cache oracle: collected as the run steps,
checked in padded batches as requests stop producing (and every few steps for those still live),
each result an oracle event; the first check's longest request is cross-checked against the
float64 reference."""

from __future__ import annotations

import torch

from kvchaos.harness.run.reference import cross_check

# Requests that produce no more tokens wait for the oracle in a queue, checked in padded passes
# of up to this many (the reference model's cost is mostly per op); the rest at the run's end.
ORACLE_BATCH = 16
# Live requests are checked at least this often, so when a divergence is known does not depend on
# the batching above: a request found diverged is reported then, and checked no more.
ORACLE_EVERY = 8


class OracleFeed:
    """What awaits the oracle: each live request's logits and the steps they came at, the queue
    of requests done producing, the requests already found diverged."""

    def __init__(self, oracle, engine, history, planned: dict) -> None:
        self.oracle, self.engine, self.history = oracle, engine, history
        self.planned = planned  # each request's prompt as planned (the run's own dict)
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.token_steps: dict[str, list[int]] = {}
        self.results: list[dict] = []
        # requests done producing: (step, token steps, Oracle.check_many item, prompt mismatch)
        self.queue: list = []
        self.cross_checked = False  # the shared model code against the reference, once a run
        self.known_diverged: set[str] = set()  # reported by a live check: not collected again

    def step(self, step: int, out) -> None:
        """A step's output: its logits kept, its finished requests queued, a live check due."""
        for req, row in out.logits.items():
            if req in self.known_diverged:
                continue
            self.logits.setdefault(req, []).append(row)
            self.token_steps.setdefault(req, []).append(step)
        for req in (*out.finished, *out.failed):
            self.done(req, step)
        if step % ORACLE_EVERY == 0:
            self.check_live(step)

    def finish(self, step: int) -> None:
        """The run's end: what the still-running produced, and the whole queue, checked."""
        for req in list(self.logits):
            self.done(req, step)
        self._check_queue()

    def done(self, req: str, step: int, keep: bool = False) -> None:
        """Queue a request that will produce no more tokens for the oracle; checked in batches.
        keep: a live request's check so far (its rows stay for the next)."""
        rows = self.logits.get(req, []) if keep else self.logits.pop(req, [])
        steps = list(self.token_steps.get(req, [])) if keep else self.token_steps.pop(req, [])
        if rows:
            seq = self.engine.seqs[req]
            planned = self.planned.get(req, seq.tokens[: seq.prompt_len])
            stored = seq.tokens[: seq.prompt_len]
            mismatch = (
                None
                if stored == planned  # at C speed: the common case, every live check
                else next(
                    (i for i, (a, b) in enumerate(zip(stored, planned)) if a != b),
                    min(len(stored), len(planned)),
                )
            )
            tokens = planned + seq.tokens[seq.prompt_len :]
            self.queue.append(
                (step, steps, (req, tokens, len(planned), torch.stack(rows)), mismatch)
            )
            if len(self.queue) >= ORACLE_BATCH and not keep:
                self._check_queue()

    def check_live(self, step: int) -> None:
        """The queue and every request still producing tokens (on what it produced so far), in
        one set of padded passes."""
        done = len(self.queue)
        for req in [r for r in self.logits if self.logits[r]]:
            self.done(req, step, keep=True)
        queue, self.queue = self.queue, []
        self._check(queue, live_from=done)

    def _check_queue(self) -> None:
        queue, self.queue = self.queue, []
        self._check(queue)

    def _check(self, queue: list, live_from: int | None = None) -> None:
        """Check queued requests in padded passes and record them; those from live_from on are
        live requests checked so far: only the diverged are recorded, then checked no more."""
        # the cross-check takes the longest request (prompt and rows; the first of them)
        first = (
            max(queue, key=lambda q: q[2][3].shape[0]) if queue and not self.cross_checked else None
        )
        live = {q[2][0] for q in queue[live_from:]} if live_from is not None else set()
        results = self.oracle.check_many(
            [q[2] for q in queue], keep=live, capture=first and first[2][0]
        )
        if first and self.oracle.captured:  # (none: no pass ran for it; the next check tries)
            self._cross_check(first)
        for i, ((step, steps, _, mismatch), res) in enumerate(zip(queue, results)):
            if live_from is not None and i >= live_from:
                if res.first_divergence is None and mismatch is None:
                    continue
                self.logits.pop(res.request, None)  # known now: never checked (or told) again
                self.token_steps.pop(res.request, None)
                self.known_diverged.add(res.request)
            r = res.to_dict()
            r["req"] = r.pop("request")
            r["prompt_mismatch_at"] = mismatch
            r["divergence_step"] = (
                steps[r["first_divergence"]] if r["first_divergence"] is not None else None
            )
            self.history.append({"e": "oracle", "step": step, **r})
            self.results.append(r)

    def _cross_check(self, item) -> None:
        """The model code the oracle shares with the engine, against an independent float64
        reference, on the logits the oracle computed for a request of its first check."""
        self.cross_checked = True
        step, _, (req, tokens, prompt_len, rows), _ = item
        start, logits = self.oracle.captured
        res = cross_check(self.oracle, tokens[: start + logits.shape[0]], start, logits)
        self.history.append({"e": "reference", "step": step, "req": req, **res})
