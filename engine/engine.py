"""The reference engine: continuous batching over a paged KV pool, greedy decoding.

One step = schedule (decode every running sequence, then prefill chunks within the token budget,
preempting by recompute when blocks run out) -> reserve slots -> upload the block table through
the staging buffer to every rank -> one model pass -> one token per sequence whose tokens are all
computed.
"""

from __future__ import annotations

import time

import torch

from kvchaos.engine.attention import paged_decode_torch
from kvchaos.engine.batch import BatchBuilder
from kvchaos.engine.block_manager import BlockManager
from kvchaos.engine.boundary import Boundary
from kvchaos.engine.config import EngineConfig
from kvchaos.engine.errors import InvalidRequest, OutOfBlocks, RequestFailed, RequestRejected
from kvchaos.engine.geometry import KernelGeometry
from kvchaos.engine.inflight import AsyncSteps, InFlight
from kvchaos.engine.model import Model
from kvchaos.engine.offload import HostTier, TierSteps
from kvchaos.engine.prefix_manager import PrefixCachingManager
from kvchaos.engine.protocols import NOT_V2, KVManager, capabilities, protocol_version
from kvchaos.engine.ranks import RankGroup
from kvchaos.engine.scheduler import Scheduler
from kvchaos.engine.seams import Seams
from kvchaos.engine.sequence import Sequence, State, StepOutput, StepStats
from kvchaos.engine.staging import StagingBuffer
from kvchaos.engine.tables import BuiltTable, OwnedTable
from kvchaos.engine.upload import TableUpload

# The seams' names for a sequence's exits (faults key on them) -> the v2 release reasons
RELEASE_REASONS = {
    "finish": "finished",
    "cancel": "aborted",
    "preempt": "preempted",
    "error": "error",
}


def decode_backend(name: str):
    if name == "triton":
        from kvchaos.engine.triton_decode import paged_decode_triton

        return paged_decode_triton
    return paged_decode_torch


class Engine(BatchBuilder, AsyncSteps, TableUpload, KernelGeometry, TierSteps):
    def __init__(self, config: EngineConfig, block_manager: KVManager | None = None) -> None:
        self.config = config
        mc, cc = config.model, config.cache
        self.device = torch.device(config.device)
        self.model = Model(mc, config.seed, self.device)
        host = {"host_blocks": config.offload.host_blocks} if config.offload else {}
        if block_manager is not None:
            manager = block_manager
        elif cc.prefix_caching:
            manager = PrefixCachingManager(cc.num_blocks, cc.block_size, **host)
        else:
            manager = BlockManager(
                cc.num_blocks, cc.block_size, cc.max_num_seqs, cc.max_blocks_per_seq, **host
            )
        if protocol_version(manager) < 2:
            raise TypeError(f"{type(manager).__name__} {NOT_V2}")
        if not isinstance(manager, KVManager):
            raise TypeError(
                f"{type(manager).__name__} does not implement kvchaos.engine.protocols.KVManager"
            )
        self.protocol = 2  # what the manager speaks (run records)
        self.bm = Boundary(manager)  # every call into the manager recorded and guarded
        self.capabilities = capabilities(manager)  # what it offers beyond the core
        self.reserved = tuple(getattr(manager, "reserved_blocks", ()) or ())  # never handed out
        self.table = (
            OwnedTable(self.bm)  # the manager writes the table the kernels read
            if "own_table" in self.capabilities
            else BuiltTable(
                self.bm,
                cc.max_num_seqs,
                cc.max_blocks_per_seq,
                lambda kind, data: self.seams.on_event(kind, data),
            )
        )
        # planning asks the manager's estimate, only about sequences it holds
        self._estimates = "estimates" in self.capabilities
        self.record_writes = False  # the harness asks: blocks written per sequence, each step
        self.written: dict[str, dict[int, set[int]]] = {}  # seq -> block -> ranks writing it
        self.write_spans: dict[str, tuple[int, int]] = {}  # seq -> positions written [a, b)
        self.unslotted: list[tuple[str, int, int]] = []  # (seq, position, rank) via a -1 entry
        self.seams = Seams()
        self.watermark_blocks = int(cc.watermark * self.bm.num_blocks)
        self.decode_attention = decode_backend(config.resolved_backend())
        tp = config.tp_size
        self.kv_heads_per_rank = mc.num_kv_heads // tp
        self.kernel_bs: int | None = None  # the kernels' block size, where not the manager's
        self.geometry_alignments = 0  # pool sizes / kernel block sizes aligned to the manager's
        self._alloc_pools(self.bm.num_blocks)  # one per rank (geometry.py)
        self.ranks = RankGroup(tp, self.device)
        self._pinned = True  # page-locked: pinned on CUDA, mlock on the CPU (staging.py)
        self.staging = StagingBuffer(self.table.table.host_tensor.numel(), self._pinned)
        self._probe: StagingBuffer | None = None  # the calibration's buffers (_stage)
        self._warm: StagingBuffer | None = None
        self._probe_s = self._stage_s = self._calib_s = self._host_cpu_s = 0.0
        self.seqs: dict[str, Sequence] = {}
        self.scheduler = Scheduler(self)  # the waiting and running queues
        self.step_count = 0
        self.table_version = 0
        self._late_copies: list[tuple[int, int, list]] = []  # (due step, rank, copies) in flight
        self.copies_in_flight: dict[int, list] = {}  # rank -> copies it computes the step without
        self.step_copies: list = []  # this step's copy-on-write copies (src, dst), as issued
        self.scrambled_ranks: list[int] = []  # ranks that wrote the step's blocks reversed
        self.order_fixes = 0  # ranks whose tokens came out of order, written by position all same
        self.counters = {
            "staging_reallocs": 0,
            "preemptions": 0,
            "cow_copies": 0,
            "stale_rank_computes": 0,
            "rank_sync_waits": 0,
            "overlong_requests": 0,  # longer than a table row: the overflow trigger reached us
            "overlong_rejected": 0,
            "table_resizes": 0,
            "refusals": 0,  # OutOfBlocks answers of the manager (admission, growth, fork)
            "refusals_with_room": 0,  # ... while its own counts said the blocks were free
        }
        # asynchronous scheduling: the step whose KV writes have not landed (None: synchronous)
        self.inflight = InFlight(counters=self.counters) if config.async_scheduling else None
        if self.inflight is not None:
            self.counters.update(async_fences=0, async_freed=0, async_landed=0, async_mixed=0)
        # a host tier ([engine.offload]), where the manager offers it (else not applicable)
        self.tier: HostTier | None = None
        if config.offload is not None and "offload" in self.capabilities:
            self.counters.update(
                offload_stores=0, offload_restores=0, offload_fences=0, offload_refused=0
            )
            if "prefix_cache" in self.capabilities:  # a prefix hit on the host tier alone
                self.counters["offload_hit_loads"] = 0
            # (on CUDA the side stream's counts join the counters)
            self.tier = HostTier.build(
                self.kv_pools, self.bm.host_blocks, config.offload, self.counters
            )
        if "prefix_cache" in self.capabilities:  # (absent otherwise: histories as they were)
            self.counters.update(
                admissions=0,
                known_tokens=0,  # tokens known at admission (prompt; + output on readmission)
                hit_tokens=0,  # ... of which served from the prefix cache, not computed
                # answers over the cap: none run (the boundary's ManagerError); kept in the record
                hits_capped=0,
            )

    # -- requests ------------------------------------------------------------------------
    def _validate(self, request_id: str, tokens: list[int], max_new_tokens: int) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(f"request id must be a non-empty string, got {request_id!r}")
        if request_id in self.seqs:
            raise InvalidRequest(f"request {request_id!r}: duplicate request id")
        if not tokens:
            raise InvalidRequest(f"request {request_id!r}: empty prompt")
        vocab = self.config.model.vocab_size
        bad = [
            t for t in tokens if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
        ]
        if bad:
            raise InvalidRequest(
                f"request {request_id!r}: token {bad[0]!r} outside the vocabulary [0, {vocab})"
            )
        if (
            not isinstance(max_new_tokens, int)
            or isinstance(max_new_tokens, bool)
            or max_new_tokens <= 0
        ):
            raise InvalidRequest(
                f"request {request_id!r}: max_new_tokens must be a positive int, "
                f"got {max_new_tokens!r}"
            )
        total = len(tokens) + max_new_tokens
        if total > self.config.model.max_position:
            raise RequestRejected(
                f"request {request_id!r}: {total} tokens exceed the model's "
                f"{self.config.model.max_position} positions"
            )
        bs, table = self.bm.block_size, self.table.table
        blocks = -(-total // bs)
        usable = self.bm.num_blocks - len(self.reserved)
        if blocks > usable:
            raise RequestRejected(
                f"request {request_id!r}: needs {blocks} blocks, the pool has {usable}"
                + (f" usable ({len(self.reserved)} reserved)" if self.reserved else "")
            )
        if blocks > table.width:
            self.counters["overlong_requests"] += 1
        judged = blocks
        if self.seams.admission_blocks is not None:
            judged = self.seams.admission_blocks(total, len(tokens))
        if judged > table.width and self.seams.admission_check:
            if self.config.cache.overflow_policy == "resize":
                self.table.resize(width=blocks)
                self.counters["table_resizes"] += 1
            else:
                self.counters["overlong_rejected"] += 1
                raise RequestRejected(
                    f"request {request_id!r}: {total} tokens need {blocks} blocks, a table row "
                    f"holds {table.width} (max {table.width * bs} tokens per sequence)"
                )

    def add_request(self, request_id: str, prompt: list[int], max_new_tokens: int) -> None:
        """Queue a request. Raises InvalidRequest (malformed) or RequestRejected (429: can never
        fit); either way the engine is unchanged."""
        try:
            prompt = list(prompt)
        except TypeError:
            raise InvalidRequest(
                f"request {request_id!r}: prompt must be a list of token ids, got "
                f"{type(prompt).__name__}"
            ) from None
        self._validate(request_id, prompt, max_new_tokens)
        seq = Sequence(
            id=request_id, tokens=prompt, prompt_len=len(prompt), max_new_tokens=max_new_tokens
        )
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def fork(
        self, parent_id: str, child_id: str, max_new_tokens: int, extra_tokens: list[int] = ()
    ) -> None:
        """A new request continuing parent's tokens (plus extra_tokens). If the parent holds blocks,
        the child shares them (prefix sharing); copy-on-write keeps the two apart."""
        parent = self.seqs.get(parent_id)
        if parent is None or parent.done:
            raise InvalidRequest(f"fork: parent {parent_id!r} is not a live request")
        tokens = parent.tokens + list(extra_tokens)
        self._validate(child_id, tokens, max_new_tokens)
        child = Sequence(
            id=child_id,
            tokens=tokens,
            prompt_len=len(tokens),
            max_new_tokens=max_new_tokens,
            parent=parent_id,
        )
        can_share = "fork" in self.capabilities and self.table.num_free_rows > 0
        if parent.state is State.RUNNING and can_share:
            try:
                self.table.place(child_id)
                self.bm.fork(parent_id, child_id)
                self.table.sync(child_id)
                child.state, child.num_computed = State.RUNNING, parent.num_computed
                child.holds = True
                self.scheduler.start(child)
            except OutOfBlocks as no:  # no room to share: the child computes its tokens itself
                self.table.drop(child_id)
                self.refused("fork", child_id, 0, no)
        if child.state is State.WAITING:
            self.scheduler.add(child)
        self.seqs[child_id] = child

    def cancel(self, request_id: str) -> bool:
        """Cancel in any state. True if it was live; False (a no-op) if already finished or
        cancelled. Raises InvalidRequest for an id the engine never saw."""
        seq = self.seqs.get(request_id)
        if seq is None:
            raise InvalidRequest(f"cancel: unknown request id {request_id!r}")
        if seq.done:
            return False
        self.scheduler.remove(seq)
        if seq.holds:  # running, idle, stored out, or waiting for its KV to land
            self._release(seq, "cancel")
        seq.state = State.CANCELLED
        return True

    def _fail(self, seq: Sequence, err: RequestFailed) -> None:
        """The engine's abort of a request whose own work failed in the step: it ends in error
        and gives its blocks back ("error"), as every exit path does."""
        self.scheduler.remove(seq)
        seq.state = State.FAILED
        self.seams.on_event("request_failed", {"req": seq.id, "error": str(err)})
        self._release(seq, "error")

    def refused(self, call: str, seq_id: str, tokens: int, refusal=None) -> None:
        """Count a refusal ("no room"): the manager's answer, which the scheduler works around.
        A refusal must change nothing: what it changed all the same goes in the event."""
        # a fork asks for no new slots; growth asks the manager's own estimate
        free = self.bm.num_free_blocks
        needed = self.estimate(self.seqs[seq_id], tokens) if tokens else 0
        self.counters["refusals"] += 1
        self.counters["refusals_with_room"] += free >= needed
        data = {"call": call, "seq": seq_id, "tokens": tokens, "free": free, "needed": needed}
        changed = getattr(refusal, "changed", None)
        self.seams.on_event("refusal", {**data, "changed": changed} if changed else data)

    def admitted(self, seq: Sequence, known: int, answered: int, used: int) -> None:
        """Count an admission and its cache hit; a hit is an event naming the blocks it served."""
        c = self.counters
        if "admissions" in c:  # a manager offering a prefix cache
            c["admissions"] += 1
            c["known_tokens"] += known
            c["hit_tokens"] += used
            c["hits_capped"] += answered > used
        if answered:
            bs = self.bm.block_size
            blocks = list(self.bm.block_ids(seq.id)[: -(-used // bs)])
            c = self.tier.copies.get(seq.id) if self.tier is not None else None
            if c is not None:  # on the host tier alone: the copy in (offload_restore) names them
                loading = {b for _, b in c.pairs}
                blocks = [b for b in blocks if b not in loading]
            hit = {"req": seq.id, "known": known, "answered": answered, "used": used}
            self.seams.on_event("hit", {**hit, "capped": answered > used, "blocks": blocks})

    def estimate(self, seq: Sequence, n: int) -> int:
        """Free blocks n more tokens of seq should take: the manager's estimate where it gives
        one, else the blocks those positions add (the engine never asks about an unseen id)."""
        if self._estimates and seq.holds:
            return self.bm.blocks_needed(seq.id, n)
        bs, held = self.bm.block_size, seq.num_computed if seq.holds else 0
        return -(-(held + n) // bs) - -(-held // bs)

    def _release(self, seq: Sequence, why: str) -> None:
        """Every exit path of a sequence that holds blocks comes through here. why: the seam's
        name (finish, cancel, preempt, error); the manager is told the v2 reason."""
        if self.tier is not None:
            self._tier_release(seq, why)  # a copy in flight completes before its blocks go back
        if self.seams.free_on_exit(seq, why):
            if self.inflight is not None and self.inflight.wrote(seq.id):
                self._release_in_flight(seq, why)  # the step in flight still writes its blocks
            self.bm.release(seq.id, RELEASE_REASONS[why])
        seq.holds = False
        self.table.drop(seq.id)  # a skipped free leaks blocks; an engine-built row goes anyway

    def kernel_stride(self) -> int | None:
        """The stride the kernels read the flat table with, where it is not the table's width
        (None: they read the table as the host lays it out)."""
        ks = self.seams.kernel_stride
        return None if ks is None or ks == self.table.table.width else ks

    def snapshot(self):
        """The manager's snapshot; a table the engine builds replaces its table fields (an owned
        table is the manager's word about itself, judged as given)."""
        snap, t = self.bm.snapshot(), self.table
        if not t.owned:
            snap.table, snap.table_width = t.table.host.tolist(), t.table.width
            snap.seq_rows = dict(t.rows)
        if snap.reserved is None and self.reserved:  # its declared reserved ids, judged
            snap.reserved = list(self.reserved)
        return snap

    def preempted(self, seq: Sequence, why: str) -> None:
        """The scheduler preempted seq (why: "preempt", or "error" for a failed step): its blocks
        go back (with a host tier: stored out, restored when it runs again), and it is counted."""
        self.counters["preemptions"] += 1
        oc = self.config.offload
        if self.tier is not None and why == "preempt" and oc.preempt and seq.num_computed:
            self._tier_settle(seq)
            if self._tier_store(seq, "preempt"):
                return
        self._release(seq, why)

    # -- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> StepOutput:
        t0, c0 = time.perf_counter(), time.thread_time()
        self.step_count += 1
        self.scrambled_ranks = []
        self.step_copies = []
        if self.tier is not None:
            self._tier_tick()
        scheduler = self.scheduler
        decode, prefill, preempted = scheduler.schedule()
        if not decode and not prefill:
            self._complete()
            stats = self._stats(t0, c0, t0, t0, decode, prefill, preempted, [], computed=False)
            return StepOutput(stats, {}, {}, [])
        scheduled = decode + [s for s, _ in prefill]
        try:
            decode, prefill, copies = scheduler.reserve(decode, prefill, preempted)
            if not decode and not prefill:  # every reservation refused: nothing runs this step
                self._complete()
                stats = self._stats(t0, c0, t0, t0, [], [], preempted, [], computed=False)
                return StepOutput(stats, {}, {}, [])
            if copies:
                self._copy_blocks(copies)
            t_upload = time.perf_counter()
            stale = self._upload_table()
            t_prep = time.perf_counter()
            self._upload_s = t_prep - t_upload - self._calib_s
            tokens, positions, metas = self._build_batch(decode, prefill)
            t_host, self._host_cpu_s = time.perf_counter(), time.thread_time() - c0
            hidden = self.model.forward(tokens, positions, self._attend(len(decode), metas))
            if self.inflight is not None:
                self._went_in_flight(decode, prefill, metas)
            if self.tier is not None and (self.tier.copies or self.tier.kept):
                self._tier_reads(decode, prefill)
            # Sequences whose every token is now computed produce a token.
            emit: list[tuple[Sequence, int]] = [(s, i) for i, s in enumerate(decode)]
            off = len(decode)
            for s, n in prefill:
                off += n
                if s.uncomputed == n:
                    emit.append((s, off - 1))
            rows = [i for _, i in emit]
            if rows:  # decode rows come first: a pure decode step takes a view
                logits = self.model.logits(
                    hidden[: len(rows)] if rows[-1] == len(rows) - 1 else hidden[rows]
                )
        except BaseException:
            # Leave nothing half-done: the step's sequences give their blocks back ("error": the
            # step that reserved their last slots did not run) and recompute.
            for s in scheduled + scheduler.replanned:
                if s.state is State.RUNNING and s in scheduler.running:
                    scheduler.preempt(s, "error")
            raise
        for s in decode:
            s.num_computed += 1
        for s, n in prefill:
            s.num_computed += n
        if "end_step" in self.capabilities:
            self.bm.end_step({s.id: s.num_computed for s in (*decode, *(p for p, _ in prefill))})
        out_tokens, out_logits, finished, failed = {}, {}, [], []
        if emit:
            logits_cpu = logits.cpu()
            next_tokens = logits_cpu.argmax(-1).tolist()
            for (s, _), tok, row in zip(emit, next_tokens, logits_cpu):
                try:
                    self.seams.on_sample(s)
                except RequestFailed as err:  # its own error: the others' step goes on
                    self._fail(s, err)
                    failed.append(s.id)
                    continue
                s.tokens.append(tok)
                out_tokens[s.id], out_logits[s.id] = tok, row
                if s.num_generated >= s.max_new_tokens:
                    scheduler.remove(s)
                    s.state = State.FINISHED
                    self._release(s, "finish")
                    finished.append(s.id)
        stats = self._stats(t0, c0, t_prep, t_host, decode, prefill, preempted, stale)
        return StepOutput(stats, out_tokens, out_logits, finished, failed)

    def _stats(
        self, t0, c0, t_prep, t_host, decode, prefill, preempted, stale, computed=True
    ) -> StepStats:
        crcs, table_crc = (self._crcs, self._table_crc) if computed else ([], 0)
        calib = self._calib_s if computed else 0.0  # the staging calibration's, not the step's
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        return StepStats(
            step=self.step_count,
            latency_s=now - t0 - calib,
            host_s=t_host - t0 - calib,
            cpu_s=time.thread_time() - c0,
            host_cpu_s=max(0.0, self._host_cpu_s - calib) if computed else 0.0,
            prep_s=t_host - t_prep,
            upload_s=self._upload_s if computed else 0.0,
            stage_s=self._stage_s if computed else 0.0,
            probe_s=self._probe_s if computed else 0.0,
            free_blocks=self.bm.num_free_blocks,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            prefill_tokens=sum(n for _, n in prefill),
            decode_tokens=len(decode),
            preempted=preempted,
            table_version=self.table_version,
            stale_ranks=stale,
            rank_table_crcs=crcs,
            table_crc=table_crc,
            stale_tables=self._stale_tables if computed else [],
        )

    # -- lifecycle -----------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        # a step in flight with writes kept to land still has to complete
        return (
            self.scheduler.has_unfinished()
            or bool(self.inflight and self.inflight.early)
            or bool(self.tier and (self.tier.copies or self.tier.orphans))
        )

    def close(self) -> None:
        """Release every block still held (idempotent)."""
        self._complete()
        sched = self.scheduler
        # idle, stored out, or waiting for their KV to land: a waiting request may hold too
        held = [s for s in (*sched.idle, *sched.waiting) if s.holds]
        for s in list(sched.running) + held:
            if self.tier is not None:
                self._tier_settle(s)
            sched.remove(s)
            self.bm.release(s.id, "aborted")
            s.holds = False
            self.table.drop(s.id)
            s.state = State.CANCELLED

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
