"""A request as the engine tracks it: plain data."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class State(enum.Enum):
    WAITING = "waiting"  # never scheduled yet, or waiting for room
    RUNNING = "running"  # holds blocks: prefilling (more than one token to compute) or decoding
    PREEMPTED = "preempted"  # blocks taken back; recomputes from scratch when readmitted
    # (with a host tier: stored out, restored when readmitted)
    IDLE = "idle"  # paused holding its blocks (a session's think time), resumed by the workload
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"  # ended by the engine: its own work failed in a step (RequestFailed)


@dataclass(eq=False)
class Sequence:
    id: str
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    state: State = State.WAITING
    num_computed: int = 0  # tokens whose K/V are in the pool
    holds: bool = False  # admitted (or forked) and not yet released: the manager holds its blocks
    hit_tokens: int = 0  # tokens its last admission found computed (prefix cache hits)
    parent: str | None = None  # forked from (shares its blocks until written)
    tier: str = "device"  # with a host tier: device | storing | host | restoring
    idle_since: int = 0  # the step it paused at

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def phase(self) -> str:
        """Its stage: waiting, prefill, decode, preempted, idle, restoring, finished, cancelled,
        failed."""
        if self.state is State.RUNNING:
            return "decode" if self.uncomputed == 1 else "prefill"
        if self.tier == "restoring":  # a host tier's load into its blocks in flight
            return "restoring"
        return self.state.value

    @property
    def done(self) -> bool:
        return self.state in (State.FINISHED, State.CANCELLED, State.FAILED)


@dataclass
class StepStats:
    step: int
    latency_s: float
    # scheduling, block bookkeeping, table upload, metadata: everything but the model, this rank's
    # own work (waits on other ranks are wait_s)
    host_s: float
    cpu_s: float  # CPU time of the engine's thread in the step (immune to other processes' load)
    free_blocks: int
    num_running: int
    num_waiting: int
    prefill_tokens: int
    decode_tokens: int
    preempted: list[str] = field(default_factory=list)
    table_version: int = 0
    stale_ranks: list[int] = field(default_factory=list)  # ranks that computed on an old table
    stale_tables: list[int] = field(default_factory=list)  # ... whose content was not the new one
    rank_table_crcs: list[int] = field(default_factory=list)  # per rank, when tp_size > 1
    table_crc: int = 0
    prep_s: float = (
        0.0  # the part of host_s that builds the model's inputs (tokens, positions, slots,
    )
    # tables); host_s - prep_s is the bookkeeping: scheduling, blocks, table upload
    upload_s: float = 0.0  # the part of host_s that uploads the table: staging, every rank's copy
    stage_s: float = 0.0  # the part of upload_s that copies the table into the staging buffer
    probe_s: float = 0.0  # the same copy through a sound buffer beside it (its calibration)
    host_cpu_s: float = 0.0  # the thread's CPU time in host_s: waiting for a core is not in it
    wait_s: float = 0.0  # waits on other real ranks before the model runs (broadcast, tables, ack)


@dataclass
class StepOutput:
    stats: StepStats
    tokens: dict[str, int]  # request id -> token produced this step
    logits: dict[str, "object"]  # request id -> float32 logits [vocab] (CPU tensor)
    finished: list[str]
    failed: list[str] = field(default_factory=list)  # ended in error this step (RequestFailed)
