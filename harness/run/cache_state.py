"""The prefix cache's own state against the writer record (docs/protocol-v2.md section 4): what
the manager says its cache holds (the snapshot's `cache`) is checked against what the harness saw
written, slot by slot, and every hit against the entries of the blocks it served.

- cache_content: a cached block must hold, in every slot, KV of one chain of tokens (each slot's
  identity extends the previous one's), the entry's tokens when it names them, and continue the
  block its parent key names (position 0 when it has none). Problems: partial (a slot never
  written, or torn), tokens, chain, parent.
- hit_blocks: each block a hit served is cached, its entry's tokens are the reader's tokens for
  that block, and its parent key is the key of the block served before it. Problems:
  not_cached, tokens, parent.
Judged after the step's writes, on the snapshot taken at that step's upload (a manager may key a
block as it allocates it: its KV is written within the step). An entry is judged again only when
its block was written since, and told wrong once; a hit only on its own step's snapshot."""

from __future__ import annotations

from hashlib import blake2b

from kvchaos.harness.run.kv_record import KVRecord

# cache_mismatch events a step writes (a cache gone stale has hundreds of entries). Per step, not
# per run: one fault's flood early in a run must not silence the entries another spoils later
# (soak seed 1020: async_free's 64 by step 12 hid every stale_revive entry after it)
MAX_TOLD = 64


def _extend(d: bytes, token: int) -> bytes:
    return blake2b(d + token.to_bytes(4, "little"), digest_size=8).digest()  # as Identities


class CacheWatch:
    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.judged: dict[int, tuple[str, int]] = {}  # block -> (key, version) last judged
        self.told: set[tuple[int, str]] = set()  # (block, key) of entries found wrong
        self.untold = 0  # wrong entries past a step's MAX_TOLD: counted, not written one by one
        self.hits: list[tuple[int, str, list[int], list[int]]] = []  # step, req, tokens, blocks
        self.state = None  # the judge's cache state at the last full look, and its blocks
        self.blocks: set[int] | None = None

    def hit(self, step: int, req: str, tokens: list[int], blocks: list[int]) -> None:
        self.hits.append((step, req, list(tokens[: len(blocks) * self.bs]), list(blocks)))

    def check(self, rec: KVRecord, cache: list[dict] | None, step: int, state=None) -> list[dict]:
        """The cache_mismatch and hit_mismatch events of this step's snapshot (cache None: the
        manager shows no cache state; nothing is judged). state: the cache as the snapshot
        judge keeps it, the very object while no entry changed."""
        hits, self.hits = [h for h in self.hits if h[0] == step], []
        if cache is None:
            return []
        bumped, rec.bumped = rec.bumped, set()
        if not hits and state is not None and state is self.state and self.blocks is not None:
            if self.blocks.isdisjoint(bumped):  # every entry as judged last time: nothing new
                return []
        self.state = state
        blocks = {e["block"] for e in cache}
        self.blocks = blocks if len(blocks) == len(cache) else None  # a block twice: scan all
        judged, version = self.judged, rec.version
        fresh = [e for e in cache if judged.get(e["block"]) != (e["key"], version[e["block"]])]
        if not fresh and not hits:
            return []
        by_key = {e["key"]: e for e in cache}
        out, told = [], 0
        for e in fresh:
            b = e["block"]
            judged[b] = (e["key"], version[b])
            problem = self._content(rec, e, by_key)
            if problem and (b, e["key"]) not in self.told:  # an entry found wrong: told once
                self.told.add((b, e["key"]))
                told += 1
                if told > MAX_TOLD:
                    self.untold += 1
                    continue
                s = b * self.bs
                writers = sorted({w for w in rec.writer[s : s + self.bs] if w is not None})
                written = sum(x is not None for x in rec.ident[s : s + self.bs])
                ev = {"e": "cache_mismatch", "step": step, "block": b, "key": e["key"],
                      "problem": problem, "writers": writers, "written": written}  # fmt: skip
                if problem == "parent" and e.get("parent") in by_key:  # the block it continues
                    ev["parent_block"] = by_key[e["parent"]]["block"]
                out.append(ev)
        by_block = {e["block"]: e for e in cache}
        for _, req, tokens, blocks in hits:
            out += self._hit(step, req, tokens, blocks, by_block)
        return out

    def _content(self, rec: KVRecord, e: dict, by_key: dict) -> str | None:
        bs, s = self.bs, e["block"] * self.bs
        ident, token = rec.ident[s : s + bs], rec.token[s : s + bs]
        if any(d is None for d in ident):
            return "partial"
        if e.get("tokens") is not None and list(e["tokens"]) != token:
            return "tokens"
        # One writer at consecutive positions: its own identity chain (the record stores each
        # slot's writer identity), so no hashing; any other mix is checked link by link.
        writer, pos = rec.writer[s : s + bs], rec.pos[s : s + bs]
        one = writer.count(writer[0]) == bs and pos == list(range(pos[0], pos[0] + bs))
        if not one and any(ident[o] != _extend(ident[o - 1], token[o]) for o in range(1, bs)):
            return "chain"
        parent = e.get("parent")
        if parent is None:
            ok = pos[0] == 0 and (one or ident[0] == _extend(b"", token[0]))
        else:
            p = by_key.get(parent)
            if p is None:  # the parent was evicted: its end cannot be read back, not judged
                return None
            last = p["block"] * bs + bs - 1
            same = one and rec.writer[last] == writer[0] and rec.pos[last] == pos[0] - 1
            ok = rec.ident[last] is not None and (
                same or ident[0] == _extend(rec.ident[last], token[0])
            )
        return None if ok else "parent"

    def _hit(self, step, req, tokens, blocks, by_block) -> list[dict]:
        out, bs, prev = [], self.bs, None
        for i, b in enumerate(blocks):
            e = by_block.get(b)
            want = tokens[i * bs : (i + 1) * bs]
            if e is None:
                problem = "not_cached"
            elif e.get("tokens") is not None and len(want) == bs and list(e["tokens"]) != want:
                problem = "tokens"
            elif e.get("parent") != (prev["key"] if prev else None):
                problem = "parent"
            else:
                problem = None
            if problem:
                out.append(
                    {"e": "hit_mismatch", "step": step, "req": req, "index": i, "block": b,
                     "problem": problem}
                )  # fmt: skip
                break  # the rest of the hit hangs on this block
            prev = e
        return out
