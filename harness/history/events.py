"""The history's events, as types: the contract between the rooms. The run writes them
(harness/run/), the checkers and the reports read them (harness/check/, harness/report/).

Every event has "e" (its kind) and "step" (the engine step it belongs to; 0 before the first).
Events are plain dicts on disk and in memory (JSON lines); these TypedDicts say which keys each
kind has, `tests/test_events.py` holds recorded histories to them. Keys a kind has only
sometimes are in its `total=False` part. Fields that measure time or the machine are left out
of the history's digest (log.UNSTABLE_KEYS)."""

from __future__ import annotations

from typing import Any, Literal, TypedDict, Union, get_args, get_type_hints

from kvchaos.engine.inflight import AsyncFence, AsyncFreed, AsyncLanded, AsyncMixed, AsyncStep
from kvchaos.engine.offload_events import (
    OffloadLanded,
    OffloadLate,
    OffloadRestore,
    OffloadStore,
    OffloadTier,
    Pause,
    Resume,
)

Phase = Literal["waiting", "prefill", "decode", "preempted", "idle", "restoring"]
EndReason = Literal["done", "max_steps", "interrupted", "error"]
FaultKind = Literal["armed", "trigger", "fired"]
Origin = Literal["plan", "fault", "harness"]  # who asked for a submit, cancel or reject


class RunStart(TypedDict):
    e: Literal["run_start"]
    step: int
    scenario: str
    seed: int
    config: dict[str, Any]  # EngineConfig.to_dict()
    config_hash: str
    commit: str
    device: str
    time: str
    block_manager: str  # its spec, module:attr
    capabilities: list[str]
    telemetry: dict[str, Any]
    plan: list[dict[str, Any]]  # the workload plan's actions, faults' triggers included


class _Submit(TypedDict):
    e: Literal["submit"]
    step: int
    req: str
    prompt_len: int
    max_new: int
    parent: str | None  # the fork source
    origin: str


class Submit(_Submit, total=False):
    turn_of: str  # a turn only: the request whose prompt and output its prompt continues
    prompt_ids: list[int]  # with a prefix cache: the prompt the manager is given (not digested)


class Reject(TypedDict):
    e: Literal["reject"]
    step: int
    req: str
    error: Literal["InvalidRequest", "RequestRejected"]
    message: str
    origin: str


class Cancel(TypedDict):
    e: Literal["cancel"]
    step: int
    req: str
    phase: Phase
    shared: bool  # held a block also held by another sequence
    blocks: list[int]  # the blocks it held
    origin: str


class _Step(TypedDict):
    e: Literal["step"]
    step: int
    latency_s: float
    host_s: float  # this rank's own host work
    upload_s: float  # its table upload part
    wait_s: float  # on other real ranks before the model
    harness_s: float  # the harness's own snapshots in the step, taken out of the three above
    cpu_s: float
    free_blocks: int
    running: int
    waiting: int
    prefill_tokens: int
    decode_tokens: int
    preempted: list[str]
    tokens: dict[str, int]  # req -> the token it produced
    finished: list[str]
    table_version: int
    stale_ranks: list[int]
    rank_crcs: list[int]
    table_crc: int


class Step(_Step, total=False):
    telemetry: dict[str, Any]  # RSS, CPU and GPU fields, on sampled steps
    stage_s: float  # the upload's copy into the staging buffer (histories from before: none)
    probe_s: float  # the same copy through a sound buffer beside it, in the step (calibration)
    host_cpu_s: float  # the CPU time of host_s (a neighbour's load does not add to it)
    failed: list[str]  # requests the engine ended in error in the step (their own failure)


class _Snapshot(TypedDict):
    """The manager's Snapshot fields (kvchaos.engine.protocols), checked as taken; the table is
    the one the kernels read. Taken as each step's table is uploaded, after a step that ran
    nothing, and once more at the end (stamped one past the last step)."""

    e: Literal["snapshot"]
    step: int
    num_blocks: int
    free: list[int]
    ref_counts: list[int]
    seq_blocks: dict[str, list[int]]
    seq_rows: dict[str, int]
    table: list[int]
    table_width: int
    live: list[str]  # requests the engine is running


class Calls(TypedDict):
    """The calls into the manager in a step, in order (the engine's and the plan's: a cancel's
    release, a fork), each [name, args, answer]; answer {"refused": message} for a refusal,
    {"raised": "Type: message"} for an exception. Token lists are shown as "<N tokens>".
    Written before the step's own event; left out of the history's digest (log.DIGEST_SKIP)."""

    e: Literal["calls"]
    step: int
    calls: list[list[Any]]


class Snapshot(_Snapshot, total=False):
    seq_tokens: dict[str, int]
    reserved: list[int]
    # a prefix cache, as its change since the snapshot before (history.cache.apply_cache)
    cache_added: list[dict[str, Any]]
    cache_removed: list[list[Any]]  # [block, key]
    cache_n: int
    # a manager with a host tier ("offload"): each sequence's host slots, the free ones
    host_blocks: dict[str, list[int]]
    host_free: list[int]
    host_ref_counts: list[int]  # a host tier that shares slots (a prefix cache on the host)


class SnapshotInvalid(TypedDict):
    e: Literal["snapshot_invalid"]
    step: int
    problem: str  # what is wrong with the manager's word: a finding against it


class Engine(TypedDict):
    e: Literal["engine"]
    step: int
    # cow (late_ranks: ranks whose copies are in flight) | cow_landed (rank, copies) |
    # staging_realloc | hit | refusal | table_resync | estimate_off | unneeded_preemption;
    # with [engine] async_scheduling: async_step | async_fence | async_freed | async_landed |
    # async_mixed; with [engine.offload]: offload_store | offload_restore | offload_landed |
    # offload_tier; with [workload.think]: pause | resume
    kind: str
    data: dict[str, Any]  # a hit: req, known, answered, used, capped, blocks; ENGINE_DATA's


# the data of engine events typed where the engine builds them (asynchronous scheduling: what is
# in flight, a release that waited for it, one that did not, and its writes landing late)
ENGINE_DATA: dict[str, type] = {
    "async_step": AsyncStep,
    "async_fence": AsyncFence,
    "async_freed": AsyncFreed,
    "async_landed": AsyncLanded,
    "async_mixed": AsyncMixed,
    # with [engine.offload]: a store or restore issued, a copy completed, the tier each step
    "offload_store": OffloadStore,
    "offload_restore": OffloadRestore,
    "offload_landed": OffloadLanded,
    "offload_tier": OffloadTier,
    "offload_late": OffloadLate,
    # with [workload.think]: a request paused (idle, holding its blocks) and resumed
    "pause": Pause,
    "resume": Resume,
}


class Fault(TypedDict):
    e: Literal["fault"]
    step: int
    fault: str
    kind: FaultKind
    detail: dict[str, Any]


class KVRecordOn(TypedDict):
    e: Literal["kv_record"]  # the per-block writer record is on (a manager with a prefix cache)
    step: int
    ranks: int


class _KVRead(TypedDict):
    e: Literal["kv_read"]  # a read of KV not written for the READER's tokens
    step: int
    req: str  # the reader
    rank: int
    index: int  # entry of its row
    block: int
    slots: list[int]  # offsets in the block read wrongly
    pos: list[int]  # its positions there
    writer: str | None  # None: never written
    writer_pos: int | None
    writer_step: int | None
    via_hit: bool  # the block came with req's last cache hit
    origin: str | None  # set: the KV was computed from a wrong read by that request


class KVRead(_KVRead, total=False):
    torn: bool  # written in a step that raised


class _CacheMismatch(TypedDict):
    e: Literal["cache_mismatch"]  # a cached block whose slots are not KV of its key's tokens
    step: int
    block: int
    key: str
    problem: Literal["partial", "tokens", "chain", "parent"]
    writers: list[Any]
    written: int


class CacheMismatch(_CacheMismatch, total=False):
    parent_block: int


class HitMismatch(TypedDict):
    e: Literal["hit_mismatch"]  # a hit's block that its key does not name
    step: int
    req: str
    index: int
    block: int
    problem: Literal["not_cached", "tokens", "parent"]


class ForeignWrite(TypedDict):
    e: Literal["foreign_write"]
    step: int
    req: str
    blocks: list[int]
    owned: list[int]
    ranks: list[int]


class TierRead(TypedDict):
    """A host tier: a sequence computed (its blocks read) while its restore was in flight (the
    harness's look at the engine's writes and the tier's copies, after the step)."""

    e: Literal["tier_read"]
    step: int
    req: str
    blocks: list[int]  # the device blocks the restore had not finished writing
    issued: int  # the step the restore was issued at


class _UnslottedWrite(TypedDict):
    e: Literal["unslotted_write"]  # positions whose KV was written with no slot reserved
    step: int
    req: str
    positions: list[int]
    ranks: list[int]
    via: Literal["past_blocks", "unused_entry"]  # past the blocks it holds; a -1 table entry
    slots_held: int | None  # slots its blocks give it, by this step's snapshot (None: none)
    entry: int  # the row entry the first position was written through


class UnslottedWrite(_UnslottedWrite, total=False):
    blocks: list[int]  # where writes through an unused entry landed: the pool's last block


class Oracle(TypedDict):
    """A request checked against the contiguous-cache oracle; step: when it stopped producing."""

    e: Literal["oracle"]
    step: int
    req: str
    checked: int
    max_abs_err: float
    max_rel_err: float
    first_divergence: int | None
    abs_err_at_divergence: float | None
    tolerance: float | None
    divergence_step: int | None  # engine step of the first divergent token
    prompt_mismatch_at: int | None


class Reference(TypedDict):
    e: Literal["reference"]  # the model code cross-checked by an independent float64 forward
    step: int
    req: str
    checked: int
    max_abs_err: float
    agrees: bool
    first_disagreement: int | None


class _Error(TypedDict):
    e: Literal["error"]  # the harness's own failure: the run is ERROR
    step: int
    error: str
    message: str
    traceback: str


class _Parent(TypedDict, total=False):
    """What the worker's parent adds to the event it writes for a worker that hung or died
    before its history said who it was."""

    scenario: str
    seed: int
    commit: str
    device: str


class Error(_Error, _Parent, total=False):
    pass


class _SutError(TypedDict):
    e: Literal["sut_error"]  # an exception, hang or death inside a call into the manager
    step: int
    call: str
    args: list[str]
    error: str
    message: str
    traceback: str


class SutError(_SutError, _Parent, total=False):
    how: Literal["hang", "died"]  # written by the worker's parent when the call never returned


class _RunEnd(TypedDict):
    e: Literal["run_end"]
    step: int
    reason: EndReason
    counters: dict[str, Any]
    manager_calls: dict[str, Any]
    fault_verify: dict[str, Any]
    telemetry: dict[str, Any]


class RunEnd(_RunEnd, total=False):
    kv_record: dict[str, Any]  # with a manager offering a prefix cache (the writer record)


Event = Union[
    RunStart,
    Submit,
    Reject,
    Cancel,
    Step,
    Snapshot,
    Calls,
    SnapshotInvalid,
    Engine,
    Fault,
    KVRecordOn,
    KVRead,
    CacheMismatch,
    HitMismatch,
    ForeignWrite,
    TierRead,
    UnslottedWrite,
    Oracle,
    Reference,
    Error,
    SutError,
    RunEnd,
]
# kind -> its type
KINDS: dict[str, type] = {get_args(get_type_hints(t)["e"])[0]: t for t in get_args(Event)}
