"""The step's writes against the manager's snapshot of that step (LiveRun, after each step):
positions written with no slot reserved for them. Events of the history, built here."""

from __future__ import annotations


def unslotted_writes(e, snap, step: int) -> list[dict]:
    """Positions written with no slot reserved for them: past the blocks the snapshot of this
    step lists for the sequence ("past_blocks"), or through an unused (-1) entry of a rank's
    table ("unused_entry"), whose write lands in the pool's last block."""
    bs, out = e.bm.block_size, []
    found: dict[str, dict[int, set[int]]] = {}  # req -> position -> ranks
    last = [e.kv_pools[0].shape[2] - 1] if e.kv_pools else []  # where a -1 entry lands
    through = {req for req, _, _ in e.unslotted}
    for req, pos, rank in e.unslotted:
        found.setdefault(req, {}).setdefault(pos, set()).add(rank)
    held = {} if snap is None else snap.seq_blocks
    every = set(range(len(e.ranks.ranks)))  # every rank writes every position it computes
    for req, (start, end) in e.write_spans.items() if snap is not None else ():
        for pos in range(max(start, len(held.get(req, ())) * bs), end):
            found.setdefault(req, {}).setdefault(pos, set()).update(every)
    for req, by_pos in sorted(found.items()):
        positions = sorted(by_pos)
        slots = None if snap is None else len(held.get(req, ())) * bs
        out.append(
            {
                "e": "unslotted_write",
                "step": step,
                "req": req,
                "positions": positions,
                "ranks": sorted(set().union(*by_pos.values())),
                "via": "past_blocks"
                if slots is not None and positions[0] >= slots
                else "unused_entry",  # fmt: skip
                "slots_held": slots,
                "entry": positions[0] // bs,
                **({"blocks": last} if req in through else {}),
            }
        )
    return out
