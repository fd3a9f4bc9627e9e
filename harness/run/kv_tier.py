"""The host tier's copies in the per-block writer record (harness/run/kv_record.py): a store
takes each device block's slots as the copy reads them (its host copy, per rank); a restore, or a
prefix hit's load, puts the host copy's slots into the device blocks as each lands (or, a load
of a released request, when it lands late). So a reader of restored blocks is judged against what
the tier brought back, and a cached block written by a load is a written block. Fed LiveRun's
engine events (engine/offload.py); pure, no torch.

Not mirrored: a store that read slots the step in flight still wrote (seam store_early): the
record holds those writes, the host copy lacks them; the oracle and the offload checker judge
that one."""

from __future__ import annotations

from collections.abc import Callable

from kvchaos.harness.run.kv_record import RankRecords

KINDS = frozenset({"offload_store", "offload_restore", "offload_landed", "offload_late"})


class TierRecord:
    def __init__(self, kv: RankRecords, tier, pool_blocks: Callable[[], int]) -> None:
        self.kv = kv
        self.tier = tier  # the engine's HostTier: which of a store's blocks were kept copies
        # the KV pool's blocks: a block past a pool sized short is read and written where the
        # copies' raw addresses land (engine/offload.py at), as the record's writes are (asked
        # each copy: a planted geometry defect sizes the pool after the record is built)
        self.pool = pool_blocks
        self.host: dict[int, dict[int, list]] = {0: {}}  # rank -> host slot -> its slots' rows
        self.kept: dict[str, dict[int, dict[int, list]]] = {}  # req -> index -> rank -> rows
        self.loads: dict[str, dict[int, list]] = {}  # req -> rank -> [(device block, rows)]
        self.hits: set[str] = set()  # loads of a prefix hit (no host copy of their own kept)
        self.landed: dict[str, set[int]] = {}  # req -> the device blocks of its load landed

    def _slot(self, rank: int, s: int) -> list | None:
        own = self.host.get(rank)
        return own[s] if own is not None and s in own else self.host[0].get(s)

    def on(self, kind: str, d: dict) -> None:
        req, records, pool = d["req"], self.kv.records, self.pool()
        if kind == "offload_store":
            kept = next((k for q, k in reversed(self.tier.reused) if q == req), ())
            mine = self.kept.pop(req, {})
            for r, rec in records.items():
                host = self.host.setdefault(r, {})
                for i, (b, s) in enumerate(d["pairs"]):
                    rows = mine.get(i, {}).get(r) if i in kept else None
                    host[s] = rows if rows is not None else rec.rows(b % pool)
        elif kind == "offload_restore":
            self.loads[req] = {r: [(b, self._slot(r, s)) for s, b in d["pairs"]] for r in records}
            self.landed.pop(req, None)
            if d.get("hit"):
                self.hits.add(req)
                self.kv.hits.setdefault(req, set()).update(b for _, b in d["pairs"])
        elif kind == "offload_late" or kind == "offload_landed" and d["kind"] == "restore":
            loads = self.loads.get(req)
            if loads is None:
                return
            # the blocks that landed now (with a copy bandwidth, a part of the load)
            now = set(d["blocks"]) if kind == "offload_late" else {b for _, b in d["pairs"]}
            for r, rec in records.items():
                for b, rows in loads.get(r, loads[0]):
                    if rows is not None and b in now:
                        rec.put(b % pool, rows)
            landed = self.landed.setdefault(req, set())
            landed |= now
            if not landed >= {b for b, _ in loads[0]}:
                return  # its last block has not landed
            del self.loads[req], self.landed[req]
            hit = req in self.hits
            self.hits.discard(req)
            if kind == "offload_landed" and not hit:  # kept as valid, as the engine keeps it
                self.kept[req] = {
                    i: {r: rows for r, ls in loads.items() if (rows := ls[i][1]) is not None}
                    for i in range(len(loads[0]))
                }
