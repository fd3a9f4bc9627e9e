"""stale_revive's ground truth (faults/prefix_cache.py): when a key allocate kept goes bad. A kept
key is harmless while its block still holds the KV the key names: its new owner has not written
yet (with async scheduling its KV lands a step later), wrote the same tokens after the same
prefix, or its writes went astray (another fault's table misread). So an entry goes bad at the
step a write lands in its block with other KV, on a rank where it was still right (the engine's
record of the blocks each sequence's writes landed in, engine.written, read at end_step while
every writer still holds its blocks). A copy in from the host tier writes too, every rank, with
no batch (engine/offload.py landings): a restore or a hit's load landing in a kept entry's block
(its new owner's blocks) with other KV spoils it at the step it landed, as a late load landing in
a block its request no longer holds does. An entry another fault's stray write spoiled while
cached misnamed its KV there before this defect kept it: not this defect's on that rank."""

from __future__ import annotations


class KeptEntries:
    def __init__(self, engine, manager, pool) -> None:
        self.engine, self.manager, self.pool = engine, manager, pool
        # key -> (block, parent key, token ids) as the entry named them, the engine's record of
        # writes then (those came before the block was handed out), the ranks it was spoiled on
        self.kept: dict = {}
        self.spoiled: dict = {}  # (block, key) -> ranks where a write spoiled it while cached
        self.looked = None  # the engine's record of writes last looked at
        self.landings = 0  # the host tier's copies in looked at (engine.tier.landings)
        self.landed: dict[int, int] = {}  # block of a kept entry a copy in spoiled -> the step

    def _land(self) -> None:
        """The copies in from the host tier since last looked: each block a kept entry names
        that one wrote with other KV is bad from the step it landed; a cached entry's, spoiled
        while cached (not this defect's). In order, before any later keep."""
        tier, pool = getattr(self.engine, "tier", None), self.pool
        if tier is None or len(tier.landings) == self.landings:
            return
        ranks = set(range(len(self.engine.ranks.ranks)))
        for step, q, blocks, _ in tier.landings[self.landings :]:
            for b in blocks:
                k = pool.key[b]
                if k is None or b in self.landed:
                    continue
                x = self.kept.get(k)
                if x is not None and x[0] == b:
                    if not self._same_kv(q, b, x[1], x[2]):
                        self.landed[b] = step
                elif not self._same_kv(q, b, pool.parent[b], pool.tokens[b]):
                    self.spoiled.setdefault((b, k), set()).update(ranks)
        self.landings = len(tier.landings)

    def landed_over(self) -> dict[int, list[int]]:
        """Per step, the blocks of kept entries a copy in from the host tier gave other KV than
        the entry names (let go, as written_over's)."""
        self._land()
        out: dict[int, list[int]] = {}
        for b, step in sorted(self.landed.items()):
            out.setdefault(step, []).append(b)
        for k in [k for k, x in self.kept.items() if x[0] in self.landed]:
            del self.kept[k]
        self.landed = {}
        return out

    def keep(self, b: int) -> None:
        """allocate handed out cached block b with its key kept (the pool's entry, as it was)."""
        self._land()  # (a late load may have spoiled it while cached)
        pool, e = self.pool, self.engine
        k = pool.key[b]
        spoiled = self.spoiled.pop((b, k), set())
        if len(spoiled) < len(e.ranks.ranks):  # (else bad already, not by this defect)
            self.kept[k] = (b, pool.parent[b], pool.tokens[b], e.written, spoiled)

    def intact(self) -> set[int]:
        """The blocks of kept entries whose KV is still the one their key names."""
        self._land()
        return {x[0] for x in self.kept.values() if x[0] not in self.landed}

    def written_over(self) -> list[int]:
        """The blocks of kept entries this step's writes gave other KV than the entry names:
        bad from now on (and let go). Entries dropped or moved since are let go too."""
        pool, by_block, written = self.pool, {}, self.engine.written
        if written is not self.looked:
            self.looked = written
            for q, blocks in written.items():
                for b, ranks in blocks.items():
                    k = pool.key[b]
                    if k is None or k in self.kept or ranks <= self.spoiled.get((b, k), set()):
                        continue
                    if not self._same_kv(q, b, pool.parent[b], pool.tokens[b]):
                        self.spoiled.setdefault((b, k), set()).update(ranks)
        for k, (b, parent, toks, before, spoiled) in list(self.kept.items()):
            if pool.cache.get(k) != b:
                del self.kept[k]
            elif before is not written:  # (a new record: a batch since it was kept)
                by_block.setdefault(b, []).append((parent, toks, spoiled))
        over = set()
        for q, blocks in written.items():
            for b, ranks in blocks.items():
                if b in by_block and any(
                    ranks - sp and not self._same_kv(q, b, p, t) for p, t, sp in by_block[b]
                ):
                    over.add(b)
        for k in [k for k, x in self.kept.items() if x[0] in over]:
            del self.kept[k]
        return sorted(over)

    def _same_kv(self, q: str, b: int, parent, toks: tuple) -> bool:
        """Whether q's writes in block b are the KV an entry (parent key, token ids) names: b is
        in q's own blocks, q's tokens there are the entry's (a prefix of them while q fills it)
        and its blocks before it chain to the entry's parent key."""
        m, bs = self.manager, self.pool.block_size
        blocks, tokens = m.blocks.get(q), m.tokens.get(q)
        if not blocks or tokens is None or b not in blocks:
            return False
        i = blocks.index(b)
        mine = tuple(tokens[i * bs : (i + 1) * bs])
        if mine != toks[: len(mine)]:
            return False
        k = None
        for j in range(i):
            k = self.pool.hash_fn(k, tuple(tokens[j * bs : (j + 1) * bs]))
        return k == parent
