"""The kernels' geometry over the KV pool (engine/geometry.py): a pool sized, or a kernel block
size asked, apart from the manager's is aligned by the remediated engine and kept by a planted
defect, whose kernels address the pool as asked (an entry past it wraps to its start); and
block_table.kernel_view, the one reading of a row through a geometry."""

from __future__ import annotations

import pytest
import torch

from kvchaos.engine import CacheConfig, EngineConfig
from kvchaos.engine.block_table import kernel_view
from kvchaos.engine.engine import Engine

CFG = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=9, max_blocks_per_seq=4))


def engine(planted: bool) -> Engine:
    e = Engine(CFG)
    e.seams.geometry_check = not planted
    return e


def test_a_pool_sized_short_is_aligned_unless_planted():
    e = engine(False)
    flat = torch.tensor([8, 0, -1], dtype=torch.int32)
    assert e._kernel_entries(flat) is flat and e.kernel_geometry() == {}
    e.size_kv_pool(8)
    assert (e.pool_blocks, e.geometry_alignments, e.kernel_geometry()) == (9, 1, {})
    assert e.kv_pools[0].shape[2] == 9
    e = engine(True)
    e.size_kv_pool(8)
    assert (e.pool_blocks, e.geometry_alignments) == (8, 0)
    assert e.kernel_geometry() == {"pool_blocks": 8} and e.kv_pools[0].shape[2] == 8
    assert e._kernel_entries(flat).tolist() == [0, 0, -1]  # the last block wraps; unused stays


def test_a_kernel_block_size_is_aligned_unless_planted():
    e = engine(False)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        e.launch_block_size(6)
    e.launch_block_size(8)
    assert (e.kernel_bs, e.geometry_alignments, e.kernel_geometry()) == (None, 1, {})
    assert e._kv_views[0][0][0].shape[:2] == (9, 4)
    e = engine(True)
    e.launch_block_size(8)
    assert e.kernel_geometry() == {"kernel_block_size": 8, "block_size": 4}
    k = e._kv_views[0][0][0]  # 9 blocks of 4: four kernel blocks of 8, the last block past them
    assert k.shape[:2] == (4, 8) and k.data_ptr() == e.kv_pools[0][0, 0].data_ptr()
    flat = torch.tensor([3, 4, 8, -1], dtype=torch.int32)
    assert e._kernel_entries(flat).tolist() == [3, 0, 0, -1]


def test_kernel_view_reads_a_row_through_stride_block_size_and_pool():
    table = [5, 6, 7, -1, 8, 2, -1, -1]
    assert kernel_view(table, 1, 4, 2) == [8, 2]  # the manager's layout: its blocks
    assert kernel_view(table, 1, 3, 2) == [-1, 8]  # an old stride: another row's entries
    assert kernel_view(table, 1, 4, 2, ratio=2, pool_kernel_blocks=4) == [0, 1]  # 8 wraps to 0
    assert kernel_view(table, 0, 4, 3, ratio=2, pool_kernel_blocks=5) == [0, 1, 2]
    assert kernel_view(table, 0, 4, 3, pool_kernel_blocks=6) == [5, 0, 1]
    assert kernel_view(table, 1, 8, 2) == []  # past the table's end: the row comes short
