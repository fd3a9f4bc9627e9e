"""The worked example of an adapter (docs/adapters.md): your engine's KV manager, with its own API,
as a kvchaos block manager (protocol v2), wrapped method by method.

`MyKV` stands for your engine's manager: pages of `page` tokens, ref-counted, and a cache of full
pages keyed by the tokens up to their end, filled when a request is dropped and kept while a page
is free, until it is reused. `MyKVManager` is all an adapter is: it answers each protocol call
with MyKV's calls. Run it: `kvchaos run --block-manager kvchaos.harness.adapters.example:
MyKVManager`; `kvchaos conformance` takes the same spec."""

from __future__ import annotations

from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.protocols import Snapshot


class MyKV:  # your engine's manager: nothing of kvchaos in it
    def __init__(self, pages: int, page: int) -> None:
        self.page, self.refs, self.free = page, [0] * pages, list(range(pages))  # free: LRU first
        self.cache: dict[tuple, int] = {}  # tokens up to a page's end -> the page
        self.key_of: dict[int, tuple] = {}
        self.held: dict[str, list[int]] = {}

    def lookup(self, tokens) -> list[int]:
        """The cached pages of tokens' longest prefix of whole pages."""
        pages: list[int] = []
        while (end := (len(pages) + 1) * self.page) <= len(tokens):
            if (page := self.cache.get(tuple(tokens[:end]))) is None:
                break
            pages.append(page)
        return pages

    def reserve(self, req: str, slots: int, hit=()) -> bool:
        """Grow req to `slots` token slots, adopting the hit pages first; False: no room."""
        pages = self.held.get(req, []) + list(hit)
        new = max(0, -(-slots // self.page) - len(pages))
        revived = [p for p in hit if not self.refs[p]]  # cached, free: taken back
        if new + len(revived) > len(self.free):
            return False
        for p in hit:
            self.refs[p] += 1
        self.free = [p for p in self.free if p not in revived]
        for p in self.free[:new]:  # reused: its old key goes
            self.cache.pop(self.key_of.pop(p, None), None)
            self.refs[p] = 1
        self.held[req], self.free = pages + self.free[:new], self.free[new:]
        return True

    def blocks(self, req: str) -> list[int]:
        return self.held.get(req, [])

    def drop(self, req: str, computed=()) -> None:
        """Release req's pages, its tail first (reused first); the full ones among its computed
        tokens are cached."""
        for i, p in reversed(list(enumerate(self.held.pop(req)))):
            key = tuple(computed[: (i + 1) * self.page])
            if len(key) == (i + 1) * self.page and key not in self.cache and p not in self.key_of:
                self.cache[key], self.key_of[p] = p, key
            self.refs[p] -= 1
            if not self.refs[p]:
                self.free.append(p)


class MyKVManager:
    """The adapter: protocol v2 in MyKV's calls."""

    kvchaos_protocol = 2
    capabilities = frozenset({"prefix_cache", "end_step"})

    def __init__(self, num_blocks, block_size, max_num_seqs=None, max_blocks_per_seq=None):
        self.kv, self.block_size = MyKV(num_blocks, block_size), block_size
        self.tokens: dict[str, list[int]] = {}  # what each sequence has slots for
        self.done: dict[str, int] = {}  # ... of which computed (end_step): cached on release

    num_blocks = property(lambda self: len(self.kv.refs))
    num_free_blocks = property(lambda self: len(self.kv.free))

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        hit = self.kv.lookup(token_ids[:max_computed])
        h = len(hit) * self.block_size
        slots = h + min(num_new_tokens, len(token_ids) - h)
        if not self.kv.reserve(seq_id, slots, hit):
            raise OutOfBlocks(f"{seq_id}: no room for {slots} tokens")
        self.tokens[seq_id], self.done[seq_id] = list(token_ids[:slots]), h
        return h

    def append(self, seq_id, token_ids):
        if not self.kv.reserve(seq_id, len(self.tokens[seq_id]) + len(token_ids)):
            raise OutOfBlocks(f"{seq_id}: no room for {len(token_ids)} more tokens")
        self.tokens[seq_id] += token_ids
        return []  # MyKV never shares a page it writes: no copies

    def block_ids(self, seq_id):
        return self.kv.blocks(seq_id)

    def release(self, seq_id, reason):
        if seq_id not in self.done:
            return False
        self.kv.drop(seq_id, self.tokens.pop(seq_id)[: self.done.pop(seq_id)])
        return True

    def end_step(self, computed):
        self.done.update((s, n) for s, n in computed.items() if s in self.done)

    def snapshot(self):
        kv = self.kv
        blocks = {s: list(pages) for s, pages in kv.held.items()}
        return Snapshot(len(kv.refs), list(kv.free), list(kv.refs), blocks)
