"""The prefix-caching reference's host tier ("offload", docs/protocol-v2.md section 10), as
SGLang's hierarchical cache and vLLM's offloading connector keep one: a second PrefixBlockPool
over host slots, whose keyed slots are a prefix cache of their own. A sequence's blocks are
stored out and restored as the plain reference does; a store's full, computed blocks key their
host slots once it completed, and those keys outlive the sequence (LRU, evicted as a new store
takes the slot). An admission whose prefix runs past the device cache into host-only keys takes
new device blocks for them and answers them as computed: the engine copies them in
(offload_hits) before the sequence runs, then says so (offload_done), and only then are the
device blocks keyed.

Invariants beside the prefix manager's (tests/test_prefix_host.py):
  H1  host.ref[s] == number of sequences whose host_slots hold s (stored out, or loading)
  H2  a sequence is stored out (host slots, no device blocks), loading (both), or on the device
  H3  a keyed host slot holds a completed store's copy of a full, computed block
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvchaos.engine.block_pool import PrefixBlockPool
from kvchaos.engine.errors import OutOfBlocks

Load = tuple[int, int, int]  # (host slot, device block, logical index) of an admission's hit


class PrefixHostTier:
    """The PrefixCachingManager's half of the host tier (a mixin: self is the manager)."""

    host: PrefixBlockPool | None = None

    def _init_host(self, host_blocks: int) -> None:
        self.host = PrefixBlockPool(host_blocks, self.block_size) if host_blocks > 0 else None
        self.host_slots: dict[str, list[int]] = {}  # seq -> its host slots, in logical order
        self.copying: dict[str, str] = {}  # seq -> "store" | "restore" | "load" until done
        self.loads: dict[str, list[Load]] = {}  # seq -> its admission's host hits, to copy in
        # set (a planted bug, faults/offload.py host_slot_freed): host_frees_early(seq_id) says
        # a completed store gives its host slots back while the sequence still needs them
        self.host_frees_early: Callable[[str], bool] | None = None
        self._freed_early: dict[str, set[int]] = {}
        if self.host is not None:
            self.capabilities = type(self).capabilities | {"offload"}

    @property
    def host_blocks(self) -> int:
        return self.host.num_blocks if self.host is not None else 0

    @property
    def num_free_host_blocks(self) -> int:
        return self.host.num_free if self.host is not None else 0

    # -- admission: the hit past the device cache ----------------------------------------------
    def _host_hit(self, token_ids: Sequence[int], hit: list[int], cap: int) -> list[int]:
        """Host slots keyed for the full blocks after the device hit, within cap tokens, while
        the device cache misses them (a query: the caller touches what it takes)."""
        host, pool, bs = self.host, self.pool, self.block_size
        if host is None or not host.cache:
            return []
        k = pool.key[hit[-1]] if hit else None
        verify, out = pool.seams.verify_hits, []
        for i in range(len(hit) * bs, cap - bs + 1, bs):
            toks = tuple(token_ids[i : i + bs])
            k, parent = pool.hash_fn(k, toks), k
            if k in pool.cache:  # on the device after all: the device hit's walk ends here
                break
            s = host.cache.get(k)
            if s is None or verify and (host.tokens[s] != toks or host.parent[s] != parent):
                break
            out.append(s)
        return out

    def _take_loads(self, seq_id: str, slots: list[int], blocks: list[int], first: int) -> None:
        """Hold the hit's host slots until its copy completed (touch: a store cannot evict them)."""
        if not slots:
            return
        for s in slots:
            self.host.touch(s)
        self.host_slots[seq_id] = list(slots)
        self.copying[seq_id] = "load"
        self.loads[seq_id] = [(s, blocks[first + j], first + j) for j, s in enumerate(slots)]

    def offload_hits(self, seq_id: str) -> list[tuple[int, int]]:
        """The host hits of seq_id's admission, to copy in before it runs: (host slot, device
        block) in logical order; empty when its hit was on the device alone. Asked once, right
        after admit; offload_done(seq_id) once the copy completed."""
        return [(s, b) for s, b, _ in self.loads.get(seq_id, ())]

    # -- stores and restores -------------------------------------------------------------------
    def offload_store(self, seq_id: str, num_tokens: int) -> list[tuple[int, int]]:
        """Host slots for the blocks holding seq_id's first num_tokens tokens (those computed):
        (device block, host slot) in logical order. Blocks past them go back now; the stored
        ones stay held until offload_done. Atomic: OutOfBlocks."""
        if seq_id not in self.blocks or seq_id in self.copying or self.host is None:
            raise KeyError(f"offload_store of {seq_id!r}: not resident, or a copy in flight")
        blocks, toks, host = self.blocks[seq_id], self.tokens[seq_id], self.host
        if not 0 < num_tokens <= len(toks):
            raise ValueError(f"offload_store of {seq_id!r}: {num_tokens} tokens stored")
        keep = -(-num_tokens // self.block_size)
        if keep > host.num_free:
            raise OutOfBlocks(f"sequence {seq_id}: {keep} blocks, host tier full")
        while len(blocks) > keep:
            self.pool.free(blocks.pop())
        del toks[num_tokens:]
        slots = [host.allocate() for _ in blocks]  # may evict the LRU host keys
        self.host_slots[seq_id], self.copying[seq_id] = slots, "store"
        return list(zip(blocks, slots))

    def offload_restore(self, seq_id: str) -> list[tuple[int, int]]:
        """New device blocks for a stored seq_id: (host slot, device block) in logical order; its
        host slots stay held until offload_done, its blocks keyed once it computes again (M3).
        Atomic: OutOfBlocks."""
        if seq_id in self.blocks or seq_id not in self.host_slots or seq_id in self.copying:
            raise KeyError(f"offload_restore of {seq_id!r}: not stored out, or a copy in flight")
        slots = self.host_slots[seq_id]
        if len(slots) > self.pool.num_free:
            raise OutOfBlocks(f"sequence {seq_id}: restoring {len(slots)} blocks, no room")
        self.blocks[seq_id] = [self.pool.allocate() for _ in slots]
        self.keyed[seq_id], self.last_key[seq_id] = 0, None
        self.copying[seq_id] = "restore"
        return list(zip(slots, self.blocks[seq_id]))

    def offload_done(self, seq_id: str) -> None:
        """seq_id's copy completed. A store: its device blocks go back (still keyed on the device
        until evicted) and its full, computed blocks key their host slots. A restore: its host
        slots go back. A load: the hit's device blocks are keyed, its host slots go back."""
        kind = self.copying.pop(seq_id)
        if kind == "store":
            self._stored(seq_id)
            return
        if kind == "load":
            self._loaded(seq_id)
        self._release_host(seq_id)

    def _stored(self, seq_id: str) -> None:
        pool, host, bs = self.pool, self.host, self.block_size
        blocks, toks, slots = self.blocks.pop(seq_id), self.tokens[seq_id], self.host_slots[seq_id]
        keyed = self.keyed.pop(seq_id)
        self.last_key.pop(seq_id)
        host.hash_fn = pool.hash_fn  # one key for one prefix on either tier
        k = None
        for i in range(keyed):
            k = host.cache_full_block(slots[i], k, toks[i * bs : (i + 1) * bs])
        for b in reversed(blocks):
            pool.free(b)
        if self.host_frees_early is not None and self.host_frees_early(seq_id):
            for s in slots:
                host.free(s)
            self._freed_early[seq_id] = set(slots)

    def _loaded(self, seq_id: str) -> None:
        pool, bs = self.pool, self.block_size
        loads = self.loads.pop(seq_id)
        blocks, toks = self.blocks[seq_id], self.tokens[seq_id]
        i, k = self.keyed[seq_id], self.last_key[seq_id]
        last = loads[-1][2] + 1
        while i < last:  # the hit's blocks, up to and through the loaded ones, now written
            k = pool.cache_full_block(blocks[i], k, toks[i * bs : (i + 1) * bs])
            i += 1
        if i > self.keyed[seq_id]:
            self.keyed[seq_id], self.last_key[seq_id] = i, k

    def _release_host(self, seq_id: str) -> None:
        """seq_id's host slots go back (still keyed, LRU), but those already given back."""
        self.copying.pop(seq_id, None)
        self.loads.pop(seq_id, None)
        given = self._freed_early.pop(seq_id, ())
        for s in self.host_slots.pop(seq_id, ()):
            if s not in given:
                self.host.free(s)

    def check_host(self) -> None:
        """Raise AssertionError naming the first broken invariant (H1, H2; the pool's P1-P4)."""
        if self.host is None:
            return
        self.host.check()
        held: dict[int, int] = {}
        for slots in self.host_slots.values():
            for s in slots:
                held[s] = held.get(s, 0) + 1
        given = {s for v in self._freed_early.values() for s in v}
        for s, r in enumerate(self.host.ref):
            if s not in given and r != held.get(s, 0):
                raise AssertionError(f"H1: host slot {s} ref {r}, held by {held.get(s, 0)}")
        for q in self.host_slots:
            kind = self.copying.get(q)
            if (q in self.blocks) != (kind in ("load", "restore", "store")):
                raise AssertionError(f"H2: {q} holds host slots, device blocks {q in self.blocks}")

    def _host_snapshot(self) -> dict:
        if self.host is None:
            return {}
        return {
            "host_blocks": {s: list(v) for s, v in self.host_slots.items()},
            "host_free": self.host.free_order(),
            "host_ref_counts": list(self.host.ref),
        }
