"""The host tier's events in the history (engine/offload.py builds them by keyword; the
harness's event types import them from here, so a command starts without torch)."""

from __future__ import annotations

from typing import Literal

from typing_extensions import TypedDict

Why = Literal["preempt", "cold"]


class _Store(TypedDict):
    req: str
    why: Why
    pairs: list[list[int]]  # [device block, host slot] in logical order
    due: int
    crcs: list[int]  # each host copy as read (every rank's, chained)
    fenced: bool  # it waited for the step in flight that wrote the blocks (async scheduling)


class OffloadStore(_Store, total=False):
    """A store issued: device block -> host slot, read now, completing at `due`."""

    dues: list[int]  # with a bandwidth: each block's due step (`due`: the last's)


class _Restore(TypedDict):
    req: str
    pairs: list[list[int]]  # [host slot, device block]
    due: int
    crcs: list[int]  # each host slot's content now
    flipped: bool  # the table named the new blocks to the kernels before the copy completed


class OffloadRestore(_Restore, total=False):
    """A restore issued: host slot -> new device block, written when it lands at `due`."""

    dues: list[int]  # with a bandwidth: each block's due step (`due`: the last's)
    hit: bool  # an admission's prefix hit found on the host tier alone (offload_hits)


class OffloadLanded(TypedDict):
    """Blocks of a copy landed (all of them, without a bandwidth; the copy completed once every
    block of its issue did). store: each device block's CRC now (what its host copy must equal);
    restore: each device block's CRC once written (what the store's copy was)."""

    req: str
    kind: Literal["store", "restore"]
    issued: int
    pairs: list[list[int]]
    crcs: list[int]


class OffloadLate(TypedDict):
    """A load of a request released while it was in flight landed (seam free_loading): into
    device blocks the manager took back, and may have handed on."""

    req: str
    issued: int
    blocks: list[int]
    holders: dict[str, list[str]]  # block -> the sequences whose table rows name it now


class Pause(TypedDict):
    """A request sits idle holding its blocks (the workload's think time)."""

    req: str


class Resume(TypedDict):
    """An idle request waits to run again; tier: where its blocks are now."""

    req: str
    tier: str


class _Tier(TypedDict):
    device_used: int
    host_used: int
    in_flight: int  # sequences with a copy in flight
    stored: int  # blocks whose store completed this step
    restored: int  # ... whose restore completed


class OffloadTier(_Tier, total=False):
    """Occupancy and traffic of the step (device blocks in use, host slots in use, in flight)."""

    blocks_in_flight: int  # with a bandwidth: blocks issued, not landed
