"""The block manager protocol (v2, `KVManager`; docs/protocol-v2.md section 1): what the engine
needs from a block manager, so a user's own can run under kvchaos (`--block-manager module:attr`).
Both references speak it: kvchaos.engine.block_manager.BlockManager and
kvchaos.engine.prefix_manager.PrefixCachingManager.

A manager declares `kvchaos_protocol = 2`; one that does not is refused (the first protocol, v1,
was removed in 0.2: docs/adapters.md has the migration table). It answers `admit` with the tokens
it already holds (a prefix cache), is told `release` reasons, and may leave the block table to the
engine. Sequences are keyed by string ids; every growth is atomic (OutOfBlocks changes nothing).
Everything beyond KVManager's members is optional, each behind a capability (the small protocols
below); a path a manager lacks is "not applicable", never a failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypedDict, runtime_checkable

Reason = Literal["finished", "aborted", "preempted", "error"]
REASONS: tuple[Reason, ...] = ("finished", "aborted", "preempted", "error")


class CacheEntry(TypedDict):
    """One keyed block of a prefix cache ("cache_state"), free or held."""

    block: int
    key: str  # key as text: bytes.hex(), else str(); never truncated
    parent: str | None  # the parent block's key (None: first block)
    tokens: list[int] | None  # the token ids it is keyed over, when the manager keeps them


@dataclass
class Snapshot:
    """A read-only picture of a block manager, for checkers. Plain data (JSON-able). The fields
    after seq_blocks are optional: a manager declaring "own_table" fills the table ones, the engine
    does for a manager whose table it builds."""

    num_blocks: int
    free: list[int]
    ref_counts: list[int]
    seq_blocks: dict[str, list[int]]
    seq_rows: dict[str, int] | None = None
    table: list[int] | None = None
    table_width: int | None = None
    # Tokens each sequence has slots for. With it a checker sees a write into a block that
    # another sequence still shares (a missed copy-on-write); without it, that is not judged.
    seq_tokens: dict[str, int] | None = None
    reserved: list[int] | None = None  # the manager's reserved_blocks (v2)
    cache: list[CacheEntry] | None = None  # "cache_state": every keyed block (v2)
    # "offload": each sequence's host slots (stored out, or a copy in flight) and the free ones
    host_blocks: dict[str, list[int]] | None = None
    host_free: list[int] | None = None
    # ... a host tier that shares slots (a prefix cache on the host): each slot's holders
    host_ref_counts: list[int] | None = None

    def to_dict(self) -> dict:
        # shallow: snapshot() already hands out fresh lists; optional fields only when given
        return {k: v for k, v in self.__dict__.items() if v is not None}


CAPABILITIES = (
    "fork",
    "seq_tokens",
    "prefix_cache",
    "cache_state",
    "estimates",
    "append_decode",
    "end_step",
    "own_table",
    "offload",
)


# Why a manager without the declaration is refused, at the door and by the engine (one line)
NOT_V2 = (
    "does not declare kvchaos_protocol = 2: protocol v1 was removed in kvchaos 0.2; move it to v2 "
    "with the migration table in docs/adapters.md ('Moving a manager from the first protocol to "
    "v2')"
)


def protocol_version(manager) -> int:
    """2 for a manager declaring `kvchaos_protocol >= 2`, else 1 (refused: NOT_V2)."""
    v = getattr(manager, "kvchaos_protocol", 1)
    return 2 if isinstance(v, int) and not isinstance(v, bool) and v >= 2 else 1


def declared_block_sizes(manager) -> tuple[int, ...] | None:
    """The block sizes a manager (or its class, or factory) declares it supports (`block_sizes`,
    optional; None: any). ValueError when the declaration is not positive ints."""
    sizes = getattr(manager, "block_sizes", None)
    if sizes is None:
        return None
    if (
        not isinstance(sizes, (tuple, list, frozenset, set, range))
        or not sizes
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in sizes)
    ):
        raise ValueError(f"block_sizes is {sizes!r}, not a tuple of positive ints")
    return tuple(sorted(sizes))


def capabilities(manager) -> frozenset[str]:
    """What a manager offers beyond the core protocol: declared, or inferred from what it has."""
    declared = getattr(manager, "capabilities", None)
    if declared is not None:
        return frozenset(declared) & frozenset(CAPABILITIES)
    # seq_tokens, prefix_cache and cache_state are in what snapshot() returns: declared only
    return frozenset(name for name, shape in INFERABLE.items() if isinstance(manager, shape))


@runtime_checkable
class KVManager(Protocol):
    """Protocol v2. Declare `kvchaos_protocol = 2`; everything not below is optional."""

    kvchaos_protocol: int  # 2
    block_size: int

    @property
    def num_blocks(self) -> int: ...  # every id, reserved ones included (sizes the KV pool)
    @property
    def num_free_blocks(self) -> int: ...  # usable ids with ref 0 (cached-but-free count as free)
    def admit(
        self, seq_id: str, token_ids: Sequence[int], num_new_tokens: int, max_computed: int
    ) -> int:
        """Start seq_id whose known tokens are token_ids (prompt; prompt + output when readmitted
        after preemption). Reuse the longest cached prefix, h <= max_computed tokens (any h, not
        only whole blocks), and reserve slots for min(num_new_tokens, len(token_ids) - h) tokens
        after it. Returns h (0 without a cache). Atomic: OutOfBlocks changes nothing."""
        ...

    def append(self, seq_id: str, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Reserve slots for these tokens, next in order (a prefill chunk, or the token generated
        last step). Returns (src, dst) copies to apply before the step (copy-on-write). Atomic."""
        ...

    def block_ids(self, seq_id: str) -> Sequence[int]:
        """Its blocks in logical order (entry i holds positions i*bs ..). May be a live view;
        the engine never mutates it. Entries change only by growth or by a reported copy."""
        ...

    def release(self, seq_id: str, reason: Reason) -> bool:
        """Give back everything seq_id holds. Idempotent: unknown id -> False. 'error': the step
        that reserved its last slots did not run; keys over those slots must not be served."""
        ...

    def snapshot(self) -> Snapshot: ...


# The optional members of a v2 manager, one protocol per capability it may infer from. Also
# optional, not inferred: `reserved_blocks: tuple[int, ...]` (ids never handed out, vLLM's (0,)),
# `block_sizes: tuple[int, ...]` (the block sizes it supports, on its class: read before it is
# built) and `capabilities: frozenset[str]`.
@runtime_checkable
class Estimates(Protocol):  # "estimates": for sequences the manager knows only
    def blocks_needed(self, seq_id: str, num_new_tokens: int) -> int: ...


@runtime_checkable
class AppendDecode(Protocol):  # "append_decode": append(s, [t]) for every s, batched
    def append_decode(
        self, seq_ids: Sequence[str], token_ids: Sequence[int]
    ) -> list[tuple[int, int]]: ...


@runtime_checkable
class Fork(Protocol):  # "fork": child shares every block of parent
    def fork(self, parent_id: str, child_id: str) -> None: ...


@runtime_checkable
class EndStep(Protocol):  # "end_step": tokens now computed per sequence, after each forward
    def end_step(self, computed: dict[str, int]) -> None: ...


@runtime_checkable
class OwnTable(Protocol):  # "own_table": the manager writes the table the kernels read
    # rows, width, host_tensor (flat int32 on the CPU: entry (row, i) at row * width + i, -1
    # unused), bound_check, overflow_writes; rows: dict[str, int] optional (else seq_rows)
    table: object

    @property
    def num_free_rows(self) -> int: ...
    def resize_table(self, rows: int | None = None, width: int | None = None) -> None: ...


@runtime_checkable
class Offload(Protocol):  # "offload": a host tier the engine stores blocks out to and back
    # (docs/protocol-v2.md section 10). store: (device block, host slot) pairs for the blocks of
    # the first num_tokens tokens, the device blocks held until offload_done; restore: (host
    # slot, new device block) pairs, the host slots held until offload_done. Atomic: OutOfBlocks
    # (no room) changes nothing. release frees both tiers.
    @property
    def host_blocks(self) -> int: ...
    @property
    def num_free_host_blocks(self) -> int: ...
    def offload_store(self, seq_id: str, num_tokens: int) -> list[tuple[int, int]]: ...
    def offload_restore(self, seq_id: str) -> list[tuple[int, int]]: ...
    def offload_done(self, seq_id: str) -> None: ...


INFERABLE = {
    "fork": Fork,
    "estimates": Estimates,
    "append_decode": AppendDecode,
    "end_step": EndStep,
    "own_table": OwnTable,
    "offload": Offload,
}
