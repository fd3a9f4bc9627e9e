"""Scheduling a step: planned on the block manager's estimates, then reserved against its
actual answers (protocol v2: admit a waiting sequence, append to a running one).

The schedule is planned on `blocks_needed`, the manager's estimate, not a promise (without one, on
the blocks the new positions add: Engine.estimate): any admit or append may
be refused (OutOfBlocks), as real managers refuse (they preallocate, keep a watermark, reserve
blocks). The engine then does what a serving scheduler does: a decode sequence that cannot grow
preempts the newest running request (itself, if it is the newest); a request whose first chunk is
refused goes back to wait, in order; a later prefill chunk that is refused waits a step."""

from __future__ import annotations

from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.sequence import Sequence, State


def schedule(engine) -> tuple[list, list, list[str]]:
    """Returns decode sequences, prefill chunks (sequence, tokens) and the preempted ids."""
    bm, budget, estimate = engine.bm, engine.config.max_prefill_tokens, engine.estimate
    preempted: list[str] = []
    decode = [s for s in engine.running if s.uncomputed == 1]
    # Make room for one token per decoding sequence, preempting the newest first.
    need = sum(estimate(s, 1) for s in decode)
    while decode and need > bm.num_free_blocks:
        victim = engine.running[-1]
        engine._preempt(victim)
        preempted.append(victim.id)
        if victim in decode:
            decode.remove(victim)
        need = sum(estimate(s, 1) for s in decode)
    free = bm.num_free_blocks - need
    prefill: list[tuple[Sequence, int]] = []
    for s in engine.running:
        if s.uncomputed > 1 and budget > 0:
            n = min(s.uncomputed, budget)
            need = estimate(s, n)
            if need <= free:
                prefill.append((s, n))
                budget -= n
                free -= need
    rows = engine.table.num_free_rows
    while engine.waiting and budget > 0 and rows > 0:
        s = engine.waiting[0]
        n = min(s.uncomputed, budget)
        need = estimate(s, n)
        if need > free - engine.watermark_blocks:
            break  # FCFS: the head waits for room, nobody overtakes it
        engine.waiting.popleft()
        s.state = State.RUNNING
        engine.running.append(s)
        prefill.append((s, n))
        budget -= n
        free -= need
        rows -= 1
    return decode, prefill, preempted


def reserve(engine, decode: list, prefill: list, preempted: list[str]):
    """Appends for the step's decode sequences and prefill chunks. Returns what may run:
    (decode, prefill, copy-on-write copies). Sequences preempted here are added to `preempted`."""
    bm, sync = engine.bm, engine.table.sync
    if decode and hasattr(bm, "append_decode"):
        try:  # the batched fast path; all or nothing
            copies = bm.append_decode([s.id for s in decode], [s.tokens[-1] for s in decode])
            for s in decode:
                sync(s.id, copied=bool(copies))
            return _prefill(engine, decode, prefill, copies)
        except OutOfBlocks as no:
            engine.refused("append_decode", decode[0].id, 1, no)
    copies: dict[str, list] = {}
    kept: list = []
    for s in list(decode):
        if s not in engine.running:
            continue  # preempted to make room for an earlier one
        while True:
            try:
                copies[s.id] = bm.append(s.id, [s.tokens[-1]])
                sync(s.id, copied=bool(copies[s.id]))
                kept.append(s)
                break
            except OutOfBlocks as no:
                engine.refused("append", s.id, 1, no)
                victim = engine.running[-1]
                engine._preempt(victim)
                preempted.append(victim.id)
                copies.pop(victim.id, None)
                if victim in kept:
                    kept.remove(victim)
                prefill = [(p, n) for p, n in prefill if p is not victim]
                if victim is s:
                    break
    return _prefill(engine, kept, prefill, [c for cs in copies.values() for c in cs])


def _prefill(engine, decode: list, prefill: list, copies: list):
    bm, table, ran, back = engine.bm, engine.table, [], []
    for s, n in prefill:
        try:
            if not s.holds:  # admission: the manager answers the tokens it has computed already
                table.place(s.id)
                known = s.tokens
                h = bm.admit(s.id, known, n, len(known) - 1)  # the boundary validates the int
                used = min(h, len(known) - 1)  # the last known token is computed (its logits)
                have = h + min(n, len(known) - h)  # slots the manager now has
                s.holds, s.num_computed, s.hit_tokens = True, used, used
                engine.admitted(s, len(known), h, used)
                table.sync(s.id)
                ran.append((s, have - used))  # capped: recompute [used, h)
            else:
                got = bm.append(s.id, s.tokens[s.num_computed : s.num_computed + n])
                table.sync(s.id, copied=bool(got))
                copies += got
                ran.append((s, n))
        except OutOfBlocks as no:
            engine.refused("admit" if not s.holds else "append", s.id, n, no)
            if not s.holds:
                table.drop(s.id)
                back.append(s)  # holds nothing yet: back to the queue, first in line
    for s in reversed(back):
        engine.running.remove(s)
        s.state = State.WAITING
        engine.waiting.appendleft(s)
    return decode, ran, copies
