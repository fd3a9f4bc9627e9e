"""The ordering race's variants: what each one's root cause and remediation are (as an incident
quotes them), the checkers that catch it, and its trigger and defect on the engine's seams.

Every trigger is pulled on lag_rank from from_step on, with `probability` per chance, in clean and
detect runs alike; the defect is one seam off (its remediation):

  variant       trigger (the environment)                      defect (remediation off)
  lagged        the rank's table update lands lag_steps late   rank_sync: no wait for it
  torn          half of the update's changed entries never     rank_verify: no checksum with
                land (the version does)                        the version acknowledged
  reordered     update N+1 overtakes N, which lands over it    rank_verify
  cow_lag       the rank's copy-on-write copies land           rank_sync: no wait for them
                lag_steps late
  scrambled     the rank's tokens reach it out of position     slots_by_position: it writes
                order                                          them in arrival order
  stale_unread  the update lags one step when all it changes   rank_sync
                are rows nobody holds (freed, unread)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvchaos.faults.base import CheckerName, Variant

if TYPE_CHECKING:  # the fault registry is imported by commands that start without torch
    import torch

DEFAULT = "lagged"
# the table in sync, the KV pool is what differs (the rest: the fault's own detectors)
_KV: tuple[CheckerName, ...] = ("kv_reads", "oracle_divergence")

# The manager path each variant's trigger needs (a key of results.json["exercised"]): a table
# that changes (a row gains an entry), a copy-on-write, KV written into blocks, rows freed.
REACH = {
    "lagged": "block_boundary_crossings",
    "torn": "block_boundary_crossings",
    "reordered": "block_boundary_crossings",
    "cow_lag": "copy_on_write_copies",
    "scrambled": "appends",
    "stale_unread": "frees",
}

_SYNC = (
    "Ranks acknowledge the table version before computing (barrier / event sync); a stale "
    "version is refused."
)
VARIANTS = {  # as an incident quotes them; the default (lagged) first
    "lagged": Variant(
        "A rank computed before its block-table update had landed: no acknowledgement of the "
        "table version before compute, so it read a stale table and used the wrong KV slots.",
        _SYNC,
    ),
    "torn": Variant(
        "A rank applied part of a block-table update (an asynchronous host-to-device copy of the "
        "table overwritten or cut short mid-flight, vllm-ascend#12130, Megatron-LM#5715) and "
        "took the update's version: acknowledging the version alone let it compute on a table "
        "half old, half new, and use the wrong KV slots.",
        "Ranks acknowledge a checksum of the table with its version; a copy that differs is "
        "re-sent whole (or the step refused) before any rank computes.",
    ),
    "reordered": Variant(
        "Two block-table updates reached a rank out of order (update N+1 before N, as a worker "
        "received another step's scheduler output in vllm#15332) and the late, older one was "
        "applied over the newer one while the rank kept the newer version number: its version "
        "acknowledgement passed on a stale table.",
        "Order updates by version: a rank drops an update older than the one it holds, and "
        "acknowledges a checksum of its table with the version, so a stale copy is re-sent.",
    ),
    "cow_lag": Variant(
        "A copy-on-write copy ran late on one rank (a copy kernel on a side stream, or a sync "
        "elided, with no event waited for before the forward: xLLM#1984, ik_llama.cpp#2083): "
        "the table was in sync, the copied block's contents were not, so that rank's heads read "
        "KV never copied there.",
        "Ranks wait for the step's block copies (stream / event sync) before computing, as they "
        "wait for the table version.",
        detectors=_KV,
    ),
    "scrambled": Variant(
        "A rank wrote the tokens of a block in the order they reached it, not by position: its "
        "KV lay in the wrong order within blocks (the field report's 'block 1 written before "
        "block 0'; vllm-ascend#14039 flipped KV block order on a copy), so attention on that "
        "rank's heads read keys and values misplaced.",
        "Every rank maps a token's slot from its position (table[p // block_size] * block_size "
        "+ p % block_size), never from arrival order; allocate, then synchronise, then write.",
        detectors=_KV,
    ),
    "stale_unread": Variant(
        "A rank computed on a stale table whose differing rows nobody read before the update "
        "landed (freed rows; vllm#42273, vllm#39591: stale entries harmless while every kernel "
        "masks them): the race fired and did no harm this time, latent, not manifest.",
        _SYNC,
    ),
}
KV_VARIANTS = tuple(v for v, x in VARIANTS.items() if x.detectors == _KV)


class Triggers:
    """Each variant's trigger and defect on the engine's seams, drawn from the fault's rng."""

    def __init__(self, fault, engine) -> None:
        self.f, self.e, self.p, self.rng = fault, engine, fault.p, fault.rng
        self.held_back: torch.Tensor | None = None  # reordered: update N, overtaken
        self.unread_rows: dict[int, list[int]] = {}  # stale_unread: step -> the rows it lagged

    def _due(self, rank: int, step: int) -> bool:
        p = self.p
        return (
            rank == p["lag_rank"]
            and step >= p["from_step"]
            and self.rng.random() < p["probability"]
        )

    def plant(self, variant: str, seams) -> None:
        on = not self.f.defect
        if variant in ("lagged", "stale_unread"):
            seams.rank_sync = on
            seams.rank_delay = self.lag if variant == "lagged" else self.lag_unread
        elif variant in ("torn", "reordered"):
            seams.rank_verify = on
            seams.rank_receive = self.tear if variant == "torn" else self.reorder
        elif variant == "cow_lag":
            seams.rank_sync = on
            seams.rank_copy_delay = self.copies_late
        else:
            seams.slots_by_position = on
            seams.tokens_out_of_order = self.out_of_order

    def lag(self, rank: int, step: int) -> int:
        if self._due(rank, step):
            self.f.trigger(step, {"rank": rank, "late_by_steps": self.p["lag_steps"], "at": step})
            return self.p["lag_steps"]
        return 0

    def lag_unread(self, rank: int, step: int) -> int:
        """One step late, only when every entry the update changes is in a row nobody holds."""
        if rank != self.p["lag_rank"] or step < self.p["from_step"]:
            return 0
        r, t = self.e.ranks.ranks[rank], self.e.table.table
        held, host = r.content(), t.host_tensor
        if r.inbox or held.shape != host.shape:
            return 0
        changed = (held != host).nonzero().flatten()
        if not len(changed):
            return 0
        rows = set((changed // t.width).tolist())
        if rows & set(self.e.table.rows.values()) or self.rng.random() >= self.p["probability"]:
            return 0
        self.unread_rows[step] = sorted(rows)
        self.f.trigger(step, {"rank": rank, "late_by_steps": 1, "at": step, "rows": sorted(rows)})
        return 1

    def _changed(self, rank: int, update: torch.Tensor):
        held = self.e.ranks.ranks[rank].content()
        if held.shape != update.shape:
            return held, None
        changed = (held != update).nonzero().flatten()
        return held, (changed if len(changed) else None)

    def tear(self, rank: int, step: int, update: torch.Tensor) -> torch.Tensor:
        """Half the entries the update changes (the later ones) never land."""
        if not self._due(rank, step):
            return update
        held, changed = self._changed(rank, update)
        if changed is None:
            return update
        lost = changed[len(changed) // 2 :]
        torn = update.clone()
        torn[lost] = held[lost]
        self.f.trigger(step, {"rank": rank, "at": step, "entries_lost": len(lost)})
        return torn

    def reorder(self, rank: int, step: int, update: torch.Tensor) -> torch.Tensor:
        """Update N is overtaken: the rank keeps its table under N's version; with N+1, the late
        N lands over it (under N+1's version)."""
        if rank != self.p["lag_rank"]:
            return update
        if self.held_back is not None:
            late, self.held_back = self.held_back, None
            return late if late.shape == update.shape else update
        if not self._due(rank, step):
            return update
        held, changed = self._changed(rank, update)
        if changed is None:
            return update
        self.held_back = update.clone()
        self.f.trigger(step, {"rank": rank, "at": step, "overtaken_by_next": True})
        return held.clone()

    def copies_late(self, rank: int, step: int) -> int:
        if self._due(rank, step):
            self.f.trigger(step, {"rank": rank, "copies_late_by_steps": self.p["lag_steps"]})
            return self.p["lag_steps"]
        return 0

    def out_of_order(self, rank: int, step: int) -> bool:
        if self._due(rank, step):
            self.f.trigger(step, {"rank": rank, "at": step, "tokens": "out of position order"})
            return True
        return False
