"""The block-manager conformance suite: Hypothesis stateful tests of the protocol
(kvchaos.engine.protocols) that run against any block manager.

The machine drives a manager as the engine does (start, grow, decode, fork, free, resize) and
keeps its own record: the tokens it appended to each live sequence, and what it wrote where, read
and written through the manager's flat block table as the engine's kernels do. After every call
it judges the properties in PROPERTIES; a property that needs a capability the manager does not
declare is never judged ("not applicable"). kvchaos.harness.conformance.suite runs it until
every applicable property has passed or failed with a shrunk reproducer (the Hypothesis steps).

A failure of one property can make what follows meaningless (a refusal that took a block, a
snapshot that lies): once it is known, the runner runs again without it, and an example that
breaks it again stops there rather than blaming the other properties for its consequences."""

from __future__ import annotations

import functools
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

from kvchaos.engine.boundary import state_change
from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.protocols import capabilities, protocol_version
from kvchaos.engine.tables import OwnedTable
from kvchaos.harness.check.checkers import check_block_accounting, check_table_integrity
from kvchaos.harness.check.snapshots import problem_seen

# name -> (the capability it needs, or None for the core protocol; what it says)
PROPERTIES = {
    "answers": (None, "every call answers or refuses (OutOfBlocks): no other exception escapes"),
    "refusal": (None, "a refused append, decode or fork (OutOfBlocks) changes nothing"),
    "room": (None, "append succeeds whenever num_free_blocks covers blocks_needed"),
    "data": (None, "every sequence reads back, through the block table, each token written"),
    "free": (None, "free releases a sequence; again, or for an unknown id: False, no change"),
    "resize": (None, "table rows and resize_table keep every sequence's blocks"),
    "snapshot": (None, "each snapshot passes the verdict-integrity checks against the harness"),
    "fork": ("fork", "fork: the child maps the parent's blocks and reads its tokens"),
    "copy_on_write": ("fork", "copy-on-write keeps every holder's data"),
    "seq_tokens": ("seq_tokens", "the snapshot carries seq_tokens for every live sequence"),
    "append_decode": ("append_decode", "append_decode: all or nothing, as append(s, 1) each"),
}
KEEPS_STATE = {"room"}  # a failure that leaves the manager's state as the harness knows it


class Violation(AssertionError):
    """A property failed: its name, and what happened."""

    def __init__(self, prop: str, message: str) -> None:
        self.prop = prop
        super().__init__(f"{prop}: {message}")


class _Stopped(Exception):
    """A property already known to fail broke again: the rest of the example would only show
    its consequences."""


def applicable(manager) -> frozenset[str]:
    """The optional paths a manager offers: its capabilities (v1's: and append_decode if it has
    it; a v2 manager declares it, or has it inferred)."""
    if protocol_version(manager) >= 2:
        return capabilities(manager)
    extra = {"append_decode"} if callable(getattr(manager, "append_decode", None)) else set()
    return capabilities(manager) | extra


def _guarded(target: bool = False):
    """A rule that does nothing once the example has stopped (a target rule then yields none)."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(self, **kw):
            if not self.stopped:
                try:
                    return fn(self, **kw)
                except _Stopped:
                    self.stopped = True
            return multiple() if target else None

        return run

    return wrap


class Judging:
    """Judging properties and calling the manager, for a conformance machine (protocol v1 here,
    v2 in conformance_v2): set `enabled`, `tally`, `bm`, `stopped` and `resizes`."""

    def judge(self, prop: str, ok: bool, message) -> None:
        if self.tally is not None:
            self.tally[prop] += 1
        if ok:
            return
        if prop in self.enabled:
            raise Violation(prop, message())
        if prop not in KEEPS_STATE:
            raise _Stopped

    def call(self, shown: str, fn, *args, refusable: bool = False, **kw):
        """A call into the manager: OutOfBlocks passes where it is an answer; anything else
        escaping breaks "answers"."""
        if self.tally is not None:
            self.tally["answers"] += 1
        try:
            return fn(*args, **kw)
        except OutOfBlocks as e:
            if refusable:
                raise
            error = e
        except Exception as e:
            error = e
        self.judge("answers", False, lambda: f"{shown} raised {type(error).__name__}: {error}")
        raise _Stopped

    def read(self, name: str):
        return self.call(f"reading {name}", getattr, self.bm, name)

    def read_layout(self, table):
        """(rows by sequence, the flat table, its width) of a table component
        (kvchaos.engine.tables), read as the engine's kernels read them (host_tensor)."""
        rows = self.call("the table's rows", lambda: table.rows)
        t = self.call("the table", lambda: table.table)
        host = self.call("table.host_tensor", lambda: t.host_tensor.tolist())
        return rows, host, self.call("table.width", getattr, t, "width")

    def resize_judged(self, more_rows: int, more_width: int) -> str:
        """resize_table to a table grown by these, judged on "resize": its new size, and as
        many more free rows as rows added. Returns the call as shown."""
        table = self.read("table")
        rows, width = table.rows + more_rows, table.width + more_width
        free_rows = self.read("num_free_rows")
        shown = f"resize_table(rows={rows}, width={width})"
        self.resizes += 1
        self.call(shown, self.bm.resize_table, rows=rows, width=width)
        table = self.read("table")
        self.judge(
            "resize",
            (table.rows, table.width) == (rows, width),
            lambda: f"after {shown} the table is {table.rows} x {table.width}",
        )
        now = self.read("num_free_rows")
        self.judge(
            "resize",
            now == free_rows + more_rows,
            lambda: (
                f"{shown} took free rows from {free_rows} to {now}, not {free_rows + more_rows}"
            ),
        )
        return shown


class ConformanceMachine(Judging, RuleBasedStateMachine):
    """Set `factory` (a subclass does): the block manager class or factory under test."""

    factory = None
    enabled: frozenset[str] = frozenset(PROPERTIES)  # judged; another one failing stops
    tally: Counter | None = None  # judgements made, by property

    seqs = Bundle("seq")
    freed = Bundle("freed")

    def __init__(self) -> None:
        super().__init__()
        self.bm = None
        self.caps: frozenset[str] = frozenset()
        self.content: dict[str, list[int]] = {}  # live sequence -> labels of its tokens
        self.kv: dict[int, dict[int, int]] = {}  # block -> slot -> label written there
        self.origin: dict[int, tuple[str, int]] = {}  # label -> (sequence, position)
        self.labels = itertools.count(1)
        self.ids = itertools.count(1)
        self.stopped = False
        self.step = 0
        self.resizes = 0
        self.prev: dict | None = None  # the last snapshot event (for writes into shared blocks)

    # -- what the engine sees ----------------------------------------------------------------
    def layout(self):
        """(rows by sequence, the flat table, its width), found as the engine finds them."""
        return self.read_layout(OwnedTable(self.bm))

    def block_of(self, seq: str, p: int, layout, prop: str) -> int:
        rows, host, w = layout
        row = rows.get(seq) if hasattr(rows, "get") else None
        at = row * w + p // self.bs if isinstance(row, int) else -1
        b = host[at] if 0 <= at < len(host) else None
        if b is None or not 0 <= b < self.num_blocks:  # judged only when wrong: no tally per token
            self.judge(
                prop, False, lambda: f"token {p} of {seq} maps to no block (row {row!r}, entry {b})"
            )
        return b

    def mapped(self) -> dict[str, list[int]]:
        """The blocks the table maps for each live sequence's tokens."""
        lay = self.layout()
        return {
            s: list(dict.fromkeys(self.block_of(s, p, lay, "data") for p in range(len(c))))
            for s, c in self.content.items()
        }

    def observed(self):
        """What a refusal must leave as it is: snapshot, live table, free blocks and rows."""
        snap = self.call("snapshot()", self.bm.snapshot)
        host = self.layout()[1]
        return snap, host, self.read("num_free_blocks"), self.read("num_free_rows")

    def changes(self, before) -> list[str]:
        """What differs from `before` (observed()), in words."""
        after = self.observed()
        try:
            out = [state_change(before[0], after[0])]
        except Exception:  # not a snapshot: the snapshot property says so
            out = []
        out.append("the live block table" if before[1] != after[1] else None)
        for i, name in ((2, "num_free_blocks"), (3, "num_free_rows")):
            out.append(f"{name} {before[i]} -> {after[i]}" if before[i] != after[i] else None)
        return [c for c in out if c]

    def check_refusal(self, shown: str, before) -> None:
        changes = self.changes(before)
        self.judge(
            "refusal",
            not changes,
            lambda: f"{shown} refused (OutOfBlocks), yet changed: {'; '.join(changes)}",
        )
        self.check_snapshot()

    # -- the record: written, then read back ---------------------------------------------------
    def write(self, grown: dict[str, int], copies, mapped_before: dict[str, list[int]], shown):
        prop = "append_decode" if len(grown) > 1 or shown.startswith("append_decode") else "data"
        pairs = copies if isinstance(copies, list) else None
        self.judge(
            prop,
            pairs is not None
            and all(
                isinstance(c, (tuple, list))
                and len(c) == 2
                and all(isinstance(b, int) and 0 <= b < self.num_blocks for b in c)
                for c in pairs
            ),
            lambda: f"{shown} returned {copies!r}, not a list of (src, dst) block copies",
        )
        for src, dst in pairs:  # the engine applies them before it writes
            self.kv[dst] = dict(self.kv.get(src, {}))
        for s, n in grown.items():
            labels = self.content.setdefault(s, [])
            for _ in range(n):
                label = next(self.labels)
                self.origin[label] = (s, len(labels))
                labels.append(label)
        lay = self.layout()
        for s, n in grown.items():
            for p in range(len(self.content[s]) - n, len(self.content[s])):
                b = self.block_of(s, p, lay, prop)
                self.kv.setdefault(b, {})[p % self.bs] = self.content[s][p]
        shared = {
            b
            for s in grown
            for b in mapped_before.get(s, ())
            if any(b in bl for q, bl in mapped_before.items() if q != s)
        }
        self.check_data(prop, shared)
        if shared and "fork" in self.caps:  # a write into blocks held by two, and both read back
            self.judge("copy_on_write", True, None)
        self.check_snapshot()

    def check_data(self, prop: str, shared=()) -> None:
        lay = self.layout()
        for s, labels in self.content.items():
            for p, label in enumerate(labels):
                b = self.block_of(s, p, lay, prop)
                got = self.kv.get(b, {}).get(p % self.bs)
                if got == label:
                    continue
                cow = b in shared and "fork" in self.caps  # a write into a block held by two
                by = self.origin.get(got)
                self.judge(
                    "copy_on_write" if cow else prop,
                    False,
                    lambda: (
                        f"token {p} of {s} (block {b}, slot {p % self.bs}) reads "
                        + (f"token {by[1]} of {by[0]}" if by else "nothing written")
                        + (" (written into a block they shared: no copy-on-write)" if cow else "")
                    ),
                )
        self.judge(prop, True, None)

    def check_snapshot(self) -> None:
        """The verdict-integrity checks a run makes of each snapshot, against the record."""
        snap = self.call("snapshot()", self.bm.snapshot)
        live = {s: len(c) for s, c in self.content.items()}
        free = self.read("num_free_blocks")
        computed = [(s, n, n) for s, n in live.items()]
        wrong = problem_seen(snap, self.num_blocks, free, self.bs, computed)
        self.judge("snapshot", wrong is None, lambda: wrong)
        if "seq_tokens" in self.caps:  # their values are problem_seen's: here, that they are there
            said = getattr(snap, "seq_tokens", None) or {}
            self.judge(
                "seq_tokens",
                set(live) <= set(said),
                lambda: f"the snapshot has no seq_tokens for {sorted(set(live) - set(said))}",
            )
        self.step += 1
        event = {"e": "snapshot", "step": self.step, **snap.to_dict(), "live": list(live)}
        strays = []
        for s, blocks in self.mapped().items():  # the table's blocks: the snapshot's, not free
            owned = set(event["seq_blocks"].get(s, ()))
            stray = sorted(b for b in blocks if b not in owned or b in event["free"])
            if stray:
                strays.append(
                    {"e": "foreign_write", "step": self.step, "req": s, "blocks": stray}
                    | {"owned": sorted(owned), "ranks": [0]}
                )
        start = {"e": "run_start", "config": {"cache": {"block_size": self.bs}}}
        events = [start, *([self.prev] if self.prev else []), event, *strays]
        for result in (check_block_accounting(events), check_table_integrity(events)):
            for f in result.findings:
                if f.step == self.step:
                    cow = f.kind == "shared_write" and "fork" in self.caps
                    prop = "copy_on_write" if cow else "snapshot"
                    self.judge(prop, False, lambda f=f: f"{f.checker}: {f.message}")
        self.prev = event

    # -- rules -------------------------------------------------------------------------------
    @initialize(
        num_blocks=st.integers(8, 24),
        block_size=st.sampled_from((1, 2, 4)),
        rows=st.integers(2, 5),
        width=st.integers(2, 6),
    )
    @_guarded()
    def setup(self, num_blocks, block_size, rows, width):
        self.num_blocks, self.bs = num_blocks, block_size
        args = (num_blocks, block_size, rows, width)
        self.bm = self.call(f"the factory{args}", type(self).factory, *args)
        self.caps = applicable(self.bm)
        self.check_snapshot()

    def grow(self, seq: str, n: int, new: bool) -> bool:
        """append(seq, n), judged; False when refused (or past the row: never asked)."""
        bm, have = self.bm, len(self.content.get(seq, ()))
        if -(-(have + n) // self.bs) > self.layout()[2]:
            return False  # past its row: the engine refuses (or resizes for) such a request
        need = self.call(f"blocks_needed({seq!r}, {n})", bm.blocks_needed, seq, n)
        before, mapped = self.observed(), self.mapped()
        shown = f"append({seq!r}, {n})"
        try:
            copies = self.call(shown, bm.append, seq, n, refusable=True)
        except OutOfBlocks:
            free, rows = before[2], before[3]
            self.judge(
                "room",
                need > free or (new and rows == 0),
                lambda: (
                    f"{shown} refused, yet num_free_blocks {free} covers blocks_needed "
                    f"{need}" + (f" and {rows} rows are free" if new else "")
                ),
            )
            self.check_refusal(shown, before)
            return False
        self.write({seq: n}, copies, mapped, shown)
        return True

    @rule(target=seqs, tokens=st.integers(1, 12))
    @_guarded(target=True)
    def start(self, tokens):
        seq = f"s{next(self.ids)}"
        return seq if self.grow(seq, tokens, new=True) else multiple()

    @rule(seq=seqs, tokens=st.integers(1, 9))
    @_guarded()
    def append(self, seq, tokens):
        self.grow(seq, tokens, new=False)

    @precondition(lambda self: "append_decode" in self.caps and self.content)
    @rule(batch=st.lists(seqs, min_size=1, max_size=4))
    @_guarded()
    def decode(self, batch):
        batch = list(dict.fromkeys(batch))
        bm, width = self.bm, self.layout()[2]
        if any(-(-(len(self.content[s]) + 1) // self.bs) > width for s in batch):
            return
        need = sum(self.call(f"blocks_needed({s!r}, 1)", bm.blocks_needed, s, 1) for s in batch)
        before, mapped = self.observed(), self.mapped()
        shown = f"append_decode({batch!r})"
        try:
            copies = self.call(shown, bm.append_decode, batch, refusable=True)
        except OutOfBlocks:
            free = before[2]
            self.judge(
                "room",
                need > free,
                lambda: (
                    f"{shown} refused, yet num_free_blocks {free} covers the blocks_needed "
                    f"of each ({need} in all)"
                ),
            )
            self.check_refusal(shown, before)
            return
        self.write(dict.fromkeys(batch, 1), copies, mapped, shown)

    def do_fork(self, parent: str):
        child = f"s{next(self.ids)}"
        before = self.observed()
        shown = f"fork({parent!r}, {child!r})"
        try:
            self.call(shown, self.bm.fork, parent, child, refusable=True)
        except OutOfBlocks:  # an answer: the engine runs the child as a fresh request
            self.check_refusal(shown, before)
            return None
        self.content[child] = list(self.content[parent])
        mapped = self.mapped()
        self.judge(
            "fork",
            mapped[child] == mapped[parent],
            lambda: f"{shown}: the child maps blocks {mapped[child]}, the parent {mapped[parent]}",
        )
        self.check_data("fork")
        self.check_snapshot()
        return child

    @precondition(lambda self: "fork" in self.caps)
    @rule(target=seqs, parent=seqs)
    @_guarded(target=True)
    def fork(self, parent):
        child = self.do_fork(parent)
        return multiple() if child is None else child

    @precondition(lambda self: "fork" in self.caps)
    @rule(target=seqs, parent=seqs, tokens=st.integers(1, 5), child_writes=st.booleans())
    @_guarded(target=True)
    def fork_then_append(self, parent, tokens, child_writes):
        """Fork, then write to one side at once: copy-on-write when the last block is partial."""
        child = self.do_fork(parent)
        if child is None:
            return multiple()
        self.grow(child if child_writes else parent, tokens, new=False)
        return child

    @rule(target=freed, seq=consumes(seqs))
    @_guarded(target=True)
    def free(self, seq):
        shown = f"free({seq!r})"
        got = self.call(shown, self.bm.free, seq)
        del self.content[seq]
        self.judge("free", bool(got), lambda: f"{shown} of a live sequence returned {got!r}")
        self.check_snapshot()
        snap = self.call("snapshot()", self.bm.snapshot)
        self.judge(
            "free",
            seq not in snap.seq_blocks and seq not in snap.seq_rows,
            lambda: f"after {shown} the snapshot still lists {seq}",
        )
        self.check_data("free")
        return seq

    @rule(seq=freed)
    @_guarded()
    def free_again(self, seq):
        self.free_unknown(seq)

    @rule()
    @_guarded()
    def free_never_seen(self):
        self.free_unknown("never-seen")

    def free_unknown(self, seq: str) -> None:
        before, shown = self.observed(), f"free({seq!r})"
        got = self.call(shown, self.bm.free, seq)
        self.judge("free", not got, lambda: f"{shown} of an id it does not hold returned {got!r}")
        changes = self.changes(before)
        self.judge(
            "free",
            not changes,
            lambda: f"{shown} of an id it does not hold changed: {'; '.join(changes)}",
        )

    @precondition(lambda self: self.bm is not None and self.resizes < 3)
    @rule(more_rows=st.integers(0, 2), more_width=st.integers(0, 3))
    @_guarded()
    def resize(self, more_rows, more_width):
        self.resize_judged(more_rows, more_width)
        self.check_data("resize")
        self.check_snapshot()
