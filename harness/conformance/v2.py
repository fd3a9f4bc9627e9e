"""Conformance of protocol v2 block managers (docs/protocol-v2.md section 8): a Hypothesis state
machine that drives a manager as the engine does, in v2 calls. Prompts come from a few templates,
so prefix-cache hits happen; growth is prefill chunks and the token each step generates (a
deterministic function of the prefix, as greedy decoding is); end_step follows each step when
declared, fork when declared; sequences end with every release reason, and some in a failed step
(slots reserved, then released with "error" before any KV was written). The table is the engine's
(BuiltTable, from block_ids) or, with "own_table", the manager's.

The machine's record is content-addressed, as a model's KV is: a slot holds the KV of one prefix
(the tokens up to its position), so a sequence reads right exactly when every computed position
of it, cache hits included, holds its own prefix. After every call it judges PROPERTIES_V2;
kvchaos.harness.conformance.suite runs it."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    multiple,
    precondition,
    rule,
)

from kvchaos.engine.boundary import BadAnswer, check_answer, copied, describe, state_change
from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.protocols import REASONS, capabilities
from kvchaos.engine.tables import BuiltTable, OwnedTable
from kvchaos.harness.check.checkers import check_block_accounting, check_table_integrity
from kvchaos.harness.check.snapshots import problem_seen
from kvchaos.harness.conformance.common import Judging, guarded
from kvchaos.harness.conformance.offload import OFFLOAD_PROPERTIES, OffloadRules
from kvchaos.harness.conformance.table import TABLE_PROPERTIES, TableRules

# name -> (the capability it needs, or None for the core protocol; what it says)
PROPERTIES_V2 = {
    "answers": (None, "every call answers in the protocol's types or refuses (OutOfBlocks)"),
    "refusal": (None, "a refused admit, append, decode or fork changes nothing (cache, table)"),
    "data": (None, "every sequence reads, at each computed position (hits too), its own KV"),
    "release_reasons": (None, "release of a live sequence, for any reason: True; again: False"),
    "snapshot": (None, "each snapshot passes the verdict-integrity checks against the harness"),
    "reserved_never_handed_out": (None, "no reserved id is ever held, free, cached or mapped"),
    "hit_over_cap": ("prefix_cache", "admit never answers more than max_computed tokens"),
    "cache_consistent": ("cache_state", "each cached block holds the tokens its key is over"),
    "seq_tokens": ("seq_tokens", "the snapshot carries seq_tokens for every live sequence"),
    "fork": ("fork", "fork: the child maps the parent's blocks and reads its KV"),
    "copy_on_write": ("fork", "copy-on-write keeps every holder's data"),
    **TABLE_PROPERTIES,
    **OFFLOAD_PROPERTIES,
}
VOCAB = 11
BLOCK_SIZES = (1, 2, 4)  # drawn from, for a manager that declares no block_sizes
TEMPLATES = tuple([k] + [(i * 5 + k * 3) % VOCAB for i in range(1, 40)] for k in range(3))
ROWS = 12  # table rows: sequences live at once


def sized_setup(sizes: tuple[int, ...]):
    """The machine's first rule: a pool of 8 to 24 blocks of one of these block sizes."""

    @initialize(num_blocks=st.integers(8, 24), block_size=st.sampled_from(sizes))
    @guarded()
    def setup(self, num_blocks, block_size):
        self.start(num_blocks, block_size)

    return setup


class ConformanceMachineV2(TableRules, OffloadRules, Judging, RuleBasedStateMachine):
    """Set `factory` (a subclass does): the v2 block manager class or factory under test."""

    factory = None
    enabled: frozenset[str] = frozenset(PROPERTIES_V2)  # judged; another one failing stops
    tally: Counter | None = None  # judgements made, by property

    seqs = Bundle("seq")
    released = Bundle("released")

    def __init__(self) -> None:
        super().__init__()
        self.bm = None
        self.caps: frozenset[str] = frozenset()
        self.tokens: dict[str, list[int]] = {}  # live sequence -> its known tokens
        self.prefixes: dict[str, list[int]] = {}  # -> the prefix id of each of its positions
        self.done: dict[str, int] = {}  # -> positions computed (= slots held)
        self.kv: dict[int, dict[int, int]] = {}  # block -> slot -> the prefix id written there
        self.trie: dict[tuple[int, int], int] = {}  # (parent prefix id, token) -> prefix id
        self.parent_of: dict[int, tuple[int, int]] = {}  # prefix id -> (parent id, token)
        self.ids = itertools.count(1)
        self.stopped = False
        self.step = 0
        self.resizes = 0
        self.prev: dict | None = None  # the last snapshot event (for writes into shared blocks)
        self.made: list[str] = []  # the calls into the manager, as Python: the reproducer

    # -- the record ------------------------------------------------------------------------
    def extend(self, seq: str, tokens) -> None:
        """Known tokens of seq, and the prefix id of each (0 is the empty prefix)."""
        ids = self.prefixes.setdefault(seq, [])
        for t in tokens:
            key = (ids[-1] if ids else 0, t)
            if key not in self.trie:
                self.trie[key] = len(self.trie) + 1
                self.parent_of[self.trie[key]] = key
            ids.append(self.trie[key])
        self.tokens.setdefault(seq, []).extend(tokens)

    def answer(self, name: str, *args, refusable: bool = False):
        """A v2 call; its answer held to what the engine's boundary accepts. Each is recorded in
        `made` as Python (a read, block_ids, only when it is the one that fails)."""
        shown = describe(name, args)
        line = f"m.{name}({', '.join(map(repr, args))})"
        self.made.append(line)
        try:
            out = self.call(shown, getattr(self.bm, name), *args, refusable=refusable)
            check_answer(name, out, args, self.bm.num_blocks)
        except OutOfBlocks:
            self.made[-1] = f"with pytest.raises(OutOfBlocks): {line}"
            raise
        except BadAnswer as e:
            needs = PROPERTIES_V2.get(e.rule, ("-",))[0]  # a property this manager is judged on
            why, rule = str(e), e.rule if needs is None or needs in self.caps else "answers"
            self.judge(rule, False, lambda: f"{shown} {why}")
        if name == "block_ids":  # a read: kept only when it is the one that fails
            self.made.pop()
        self.after_call(name, args)
        return out

    def layout(self):
        """(rows by sequence, the flat table, its width) of the table the kernels read."""
        return self.read_layout(self.table)

    def entries(self, seq: str, layout, prop: str = "data") -> list[int]:
        """seq's blocks as the kernels find them: its row of the table (layout())."""
        rows, host, width = layout
        row = self.call("the table's rows", lambda: rows.get(seq))
        n = -(-self.done[seq] // self.bs)
        self.judge(prop, isinstance(row, int), lambda: f"{seq} has no table row ({row!r})")
        return [int(b) for b in host[row * width : row * width + n]]

    def compute(self, spans: dict[str, tuple[int, int]], copies=(), prop: str = "data") -> None:
        """The step that follows a reservation: copies applied, then each sequence's positions
        [start, end) written through the table, end_step told, the next token generated for
        each whose known tokens are all computed."""
        for src, dst in copies:
            self.kv[dst] = dict(self.kv.get(src, {}))
        layout, bs = self.layout(), self.bs
        for seq, (start, end) in spans.items():
            self.done[seq] = end
            blocks, ids = self.entries(seq, layout, prop), self.prefixes[seq]
            for p in range(start, end):
                b = blocks[p // bs]
                self.judge(
                    prop,
                    0 <= b < self.num_blocks,
                    lambda: f"position {p} of {seq} maps to block {b} (entry {p // bs} of its row)",
                )
                self.kv.setdefault(b, {})[p % bs] = ids[p]
        if "end_step" in self.caps:
            self.answer("end_step", {seq: end for seq, (_, end) in spans.items()})
        for seq, (_, end) in spans.items():
            toks = self.tokens[seq]
            if end == len(toks):  # greedy decoding: the next token is a function of the prefix
                self.extend(seq, [(sum(toks) * 7 + len(toks)) % VOCAB])
        self.check_data(prop)
        self.check_snapshot()

    def check_data(self, prop: str = "data") -> None:
        layout = self.layout()
        mapped = {s: self.entries(s, layout, prop) for s in self.tokens}
        holders = Counter(b for blocks in mapped.values() for b in set(blocks))
        if "fork" in self.caps and max(holders.values(), default=0) > 1:
            self.judge("copy_on_write", True, None)  # blocks held by two: each reads its own
        for s, blocks in mapped.items():
            bad = sorted(set(blocks) & self.reserved)
            self.judge(
                "reserved_never_handed_out",
                not bad,
                lambda: f"{s} maps reserved block {bad[0]}",
            )
            for p in range(self.done[s]):
                b, want = blocks[p // self.bs], self.prefixes[s][p]
                got = self.kv.get(b, {}).get(p % self.bs)
                if got != want:
                    cow = "fork" in self.caps and holders[b] > 1
                    self.judge(
                        "copy_on_write" if cow else prop,
                        False,
                        lambda: (
                            f"position {p} of {s} (block {b}, slot {p % self.bs}) holds "
                            + (f"the KV of another prefix ({self.prefix_text(got)})" if got else "")
                            + ("no KV written" if got is None else "")
                        ),
                    )
        self.judge(prop, True, None)

    def prefix_text(self, prefix: int) -> str:
        toks = []
        while prefix:
            prefix, t = self.parent_of[prefix]
            toks.append(t)
        return f"position {len(toks) - 1}, tokens ..{toks[:4][::-1]}"

    # -- snapshots ---------------------------------------------------------------------------
    def snapshot(self):
        """The manager's snapshot with the engine's table in it, as Engine.snapshot gives (and
        copied, as the engine's boundary keeps it: live state may be handed out)."""
        snap = copied(self.call("snapshot()", self.bm.snapshot))
        if not self.table.owned and hasattr(snap, "to_dict"):
            t = self.table.table
            snap.table, snap.table_width, snap.seq_rows = (
                t.host.tolist(),
                t.width,
                dict(self.table.rows),
            )
        return snap

    def observed(self):
        """What a refusal must leave as it is (an own table, free rows and seq_tokens too)."""
        snap = self.snapshot()
        blocks = {s: list(self.answer("block_ids", s)) for s in self.tokens}
        cache = {(c["block"], c["key"]) for c in getattr(snap, "cache", None) or ()}
        owned = self.table.owned
        table = (self.layout()[1], self.read("num_free_rows")) if owned else None
        said = getattr(snap, "seq_tokens", None)
        said = dict(said) if isinstance(said, dict) else None  # a live dict would follow along
        return snap, blocks, cache, self.read("num_free_blocks"), table, said

    def check_refusal(self, shown: str, before) -> None:
        after = self.observed()
        try:
            changes = [state_change(before[0], after[0])]
        except Exception:  # not a snapshot: the snapshot property says so
            changes = []
        changes.append("its blocks" if before[1] != after[1] else None)
        changes.append("its cache" if before[2] != after[2] else None)
        free = (before[3], after[3])
        changes.append(f"num_free_blocks {free[0]} -> {free[1]}" if free[0] != free[1] else None)
        if before[4] != after[4]:
            (host, rows), (host_now, rows_now) = before[4], after[4]
            changes.append("the live block table" if host != host_now else None)
            changes.append(f"num_free_rows {rows} -> {rows_now}" if rows != rows_now else None)
        changes.append("its seq_tokens" if before[5] != after[5] else None)
        changes = [c for c in changes if c]
        self.judge(
            "refusal",
            not changes,
            lambda: f"{shown} refused (OutOfBlocks), yet changed: {'; '.join(changes)}",
        )
        self.check_snapshot()

    def check_snapshot(self) -> None:
        """The verdict-integrity checks a run makes of each snapshot, against the record."""
        snap = self.snapshot()
        computed = [(s, self.done[s], len(t)) for s, t in self.tokens.items()]
        free = self.read("num_free_blocks")
        wrong = problem_seen(snap, self.num_blocks, free, self.bs, computed)
        self.judge("snapshot", wrong is None, lambda: wrong)
        if "seq_tokens" in self.caps:
            said = snap.seq_tokens or {}
            missing = sorted(set(self.tokens) - set(said))
            self.judge("seq_tokens", not missing, lambda: f"no seq_tokens for {missing}")
        cache = snap.cache or []
        seen = set(snap.free) | {b for bs in snap.seq_blocks.values() for b in bs}
        bad = sorted(self.reserved & (seen | {c["block"] for c in cache}))
        self.judge(
            "reserved_never_handed_out",
            not bad,
            lambda: f"reserved block {bad[0]} is free, held or cached in the snapshot",
        )
        if "cache_state" in self.caps:
            self.check_cache(cache)
        self.step += 1
        event = {"e": "snapshot", "step": self.step, **snap.to_dict(), "live": list(self.tokens)}
        start = {"e": "run_start", "config": {"cache": {"block_size": self.bs}}}
        events = [start, *([self.prev] if self.prev else []), event]
        for result in (check_block_accounting(events), check_table_integrity(events)):
            for f in result.findings:
                if f.step == self.step:
                    cow = f.kind == "shared_write" and "fork" in self.caps
                    prop = "copy_on_write" if cow else "snapshot"
                    self.judge(prop, False, lambda f=f: f"{f.checker}: {f.message}")
        self.prev = event

    def check_cache(self, cache: list) -> None:
        """Each keyed block is written in full with the tokens its entry names (when it names
        them), and continues the block its parent key names (when that one is cached)."""
        by_key = {c["key"]: c["block"] for c in cache}
        for c in cache:
            slots = self.kv.get(c["block"], {})
            held = [slots.get(i) for i in range(self.bs)]
            problem = "is not written in full" if None in held else None
            toks = [self.parent_of[x][1] for x in held] if problem is None else None
            if problem is None and c.get("tokens") is not None and toks != c["tokens"]:
                problem = f"holds tokens {toks}, its entry says {c['tokens']}"
            first = self.parent_of[held[0]][0] if problem is None else None
            parent = by_key.get(c.get("parent")) if c.get("parent") is not None else None
            if problem is None and c.get("parent") is None and first != 0:
                problem = "has no parent key, yet does not start at position 0"
            elif problem is None and parent is not None:
                if self.kv.get(parent, {}).get(self.bs - 1) != first:
                    problem = f"does not continue block {parent}, which its parent key names"
            self.judge(
                "cache_consistent",
                problem is None,
                lambda c=c, problem=problem: (
                    f"cached block {c['block']} ({c['key'][:12]}..) {problem}"
                ),
            )

    # -- rules -------------------------------------------------------------------------------
    def start(self, num_blocks, block_size):
        """The manager built on a pool of num_blocks of block_size (the setup rule's draw)."""
        self.num_blocks, self.bs = num_blocks, block_size
        args = (num_blocks, block_size, ROWS, num_blocks)
        factory = type(self).factory
        self.made.append(f"m = {getattr(factory, '__qualname__', 'Manager')}{args}")
        self.bm = self.call(f"the factory{args}", factory, *args)
        self.caps = capabilities(self.bm)
        self.reserved = set(getattr(self.bm, "reserved_blocks", ()))
        own = "own_table" in self.caps
        self.table = OwnedTable(self.bm) if own else BuiltTable(self.bm, ROWS, num_blocks)
        self.check_snapshot()

    setup = sized_setup(BLOCK_SIZES)

    def fits(self, tokens: int) -> bool:
        """Whether the engine would run a sequence of this many tokens (a row, the pool)."""
        return -(-tokens // self.bs) < self.num_blocks - len(self.reserved)

    @precondition(lambda self: self.bm is not None and len(self.tokens) < ROWS)
    @rule(
        target=seqs,
        template=st.integers(0, len(TEMPLATES) - 1),
        shared=st.integers(0, 24),
        own=st.lists(st.integers(0, VOCAB - 1), max_size=5),
        chunk=st.integers(1, 16),
    )
    @guarded(target=True)
    def admit(self, template, shared, own, chunk):
        tokens = TEMPLATES[template][:shared] + own or [template]
        if not self.fits(len(tokens) + 1):
            return multiple()
        seq, maxc = f"s{next(self.ids)}", len(tokens) - 1
        before = self.observed()
        self.call("the table's place", self.table.place, seq)
        try:
            h = self.answer("admit", seq, tokens, chunk, maxc, refusable=True)
        except OutOfBlocks:
            self.table.drop(seq)
            self.check_refusal(describe("admit", (seq, tokens, chunk, maxc)), before)
            return multiple()
        if "prefix_cache" in self.caps:  # an answer over the cap is judged as it is given
            self.judge("hit_over_cap", True, None)
        self.extend(seq, tokens)
        self.done[seq] = h
        self.call("the table's sync", self.table.sync, seq)
        self.compute({seq: (h, h + min(chunk, len(tokens) - h))})
        return seq

    def reserve(self, seq: str, n: int):
        """append(seq, its next n known tokens): (copies, end), or None when refused or when the
        engine would not ask (past the pool)."""
        done = self.done[seq]
        chunk = self.tokens[seq][done : done + n]
        if not self.fits(done + len(chunk) + 1):
            return None
        before = self.observed()
        try:
            copies = self.answer("append", seq, chunk, refusable=True)
        except OutOfBlocks:
            self.check_refusal(describe("append", (seq, chunk)), before)
            return None
        self.call("the table's sync", self.table.sync, seq, copied=bool(copies))
        return copies, done + len(chunk)

    @rule(seq=seqs, n=st.integers(1, 9))
    @guarded()
    def grow(self, seq, n):
        grown = self.reserve(seq, n)
        if grown is not None:
            self.compute({seq: (self.done[seq], grown[1])}, grown[0])

    @rule(target=released, seq=consumes(seqs), n=st.integers(1, 9))
    @guarded(target=True)
    def failed_step(self, seq, n):
        """Slots reserved, then the step fails before it writes them: released with "error"."""
        self.reserve(seq, n)
        self.release_(seq, "error")
        return seq

    @rule(target=released, seq=consumes(seqs), reason=st.sampled_from(REASONS))
    @guarded(target=True)
    def release(self, seq, reason):
        self.release_(seq, reason)
        return seq

    def release_(self, seq: str, reason: str) -> None:
        got = self.answer("release", seq, reason)
        self.judge("release_reasons", got is True, lambda: f"release({seq!r}, {reason!r}): {got}")
        self.table.drop(seq)
        for record in (self.tokens, self.prefixes, self.done):
            del record[seq]
        snap = self.snapshot()
        self.judge(
            "release_reasons",
            seq not in snap.seq_blocks,
            lambda: f"after release({seq!r}, {reason!r}) the snapshot still lists it",
        )
        self.check_data()
        self.check_snapshot()

    @rule(seq=released, reason=st.sampled_from(REASONS))
    @guarded()
    def release_again(self, seq, reason):
        self.release_unknown(seq, reason)

    @rule()
    @guarded()
    def release_never_seen(self):
        self.release_unknown("never-seen", "aborted")

    def release_unknown(self, seq: str, reason: str) -> None:
        before, shown = self.observed(), describe("release", (seq, reason))
        got = self.answer("release", seq, reason)
        self.judge("release_reasons", got is False, lambda: f"{shown} of no live id: {got!r}")
        after = self.observed()
        self.judge(
            "release_reasons",
            state_change(before[0], after[0]) is None and before[1:] == after[1:],
            lambda: f"{shown} of an id it does not hold changed the manager",
        )

    @precondition(lambda self: "fork" in self.caps and len(self.tokens) < ROWS)
    @rule(target=seqs, parent=seqs)
    @guarded(target=True)
    def fork(self, parent):
        child = f"s{next(self.ids)}"
        before = self.observed()
        self.call("the table's place", self.table.place, child)
        try:
            self.answer("fork", parent, child, refusable=True)
        except OutOfBlocks:
            self.table.drop(child)
            self.check_refusal(describe("fork", (parent, child)), before)
            return multiple()
        self.call("the table's sync", self.table.sync, child)
        self.extend(child, self.tokens[parent])
        self.done[child] = self.done[parent]
        layout = self.layout()
        mine, theirs = self.entries(child, layout), self.entries(parent, layout)
        self.judge("fork", mine == theirs, lambda: f"the child maps {mine}, the parent {theirs}")
        self.check_data("fork")
        self.check_snapshot()
        return child
