"""The block table the kernels read, whoever writes it (docs/protocol-v2.md section 2).

A manager declaring "own_table" writes its own table: `OwnedTable` reads it through the
manager. Any other manager only answers `block_ids(seq)`, as vLLM's does (its
worker owns the table): `BuiltTable` keeps the rows and writes each sequence's new entries into a
flat `BlockTable`, the same buffer, bound check and spill as the reference manager's own.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvchaos.engine.block_table import BlockTable
from kvchaos.engine.errors import OutOfBlocks


class OwnedTable:
    """The manager's own table, read through the manager (a Boundary: calls stay guarded)."""

    owned = True

    def __init__(self, manager) -> None:
        self.manager = manager

    @property
    def table(self) -> BlockTable:  # read each time: a manager may swap its table on resize
        return self.manager.table

    @property
    def rows(self) -> Mapping[str, int]:
        m = self.manager
        return m.rows if hasattr(m, "rows") else m.snapshot().seq_rows

    @property
    def num_free_rows(self) -> int:
        return self.manager.num_free_rows

    def place(self, seq_id: str) -> None:
        """The manager places rows itself."""

    def sync(self, seq_id: str, full: bool = False, copied: bool = False) -> None:
        """The manager writes its rows itself."""

    def drop(self, seq_id: str) -> None:
        """The manager clears rows itself (in free)."""

    def resize(self, rows: int | None = None, width: int | None = None) -> None:
        given = {k: v for k, v in (("rows", rows), ("width", width)) if v is not None}
        self.manager.resize_table(**given)


class BuiltTable:
    """The engine's table over a manager's block lists. Rows come from a free stack in the
    reference's order; `mapped[s]` is how many entries of s are written, so a step writes only
    the entries its appends added (plus the last one after a copy-on-write)."""

    owned = False

    def __init__(self, manager, rows: int, width: int, on_event=None) -> None:
        self.manager = manager
        self.table = BlockTable(rows, width)
        self.rows: dict[str, int] = {}
        self.mapped: dict[str, int] = {}
        self._free_rows = list(range(rows - 1, -1, -1))  # pop() hands out low rows first
        self.on_event = on_event or (lambda kind, data: None)

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def place(self, seq_id: str) -> None:
        """A row for a new or forked sequence (a no-op if it has one)."""
        if seq_id in self.rows:
            return
        if not self._free_rows:
            raise OutOfBlocks(f"sequence {seq_id}: no free table row")
        self.rows[seq_id] = self._free_rows.pop()
        self.mapped[seq_id] = 0

    def sync(self, seq_id: str, full: bool = False, copied: bool = False) -> None:
        """Write seq_id's entries from block_ids: the new ones, the last mapped one too when its
        append returned copies (copy-on-write replaces the last, partial block), every one when
        full (each snapshot), where an entry changed without a copy emits `table_resync`.
        TableOverflow past the row's width with the bound check on; else the flat spill."""
        ids = self.manager.block_ids(seq_id)
        row, start = self.rows[seq_id], self.mapped[seq_id]
        if full:
            self._resync(seq_id, row, ids, start)
        elif copied and start:
            start -= 1
        write = self.table.write
        for i in range(start, len(ids)):
            write(row, i, ids[i])
        self.mapped[seq_id] = len(ids)

    def _resync(self, seq_id: str, row: int, ids, mapped: int) -> None:
        t = self.table
        base, host = row * t.width, t.host
        changed = [
            (i, host[base + i], ids[i])
            for i in range(min(mapped, len(ids), t.width))  # spilled entries: the overflow's
            if host[base + i] != ids[i]
        ]
        if changed:
            for i, _, now in changed:
                host[base + i] = now
            self.on_event(
                "table_resync", {"seq": seq_id, "row": row, "entries": [list(c) for c in changed]}
            )

    def drop(self, seq_id: str) -> None:
        """Clear its row (flat: spilled entries too) and give the row back. Idempotent."""
        row = self.rows.pop(seq_id, None)
        if row is None:
            return
        self.table.clear(row, self.mapped.pop(seq_id))
        self._free_rows.append(row)

    def resize(self, rows: int | None = None, width: int | None = None) -> None:
        """Grow keeping every row's entries; new rows go to the bottom of the free stack."""
        old = self.table.rows
        self.table.resize(rows or old, width or self.table.width)
        self._free_rows[:0] = range(self.table.rows - 1, old - 1, -1)
