"""Scheduling a step: the waiting and running queues, and each step planned on the block
manager's estimates, then reserved against its actual answers (admit a waiting sequence, append to
a running one). As nano-vllm's scheduler, it owns its queues and calls only public methods: the
manager's (through engine.bm, the boundary) and the engine's (estimate, refused, admitted,
preempted, table).

The schedule is planned on `blocks_needed`, the manager's estimate, not a promise (without one, on
the blocks the new positions add: Engine.estimate): any admit or append may be refused
(OutOfBlocks), as real managers refuse (they preallocate, keep a watermark, reserve blocks). The
scheduler then does what a serving scheduler does: a decode sequence that cannot grow preempts the
newest running request (itself, if it is the newest); a request whose first chunk is refused goes
back to wait, in order; a later prefill chunk that is refused waits a step. Its audit
(engine/audit.py) holds the plan's estimates against what the calls then took.

A request whose KV lands from elsewhere (seams.kv_load_steps: a disaggregated prefill's transfer)
is admitted, then waits in the waiting queue holding the blocks its admission reserved, skipped by
admission, until the step it lands: then it runs that chunk with no new call to the manager."""

from __future__ import annotations

from collections import deque

from kvchaos.engine.audit import Audit
from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.sequence import Sequence, State


class Scheduler:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.idle: list[Sequence] = []  # paused, holding blocks (on either tier)
        # admitted, waiting for their KV to land (seams.kv_load_steps): id -> (tokens their
        # admission reserved, the step they run). They hold blocks in the waiting queue.
        self.loading: dict[str, tuple[int, int]] = {}
        self.audit = Audit(engine)  # the plan's estimates against what the calls took
        self.replanned: list[Sequence] = []  # planned again in reserve (a give-back): a failed
        # step preempts them too

    # -- the queues ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """A new request, last in line."""
        self.waiting.append(seq)

    def start(self, seq: Sequence) -> None:
        """A sequence running at once (a fork's child sharing its parent's blocks)."""
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Out of its queue (finished or cancelled)."""
        if seq.state is State.RUNNING:
            self.running.remove(seq)
        elif seq.state is State.IDLE:
            self.idle.remove(seq)
        else:
            self.waiting.remove(seq)
            self.loading.pop(seq.id, None)

    def preempt(self, seq: Sequence, why: str = "preempt") -> None:
        """Back to wait, first in line, recomputing from scratch; the engine takes its blocks
        back (why: "preempt", or "error" for a failed step)."""
        self.running.remove(seq)
        self.audit.release(seq)
        self.engine.preempted(seq, why)
        seq.state = State.PREEMPTED
        if seq.tier == "device":  # stored out (a host tier) it is restored, not recomputed
            seq.num_computed = 0
        self.waiting.appendleft(seq)

    def pause(self, seq: Sequence, step: int) -> None:
        """A running sequence sits idle, holding its blocks, until resumed."""
        self.running.remove(seq)
        seq.state, seq.idle_since = State.IDLE, step
        self.idle.append(seq)

    def resume(self, seq: Sequence) -> None:
        """An idle sequence waits again, first in line as a preempted one (it holds blocks, on
        either tier: served before anyone new)."""
        self.idle.remove(seq)
        seq.state = State.WAITING
        self.waiting.appendleft(seq)

    def live(self) -> list[str]:
        """The ids of the sequences holding blocks: the running ones, then those waiting for
        their KV to land."""
        ids = [s.id for s in self.running]
        if self.loading:
            ids += [s.id for s in self.waiting if s.holds]
        return ids

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.idle)

    # -- a step --------------------------------------------------------------------------------
    def schedule(self) -> tuple[list, list, list[str]]:
        """Returns decode sequences, prefill chunks (sequence, tokens) and the preempted ids."""
        self.audit.begin()
        decode, prefill, preempted = self._plan()
        while not decode and not prefill and len(self.running) > 1:
            # Every running sequence is stuck mid-prefill on a full pool: free the newest.
            victim = self.running[-1]
            self.preempt(victim)
            decode, prefill, more = self._plan()
            preempted = preempted + [victim.id] + more
        while not decode and not prefill and (self.running or self.waiting):
            # Nothing runs (the one left running is stuck mid-prefill, or the head lacks room):
            # one holding blocks without running gives them back
            victim = self._give_back()
            if victim is None:
                break
            decode, prefill, more = self._plan()
            preempted = preempted + [victim.id] + more
        return decode, prefill, preempted

    def _give_back(self) -> Sequence | None:
        """Of the sequences that hold blocks without running (idle, or resumed and waiting), the
        newest gives its blocks back (stored out with a host tier); None: there is none."""
        held = [
            s
            for s in (*self.waiting, *self.idle)
            if s.holds and s.tier == "device" and s.id not in self.loading
        ]
        if not held:
            return None
        victim = held[-1]
        self.engine.preempted(victim, "preempt")
        if victim.tier == "device":
            victim.num_computed = 0
        if victim.state is not State.IDLE:
            victim.state = State.PREEMPTED
        return victim

    def _estimate(self, s: Sequence, n: int) -> int:
        need = self.engine.estimate(s, n)
        self.audit.asked(s, n, need)
        return need

    def _plan(self) -> tuple[list, list, list[str]]:
        engine = self.engine
        bm, budget, estimate = engine.bm, engine.config.max_prefill_tokens, self._estimate
        preempted: list[str] = []
        decode = [s for s in self.running if s.uncomputed == 1]
        # Make room for one token per decoding sequence, preempting the newest first.
        need = sum(estimate(s, 1) for s in decode)
        while decode and need > (free := bm.num_free_blocks):
            victim = self.running[-1]
            self.audit.preempting("estimate", free, decode, victim)
            self.preempt(victim)
            preempted.append(victim.id)
            if victim in decode:
                decode.remove(victim)
            need = sum(estimate(s, 1) for s in decode)
        free = bm.num_free_blocks - need
        prefill: list[tuple[Sequence, int]] = []
        for s in self.running:
            if s.uncomputed > 1 and budget > 0:
                n = min(s.uncomputed, budget)
                need = estimate(s, n)
                if need <= free:
                    prefill.append((s, n))
                    budget -= n
                    free -= need
        if self.loading:
            budget = self._landed(prefill, budget)
        rows = engine.table.num_free_rows
        while budget > 0:
            s = self._head()
            if s is None or s.tier != "device":  # none, or stored out / its restore in flight
                break
            if rows <= 0 and not s.holds:  # one resumed (idle, restored) has its row
                break
            n = min(s.uncomputed, budget)
            need = estimate(s, n)
            if need > free - engine.watermark_blocks:
                break  # FCFS: the head waits for room, nobody overtakes it
            self.waiting.remove(s)
            s.state = State.RUNNING
            self.running.append(s)
            prefill.append((s, n))
            budget -= n
            free -= need
            rows -= not s.holds
        return decode, prefill, preempted

    def _head(self) -> Sequence | None:
        """The first waiting sequence not waiting for its KV to land."""
        if not self.loading:
            return self.waiting[0] if self.waiting else None
        return next((s for s in self.waiting if s.id not in self.loading), None)

    def _landed(self, prefill: list, budget: int) -> int:
        """Sequences whose KV landed run the chunk their admission reserved (no new blocks, no
        new row); returns the budget left."""
        for s in [s for s in self.waiting if s.id in self.loading]:
            n, due = self.loading[s.id]
            if due > self.engine.step_count or n > budget or s.tier == "restoring":
                continue
            self.waiting.remove(s)
            s.state = State.RUNNING
            self.running.append(s)
            prefill.append((s, n))
            budget -= n
        return budget

    def reserve(self, decode: list, prefill: list, preempted: list[str]):
        """Appends for the step's decode sequences and prefill chunks. Returns what may run:
        (decode, prefill, copy-on-write copies). Sequences preempted here join `preempted`."""
        self.replanned = []
        out = self._reserve(decode, prefill, preempted)
        while not out[0] and not out[1] and not self.running and self.waiting:
            # Every admission refused with nothing running: the head lacks room as the manager
            # answered, past its estimate (a revived prefix hit takes free blocks). As when the
            # estimate says so (schedule), one holding blocks without running gives them back;
            # else a resumed holder queued behind the head would wait on it for ever.
            victim = self._give_back()
            if victim is None:
                break
            preempted.append(victim.id)
            decode, prefill, more = self._plan()
            preempted += more
            self.replanned += decode + [s for s, _ in prefill]
            out = self._reserve(decode, prefill, preempted) if decode or prefill else out
        self.audit.settle()
        return out

    def _reserve(self, decode: list, prefill: list, preempted: list[str]):
        engine, audit = self.engine, self.audit
        bm, sync = engine.bm, engine.table.sync
        if decode and "append_decode" in engine.capabilities:
            try:  # the batched fast path; all or nothing
                before = bm.num_free_blocks if audit.on else 0
                copies = bm.append_decode([s.id for s in decode], [s.tokens[-1] for s in decode])
                if audit.on:
                    audit.grew("append_decode", decode, 1, before, bm.num_free_blocks, copies)
                for s in decode:
                    sync(s.id, copied=bool(copies))
                return self._prefill(decode, prefill, copies)
            except OutOfBlocks as no:
                engine.refused("append_decode", decode[0].id, 1, no)
        copies: dict[str, list] = {}
        kept: list = []
        for s in list(decode):
            if s not in self.running:
                continue  # preempted to make room for an earlier one
            while True:
                try:
                    before = bm.num_free_blocks if audit.on else 0
                    copies[s.id] = bm.append(s.id, [s.tokens[-1]])
                    if audit.on:
                        audit.grew("append", [s], 1, before, bm.num_free_blocks, copies[s.id])
                    sync(s.id, copied=bool(copies[s.id]))
                    kept.append(s)
                    break
                except OutOfBlocks as no:
                    engine.refused("append", s.id, 1, no)
                    victim = self.running[-1]
                    if audit.on:
                        audit.preempting("refusal", bm.num_free_blocks, [s], victim)
                    self.preempt(victim)
                    preempted.append(victim.id)
                    copies.pop(victim.id, None)
                    if victim in kept:
                        kept.remove(victim)
                    prefill = [(p, n) for p, n in prefill if p is not victim]
                    if victim is s:
                        break
        return self._prefill(kept, prefill, [c for cs in copies.values() for c in cs])

    def _prefill(self, decode: list, prefill: list, copies: list):
        engine, audit = self.engine, self.audit
        bm, table, ran, back, parked = engine.bm, engine.table, [], [], []
        for s, n in prefill:
            if s.id in self.loading:  # landed: its slots were reserved at admission
                del self.loading[s.id]
                ran.append((s, n))
                continue
            try:
                if not s.holds:  # admission: the manager answers the tokens it has computed already
                    table.place(s.id)
                    known = s.tokens
                    # the last known token is computed (its logits): the boundary refuses an
                    # answer over max_computed as the manager's error
                    h = bm.admit(s.id, known, n, len(known) - 1)
                    have = h + min(n, len(known) - h)  # slots the manager now has
                    s.holds, s.num_computed, s.hit_tokens = True, h, h
                    # its hit's blocks found on the host tier alone are copied in first
                    load = engine.tier_hits(s) if engine.tier is not None else 0
                    engine.admitted(s, len(known), h, h)
                    table.sync(s.id)
                    wait = max(engine.seams.kv_load_steps(s), load)
                    if wait > 0:  # its KV lands from elsewhere: it waits, holding the blocks
                        self.loading[s.id] = (have - h, engine.step_count + wait)
                        parked.append(s)
                        continue
                    ran.append((s, have - h))
                else:
                    before = bm.num_free_blocks if audit.on else 0
                    got = bm.append(s.id, s.tokens[s.num_computed : s.num_computed + n])
                    if audit.on:
                        audit.grew("append", [s], n, before, bm.num_free_blocks, got)
                    table.sync(s.id, copied=bool(got))
                    copies += got
                    ran.append((s, n))
            except OutOfBlocks as no:
                engine.refused("admit" if not s.holds else "append", s.id, n, no)
                if not s.holds:
                    table.drop(s.id)
                    back.append(s)  # holds nothing yet: back to the queue, first in line
        for s in reversed(back):
            self.running.remove(s)
            s.state = State.WAITING
            self.waiting.appendleft(s)
        for s in parked:
            self.running.remove(s)
            s.state = State.WAITING
            self.waiting.append(s)
        return decode, ran, copies
