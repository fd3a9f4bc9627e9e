"""The per-block writer record (harness/run/kv_record.py): a read is right iff the slot holds KV
for the reader's own position and whole prefix, whoever wrote it; a wrong read names its reader,
the block and the writer; copy-on-write, taint, torn steps and rank mirroring; and the version
cache keeps a long decode's cost to the blocks that changed."""

from __future__ import annotations

from kvchaos.harness.run.kv_record import Identities, KVRecord, RankRecords

BS = 4


def chain(tokens: list[int], seq: str = "x") -> list[bytes]:
    return Identities().upto(seq, tokens, len(tokens))


def fill(rec: KVRecord, seq: str, tokens: list[int], blocks: list[int], step: int = 1) -> None:
    """seq writes positions 0..len-1 into its blocks, in order."""
    ids = chain(tokens)
    for p, t in enumerate(tokens):
        rec.write(seq, p, t, ids[p], blocks[p // BS] * BS + p % BS, step)


PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def test_identities_are_the_whole_prefix_not_the_writer():
    ids = Identities()
    a = ids.upto("a", PROMPT, 8)
    b = ids.upto("b", PROMPT[:6] + [1, 2], 8)
    assert a[:6] == b[:6] and a[6] != b[6] and a[7] != b[7]
    assert ids.upto("c", [6, 5], 2)[1] != a[1]  # same tokens, other order: another prefix
    assert len(set(a)) == 8  # the same token at two positions is two identities


def test_a_read_of_kv_for_the_same_prefix_is_right_whoever_wrote_it():
    rec = KVRecord(8, BS)
    fill(rec, "a", PROMPT, [3, 5])
    assert rec.read("a", chain(PROMPT), [3, 5], 8, 2) == []
    assert rec.read("b", chain(PROMPT + [1]), [3, 5], 8, 2) == []  # a cache hit on a's blocks
    assert rec.shared == 8  # b's slots, all written by a


def test_a_read_of_kv_for_other_tokens_names_the_reader_block_and_writer():
    rec = KVRecord(8, BS)
    fill(rec, "a", PROMPT, [3, 5], step=4)
    other = PROMPT[:6] + [40, 41]
    (bad,) = rec.read("c", chain(other), [3, 5], 8, 9)
    assert bad == {
        "req": "c",
        "index": 1,
        "block": 5,
        "slots": [2, 3],
        "pos": [6, 7],
        "writer": "a",
        "writer_pos": 6,
        "writer_step": 4,
        "origin": None,
    }


def test_a_read_of_a_slot_never_written_has_no_writer():
    rec = KVRecord(8, BS)
    fill(rec, "a", PROMPT[:4], [2])
    (bad,) = rec.read("a", chain(PROMPT), [2, 6], 8, 2)
    assert (bad["block"], bad["writer"], bad["slots"]) == (6, None, [0, 1, 2, 3])


def test_a_negative_slot_wraps_to_the_last_block_as_the_kernel_writes():
    rec = KVRecord(8, BS)
    rec.write("a", 0, 5, chain([5])[0], -BS, 1)  # an unused entry (-1), offset 0
    assert rec.writer[7 * BS] == "a"


def test_copy_on_write_copies_the_record_and_invalidates_what_was_verified():
    rec = KVRecord(8, BS)
    fill(rec, "a", PROMPT[:6], [1, 2])
    fill(rec, "z", [30, 31, 32], [4])
    assert rec.read("b", chain(PROMPT[:6]), [1, 4], 6, 2) != []  # block 4 holds z's KV
    rec.copy([(2, 4)])  # b's copy of a's partial block
    assert rec.read("b", chain(PROMPT[:6]), [1, 4], 6, 3) == []
    assert rec.writer[4 * BS : 4 * BS + 2] == ["a", "a"]


def test_copies_read_every_source_before_writing():
    rec = KVRecord(8, BS)
    fill(rec, "a", PROMPT, [1, 2])
    rec.copy([(1, 2), (2, 1)])  # a swap
    assert rec.pos[1 * BS] == 4 and rec.pos[2 * BS] == 0


def test_a_wrong_read_taints_what_the_reader_writes_and_poisons_who_reads_it():
    rec = KVRecord(16, BS)
    fill(rec, "a", PROMPT, [0, 1])
    mine = PROMPT[:4] + [20, 21, 22, 23]
    rec.write("c", 8, 24, chain(mine + [24])[8], 2 * BS, 5)  # same step as its wrong read
    (bad,) = rec.read("c", chain(mine + [24]), [0, 1, 2], 9, 5)
    assert (bad["req"], bad["block"], bad["origin"]) == ("c", 1, None)
    later = chain(mine + [24, 25])
    rec.write("c", 9, 25, later[9], 2 * BS + 1, 6)
    assert rec.read("c", later, [0, 1, 2], 10, 6) == []  # its own tainted KV: told once, above
    # d has c's tokens, computed its first 8 itself, then hits c's block: its identities match,
    # yet that KV was computed from a wrong read
    fill(rec, "d", mine, [4, 5], step=7)
    (poisoned,) = rec.read("d", later, [4, 5, 2], 10, 7)
    assert (poisoned["req"], poisoned["block"], poisoned["writer"]) == ("d", 2, "c")
    assert poisoned["origin"] == "c" and poisoned["slots"] == [0, 1]


def test_a_block_read_wrongly_again_is_told_once():
    rec = KVRecord(8, BS)
    fill(rec, "a", PROMPT, [3, 5])
    other = chain(PROMPT[:6] + [40, 41, 42])
    assert len(rec.read("c", other, [3, 5], 8, 2)) == 1
    rec.write("a", 8, 0, b"?", 5 * BS + 3, 3)  # the block changes, still wrong for c
    assert rec.read("c", other, [3, 5], 8, 3) == []
    assert len(rec.read("c", other, [3, 6], 8, 4)) == 1  # another block at that entry: told


def test_a_long_decode_verifies_only_the_blocks_that_changed():
    """Work counts verified slots: a decode step re-verifies its last block (<= BS slots), not
    its whole context; an earlier block that changes is verified again (and found wrong)."""
    n, rec, ids = 400, KVRecord(128, BS), Identities()
    tokens = [(7 * i) % 50 for i in range(n)]
    blocks = list(range(n // BS))
    for p in range(n):  # one token a step, each step reading everything before it
        d = ids.upto("a", tokens, p + 1)
        rec.write("a", p, tokens[p], d[p], blocks[p // BS] * BS + p % BS, p)
        assert rec.read("a", d, blocks, p + 1, p) == []
    assert rec.work <= n * BS  # a re-read of every context would be n * (n + 1) / 2 = 80200
    before = rec.work
    rec.write("z", 1, 9, b"not a's", blocks[0] * BS + 1, n)
    (bad,) = rec.read("a", ids.upto("a", tokens, n), blocks, n, n)
    assert (bad["block"], bad["writer"]) == (0, "z") and rec.work - before == BS


def _batch(seq, tokens, start, n, blocks, table=None):
    """One prefill chunk: writes through `table` (the rank's own row), reads through blocks."""
    row = table or blocks
    writes = [(seq, p, tokens[p], row[p // BS] * BS + p % BS) for p in range(start, start + n)]
    return [(seq, start + n, blocks)], writes


def test_writes_of_a_step_apply_before_its_reads_and_a_same_step_hit_is_right():
    rr = RankRecords(8, BS)
    toks = {"a": PROMPT, "b": PROMPT[:4] + [1]}
    reads, writes = _batch("a", PROMPT, 0, 8, [1, 2])
    b_reads, b_writes = _batch("b", toks["b"], 4, 1, [1, 3])  # b hit a's block 1 this step
    rr.on_batch(0, reads + b_reads, writes + b_writes)
    assert rr.commit(1, toks.__getitem__) == []
    assert rr.records[0].shared == 4


def test_ranks_mirror_rank_0_until_their_table_differs():
    rr, toks = RankRecords(8, BS), {"a": PROMPT}
    rr.on_batch(0, *_batch("a", PROMPT, 0, 4, [1]))
    assert rr.commit(1, toks.__getitem__) == [] and list(rr.records) == [0]
    # step 2: rank 1 computes on a stale row (block 2 not yet in it: the unused entry is -1)
    rr.on_batch(0, *_batch("a", PROMPT, 4, 4, [1, 2]))
    reads, writes = _batch("a", PROMPT, 4, 4, [1, 0], table=[1, -1])
    rr.on_batch(1, reads, writes)
    out = rr.commit(2, toks.__getitem__)
    assert [(f["rank"], f["block"], f["writer"]) for f in out] == [(1, 0, None)]
    assert sorted(rr.records) == [0, 1]
    # step 3: the tables agree again; rank 1's pool still lacks positions 4..7 of block 2
    rr.on_batch(0, [("a", 8, [1, 2])], [])
    out = rr.commit(3, toks.__getitem__)
    assert [(f["rank"], f["block"], f["writer"]) for f in out] == [(1, 2, None)]


def test_a_cache_hit_is_named_and_a_step_that_raised_leaves_its_slots_torn():
    rr, toks = RankRecords(8, BS), {"a": PROMPT, "b": PROMPT[:4] + [3, 3, 3, 3, 3]}
    rr.on_batch(0, *_batch("a", PROMPT, 0, 8, [1, 2]))
    rr.abort(1)  # the step raised after the batch was built
    rr.hit("b", [1, 2])
    rr.on_batch(0, *_batch("b", toks["b"], 8, 1, [1, 2, 3]))
    out = rr.commit(2, toks.__getitem__)
    assert [(f["block"], f["via_hit"], f.get("torn")) for f in out] == [
        (b, True, True) for b in (1, 2)
    ]


def test_a_whole_block_read_before_is_read_again_once_anyone_writes_into_it():
    """A reader's whole entries, unchanged since it read them, are skipped at C speed; a write
    into one of them (by another writer, a copy or a taint) makes the next read verify it."""
    rec = KVRecord(8, BS)
    fill(rec, "a", PROMPT, [3, 5])
    ids = chain(PROMPT)
    assert rec.read("a", ids, [3, 5], 8, 2) == [] and rec.work == 8
    assert rec.read("a", ids, [3, 5], 8, 3) == [] and rec.work == 8  # nothing changed: skipped
    rec.write("b", 1, 99, chain([5, 99], "b")[1], 3 * BS + 1, 4)  # b overwrites a's slot 1
    (bad,) = rec.read("a", ids, [3, 5], 8, 5)
    assert (bad["block"], bad["slots"], bad["writer"]) == (3, [1], "b")
    fill(rec, "a", PROMPT, [3, 5], step=6)  # a rewrites both blocks: right again
    work = rec.work
    assert rec.read("a", ids, [3, 5], 8, 7) == [] and rec.work == work + 8
    rec.copy([(5, 3)])  # block 3 takes block 5's slots: a's positions 4..7 at 0..3
    (bad,) = rec.read("a", ids, [3, 5], 8, 8)
    assert bad["block"] == 3 and bad["slots"] == [0, 1, 2, 3]
    assert rec.read("a", ids, [5, 5], 8, 9)[0]["index"] == 0  # other blocks: verified again


def test_a_wrong_read_on_one_rank_poisons_the_readers_kv_on_every_rank():
    """Attention outputs are gathered from every rank: a request that read wrongly on rank 1
    writes KV computed from it on rank 0 too, and a later reader of that KV there (a cache hit
    on its block) has read poisoned KV (soak seed 14: cow_lag, a hit on r2's block by f6)."""
    rr = RankRecords(8, BS, world=2)
    toks = {"a": PROMPT, "b": PROMPT + [1]}
    rr.on_batch(0, *_batch("a", PROMPT, 0, 4, [1]))
    assert rr.commit(1, toks.__getitem__) == []
    # step 2: rank 1 reads a's block 1 at a copy's destination never written there (block 3)
    rr.copy([(1, 3)], late=[1])
    rr.on_batch(0, *_batch("a", PROMPT, 4, 4, [3, 2]))
    rr.on_batch(1, *_batch("a", PROMPT, 4, 4, [3, 2]))
    out = rr.commit(2, toks.__getitem__)
    assert [(f["rank"], f["block"], f["writer"]) for f in out] == [(1, 3, None)]
    # step 3: b hits a's blocks; on rank 0 their positions 4..7 are a's KV, computed from the
    # wrong read on rank 1
    rr.copy_on(1, [(1, 3)])
    rr.hit("b", [3, 2])
    rr.on_batch(0, *_batch("b", toks["b"], 8, 1, [3, 2, 4]))
    out = rr.commit(3, toks.__getitem__)
    assert {(f["rank"], f["block"], f["writer"], f["origin"]) for f in out} == {
        (r, 2, "a", "a") for r in (0, 1)
    }


def test_tainting_across_ranks_moves_no_version_only_its_writer_read():
    """The taint lands on the writes of the step that read wrongly; read since by their writer
    alone, rank 0's versions are those of a run where rank 1 read right (the record's cost, and
    so a run's history, as before)."""
    toks, seen = {"a": PROMPT}, []
    for late in ([1], []):
        rr = RankRecords(8, BS, world=2)
        rr.on_batch(0, *_batch("a", PROMPT, 0, 4, [1]))
        rr.commit(1, toks.__getitem__)
        rr.copy([(1, 3)], late=late)
        rr.on_batch(0, *_batch("a", PROMPT, 4, 4, [3, 2]))
        rr.on_batch(1, *_batch("a", PROMPT, 4, 4, [3, 2]))
        out = rr.commit(2, toks.__getitem__)
        seen.append((len(out), list(rr.records[0].version), dict(rr.records[0].tainted)))
    (wrong, v_wrong, t_wrong), (right, v_right, t_right) = seen
    assert (wrong, right) == (1, 0) and v_wrong == v_right
    assert t_wrong == {"a": "a"} and t_right == {}


def test_a_same_step_reader_of_kv_tainted_across_ranks_reads_it_again():
    """b hits a's blocks in the step a reads wrongly on rank 1: judged before the taint crossed,
    b's read on rank 0 holds that step, and its next read of the block verifies it again."""
    rr = RankRecords(8, BS, world=2)
    toks = {"a": PROMPT, "b": PROMPT + [1]}
    rr.on_batch(0, *_batch("a", PROMPT, 0, 4, [1]))
    rr.commit(1, toks.__getitem__)
    rr.copy([(1, 3)], late=[1])  # rank 1: block 3 not yet copied there
    reads, writes = _batch("a", PROMPT, 4, 4, [3, 2])
    rr.on_batch(0, reads + [("b", 8, [3, 2])], writes)  # b reads block 2, written this step
    rr.on_batch(1, reads, writes)
    assert [(f["rank"], f["req"]) for f in rr.commit(2, toks.__getitem__)] == [(1, "a")]
    rr.copy_on(1, [(1, 3)])
    rr.on_batch(0, [("b", 8, [3, 2])], [])
    out = rr.commit(3, toks.__getitem__)
    assert {(f["rank"], f["req"], f["block"], f["origin"]) for f in out} == {
        (r, "b", 2, "a") for r in (0, 1)
    }
