"""Scheduling a step: planned on the block manager's estimates, then reserved against its
actual answers.

The schedule is planned on `blocks_needed`, the manager's estimate, not a promise: any append may
be refused (OutOfBlocks), as real managers refuse (they preallocate, keep a watermark, reserve
blocks). The engine then does what a serving scheduler does: a decode sequence that cannot grow
preempts the newest running request (itself, if it is the newest); a request whose first chunk is
refused goes back to wait, in order; a later prefill chunk that is refused waits a step."""

from __future__ import annotations

from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.sequence import Sequence, State


def schedule(engine) -> tuple[list, list, list[str]]:
    """Returns decode sequences, prefill chunks (sequence, tokens) and the preempted ids."""
    bm, budget = engine.bm, engine.config.max_prefill_tokens
    preempted: list[str] = []
    decode = [s for s in engine.running if s.uncomputed == 1]
    # Make room for one token per decoding sequence, preempting the newest first.
    need = sum(bm.blocks_needed(s.id, 1) for s in decode)
    while decode and need > bm.num_free_blocks:
        victim = engine.running[-1]
        engine._preempt(victim)
        preempted.append(victim.id)
        if victim in decode:
            decode.remove(victim)
        need = sum(bm.blocks_needed(s.id, 1) for s in decode)
    free = bm.num_free_blocks - need
    prefill: list[tuple[Sequence, int]] = []
    for s in engine.running:
        if s.uncomputed > 1 and budget > 0:
            n = min(s.uncomputed, budget)
            need = bm.blocks_needed(s.id, n)
            if need <= free:
                prefill.append((s, n))
                budget -= n
                free -= need
    rows = engine.table.num_free_rows
    while engine.waiting and budget > 0 and rows > 0:
        s = engine.waiting[0]
        n = min(s.uncomputed, budget)
        need = bm.blocks_needed(s.id, n)
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
    bm = engine.bm
    if decode and hasattr(bm, "append_decode"):
        try:  # the batched fast path; all or nothing
            return _prefill(engine, decode, prefill, bm.append_decode([s.id for s in decode]))
        except OutOfBlocks as no:
            engine.refused("append_decode", decode[0].id, 1, no)
    copies: dict[str, list] = {}
    kept: list = []
    for s in list(decode):
        if s not in engine.running:
            continue  # preempted to make room for an earlier one
        while True:
            try:
                copies[s.id] = bm.append(s.id, 1)
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
    bm, ran, back = engine.bm, [], []
    for s, n in prefill:
        try:
            copies += bm.append(s.id, n)
            ran.append((s, n))
        except OutOfBlocks as no:
            engine.refused("append", s.id, n, no)
            if s.num_computed == 0:
                back.append(s)  # holds nothing yet: back to the queue, first in line
    for s in reversed(back):
        engine.running.remove(s)
        s.state = State.WAITING
        engine.waiting.appendleft(s)
    return decode, ran, copies
