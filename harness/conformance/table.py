"""The table and decode-batch paths of conformance v2 (kvchaos.harness.conformance.v2): a
manager declaring "own_table" writes the table the kernels read, so its rows are judged against
its own block_ids after every call, and across resize_table; one declaring "append_decode" gets
decode batches, judged all or nothing. The calls and the record are the v2 machine's (TableRules
is its mixin)."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvchaos.engine.boundary import describe
from kvchaos.engine.errors import OutOfBlocks
from kvchaos.harness.conformance.common import guarded

# name -> (the capability it needs; what it says), as PROPERTIES_V2's
TABLE_PROPERTIES = {
    "table_rows": (
        "own_table",
        "each row is its sequence's block_ids, then -1; num_free_rows true",
    ),
    "resize": ("own_table", "resize_table keeps every sequence's blocks and its row's contents"),
    "append_decode": ("append_decode", "append_decode: all or nothing, as append(s, [t]) each"),
}
MUTATING = frozenset({"admit", "append", "append_decode", "fork", "release", "end_step"})


class TableRules:
    """Rules and checks for ConformanceMachineV2 (which sets what they read: bm, caps, table,
    tokens, done, bs, resizes)."""

    def table_problem(self, released: str | None = None) -> str | None:
        """What is wrong with the live table against the manager's own word (block_ids,
        num_free_rows), in words; None when nothing is. `released`: just now, still on record."""
        rows, host, width = self.layout()
        owner = self.call("the table's rows", lambda: dict(rows))
        n_rows = len(host) // width if isinstance(width, int) and width > 0 else 0
        by_row: dict[int, str] = {}
        for s, r in owner.items():
            if not isinstance(r, int) or not 0 <= r < n_rows:
                return f"{s} has row {r!r}, not one of the table's {n_rows}"
            if r in by_row:
                return f"{by_row[r]} and {s} both have row {r}"
            by_row[r] = s
        rowless = sorted(set(self.tokens) - set(owner) - {released})
        if rowless:
            return f"{rowless[0]} holds blocks but has no row"
        for r in range(n_rows):
            s = by_row.get(r)
            blocks = list(self.answer("block_ids", s)) if s is not None else []
            want, got = (blocks + [-1] * width)[:width], host[r * width : (r + 1) * width]
            if got != want:
                whose = f"{s}'s, block_ids {blocks}" if s is not None else "no sequence's"
                return f"row {r} ({whose}) is {got}, not {want}"
        free = self.read("num_free_rows")
        if free != n_rows - len(owner):
            return f"num_free_rows is {free}, yet {len(owner)} of {n_rows} rows are in use"
        return None

    def after_call(self, name: str, args: tuple) -> None:
        """What follows each answered call into the manager: the table_rows property."""
        if name in MUTATING and "own_table" in self.caps:
            wrong = self.table_problem(args[0] if name == "release" else None)
            self.judge(
                "table_rows", wrong is None, lambda: f"after {describe(name, args)}, {wrong}"
            )

    @precondition(lambda self: "own_table" in self.caps and self.resizes < 3)
    @rule(more_rows=st.integers(0, 2), more_width=st.integers(0, 3))
    @guarded()
    def resize(self, more_rows, more_width):
        before = {s: list(self.answer("block_ids", s)) for s in self.tokens}
        shown = self.resize_judged(more_rows, more_width)
        for s, was in before.items():
            now = list(self.answer("block_ids", s))
            self.judge("resize", now == was, lambda: f"{shown}: {s}'s blocks {was} -> {now}")
        wrong = self.table_problem()
        self.judge("resize", wrong is None, lambda: f"after {shown}, {wrong}")
        self.check_data("resize")
        self.check_snapshot()

    @precondition(lambda self: "append_decode" in self.caps and self.tokens)
    @rule(first=st.integers(0, 11), size=st.integers(1, 4))  # first: modulo those decoding
    @guarded()
    def decode(self, first, size):
        """append_decode of `size` of the sequences decoding (their next token known, all else
        computed), from the `first`-th on, as the engine's step asks it."""
        decoding = [
            s
            for s, toks in self.tokens.items()
            if len(toks) == self.done[s] + 1 and self.fits(self.done[s] + 2)
        ]
        if not decoding:
            return
        first %= len(decoding)
        batch = (decoding[first:] + decoding[:first])[:size]
        toks = [self.tokens[s][-1] for s in batch]
        shown, before = describe("append_decode", (batch, toks)), self.observed()
        try:
            copies = self.answer("append_decode", batch, toks, refusable=True)
        except OutOfBlocks:
            self.check_refusal(shown, before)
            return
        for s in batch:
            self.call("the table's sync", self.table.sync, s, copied=bool(copies))
        self.check_grown(shown, batch, before[1], copies)
        self.compute({s: (self.done[s], self.done[s] + 1) for s in batch}, copies, "append_decode")

    def check_grown(self, shown: str, batch: list[str], was: dict, copies) -> None:
        """As append(s, [t]) for each s of the batch: one more slot (by its blocks, and by its
        seq_tokens where declared), every block kept but where a reported copy replaced it; the
        other sequences' blocks as they were."""
        pairs = {tuple(c) for c in copies}
        said = self.snapshot().seq_tokens if "seq_tokens" in self.caps else None
        said = said if isinstance(said, dict) else {}
        for s, old in was.items():
            new = list(self.answer("block_ids", s))
            slots = min(len(new) * self.bs, said.get(s, len(new) * self.bs))
            lost = len(new) < len(old) or any(
                a != b and (a, b) not in pairs for a, b in zip(old, new)
            )
            if s not in batch:
                why = None if new == old else "though it is not in the batch"
            elif lost:
                why = "a block dropped or replaced without a copy that says so"
            elif slots <= self.done[s]:
                why = f"no slot for position {self.done[s]} ({slots} slots)"
            else:
                why = None
            self.judge(
                "append_decode",
                why is None,
                lambda s=s, old=old, new=new, why=why: (
                    f"{shown} (copies {copies}) took {s}'s blocks {old} to {new}: {why}"
                ),
            )
