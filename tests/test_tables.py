"""The table component (engine/tables.py): BuiltTable places, syncs, drops and resizes rows from a
manager's block lists exactly as the reference manager writes its own table (same rows, same
entries, same flat spill past a row's width), writing only new entries each step; OwnedTable reads
the manager's own; the engine reads the table through it."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from kvchaos.engine import CacheConfig, Engine, EngineConfig, ModelConfig
from kvchaos.engine.block_manager import BlockManager
from kvchaos.engine.block_table import BlockTable
from kvchaos.engine.errors import OutOfBlocks, TableOverflow
from kvchaos.engine.tables import BuiltTable, OwnedTable

sys.path.insert(0, str(Path(__file__).parent))  # tests/managers.py

from managers import reserve  # noqa: E402


class Lists:
    """A manager as BuiltTable sees one: block_ids only."""

    def __init__(self, blocks: dict[str, list[int]] | None = None) -> None:
        self.blocks = blocks if blocks is not None else {}

    def block_ids(self, seq_id):
        return self.blocks[seq_id]


class CountingTable(BlockTable):
    """Counts entries written (no __slots__ here: the subclass may keep a count)."""

    def __init__(self, rows, width) -> None:
        super().__init__(rows, width)
        self.writes = 0

    def write(self, row, index, block) -> None:
        self.writes += 1
        super().write(row, index, block)


def test_place_sync_drop():
    m = Lists({"a": [5, 6], "b": [7]})
    t = BuiltTable(m, rows=2, width=3)
    t.place("a")
    t.place("b")
    t.place("a")  # already placed: nothing changes
    assert dict(t.rows) == {"a": 0, "b": 1} and t.num_free_rows == 0
    with pytest.raises(OutOfBlocks):
        t.place("c")
    t.sync("a")
    t.sync("b")
    assert t.table.row(0) == [5, 6, -1] and t.table.row(1) == [7, -1, -1]
    m.blocks["a"].append(8)
    t.sync("a")
    assert t.table.row(0) == [5, 6, 8]
    t.drop("a")
    t.drop("a")  # idempotent
    assert t.table.row(0) == [-1, -1, -1] and "a" not in t.rows and t.num_free_rows == 1
    t.place("c")
    assert t.rows["c"] == 0  # the freed row is the next one handed out


def test_copy_rewrites_the_last_entry_only_when_told():
    m = Lists({"a": [1, 2]})
    t = BuiltTable(m, rows=1, width=4)
    t.place("a")
    t.sync("a")
    m.blocks["a"][-1] = 9  # copy-on-write of the partial last block
    t.sync("a")
    assert t.table.row(0) == [1, 2, -1, -1]  # no copy reported: not looked at
    t.sync("a", copied=True)
    assert t.table.row(0) == [1, 9, -1, -1]


def test_full_sync_repairs_and_reports_an_unreported_change():
    events = []
    m = Lists({"a": [1, 2, 3]})
    t = BuiltTable(m, rows=1, width=4, on_event=lambda kind, data: events.append((kind, data)))
    t.place("a")
    t.sync("a", full=True)
    assert events == [] and t.table.row(0) == [1, 2, 3, -1]
    m.blocks["a"][0] = 7  # changed without a copy
    m.blocks["a"].append(4)
    t.sync("a", full=True)
    assert t.table.row(0) == [7, 2, 3, 4]
    assert events == [("table_resync", {"seq": "a", "row": 0, "entries": [[0, 1, 7]]})]


def test_bound_check_and_spill():
    m = Lists({"a": [1, 2, 3], "b": [4]})
    t = BuiltTable(m, rows=2, width=2)
    t.place("a")
    with pytest.raises(TableOverflow, match="index 2 >= width 2"):
        t.sync("a")
    t.table.bound_check = False
    t.sync("a")
    assert t.table.host.tolist() == [1, 2, 3, -1]  # flat: entry 2 of row 0 is row 1's entry 0
    assert t.table.overflow_writes == 1 and t.table.overflow_log == [(0, 2, 3)]
    t.drop("a")  # clears the spilled entry too, as the reference's free does
    assert t.table.host.tolist() == [-1] * 4


def test_resize_keeps_rows_and_hands_new_rows_out_last():
    m = Lists({"a": [1, 2], "b": [3]})
    t = BuiltTable(m, rows=2, width=2)
    for s in ("a", "b"):
        t.place(s)
        t.sync(s)
    t.drop("a")
    t.resize(rows=3, width=4)
    assert t.table.rows == 3 and t.table.width == 4
    assert t.table.row(1) == [3, -1, -1, -1]
    t.place("c")
    t.place("d")
    assert (t.rows["c"], t.rows["d"]) == (0, 2)  # the freed row first, as BlockManager does
    ref = BlockManager(8, 4, 2, 2)
    for s in ("a", "b"):
        ref.admit(s, [1], 1, 0)
    ref.release("a", "finished")
    ref.resize_table(rows=3, width=4)
    for s in ("c", "d"):
        ref.admit(s, [1], 1, 0)
    assert (ref.rows["c"], ref.rows["d"]) == (0, 2)


@pytest.mark.parametrize("seed", range(6))
def test_same_table_as_the_reference_spill_included(seed):
    """Random admissions, appends, decode steps, forks, releases and resizes on the reference
    manager with its bound check off; a BuiltTable over its block_ids ends each operation with the
    very same flat buffer (rows, entries, spill) and rows."""
    rng = random.Random(seed)
    ref = BlockManager(48, 2, 4, 3)
    ref.table.bound_check = False
    built = BuiltTable(ref, rows=4, width=3)
    built.table.bound_check = False
    live: list[str] = []
    for i in range(150):
        op = rng.random()
        try:
            if op < 0.4 or not live:
                s = rng.choice(live) if live and rng.random() < 0.6 else f"s{i}"
                built.place(s)
                try:
                    copies = reserve(ref, s, rng.randint(1, 5))
                except OutOfBlocks:
                    if s not in ref.blocks:
                        built.drop(s)
                    raise
                built.sync(s, copied=bool(copies))
                live += [] if s in live else [s]
            elif op < 0.6:
                seqs = rng.sample(live, rng.randint(1, len(live)))
                had = {s: len(ref.blocks[s]) for s in seqs}
                dsts = {d for _, d in ref.append_decode(seqs, [0] * len(seqs))}
                for s in seqs:  # a copy's dst is fresh: it names the sequence copied for
                    built.sync(s, copied=had[s] > 0 and ref.blocks[s][had[s] - 1] in dsts)
            elif op < 0.75:
                child = f"f{i}"
                built.place(child)
                try:
                    ref.fork(rng.choice(live), child)
                except OutOfBlocks:
                    built.drop(child)
                    raise
                built.sync(child)
                live.append(child)
            elif op < 0.95:
                s = live.pop(rng.randrange(len(live)))
                ref.release(s, "finished")
                built.drop(s)
            elif ref.table.width < 6:
                ref.resize_table(rows=ref.table.rows + 1, width=ref.table.width + 1)
                built.resize(rows=built.table.rows + 1, width=built.table.width + 1)
        except OutOfBlocks:
            pass
        assert built.table.host.tolist() == ref.table.host.tolist(), (seed, i)
        assert built.rows == ref.rows and built.num_free_rows == ref.num_free_rows
    assert ref.table.overflow_writes == built.table.overflow_writes > 0  # the spill was exercised


def test_sync_writes_only_new_entries():
    """A sequence grown token by token to 400 blocks costs one write per block, not per row."""
    m = Lists({"a": []})
    t = BuiltTable(m, rows=1, width=400)
    t.table = CountingTable(1, 400)
    t.place("a")
    for b in range(400):
        m.blocks["a"].append(b)
        for _ in range(4):  # four decode steps per block: three add no entry
            t.sync("a")
    assert t.table.writes == 400 and t.table.row(0) == list(range(400))
    t.sync("a", copied=True)
    assert t.table.writes == 401


class NoRows:
    """A manager writing its own table but keeping its rows to itself: the table's rows come
    from snapshot()."""

    def __init__(self) -> None:
        self.inner = BlockManager(8, 4, 2, 3)
        self.table = self.inner.table

    def snapshot(self):
        return self.inner.snapshot()


def test_owned_table_reads_the_manager():
    calls = []
    m = BlockManager(8, 4, 2, 3)
    real = m.resize_table
    m.resize_table = lambda **kw: (calls.append(kw), real(**kw))
    t = OwnedTable(m)
    assert t.owned and t.table is m.table and t.rows is m.rows and t.num_free_rows == 2
    m.admit("a", range(5), 5, 4)
    t.place("b")
    t.sync("a")
    t.drop("a")  # the manager's own business: nothing changes
    assert t.table.row(m.rows["a"]) == m.blocks["a"] + [-1] and t.num_free_rows == 1
    t.resize(width=5)
    assert calls == [{"width": 5}] and t.table.width == 5  # only what was given is passed
    hidden = NoRows()
    hidden.inner.admit("a", [1], 1, 0)
    hidden.inner.admit("b", [1], 1, 0)
    assert OwnedTable(hidden).rows == {"a": 0, "b": 1}


def test_engine_reads_its_table_component():
    model = ModelConfig(
        num_layers=1,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        intermediate_size=32,
        vocab_size=31,
        max_position=64,
    )
    cache = CacheConfig(
        block_size=4, num_blocks=16, max_blocks_per_seq=4, max_num_seqs=2, prefix_caching=False
    )
    eng = Engine(EngineConfig(model=model, cache=cache, seed=1, attention_backend="torch"))
    assert isinstance(eng.table, OwnedTable) and eng.table.table is eng.bm.manager.table
    eng.add_request("r", [1, 2, 3, 4, 5], 3)
    eng.step()
    assert eng.protocol == 2 and eng.bm.calls["admit"] == 1  # the plain reference speaks v2
    assert eng.snapshot().to_dict() == eng.bm.snapshot().to_dict()  # owned: the manager's word
    # an engine-built table replaces the table fields with its own
    built = BuiltTable(Lists(eng.bm.manager.blocks), rows=3, width=5)
    built.place("x")
    built.place("r")
    built.sync("r")
    eng.table = built
    snap = eng.snapshot()
    assert snap.seq_rows == {"x": 0, "r": 1} and snap.table_width == 5
    assert snap.table[5:7] == eng.bm.manager.blocks["r"] and snap.table[:5] == [-1] * 5
