"""The BlockManager protocol: what the engine needs from a block manager, so a user's own can run
under kvchaos (`--block-manager module:attr`). The reference implementation is
kvchaos.engine.block_manager.BlockManager.

Contract, in words:
- Sequences are keyed by string ids. `append(seq, n)` reserves slots for n more tokens (a new id
  starts a sequence) and returns the (src, dst) block copies the engine must apply for
  copy-on-write; it is atomic: it raises kvchaos.engine.errors.OutOfBlocks and changes nothing when
  the pool cannot cover it.
- `blocks_needed(seq, n)` is how many free blocks append(seq, n) would take (copy-on-write
  included); `num_free_rows` how many more sequences can start.
- `fork(parent, child)` (optional: the "fork" capability) makes child share every block of
  parent; a manager without it gets a parallel sample as a fresh request that computes itself.
- `capabilities` (optional) declares what the manager offers beyond the core: "fork",
  "seq_tokens" (its snapshot carries per-sequence token counts). Undeclared, they are inferred
  from what it has. A path a manager lacks is "not applicable", never a failure.
- `free(seq)` releases everything seq holds; it is idempotent (returns False for an unknown id).
- `table` is the flat block table: `rows`, `width`, `host_tensor` (a flat int32 CPU tensor of
  rows * width entries, entry (row, i) at row * width + i, -1 unused), `bound_check`,
  `overflow_writes`. Row r of the table maps sequence `seq_rows[seq]`'s block list.
- `snapshot()` is read-only and returns a Snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass
class Snapshot:
    """A read-only picture of a block manager, for checkers. Plain data (JSON-able)."""

    num_blocks: int
    free: list[int]
    ref_counts: list[int]
    seq_blocks: dict[str, list[int]]
    seq_rows: dict[str, int]
    table: list[int]
    table_width: int
    # Optional: tokens each sequence has slots for. With it a checker sees a write into a block
    # that another sequence still shares (a missed copy-on-write); without it, that is not judged.
    seq_tokens: dict[str, int] | None = None

    def to_dict(self) -> dict:
        # shallow: snapshot() already hands out fresh lists; optional fields only when given
        return {k: v for k, v in self.__dict__.items() if v is not None}


CAPABILITIES = ("fork", "seq_tokens")


def capabilities(manager) -> frozenset[str]:
    """What a manager offers beyond the core protocol: declared, or inferred from what it has."""
    declared = getattr(manager, "capabilities", None)
    if declared is not None:
        return frozenset(declared) & frozenset(CAPABILITIES)
    return frozenset({"fork"} if callable(getattr(manager, "fork", None)) else set())


@runtime_checkable
class BlockManagerProtocol(Protocol):
    block_size: int
    table: object

    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_free_rows(self) -> int: ...
    def blocks_needed(self, seq_id: str, num_new_tokens: int) -> int: ...
    def append(self, seq_id: str, num_new_tokens: int) -> list[tuple[int, int]]: ...
    def free(self, seq_id: str) -> bool: ...
    def resize_table(self, rows: int | None = None, width: int | None = None) -> None: ...
    def snapshot(self) -> Snapshot: ...
