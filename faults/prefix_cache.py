"""Failure mode 5: the prefix cache serves a request KV that was not computed for its tokens
(docs/protocol-v2.md section 5). Four variants, each a bug class shipped in a real engine and
planted in the reference pool through PoolSeams, whose defaults are the remediation:

  partial_key       vllm#34587: a block is keyed as its slots are reserved, over the prompt's
                    known tokens; a request aborted mid-prefill leaves a key over unwritten slots
  weak_key          vllm#12621, Megatron-LM#4158: a weak hash collides, hits are not verified
  evict_referenced  atlas#373: a revive leaves the block in the free queue, so allocate hands the
                    held block to another request, which overwrites it
  stale_revive      vllm#4761: allocate keeps the evicted block's key, a hit trusts it

The trigger is the same in clean and detect runs and pulled the same way for a seed: its first
request is the first one of step 1, the others wait on it (Action.after / when). Ground truth
comes from the pool: on_defect (what a defect path did) and on_admit (every hit, clean runs too).
A victim is a request that READ the wrong KV, never a holder that merely shares the block.

stale_revive's kept key is harmless while its block still holds the KV the key names: its new
owner has not written yet (with async scheduling its KV lands a step later), wrote the same
tokens after the same prefix, or its writes went astray (another fault's table misread). So the
entry goes bad, and the defect fires, at the step a write lands in the block with other KV
(faults/prefix_kept.py)."""

from __future__ import annotations

from typing_extensions import NotRequired, TypedDict

from kvchaos.engine.block_pool import PrefixBlockPool
from kvchaos.engine.prefix_manager import PrefixCachingManager
from kvchaos.faults import base
from kvchaos.faults.base import COUNT, Fault, Num, ParamError, Variant
from kvchaos.faults.plan import Action
from kvchaos.faults.prefix_explain import explains as explain_finding
from kvchaos.faults.prefix_explain import wrong_reads
from kvchaos.faults.prefix_kept import KeptEntries

BAD_ENTRIES = {  # what the pool reports of a cache entry that misnames its block's KV
    "keyed_partial": "keyed before its KV was computed",
    "kept_key": "re-allocated with its key kept, then written over",
    "collided_parent": "keyed after a parent whose key another prefix holds",
}
SHARED_BLOCKS = 3  # whole blocks a trigger's reader shares with its source (not partial_key)
VARIANTS = {  # as an incident quotes them
    "partial_key": Variant(
        "A block was keyed (published to the prefix cache) when its slots were reserved, over the "
        "prompt's known tokens, before its KV was computed. A request aborted after a prefill "
        "chunk that ended inside that block left the key over slots never written, and a later "
        "request's hit read them (vllm#34587).",
        "Key a block only once it is full and its KV computed (after the step: end_step), so an "
        "aborted or failed step leaves no key over unwritten slots.",
    ),
    "weak_key": Variant(
        "Blocks were keyed by a weak hash (a token sum, the class of builtin hash() and "
        "Megatron-LM#4158) that collides by construction, and a hit trusted the key without "
        "checking the block's token ids: two different prefixes shared blocks, and the second "
        "request attended to KV computed for the first one's tokens (vllm#12621).",
        "Key by a strong chained hash (sha256 in vLLM >= 0.10.2) and verify a hit's stored token "
        "ids and parent key before serving it.",
    ),
    "evict_referenced": Variant(
        "A cache hit revived a freed block without unlinking it from the free queue: still "
        "counted free while referenced, allocate handed it to another request, which overwrote "
        "the KV the reviver attends to (Avarok-Cybersecurity/atlas#373).",
        "A revive unlinks the block from the free queue (O(1) in an intrusive doubly linked "
        "list, as vLLM's FreeKVCacheBlockQueue), so only blocks with no reference are handed out.",
    ),
    "stale_revive": Variant(
        "allocate re-used an evicted cached block without dropping its prefix-cache entry, and a "
        "hit trusted the key: a later request with that prefix was served the block's new "
        "contents, written by another request (vllm#4761).",
        "Evict on reuse: when allocate pops a cached block, drop its key from the cache map "
        "before handing the block out.",
    ),
}


def weak_hash(parent, token_ids: tuple) -> int:
    """The planted weak key: a sum, so moving one unit between two tokens of a block collides."""
    return (sum(token_ids) + 31 * (parent or 0)) & 0xFFFF


class AtBlock(TypedDict):
    step: int
    block: int


class WrongHit(TypedDict):
    step: int
    req: str
    blocks: list[int]


class EvictedHeld(AtBlock):
    holders: list[str]


class Poisoned(TypedDict):
    step: int
    req: str


class Truth(base.Truth):
    not_applicable: NotRequired[str | None]
    wrong_hits: NotRequired[list[WrongHit]]
    evicted_held: NotRequired[list[EvictedHeld]]
    poisoned: NotRequired[list[Poisoned]]
    bad_entries: NotRequired[list[AtBlock]]
    tainted_blocks: NotRequired[list[AtBlock]]
    revived_queued: NotRequired[list[AtBlock]]


class PrefixCache(Fault):
    name = "prefix_cache"
    detectors = ("kv_reads", "prefix_cache", "oracle_divergence", "block_accounting")
    truth = Truth
    root_cause = "A prefix-cache hit served KV that was not computed for the request's tokens."
    remediation = "Serve a block only while its KV is the one its key names (see the variant)."
    any_manager = False  # its defects are switches of the reference pool
    defaults = {"variant": "partial_key", "pairs": 1, "pressure_tokens": 0}
    # pairs: trigger rounds, each after the last; pressure_tokens: what the fillers of
    # evict_referenced / stale_revive allocate (0: num_blocks x block_size, the free queue once)
    domains = {"pairs": Num(int, ge=1), "pressure_tokens": COUNT}
    variants = VARIANTS

    # -- the trigger --------------------------------------------------------------------
    @classmethod
    def _span(cls, p: dict, bs: int, max_prefill_tokens: int) -> int:
        """Tokens of the source's prefix the reader repeats: partial_key, the source's first
        chunk rounded up to whole blocks (it ends inside the last); else SHARED_BLOCKS blocks."""
        if p["variant"] == "partial_key":
            return -(-max_prefill_tokens // bs) * bs
        return SHARED_BLOCKS * bs

    @classmethod
    def row_tokens(cls, p: dict, block_size: int, max_prefill_tokens: int) -> int:
        """Tokens (prompt and output) its longest trigger request needs in a table row."""
        return cls._span(p, block_size, max_prefill_tokens) + block_size + 10

    @classmethod
    def _layout(cls, p: dict, cfg) -> dict:
        """(prompt, output) lengths of the trigger's requests: source, reader, fillers."""
        bs, cap, mpt = cfg.cache.block_size, cfg.cache.max_tokens_per_seq, cfg.max_prefill_tokens
        span = cls._span(p, bs, mpt)
        out = {"span": span, "reader": (span + bs + 2, 8)}
        if p["variant"] == "partial_key":  # still in prefill after its first chunk
            out["source"] = (span + bs, 4)
            return out
        out["source"] = (span + 2, 8 if p["variant"] == "weak_key" else 2)
        if p["variant"] in ("evict_referenced", "stale_revive"):
            pool = cfg.cache.num_blocks * bs
            total = p["pressure_tokens"] or pool
            size = max(1, min(cap - 2, pool // 4))
            out["fillers"] = [(size, 2)] * (-(-total // size))
            if p["variant"] == "evict_referenced":  # the reader holds its hit while they allocate
                steps = total // mpt + 4 * len(out["fillers"]) + 16
                out["reader"] = (span + bs + 2, max(8, min(cap - span - bs - 2, steps)))
        return out

    @classmethod
    def check_engine(cls, p: dict, cfg) -> None:
        cc, v = cfg.cache, p["variant"]
        if not cc.prefix_caching:
            raise ParamError(
                cls.name,
                "variant",
                "every variant plants in the reference prefix cache: set [engine.cache] "
                "prefix_caching = true",
            )
        if v == "partial_key" and cfg.max_prefill_tokens % cc.block_size == 0:
            raise ParamError(
                cls.name,
                "variant",
                f"partial_key needs a prefill chunk that ends inside a block: [engine] "
                f"max_prefill_tokens {cfg.max_prefill_tokens} is a multiple of block_size "
                f"{cc.block_size}",
            )
        if v == "weak_key" and cc.block_size < 2:
            raise ParamError(
                cls.name, "variant", "weak_key collides two tokens of one block: block_size >= 2"
            )
        longest = cls.row_tokens(p, cc.block_size, cfg.max_prefill_tokens)
        if longest > cc.max_tokens_per_seq:
            raise ParamError(
                cls.name,
                "variant",
                f"{v}'s trigger requests need {longest} tokens in a table row; [engine.cache] "
                f"max_blocks_per_seq x block_size holds {cc.max_tokens_per_seq}",
            )

    def shape(self, plan, cfg) -> None:
        """Per pair: the source A (pair 0: the first request of step 1, so its first chunk takes
        the whole prefill budget; later pairs: once the previous reader finished), then what the
        variant needs, each waiting on the one before."""
        v, bs, rng = self.p["variant"], cfg.cache.block_size, self.rng
        lay = self._layout(self.p, cfg)
        self.readers: dict[str, dict] = {}  # reader -> its source's id and prompt

        def add(req, prompt, out, op="submit", **wait) -> None:
            plan.add(Action(1, op, req, prompt, out, origin=self.name, **wait))

        last = None
        for i in range(self.p["pairs"]):
            a, b = f"pc{i}a", f"pc{i}b"
            src = plan.prompt(lay["source"][0], rng)
            reader = src[: lay["span"]] + plan.prompt(lay["reader"][0] - lay["span"], rng)
            fills = [(f"pc{i}f{j}", n, out) for j, (n, out) in enumerate(lay.get("fillers", ()))]
            if last is None:
                plan.actions.insert(
                    0, Action(1, "submit", a, src, lay["source"][1], origin=self.name)
                )
            else:
                add(a, src, lay["source"][1], after=last, when="finished")
            after, when = a, "finished"
            if v == "partial_key":  # aborted after its first chunk, which ends inside a block
                add(a, [], 0, op="cancel", when="prefill")
            elif v == "weak_key":  # its block 0 moves one unit between two tokens: same sum
                src[0], src[1] = min(src[0], plan.vocab - 2), max(src[1], 1)
                reader[:2] = [src[0] + 1, src[1] - 1]
                when = "decode"
            elif v == "stale_revive":  # they cycle the free queue over A's cached blocks first
                for f, n, out in fills:
                    add(f, plan.prompt(n, rng), out, after=a, when="finished")
                after, when = fills[-1][0], "decode"
            add(b, reader, lay["reader"][1], after=after, when=when)
            if v == "evict_referenced":  # they allocate while the reader holds its revived hit
                for f, n, out in fills:
                    add(f, plan.prompt(n, rng), out, after=b, when="decode")
            self.readers[b] = {"source": a, "prompt": src, "blocks": lay["span"] // bs}
            last = b

    # -- ground truth -------------------------------------------------------------------
    def arm(self, engine, emit) -> None:
        super().arm(engine, emit)
        self.engine, self.na = engine, None
        self.wrong_hits: list[dict] = []  # a hit served blocks whose KV is not the reader's
        # cache entries that misname their block's KV, when first seen: keyed before computed
        # (over slots unwritten at a step's end), kept by allocate, keyed after a collided parent
        self.bad_entries: list[dict] = []
        self.entered: set[int] = set()  # blocks already in bad_entries
        self.kept: KeptEntries | None = None  # (stale_revive) the keys allocate kept
        self.revived_queued: list[dict] = []  # revives that left a held block in the free queue
        self.evicted_held: list[dict] = []  # allocate handed out a block others still held
        self.poisoned: list[dict] = []  # hits on blocks a victim computed after its wrong read
        self.victims: dict[str, int] = {}  # reader -> step of its first wrong read
        self.hit_len: dict[str, int] = {}  # (defect) blocks of each sequence's last hit
        self.taint_from: dict[str, int] = {}  # victim -> its first block not yet looked at
        self.tainted: dict = {}  # key of a block a victim computed after its wrong read -> it
        self.tainted_blocks: list[dict] = []  # ... those blocks, keyed at step
        self.admitting: tuple[str | None, list] = (None, [])  # (defect) the latest admission
        self.seen = 0  # sequences looked at for forks of a victim
        # (a host tier) the logical blocks each victim was served wrong, which a store takes
        # out and a restore copies back in; wrong reads and landings looked at
        self.wrong_idx: dict[str, set[int]] = {}
        self.indexed, self.followed = (0, 0), 0
        m = self.manager = getattr(engine.bm, "manager", engine.bm)
        pool = self.pool = getattr(m, "pool", None)
        if not isinstance(m, PrefixCachingManager) or not isinstance(pool, PrefixBlockPool):
            self.na = (
                f"plants in the reference prefix cache (PrefixCachingManager on PrefixBlockPool), "
                f"not in {type(m).__name__}"
            )
            emit("not_applicable", {"reason": self.na}, 0)
            return
        seams, v = pool.seams, self.p["variant"]
        self.kept = KeptEntries(engine, m, pool)
        seams.on_admit = self._admitted
        if not self.defect:
            return
        seams.on_defect = self._defect
        seams.on_end_step = self._end_step  # before a victim that finished releases its blocks
        if v == "partial_key":
            seams.key_after_compute = False
        elif v == "weak_key":
            pool.hash_fn, seams.verify_hits = weak_hash, False
        elif v == "evict_referenced":
            seams.unlink_on_revive = False
        else:
            seams.evict_on_reuse = seams.verify_hits = False

    def _admitted(self, seq: str, hit: list, revived: list) -> None:
        """Every admission: a hit on a tainted block; a trigger's reader pulls the trigger when
        the defect would serve it wrong KV now (the remediation acted if its hit stops short)."""
        step, pool = self.engine.step_count, self.pool
        if self.defect:
            self.hit_len[seq] = len(hit)
            self.admitting = (seq, hit)  # holds its hit before its own allocations
        if self.tainted and hit:
            bad = [b for b in hit if pool.key[b] in self.tainted]
            if bad:
                origin = self.tainted[pool.key[bad[0]]]
                self.poisoned.append({"step": step, "req": seq, "origin": origin, "blocks": bad})
        r = self.readers.get(seq)
        if r is None or r.get("pulled"):
            return
        v, bs, src = self.p["variant"], pool.block_size, r["prompt"]
        pulled, remedied = False, 0
        if v == "partial_key":  # the source stopped inside a block the reader's prompt fills
            a = self.engine.seqs.get(r["source"])
            c = a.num_computed if a is not None and a.done else 0
            pulled = bool(c % bs) and c // bs < r["blocks"]
            remedied = int(pulled and len(hit) <= c // bs)
        elif v == "weak_key":  # the source's block 0 is cached: the weak key finds it
            c = pool.cache.get(pool.hash_fn(None, tuple(src[:bs])))
            pulled = c is not None and pool.tokens[c] == tuple(src[:bs])
            remedied = int(pulled and (not hit or hit[0] != c))
        elif v == "evict_referenced":  # the reader revived cached free blocks
            pulled = bool(revived)
            remedied = len(revived)  # each unlinked (the remediation)
        else:  # the source's keyed blocks were re-allocated since
            keys, k = [], None
            for i in range(r["blocks"]):
                k = pool.hash_fn(k, tuple(src[i * bs : (i + 1) * bs]))
                keys.append(k)
            gone = [k for k in keys if k not in pool.cache or k in pool.stale_keys]
            pulled = bool(gone)
            remedied = len(gone)  # each key dropped as its block was re-allocated
        if pulled:
            r["pulled"] = True
            self.remediated += 0 if self.defect else remedied
            self.trigger(step, {"reader": seq, "source": r["source"], "hit": len(hit)})

    def _victim(self, req: str, step: int, taint_from: int) -> None:
        self.victims.setdefault(req, step)
        self.taint_from.setdefault(req, taint_from)
        self.touch(requests=[req])

    def _defect(self, kind: str, d: dict) -> None:
        step = self.engine.step_count
        if kind in ("wrong_hit", "partial_hit"):
            why = {
                "partial_key": "not computed",
                "weak_key": "keyed over other tokens",
                "stale_revive": "re-allocated since keyed",
            }.get(self.p["variant"], kind)
            hit = {"step": step, "req": d["req"], "blocks": list(d["blocks"]), "why": why}
            self.wrong_hits.append(hit)
            self._victim(d["req"], step, self.hit_len.get(d["req"], 0))
            self.touch(blocks=d["blocks"])
            intact = self.kept.intact() if self.kept else set()
            # a stale key's block that still holds its KV serves it right: the reader stays a
            # victim (it reads the block once written over), the defect fires then
            if not intact.issuperset(d["blocks"]):
                self.fired(step, hit)
        elif kind == "kept_key" and self.kept:  # harmless until written over
            self.kept.keep(d["block"])
        elif kind in BAD_ENTRIES:
            self._bad_entries(step, kind, d.get("blocks", [d.get("block")]))
        elif kind == "revive_queued":
            self.revived_queued.append({"step": step, "block": d["block"]})
            self.touch(blocks=[d["block"]])
            self.fired(step, {"block": d["block"], "why": "revived, left in the free queue"})
        elif kind == "rehanded":
            b, m, (s0, hit) = d["block"], self.manager, self.admitting
            holders = {s for s, blocks in m.blocks.items() if b in blocks}
            holders = sorted(holders | ({s0} if b in hit and s0 not in m.blocks else set()))
            self.evicted_held.append({"step": step, "block": b, "holders": holders, "taker": None})
            for h in holders:
                self._victim(h, step, m.keyed.get(h, 0))
            self.emit("rehanded", self.evicted_held[-1], step)

    def _bad_entries(self, step: int, kind: str, blocks) -> None:
        new = [b for b in blocks if b not in self.entered]
        self.entered.update(new)  # once a block (keyed_partial comes every step)
        for b in new:
            self.bad_entries.append({"step": step, "block": b, "why": BAD_ENTRIES[kind]})
            self.touch(blocks=[b])
        if new:
            self.fired(step, {"blocks": new, "why": BAD_ENTRIES[kind]})

    def after_step(self, engine, step: int, output) -> None:
        m = self.manager
        if self.defect and self.p["variant"] == "stale_revive" and self.kept:
            self._landed_over()  # (a step that computed nothing has no end_step)
        for x in self.evicted_held:
            if x["taker"] is None and x["step"] == step:  # who took it: one not holding it before
                b = x["block"]
                now = [s for s, blocks in m.blocks.items() if b in blocks]
                x["taker"] = next(
                    (s for s in now if s not in x["holders"] or m.blocks[s].count(b) > 1), None
                )
        if self.victims and len(engine.seqs) > self.seen:  # a fork of a victim reads as it does
            truth = {"wrong_hits": self.wrong_hits, "evicted_held": self.evicted_held}
            read = wrong_reads(truth, step)
            for s in list(engine.seqs)[self.seen :]:
                bad = read.get(engine.seqs[s].parent, set()) & set(m.blocks.get(s, ()))
                if bad:
                    hit = {"step": step, "req": s, "blocks": sorted(bad), "why": "forked"}
                    self.wrong_hits.append(hit)
                    self._victim(s, step, len(m.blocks[s]))
        self.seen = len(engine.seqs)
        if getattr(engine, "tier", None) is not None:
            self._follow_restores(engine)

    def _follow_restores(self, engine) -> None:
        """A victim stored out and restored reads on what it was served: the blocks its restore
        copied in at the logical blocks it was served wrong (its host copy of them) are its
        wrong reads too, from their landing. Those logical blocks are taken where the victim
        holds the wrong blocks at the step it was served them."""
        m, tier = self.manager, engine.tier
        for step, q, blocks, how in tier.landings[self.followed :]:
            idx, held = self.wrong_idx.get(q), m.blocks.get(q)
            if how != "restore" or not idx or not held:
                continue
            new = [b for b in blocks if b in held and held.index(b) in idx]
            if new:
                self.wrong_hits.append({"step": step, "req": q, "blocks": new, "why": "restored"})
        self.followed = len(tier.landings)
        w, e = self.indexed
        served = [(x["req"], x["blocks"]) for x in self.wrong_hits[w:]]
        served += [(h, [x["block"]]) for x in self.evicted_held[e:] for h in x["holders"]]
        for q, bad in served:
            held = m.blocks.get(q, ())
            self.wrong_idx.setdefault(q, set()).update(i for i, b in enumerate(held) if b in bad)
        self.indexed = (len(self.wrong_hits), len(self.evicted_held))
        host = getattr(m, "host_slots", {})
        for q in [q for q in self.wrong_idx if q not in m.blocks and q not in host]:
            del self.wrong_idx[q]  # released: readmitted, it is served anew

    def _end_step(self) -> None:
        """Once the step's KV is written and its blocks keyed, before any release (so each
        writer still holds its blocks)."""
        self._taint()
        if self.p["variant"] == "stale_revive" and self.kept:
            self._landed_over()
            over = self.kept.written_over()
            if over:
                self._bad_entries(self.engine.step_count, "kept_key", over)

    def _landed_over(self) -> None:
        """(stale_revive) kept entries a copy in from the host tier wrote over, at its step."""
        for step, blocks in self.kept.landed_over().items():
            self._bad_entries(step, "kept_key", blocks)

    def _taint(self) -> None:
        """The blocks each victim keyed since its wrong read hold KV computed from wrong KV."""
        m, step = self.manager, self.engine.step_count
        for v, start in list(self.taint_from.items()):  # (few: the victims still running)
            blocks = m.blocks.get(v)
            if blocks is None:
                del self.taint_from[v]
                continue
            keyed = m.keyed.get(v, 0)
            for b in blocks[start:keyed]:
                if self.pool.key[b] is not None:
                    self.tainted[self.pool.key[b]] = v
                    self.tainted_blocks.append({"step": step, "block": b, "origin": v})
            self.taint_from[v] = max(start, keyed)

    def verify(self) -> dict:
        lists = ("wrong_hits", "bad_entries", "revived_queued", "evicted_held")
        return {
            **super().verify(),
            "variant": self.p["variant"],
            "not_applicable": getattr(self, "na", None),
            **{k: getattr(self, k, []) for k in lists},
            "victims": sorted(getattr(self, "victims", {})),
            "poisoned": getattr(self, "poisoned", []),
            "tainted_blocks": getattr(self, "tainted_blocks", []),
        }

    # -- what it explains ---------------------------------------------------------------
    @classmethod
    def explains(cls, finding: dict, truth: dict) -> str | None:
        return explain_finding(finding, truth)
