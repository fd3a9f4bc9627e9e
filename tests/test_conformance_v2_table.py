"""`kvchaos conformance` on the table and decode-batch paths of a v2 manager
(kvchaos.harness.conformance.table): the canaries of the table family are each caught by
the property that names their bug; a decode batch that is not all or nothing fails; a manager
without "own_table" (the engine builds its table) or without "append_decode" has those
properties not applicable. The plain reference passing all of them: tests/test_conformance.py."""

from __future__ import annotations

import pytest

from kvchaos.engine.block_manager import BlockManager
from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.prefix_manager import PrefixCachingManager
from kvchaos.harness.conformance.suite import run_conformance
from kvchaos.harness.tools import canaries

TABLE = ("table_rows", "resize")
EXAMPLES = 100  # each caught on seeds 0-7 at 100 (a decode batch of two: 6 of 8 at 60)
SHRINK = 100  # histories run while shrinking: enough for the step each test looks for


def failed(results) -> dict:
    return {r.name: r for r in results if r.status == "failed"}


class DecodeNotAtomic(BlockManager):
    """append_decode grows its batch one sequence at a time and refuses from the second on,
    keeping the slot it took for the first."""

    def append_decode(self, seq_ids, token_ids):
        copies = self.append(seq_ids[0], token_ids[:1])
        if len(seq_ids) > 1:
            raise OutOfBlocks(f"decode of {seq_ids[1]}: refused after {seq_ids[0]} grew")
        return copies


class DecodeDropsLast(BlockManager):
    """append_decode of two or more sequences forgets the last one, yet answers."""

    def append_decode(self, seq_ids, token_ids):
        n = len(seq_ids) - (len(seq_ids) > 1)
        return super().append_decode(seq_ids[:n], token_ids[:n])


class WithoutDecode(BlockManager):
    capabilities = BlockManager.capabilities - {"append_decode"}


@pytest.mark.parametrize(
    "manager, prop, says, step",
    [
        (canaries.PreemptLeavesRow, "table_rows", "(no sequence's) is [", "'preempted'"),
        (canaries.RowFromCount, "table_rows", "both have row", "m.admit("),
        (canaries.DecodeTableNotUploaded, "table_rows", "block_ids", "m.append_decode("),
        (canaries.ResizeKeepsFirstRow, "resize", "after resize_table(rows=", "m.resize_table("),
    ],
)
def test_each_table_canary_fails_the_property_that_names_its_bug(manager, prop, says, step):
    bad = failed(run_conformance(manager, examples=EXAMPLES, shrink_steps=SHRINK))
    assert list(bad) == [prop], {n: r.message for n, r in bad.items()}
    r = bad[prop]
    assert says in r.message and any(step in s for s in r.reproducer), (r.message, r.reproducer)


@pytest.mark.parametrize(
    "manager, prop, says",
    [
        (DecodeNotAtomic, "refusal", "refused (OutOfBlocks), yet changed"),
        (DecodeDropsLast, "append_decode", "no slot for position"),
    ],
)
def test_a_decode_batch_is_all_or_nothing(manager, prop, says):
    bad = failed(run_conformance(manager, examples=EXAMPLES, shrink_steps=SHRINK))
    assert list(bad) == [prop], {n: r.message for n, r in bad.items()}
    assert "append_decode([" in bad[prop].message and says in bad[prop].message
    assert any("m.append_decode(" in s for s in bad[prop].reproducer), bad[prop].reproducer


@pytest.mark.parametrize(
    "manager, lacking",
    [
        (PrefixCachingManager, {"table_rows": "own_table", "resize": "own_table"}),
        (WithoutDecode, {"append_decode": "append_decode"}),
    ],
)
def test_the_table_and_decode_properties_need_their_capability(manager, lacking):
    results = {r.name: r for r in run_conformance(manager, examples=30)}
    for name in (*TABLE, "append_decode"):
        r = results[name]
        if name in lacking:
            assert r.status == "not applicable" and r.message == f"declares no {lacking[name]!r}"
        else:
            assert r.status == "passed" and r.judged > 0, (name, r)
    assert not failed(results.values())
