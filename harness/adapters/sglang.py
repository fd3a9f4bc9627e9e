"""SGLang's radix cache and paged allocator as a kvchaos block manager: `--block-manager sglang`.

It drives the INSTALLED sglang (0.5.5.x, checked on import: later releases import torchvision
with the radix cache, whose PyPI wheel needs a CUDA torch) and copies none of its code: each
protocol v2 call is the calls SGLang's scheduler makes on `RadixCache` and
`PagedTokenToKVPoolAllocator` (docs/adapters.md). A block is a page (slot // page_size); page 0
is SGLang's padding page, never handed out (reserved). The engine builds the table from block_ids.
"""

from __future__ import annotations

from hashlib import blake2b

from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.protocols import Snapshot
from kvchaos.harness.adapters import require

# the RadixCache / allocator API it calls changes between releases
VERSION = require("sglang", "0.5.5", "sglang==0.5.5.post3", "SGLang")

try:  # after the version check; a broken install is one line too (ImportError, as above)
    import torch
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
except Exception as e:
    raise ImportError(f"sglang {VERSION} is installed but fails to import: {e}") from None


class SGLangManager:
    """Protocol v2 over one RadixCache (LRU) and its PagedTokenToKVPoolAllocator on the CPU."""

    kvchaos_protocol = 2
    capabilities = frozenset({"prefix_cache", "cache_state", "seq_tokens", "end_step"})
    reserved_blocks = (0,)  # SGLang's padding page: its allocator hands out pages 1..n

    def __init__(self, num_blocks, block_size, max_num_seqs=None, max_blocks_per_seq=None):
        self.block_size = self.bs = block_size
        self.alloc = PagedTokenToKVPoolAllocator(
            (num_blocks - 1) * block_size, block_size, torch.float32, "cpu", None, False
        )
        self.tree = RadixCache(None, self.alloc, block_size, eviction_policy="lru")
        self.pages: dict[str, list[int]] = {}  # its pages in order (its req_to_token // bs)
        self.tokens: dict[str, list[int]] = {}  # the tokens it has slots for
        self.node: dict = {}  # the tree node it locks (SGLang's req.last_node)
        self.owned: dict[str, int] = {}  # leading tokens the tree holds for it (page-aligned)
        self.known: dict[str, int] = {}  # tokens known at admission: its prefill ends there
        self.done: dict[str, int] = {}  # tokens computed (end_step)

    num_blocks = property(lambda self: self.alloc.num_pages + 1)  # its padding page included

    @property
    def num_free_blocks(self) -> int:  # evictable cached pages too, as SGLang's scheduler counts
        return (self.alloc.available_size() + self.tree.evictable_size()) // self.bs

    def _take(self, seq_id, n) -> list[int]:
        """n new pages, evicting cached ones first when short, as SGLang's alloc_token_slots."""
        if n > self.num_free_blocks:
            raise OutOfBlocks(f"{seq_id}: SGLang has {self.num_free_blocks} pages, {n} needed")
        if self.alloc.available_size() < n * self.bs:
            self.tree.evict(n * self.bs - self.alloc.available_size())
        return (self.alloc.alloc(n * self.bs)[:: self.bs] // self.bs).tolist()

    def _slots(self, seq_id, end) -> torch.Tensor:
        """Its slot indices for positions [0, end), end page-aligned (its req_to_token row)."""
        pages = torch.tensor(self.pages[seq_id][: end // self.bs], dtype=torch.int64)
        return (pages[:, None] * self.bs + torch.arange(self.bs)).reshape(-1)

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        hit = self.tree.match_prefix(RadixKey(list(token_ids[:max_computed])))
        h, node = len(hit.device_indices), hit.last_device_node
        n = min(num_new_tokens, len(token_ids) - h)
        self.tree.inc_lock_ref(node)  # before evicting: the hit is not evictable
        try:
            new = self._take(seq_id, -(-(h + n) // self.bs) - h // self.bs)  # h: whole pages
        except OutOfBlocks:
            self.tree.dec_lock_ref(node)
            raise
        self.pages[seq_id] = (hit.device_indices[:: self.bs] // self.bs).tolist() + new
        self.tokens[seq_id], self.node[seq_id] = list(token_ids[: h + n]), node
        self.owned[seq_id], self.known[seq_id], self.done[seq_id] = h, len(token_ids), h
        return h

    def append(self, seq_id, token_ids):
        have, pages = len(self.tokens[seq_id]), self.pages[seq_id]
        pages += self._take(seq_id, -(-(have + len(token_ids)) // self.bs) - len(pages))
        self.tokens[seq_id] += token_ids
        return []  # it writes only its own pages: the tree holds full, computed pages only

    def block_ids(self, seq_id):
        return self.pages[seq_id]

    def end_step(self, computed):
        for s, n in computed.items():
            if s in self.done:
                self.done[s] = n
                if n <= self.known[s]:  # in prefill: SGLang's cache_unfinished_req
                    self._insert(s, n // self.bs * self.bs)

    def _insert(self, seq_id, end) -> None:
        """Its computed full pages into the tree; it then locks their node. When another request
        put the same tokens there first, SGLang would rewrite this one's pages to the tree's; the
        protocol forbids that (entries change only by growth or a copy): deferred to release."""
        key, owned = self.tokens[seq_id][:end], self.owned[seq_id]
        if end <= owned or len(self.tree.match_prefix(RadixKey(key)).device_indices) != owned:
            return
        self.tree.insert(RadixKey(key), self._slots(seq_id, end))
        self.tree.dec_lock_ref(self.node[seq_id])
        self.node[seq_id] = self.tree.match_prefix(RadixKey(key)).last_device_node
        self.tree.inc_lock_ref(self.node[seq_id])
        self.owned[seq_id] = end

    def release(self, seq_id, reason):
        if seq_id not in self.pages:
            return False
        owned, end = self.owned.pop(seq_id), self.done.pop(seq_id) // self.bs * self.bs
        if reason in ("finished", "aborted") and end > owned:  # cache_finished_req
            slots, key = self._slots(seq_id, end), RadixKey(self.tokens[seq_id][:end])
            dup = self.tree.insert(key, slots)  # pages others put there first: freed below
            self.alloc.free(slots[owned:dup])
            owned = end  # preempted, error: is_insert=False; the rest is freed
        tail = torch.tensor(self.pages.pop(seq_id)[owned // self.bs :], dtype=torch.int64)
        self.alloc.free(tail * self.bs)
        self.tree.dec_lock_ref(self.node.pop(seq_id))
        del self.tokens[seq_id], self.known[seq_id]
        return True

    def _walk(self):
        """(page, tokens, key, parent key, locked) of every tree page, parents first."""
        stack = [(child, None) for child in self.tree.root_node.children.values()]
        while stack:
            node, parent = stack.pop()
            ids, bs = node.key.token_ids, self.bs
            for i in range(len(ids) // bs):
                toks = list(ids[i * bs : (i + 1) * bs])
                key = blake2b(repr((parent, toks)).encode(), digest_size=16).hexdigest()
                yield int(node.value[i * bs]) // bs, toks, key, parent, node.lock_ref > 0
                parent = key
            stack += [(child, parent) for child in node.children.values()]

    def snapshot(self) -> Snapshot:
        refs = [0] * self.num_blocks  # holders: SGLang counts locks per tree node, not per page
        for p in (p for pages in self.pages.values() for p in pages):
            refs[p] += 1
        cached = list(self._walk())
        free = self.alloc.free_pages.tolist() + self.alloc.release_pages.tolist()
        return Snapshot(
            self.num_blocks,
            free + [p for p, *_, locked in cached if not locked],  # cached, unlocked: free
            refs,
            {s: list(p) for s, p in self.pages.items()},
            seq_tokens={s: len(t) for s, t in self.tokens.items()},
            reserved=list(self.reserved_blocks),
            cache=[{"block": p, "key": k, "parent": up, "tokens": t} for p, t, k, up, _ in cached],
        )
