"""The per-block writer record (docs/protocol-v2.md section 3): for every KV slot, who wrote it,
for which position and tokens, at which step; so a read of KV written for other tokens is caught
and named by its READER (a holder that never read the slot is named nowhere).

Slot identity: D(seq, p) = blake2b-8(D(seq, p - 1) || token p), kept per request as its tokens
arrive (independent of any manager's hash). A reader at position p is right iff the slot its
table names holds D(reader, p): the same position after the same whole prefix, whoever wrote it.
Taint: once a request reads wrongly, on any rank (attention outputs are gathered from every rank),
every slot it writes from that step on, on every rank, carries the origin; another reader
matching such a slot has read KV computed from wrong KV (poisoned).

Pure: no torch. LiveRun feeds it the engine's on_batch seam (engine/seams.py) and `cow` events."""

from __future__ import annotations

from hashlib import blake2b
from typing import Callable, Sequence


class Identities:
    """D(seq, p) for each request, extended lazily from its tokens: O(tokens) per run."""

    def __init__(self) -> None:
        self.chains: dict[str, list[bytes]] = {}

    def upto(self, seq: str, tokens: Sequence[int], n: int) -> list[bytes]:
        """seq's identities for positions 0..n-1 at least (its chain, not a copy)."""
        chain = self.chains.get(seq)
        if chain is None:
            chain = self.chains[seq] = []
        if len(chain) < n:
            d = chain[-1] if chain else b""
            for t in tokens[len(chain) : n]:
                d = blake2b(d + t.to_bytes(4, "little"), digest_size=8).digest()
                chain.append(d)
        return chain


class KVRecord:
    """One rank's record of its KV pool, slot by slot. A step's writes apply before its reads (as
    each layer writes the batch's KV before attending). Per (reader, logical block) the (block,
    version, slots, right) last verified is kept, so a decode step re-verifies only blocks that
    changed; a block found wrong again, by the same reader at the same entry, is told once."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        n = num_blocks * block_size
        self.num_blocks, self.block_size = num_blocks, block_size
        self.writer: list[str | None] = [None] * n
        self.pos = [-1] * n
        self.token = [-1] * n
        self.ident: list[bytes | None] = [None] * n  # None: never written, or torn (writer set)
        self.step = [-1] * n
        self.taint: list[str | None] = [None] * n
        self.version = [0] * num_blocks
        self.bumped: set[int] = set()  # blocks whose version moved since a reader took the set
        self.verified: dict[str, list[tuple[int, int, int, bool]]] = {}
        self.whole: dict[str, tuple[list[int], list[int]]] = {}  # reader -> whole entries read
        self.tainted: dict[str, str] = {}  # reader -> origin of the wrong read it made or took
        self._now: tuple[int, dict[str, list[int]]] = (-1, {})  # this step's writes, by writer
        self._seen: tuple[int, dict[int, set[str]]] = (-1, {})  # this step's verified blocks
        self.reads = 0  # sequence reads judged
        self.work = 0  # slots verified: what the reads cost
        self.shared = 0  # verified slots another request wrote (reads a cache hit or fork made)

    def clone(self) -> KVRecord:
        new = KVRecord.__new__(KVRecord)
        new.__dict__.update(
            {k: (v.copy() if isinstance(v, (list, dict)) else v) for k, v in vars(self).items()}
        )
        new.verified = {r: list(c) for r, c in self.verified.items()}
        new.whole = dict(self.whole)  # its lists are replaced, never changed
        new.bumped = set()
        new._now = (-1, {})
        new._seen = (-1, {})
        return new

    def copy(self, pairs: Sequence[Sequence[int]]) -> None:
        """Copy-on-write: each dst block takes src's slots (all sources read before any write)."""
        taken = [(dst, self.rows(src)) for src, dst in pairs]
        for dst, rows in taken:
            self.put(dst, rows)

    def rows(self, b: int) -> list[list]:
        """Block b's slots, every field (what a copy of the block carries)."""
        bs = self.block_size
        fields = (self.writer, self.pos, self.token, self.ident, self.step, self.taint)
        return [f[b * bs : (b + 1) * bs] for f in fields]

    def put(self, b: int, rows: list[list]) -> None:
        """Block b takes a copy's slots (rows())."""
        bs = self.block_size
        fields = (self.writer, self.pos, self.token, self.ident, self.step, self.taint)
        for f, row in zip(fields, rows):
            f[b * bs : (b + 1) * bs] = row
        self.version[b] += 1
        self.bumped.add(b)

    def write(
        self, seq: str, pos: int, token: int, digest: bytes | None, slot: int, step: int
    ) -> None:
        """seq's KV for position pos (token) into slot; digest None: its content is unknown (the
        step raised). A negative slot (an unused table entry) wraps to the pool's end, as
        write_kv does."""
        self.write_all([(seq, pos, token, slot)], step, {}, lambda s, p: {p: digest})

    def write_all(self, writes, step: int, chains: dict, chain_of) -> None:
        """write() for a step's writes [(seq, pos, token, slot)] in one loop (a prefill writes
        many slots): each slot's identity is chains[seq][pos], else chain_of(seq, pos)[pos]."""
        n, bs = len(self.writer), self.block_size
        writer, pos_, token_, ident, step_, taint = (
            self.writer,
            self.pos,
            self.token,
            self.ident,
            self.step,
            self.taint,
        )
        tainted, version, bumped = self.tainted, self.version, self.bumped
        if self._now[0] != step:
            self._now = (step, {})
        now = self._now[1]
        for seq, pos, token, slot in writes:
            d = chains.get(seq)
            if d is None or len(d) <= pos:
                d = chain_of(seq, pos)
            s = slot % n
            writer[s], pos_[s], token_[s] = seq, pos, token
            ident[s], step_[s], taint[s] = d[pos], step, tainted.get(seq)
            version[s // bs] += 1
            bumped.add(s // bs)
            mine = now.get(seq)
            if mine is None:
                mine = now[seq] = []
            mine.append(s)

    def read(
        self, seq: str, digests: Sequence[bytes], blocks: Sequence[int], n_ctx: int, step: int
    ) -> list[dict]:
        """seq attends to positions [0, n_ctx) through blocks (its row's entries); digests are
        its identities. Returns one dict per block read wrongly (its first failing slot says the
        kind: never written, written for other tokens, or poisoned)."""
        bs, version = self.block_size, self.version
        done = self.verified.get(seq)
        if done is None:
            done = self.verified[seq] = []
        out = []
        self.reads += 1
        # Entries read whole last time, the same blocks at the same versions: checked at C speed
        # (a decode step's reader re-reads them all), then the loop starts after them.
        whole, k = n_ctx // bs, 0
        last = self.whole.get(seq)
        if last is not None:
            k = min(len(last[0]), whole)
            if (
                blocks[:k] != last[0][:k]
                or list(map(version.__getitem__, last[0][:k])) != last[1][:k]
            ):
                k = 0
        for i in range(k, -(-n_ctx // bs)):
            b, cnt, v = blocks[i], min(bs, n_ctx - i * bs), version[blocks[i]]
            was = done[i] if i < len(done) else None
            if was is not None and was[0] == b and was[1] == v and was[2] >= cnt:
                continue
            bad = self._verify(seq, digests, b, i * bs, cnt)
            if self._seen[0] != step:
                self._seen = (step, {})
            self._seen[1].setdefault(b, set()).add(seq)
            if was is None:
                done.append((b, v, cnt, not bad))
            else:
                done[i] = (b, v, cnt, not bad)
            if bad and (was is None or was[0] != b or was[3]):
                out.append(self._failed(seq, digests, i, b, bad, step))
        if last is None or k < whole or len(last[0]) != whole:  # as verified (before any taint)
            self.whole[seq] = (list(blocks[:whole]), [done[i][1] for i in range(whole)])
        return out

    def _verify(self, seq: str, digests, b: int, p0: int, cnt: int) -> list[int]:
        """The offsets of block b whose slot is not seq's KV for position p0 + offset."""
        base, own = b * self.block_size, self.tainted.get(seq)
        ident, taint, writer = self.ident, self.taint, self.writer
        bad = []
        for o in range(cnt):
            s = base + o
            t = taint[s]
            if ident[s] != digests[p0 + o] or (t is not None and t != own):
                bad.append(o)
            elif writer[s] != seq:
                self.shared += 1
        self.work += cnt
        return bad

    def _failed(self, seq: str, digests, i: int, b: int, bad: list[int], step: int) -> dict:
        bs = self.block_size
        s = b * bs + bad[0]
        w = self.writer[s]
        poisoned = w is not None and self.ident[s] == digests[i * bs + bad[0]]
        origin = self.taint[s] if poisoned else None
        out = {
            "req": seq,
            "index": i,
            "block": b,
            "slots": bad,
            "pos": [i * bs + o for o in bad],
            "writer": w,
            "writer_pos": self.pos[s] if w is not None else None,
            "writer_step": self.step[s] if w is not None else None,
            "origin": origin,
        }
        if w is not None and self.ident[s] is None:
            out["torn"] = True  # written in a step that raised: its content is unknown
        self.taint_writer(seq, origin or seq, step)
        return out

    def taint_writer(self, seq: str, origin: str, step: int, every: bool = True) -> None:
        """seq read wrongly at step (origin: whose wrong read it took): its writes from this step
        on carry the origin, unless it carries one already. Their blocks' versions move, so a
        reader that verified them re-verifies: every one's, or (every=False) only those another
        reader verified this step (the writer's own taint matches them)."""
        if seq in self.tainted:
            return
        self.tainted[seq], bs = origin, self.block_size
        if self._now[0] != step:
            return
        seen = self._seen[1] if self._seen[0] == step else {}
        for t in self._now[1].get(seq, ()):
            self.taint[t] = origin
            b = t // bs
            if every or seen.get(b, set()) - {seq}:
                self.version[b] += 1
                self.bumped.add(b)


Batch = tuple[list, list]  # (reads [(seq, n_ctx, blocks)], writes [(seq, pos, token, slot)])


class RankRecords:
    """One KVRecord per rank. A rank > 0 shares rank 0's while its table equals rank 0's (the
    engine reports no batch of its own then); from the first step it differs it keeps its own
    copy, fed rank 0's batch on steps it reports none. A step's batch is committed once the step
    returned; one that raised leaves its slots torn."""

    def __init__(self, num_blocks: int, block_size: int, world: int = 1) -> None:
        self.world = world
        self.ids = Identities()
        self.records = {0: KVRecord(num_blocks, block_size)}
        self.pending: dict[int, Batch] = {}
        self.hits: dict[str, set[int]] = {}  # req -> the blocks of its last cache hit
        self.late: list[tuple[int, list]] = []  # (rank, writes) landing after the step's batch

    def on_batch(self, rank: int, reads: list, writes: list) -> None:
        self.pending[rank] = (reads, writes)

    def on_engine(self, kind: str, data: dict, step: int, tokens_of) -> None:
        """The engine's copies and late writes (events cow, cow_landed, async_landed)."""
        if kind == "cow":
            self.copy(data["copies"], data.get("late_ranks", ()))
        elif kind == "cow_landed":
            self.copy_on(data["rank"], data["copies"])
        elif kind == "async_landed":
            self.landed(data["req"], data["writes"], step, tokens_of)

    def copy(self, pairs, late=()) -> None:
        """Copy-on-write on every rank but the `late` ones (their copies land later: copy_on);
        a rank that skips it keeps a record of its own from here."""
        if late:
            own = late if 0 not in late else range(1, self.world)  # who else shared rank 0's
            for r in own:
                if r not in self.records:
                    self.records[r] = self.records[0].clone()
        for r, rec in self.records.items():
            if r not in late:
                rec.copy(pairs)

    def copy_on(self, rank: int, pairs) -> None:
        """A rank's late copy-on-write lands."""
        self.records[rank].copy(pairs)

    def landed(self, req: str, writes, step: int, tokens_of) -> None:
        """Writes of an earlier step landing now ([rank, pos, token, slot], asynchronous
        scheduling): after this step's batch when one is reported (its kernels ran first)."""
        by: dict[int, list] = {}
        for rank, pos, token, slot in writes:
            by.setdefault(rank, []).append((req, pos, token, slot))
        self.late += sorted(by.items())
        if not self.pending:
            self._land(step, tokens_of)

    def _land(self, step: int, tokens_of) -> None:
        by: dict[int, list] = {}
        for rank, writes in self.late:
            by.setdefault(rank, []).extend(writes)
        self.late, ids = [], self.ids
        for r, rec in sorted(self.records.items()):  # a rank sharing rank 0's table: rank 0's
            chain = lambda s, p: ids.upto(s, tokens_of(s), p + 1)  # noqa: E731
            rec.write_all(by.get(r, by.get(0, [])), step, ids.chains, chain)

    def hit(self, req: str, blocks) -> None:
        self.hits[req] = set(blocks)

    def _split(self) -> dict[int, Batch]:
        pending, self.pending = self.pending, {}
        for r in sorted(pending):
            if r not in self.records:  # before rank 0's batch applies: the state both share
                self.records[r] = self.records[0].clone()
        return pending

    def commit(self, step: int, tokens_of: Callable[[str], Sequence[int]]) -> list[dict]:
        """Apply the step's batches; the failed reads, each with its rank and via_hit."""
        pending = self._split()
        if 0 not in pending:
            if self.late:
                self._land(step, tokens_of)
            return []
        ids, chains, out = self.ids, self.ids.chains, []
        for r, rec in sorted(self.records.items()):
            reads, writes = pending.get(r, pending[0])
            for seq, n, _ in reads:  # a reader's identities (a writer reads what it writes)
                d = chains.get(seq)
                if d is None or len(d) < n:
                    ids.upto(seq, tokens_of(seq), n)
            rec.write_all(writes, step, chains, lambda s, p: ids.upto(s, t := tokens_of(s), len(t)))
            for seq, n, blocks in reads:
                for f in rec.read(seq, chains[seq], blocks, n, step):
                    f["rank"], f["via_hit"] = r, f["block"] in self.hits.get(seq, ())
                    out.append(f)
        self._taint_across(step)
        if self.late:
            self._land(step, tokens_of)
        return out

    def _taint_across(self, step: int) -> None:
        """A wrong read on one rank is wrong on all: each layer's attention output is gathered
        from every rank, so the reader's hidden state, and the KV it writes on every rank from
        this step on, carries the origin of the first wrong read found for it."""
        if len(self.records) < 2:
            return
        origin: dict[str, str] = {}
        for _, rec in sorted(self.records.items()):
            for seq, o in rec.tainted.items():
                origin.setdefault(seq, o)
        for rec in self.records.values():  # a version moves where another reader verified it
            for seq, o in origin.items():
                rec.taint_writer(seq, o, step, every=False)

    def abort(self, step: int) -> None:
        """The step raised: what it may have written is unknown."""
        pending = self._split()
        for r, rec in self.records.items():
            for seq, pos, token, slot in pending.get(r, pending.get(0, ((), ())))[1]:
                rec.write(seq, pos, token, None, slot, step)

    def stats(self) -> dict:
        rec = self.records[0]
        return {
            "reads": rec.reads,
            "slots_verified": rec.work,
            "shared_slots": rec.shared,
            "own_ranks": sorted(r for r in self.records if r),
        }
