"""The flat block table: rows x width int32 entries, entry (row, i) at row * width + i, -1 unused.

Flat on purpose: it is addressed exactly as a GPU kernel addresses it, so a write past a row's
width lands in the next row. `bound_check` is the seam that refuses such writes.
"""

from __future__ import annotations

from array import array

from kvchaos.engine.errors import TableOverflow

UNUSED = -1


class BlockTable:
    __slots__ = (
        "rows",
        "width",
        "host",
        "host_tensor",
        "bound_check",
        "overflow_writes",
        "overflow_log",
    )

    def __init__(self, rows: int, width: int) -> None:
        self.rows, self.width = rows, width
        self.host = array("i", [UNUSED]) * (rows * width)
        self.host_tensor = _view(self.host)
        self.bound_check = True
        self.overflow_writes = 0  # writes that crossed into another row (only possible unchecked)
        self.overflow_log: list[tuple[int, int, int]] = []  # (row, index, block) of each

    def write(self, row: int, index: int, block: int) -> None:
        if index >= self.width:
            if self.bound_check:
                raise TableOverflow(f"block-table row {row}: index {index} >= width {self.width}")
            self.overflow_writes += 1
            self.overflow_log.append((row, index, block))
            if row * self.width + index >= len(self.host):
                return  # past the whole buffer: a raw kernel would scribble on whatever lies beyond
        self.host[row * self.width + index] = block

    def clear(self, row: int, count: int) -> None:
        """Unmap entries 0..count-1 of a row (flat addressing: an overlong row spills over too)."""
        base = row * self.width
        end = min(base + count, len(self.host))
        self.host[base:end] = array("i", [UNUSED]) * (end - base)

    def row(self, row: int) -> list[int]:
        return self.host[row * self.width : (row + 1) * self.width].tolist()

    def resize(self, rows: int, width: int) -> None:
        """Grow to rows x width keeping every row's entries (the `resize` overflow policy)."""
        if rows < self.rows or width < self.width:
            raise ValueError(
                f"block table can only grow: {self.rows}x{self.width} -> {rows}x{width}"
            )
        new = array("i", [UNUSED]) * (rows * width)
        for r in range(self.rows):
            new[r * width : r * width + self.width] = self.host[
                r * self.width : (r + 1) * self.width
            ]
        self.rows, self.width, self.host = rows, width, new
        self.host_tensor = _view(self.host)


def kernel_view(
    table: list[int],
    row: int,
    stride: int,
    count: int,
    ratio: int = 1,
    pool_kernel_blocks: int | None = None,
) -> list[int]:
    """The blocks (in the table's units) the kernels read for a sequence holding `count` blocks in
    `row`: row r from r * stride, each entry e a kernel block of `ratio` table blocks (e * ratio
    ... e * ratio + ratio - 1), an entry past the pool's `pool_kernel_blocks` wrapped to its
    start; the row comes short past the table's end. The row as the manager lays it out: exactly
    its blocks."""
    base = row * stride
    out: list[int] = []
    for e in table[base : base + -(-count // ratio)]:
        if pool_kernel_blocks is not None and e >= pool_kernel_blocks:
            e %= pool_kernel_blocks
        out += [e] * ratio if e < 0 else range(e * ratio, e * ratio + ratio)
    return out[:count]


def _view(host: array):
    """The table as an int32 tensor over the same memory (zero-copy). torch is imported here: the
    block managers, and the canaries built on them, load without it."""
    import torch

    return torch.frombuffer(host, dtype=torch.int32)
