"""The reference manager with prefix caching (protocol v2), as vLLM v1 and nano-vllm do it, on
PrefixBlockPool: a new request reuses the blocks of its longest cached prefix (ref count up, no
recompute); a block is keyed once full and computed (end_step); a freed keyed block stays
revivable until allocate evicts it (LRU). The engine builds the block table (BuiltTable).

Invariants (tests/test_prefix_manager.py checks them after every operation), beside P1-P4:
  M1  ref[b] == number of sequences whose block list holds b
  M2  tokens[s] has one id per slot s holds: len(blocks[s]) == ceil(len(tokens[s]) / bs)
  M3  a keyed block is full and computed: the first keyed[s] blocks of s, never written again
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvchaos.engine.block_pool import PrefixBlockPool
from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.prefix_host import PrefixHostTier
from kvchaos.engine.protocols import Reason, Snapshot


def _key_text(k) -> str | None:
    return None if k is None else (k.hex() if isinstance(k, bytes) else str(k))


class PrefixCachingManager(PrefixHostTier):
    kvchaos_protocol = 2
    capabilities = frozenset(
        {"fork", "seq_tokens", "prefix_cache", "cache_state", "estimates", "append_decode"}
        | {"end_step"}
    )
    reserved_blocks: tuple[int, ...] = ()

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int = 0,  # the house's constructor shape; the engine's table has the rows
        max_blocks_per_seq: int = 0,
        *,
        pool: PrefixBlockPool | None = None,
        host_blocks: int = 0,
    ):
        self.block_size = block_size
        self.pool = pool or PrefixBlockPool(num_blocks, block_size)
        self.blocks: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}  # the ids it holds slots for, in order
        self.keyed: dict[str, int] = {}  # leading blocks keyed (full and computed)
        self.last_key: dict[str, object] = {}  # key of block keyed[s] - 1: the next one's parent
        self._entries: dict[int, tuple] = {}  # block -> (key, tokens, its snapshot entry)
        # Only with key_after_compute off (a planted defect, pool.seams): blocks keyed before
        # their KV was computed (block -> (seq, index)), this step's hits on them, known tokens
        self.early: dict[int, tuple[str, int]] = {}
        self.early_hits: list[tuple[str, list[int]]] = []
        self.known: dict[str, list[int]] = {}
        # set (a planted leak, faults/refcount_leak.py): release_skips(seq_id, reason, blocks)
        # names the blocks whose reference the release keeps; None costs nothing
        self.release_skips: Callable[[str, str, list], Sequence[int]] | None = None
        self._init_host(host_blocks)  # a host tier of host_blocks slots ("offload"; prefix_host.py)

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_ids(self, seq_id: str) -> list[int]:
        return self.blocks[seq_id]

    def blocks_needed(self, seq_id: str, num_new_tokens: int) -> int:
        """Free blocks an append of num_new_tokens takes, copy-on-write included."""
        bs, have = self.block_size, len(self.tokens[seq_id])
        need = -(-(have + num_new_tokens) // bs) - -(-have // bs)
        blocks = self.blocks[seq_id]
        if have % bs and num_new_tokens and self.pool.ref[blocks[-1]] > 1:
            need += 1
        return need

    # -- mutations -----------------------------------------------------------------------------
    def admit(
        self, seq_id: str, token_ids: Sequence[int], num_new_tokens: int, max_computed: int
    ) -> int:
        """Reuse the longest cached prefix of whole blocks within max_computed tokens, then
        reserve slots for num_new_tokens after it. Touch before allocate: else allocate could
        evict a block of the hit. Atomic."""
        if seq_id in self.blocks:
            raise ValueError(f"admit of sequence {seq_id}, which holds blocks")
        pool, bs = self.pool, self.block_size
        hit = pool.match_prefix(token_ids[: max(0, max_computed)])
        far = self._host_hit(token_ids, hit, max(0, max_computed)) if self.host is not None else []
        h = (len(hit) + len(far)) * bs
        total = h + min(num_new_tokens, len(token_ids) - h)
        revived = [b for b in hit if pool.ref[b] == 0]  # a revive takes a queued block
        need = len(revived) + -(-total // bs) - len(hit)
        seams = pool.seams
        if need > pool.num_free:
            if seams.on_refused is not None:
                seams.on_refused(seq_id, hit)
            if not seams.check_before_touch:  # a defect: the hit touched, then the refusal
                for b in hit:
                    pool.touch(b)
            raise OutOfBlocks(f"sequence {seq_id}: {need} blocks needed, {pool.num_free} free")
        for b in hit:
            pool.touch(b)
        if seams.on_admit is not None:
            seams.on_admit(seq_id, hit, revived)
        if not seams.verify_hits and hit:  # a defect: what the trusted keys served
            bad = pool.served_wrong(token_ids, hit)
            if bad:
                seams.on_defect("wrong_hit", {"req": seq_id, "blocks": bad})
        early = [b for b in hit if b in self.early] if self.early else None
        if early:  # key_after_compute off: judged once the step's KV is written (end_step)
            self.early_hits.append((seq_id, early))
        blocks = hit + [pool.allocate() for _ in range(-(-total // bs) - len(hit))]
        self.blocks[seq_id], self.tokens[seq_id] = blocks, list(token_ids[:total])
        self.keyed[seq_id] = len(hit)
        if far:  # found on the host tier alone: copied in before the sequence runs
            self._take_loads(seq_id, far, blocks, len(hit))
        self.last_key[seq_id] = pool.key[hit[-1]] if hit else None
        if not seams.key_after_compute:
            self.known[seq_id] = list(token_ids)
            self._key_early(seq_id)
        return h

    def append(self, seq_id: str, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Slots for these tokens, next in order; copy-on-write of a shared partial last block."""
        n = len(token_ids)
        need = self.blocks_needed(seq_id, n)
        if need > self.pool.num_free:
            raise OutOfBlocks(f"sequence {seq_id}: {n} tokens need {need} blocks, fewer free")
        pool, bs = self.pool, self.block_size
        blocks, toks = self.blocks[seq_id], self.tokens[seq_id]
        copies = []
        if n and len(toks) % bs and pool.ref[blocks[-1]] > 1:
            src, dst = blocks[-1], pool.allocate()
            pool.free(src)
            blocks[-1] = dst
            copies.append((src, dst))
        toks.extend(token_ids)
        while len(blocks) * bs < len(toks):
            blocks.append(pool.allocate())
        if not pool.seams.key_after_compute:
            self._key_early(seq_id)
        return copies

    def append_decode(self, seq_ids: Sequence[str], token_ids: Sequence[int]):
        """append(s, [t]) for every s, all or nothing: the decode hot path, inlined; a shared
        partial last block (copy-on-write) takes append's path."""
        pool, bs, blocks, toks = self.pool, self.block_size, self.blocks, self.tokens
        ref, need, shared = pool.ref, 0, False
        for s in seq_ids:
            if len(toks[s]) % bs == 0:
                need += 1
            elif ref[blocks[s][-1]] > 1:
                need, shared = need + 1, True
        if need > pool.num_free:
            raise OutOfBlocks(f"decode of {len(seq_ids)} sequences needs more blocks than free")
        if shared or not pool.seams.key_after_compute:
            return [c for s, t in zip(seq_ids, token_ids) for c in self.append(s, [t])]
        for s, t in zip(seq_ids, token_ids):
            tl = toks[s]
            if len(tl) % bs == 0:
                blocks[s].append(pool.allocate())
            tl.append(t)
        return []

    def fork(self, parent_id: str, child_id: str) -> None:
        if child_id in self.blocks:
            raise ValueError(f"sequence {child_id} already holds blocks")
        blocks = list(self.blocks[parent_id])
        for b in blocks:
            self.pool.touch(b)
        self.blocks[child_id], self.tokens[child_id] = blocks, list(self.tokens[parent_id])
        self.keyed[child_id] = self.keyed[parent_id]
        self.last_key[child_id] = self.last_key[parent_id]

    def end_step(self, computed: dict[str, int]) -> None:
        """Key each block that is now full and computed (M3): a block is served only once its
        KV is written."""
        pool, bs = self.pool, self.block_size
        for s, n in computed.items():
            blocks, toks, i, k = self.blocks[s], self.tokens[s], self.keyed[s], self.last_key[s]
            full = min(n, len(toks)) // bs
            while i < full:
                k = pool.cache_full_block(blocks[i], k, toks[i * bs : (i + 1) * bs])
                i += 1
            self.keyed[s], self.last_key[s] = i, k
        if self.early:
            self._settle_early(computed)
        if pool.seams.on_end_step is not None:
            pool.seams.on_end_step()

    def _key_early(self, s: str) -> None:
        """The defect key_after_compute off (vllm#34587): key every reserved block that the known
        tokens fill as it is reserved, computed or not."""
        pool, bs, blocks, toks = self.pool, self.block_size, self.blocks[s], self.tokens[s]
        known = self.known.get(s, toks)
        known = toks if len(toks) > len(known) else known
        i, k = self.keyed[s], self.last_key[s]
        while i < len(blocks) and (i + 1) * bs <= len(known):
            k = pool.cache_full_block(blocks[i], k, known[i * bs : (i + 1) * bs])
            self.early[blocks[i]] = (s, i)
            i += 1
        self.keyed[s], self.last_key[s] = i, k

    def _settle_early(self, computed: dict[str, int]) -> None:
        """Ground truth of key_after_compute off: a block keyed early leaves `early` once its
        owner computed it (or its key is gone); the keys left over unwritten slots at the step's
        end, and this step's hits on such blocks, are reported (pool.seams.on_defect)."""
        pool, bs, report = self.pool, self.block_size, self.pool.seams.on_defect
        for b, (s, i) in list(self.early.items()):
            held = self.blocks.get(s)
            if held is not None and i < len(held) and held[i] == b:
                if computed.get(s, 0) >= (i + 1) * bs:
                    del self.early[b]
            elif pool.key[b] is None:  # evicted: nothing serves it any more
                del self.early[b]
        if self.early:
            report("keyed_partial", {"blocks": list(self.early)})
        for s, hit in self.early_hits:
            bad = [b for b in hit if b in self.early]
            if bad:
                report("partial_hit", {"req": s, "blocks": bad})
        self.early_hits = []

    def release(self, seq_id: str, reason: Reason) -> bool:
        """Any reason frees every block, tail first (the tail is evicted first). Only computed
        blocks are keyed (end_step), so an 'error' release leaves no key over unwritten slots."""
        blocks = self.blocks.pop(seq_id, None)
        if self.host is not None:
            stored = blocks is None and seq_id in self.host_slots
            self._release_host(seq_id)
            if stored:  # on the host tier alone
                del self.tokens[seq_id]
                return True
        if blocks is None:
            return False
        del self.tokens[seq_id], self.keyed[seq_id], self.last_key[seq_id]
        if self.known:  # key_after_compute off
            self.known.pop(seq_id, None)
            self.early_hits = [x for x in self.early_hits if x[0] != seq_id]
        skip = list(self.release_skips(seq_id, reason, blocks)) if self.release_skips else ()
        for b in reversed(blocks):
            if b in skip:  # a planted leak: this reference is never dropped
                skip.remove(b)
                continue
            self.pool.free(b)
        return True

    # -- observation ---------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        pool = self.pool
        return Snapshot(
            num_blocks=pool.num_blocks,
            free=pool.free_order(),
            ref_counts=list(pool.ref),
            seq_blocks={s: list(b) for s, b in self.blocks.items()},
            seq_tokens={s: len(t) for s, t in self.tokens.items() if s in self.blocks},
            reserved=list(self.reserved_blocks),
            cache=self._cache_entries(),
            **self._host_snapshot(),
        )

    def _cache_entries(self) -> list[dict]:
        """The snapshot's cache list. An entry is built once per (block, key, tokens) and shared
        by later snapshots (read-only, as every snapshot is): a snapshot per step stays cheap."""
        pool, memo, out = self.pool, self._entries, []
        for k, b in pool.cache.items():
            m = memo.get(b)
            toks = pool.tokens[b]
            if m is None or m[0] != k or m[1] is not toks:
                entry = {
                    "block": b,
                    "key": _key_text(k),
                    "parent": _key_text(pool.parent[b]),
                    "tokens": None if toks is None else list(toks),
                }
                m = memo[b] = (k, toks, entry)
            out.append(m[2])
        return out


class HostTierPrefixCachingManager(PrefixCachingManager):
    """The prefix-caching reference with a host tier of twice its device blocks ("offload"):
    what conformance (`--block-manager kvchaos.engine.prefix_manager:HostTierPrefixCachingManager`)
    drives the tier on."""

    def __init__(
        self, num_blocks: int, block_size: int, max_num_seqs: int = 0, max_blocks_per_seq: int = 0
    ) -> None:
        super().__init__(num_blocks, block_size, host_blocks=2 * num_blocks)
