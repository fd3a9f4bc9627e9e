"""The reference engine: continuous batching over a paged KV pool, greedy decoding.

One step = schedule (decode every running sequence, then prefill chunks within the token budget,
preempting by recompute when blocks run out) -> reserve slots -> upload the block table through
the staging buffer to every rank -> one model pass -> one token per sequence whose tokens are all
computed.
"""

from __future__ import annotations

import os
import time
import zlib
from collections import deque

import torch

from kvchaos.engine.attention import (
    DecodePlan,
    decode_blocks,
    decode_mask,
    paged_decode_torch,
    paged_prefill_torch,
    write_kv,
)
from kvchaos.engine.block_manager import BlockManager
from kvchaos.engine.boundary import Boundary
from kvchaos.engine.config import EngineConfig
from kvchaos.engine.errors import InvalidRequest, OutOfBlocks, RequestRejected
from kvchaos.engine.model import Model
from kvchaos.engine.protocols import BlockManagerProtocol, capabilities
from kvchaos.engine.ranks import RankGroup
from kvchaos.engine.scheduler import reserve, schedule
from kvchaos.engine.seams import Seams
from kvchaos.engine.sequence import Sequence, State, StepOutput, StepStats
from kvchaos.engine.staging import StagingBuffer
from kvchaos.engine.tables import OwnedTable


def _decode_backend(name: str):
    if name == "triton":
        from kvchaos.engine.triton_decode import paged_decode_triton

        return paged_decode_triton
    return paged_decode_torch


class Engine:
    def __init__(
        self, config: EngineConfig, block_manager: BlockManagerProtocol | None = None
    ) -> None:
        self.config = config
        mc, cc = config.model, config.cache
        self.device = torch.device(config.device)
        self.model = Model(mc, config.seed, self.device)
        manager = (
            block_manager
            if block_manager is not None
            else BlockManager(cc.num_blocks, cc.block_size, cc.max_num_seqs, cc.max_blocks_per_seq)
        )
        if not isinstance(manager, BlockManagerProtocol):
            raise TypeError(
                f"{type(manager).__name__} does not implement "
                "kvchaos.engine.protocols.BlockManagerProtocol"
            )
        self.bm = Boundary(manager)  # every call into the manager recorded and guarded
        self.table = OwnedTable(self.bm)  # a v1 manager writes the table the kernels read
        self.capabilities = capabilities(manager)
        self.record_writes = False  # the harness asks: blocks written per sequence, each step
        self.written: dict[str, dict[int, set[int]]] = {}  # seq -> block -> ranks writing it
        self.seams = Seams()
        self.watermark_blocks = int(cc.watermark * self.bm.num_blocks)
        self.decode_attention = _decode_backend(config.resolved_backend())
        tp = config.tp_size
        self.kv_heads_per_rank = mc.num_kv_heads // tp
        # One pool per rank: [layers, K/V, blocks, block_size, kv_heads / tp, head_dim]
        self.kv_pools = [
            torch.zeros(
                mc.num_layers,
                2,
                self.bm.num_blocks,
                self.bm.block_size,
                self.kv_heads_per_rank,
                mc.head_dim,
                dtype=mc.torch_dtype,
                device=self.device,
            )
            for _ in range(tp)
        ]
        self._kv_views = [
            [(pool[layer, 0], pool[layer, 1]) for layer in range(mc.num_layers)]
            for pool in self.kv_pools
        ]
        self.ranks = RankGroup(tp, self.device)
        self._pinned = self.device.type == "cuda"
        self.staging = StagingBuffer(self.table.table.host_tensor.numel(), self._pinned)
        self.seqs: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.step_count = 0
        self.table_version = 0
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
        if blocks > self.bm.num_blocks:
            raise RequestRejected(
                f"request {request_id!r}: needs {blocks} blocks, the pool has {self.bm.num_blocks}"
            )
        if blocks > table.width:
            self.counters["overlong_requests"] += 1
        if blocks > table.width and self.seams.admission_check:
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
        seq = Sequence(request_id, prompt, len(prompt), max_new_tokens, self.step_count)
        self.seqs[request_id] = seq
        self.waiting.append(seq)

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
            child_id, tokens, len(tokens), max_new_tokens, self.step_count, parent=parent_id
        )
        can_share = "fork" in self.capabilities and self.table.num_free_rows > 0
        if parent.state is State.RUNNING and can_share:
            try:
                self.table.place(child_id)
                self.bm.fork(parent_id, child_id)
                self.table.sync(child_id)
                child.state, child.num_computed = State.RUNNING, parent.num_computed
                self.running.append(child)
            except OutOfBlocks as no:  # no room to share: the child computes its tokens itself
                self.table.drop(child_id)
                self.refused("fork", child_id, 0, no)
        if child.state is State.WAITING:
            self.waiting.append(child)
        self.seqs[child_id] = child

    def cancel(self, request_id: str) -> bool:
        """Cancel in any state. True if it was live; False (a no-op) if already finished or
        cancelled. Raises InvalidRequest for an id the engine never saw."""
        seq = self.seqs.get(request_id)
        if seq is None:
            raise InvalidRequest(f"cancel: unknown request id {request_id!r}")
        if seq.done:
            return False
        if seq.state is State.RUNNING:
            self.running.remove(seq)
            self._release(seq, "cancel")
        else:
            self.waiting.remove(seq)
        seq.state = State.CANCELLED
        return True

    def refused(self, call: str, seq_id: str, tokens: int, refusal=None) -> None:
        """Count a refusal ("no room"): the manager's answer, which the scheduler works around.
        A refusal must change nothing: what it changed all the same goes in the event."""
        # a fork asks for no new slots; growth asks the manager's own estimate
        free = self.bm.num_free_blocks
        needed = self.bm.blocks_needed(seq_id, tokens) if tokens else 0
        self.counters["refusals"] += 1
        self.counters["refusals_with_room"] += free >= needed
        data = {"call": call, "seq": seq_id, "tokens": tokens, "free": free, "needed": needed}
        changed = getattr(refusal, "changed", None)
        self.seams.on_event("refusal", {**data, "changed": changed} if changed else data)

    def _release(self, seq: Sequence, reason: str) -> None:
        """Every exit path of a sequence that holds blocks comes through here."""
        if self.seams.free_on_exit(seq, reason):
            self.bm.free(seq.id)
        self.table.drop(seq.id)  # a skipped free leaks blocks; an engine-built row goes anyway

    def snapshot(self):
        """The manager's snapshot; a table the engine builds replaces its table fields (an owned
        table is the manager's word about itself, judged as given)."""
        snap, t = self.bm.snapshot(), self.table
        if not t.owned:
            snap.table, snap.table_width = t.table.host.tolist(), t.table.width
            snap.seq_rows = dict(t.rows)
        return snap

    # -- scheduling ----------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq, "preempt")
        seq.state, seq.num_computed = State.PREEMPTED, 0
        self.waiting.appendleft(seq)
        self.counters["preemptions"] += 1

    # -- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> StepOutput:
        t0, c0 = time.perf_counter(), time.thread_time()
        self.step_count += 1
        decode, prefill, preempted = schedule(self)
        while not decode and not prefill and len(self.running) > 1:
            # Every running sequence is stuck mid-prefill on a full pool: free the newest.
            victim = self.running[-1]
            self._preempt(victim)
            d, prefill, p = schedule(self)
            decode, preempted = d, preempted + [victim.id] + p
        if not decode and not prefill:
            stats = self._stats(t0, c0, t0, t0, decode, prefill, preempted, [], computed=False)
            return StepOutput(stats, {}, {}, [])
        scheduled = decode + [s for s, _ in prefill]
        try:
            decode, prefill, copies = reserve(self, decode, prefill, preempted)
            if not decode and not prefill:  # every reservation refused: nothing runs this step
                stats = self._stats(t0, c0, t0, t0, [], [], preempted, [], computed=False)
                return StepOutput(stats, {}, {}, [])
            if copies:
                self._copy_blocks(copies)
            t_upload = time.perf_counter()
            stale = self._upload_table()
            t_prep = time.perf_counter()
            self._upload_s = t_prep - t_upload
            tokens, positions, metas = self._build_batch(decode, prefill)
            t_host = time.perf_counter()
            hidden = self.model.forward(tokens, positions, self._attend(len(decode), metas))
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
            # Leave nothing half-done: the step's sequences give their blocks back and recompute.
            for s in scheduled:
                if s.state is State.RUNNING and s in self.running:
                    self._preempt(s)
            raise
        for s in decode:
            s.num_computed += 1
        for s, n in prefill:
            s.num_computed += n
        out_tokens, out_logits, finished = {}, {}, []
        if emit:
            logits_cpu = logits.cpu()
            next_tokens = logits_cpu.argmax(-1).tolist()
            for (s, _), tok, row in zip(emit, next_tokens, logits_cpu):
                s.tokens.append(tok)
                out_tokens[s.id], out_logits[s.id] = tok, row
                if s.num_generated >= s.max_new_tokens:
                    s.state = State.FINISHED
                    self.running.remove(s)
                    self._release(s, "finish")
                    finished.append(s.id)
        stats = self._stats(t0, c0, t_prep, t_host, decode, prefill, preempted, stale)
        return StepOutput(stats, out_tokens, out_logits, finished)

    def _stats(
        self, t0, c0, t_prep, t_host, decode, prefill, preempted, stale, computed=True
    ) -> StepStats:
        crcs, table_crc = (self._crcs, self._table_crc) if computed else ([], 0)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        return StepStats(
            step=self.step_count,
            latency_s=now - t0,
            host_s=t_host - t0,
            cpu_s=time.thread_time() - c0,
            prep_s=t_host - t_prep,
            upload_s=self._upload_s if computed else 0.0,
            free_blocks=self.bm.num_free_blocks,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            prefill_tokens=sum(n for _, n in prefill),
            decode_tokens=len(decode),
            preempted=preempted,
            table_version=self.table_version,
            stale_ranks=stale,
            rank_table_crcs=crcs,
            table_crc=table_crc,
            stale_tables=self._stale_tables if computed and stale else [],
        )

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for pool in self.kv_pools:
            pool[:, :, dst] = pool[:, :, src]
        self.counters["cow_copies"] += len(copies)
        self.seams.on_event("cow", {"copies": copies})

    def _upload_table(self) -> list[int]:
        """host table -> staging -> every rank. Returns the ranks left on an old version."""
        host = self.table.table.host_tensor
        if self.staging.tensor.numel() != host.numel():
            self.staging = StagingBuffer(host.numel(), self._pinned)
        elif self.seams.staging_check and not self.staging.valid():
            self.staging = StagingBuffer(host.numel(), self._pinned)
            self.counters["staging_reallocs"] += 1
            self.seams.on_event("staging_realloc", {"pid": os.getpid()})
        staged = self.staging.stage(host)
        self.seams.on_upload()
        self.table_version += 1
        self.ranks.publish(staged, self.table_version, self.step_count, self.seams.rank_delay)
        self.ranks.deliver(self.step_count)
        if self.seams.rank_sync:
            self.counters["rank_sync_waits"] += self.ranks.sync()
        if len(self.ranks.ranks) > 1:  # what each rank computes with vs what the scheduler uploaded
            self._crcs = [r.crc() for r in self.ranks.ranks]
            self._table_crc = zlib.crc32(memoryview(self.table.table.host))
        else:
            self._crcs, self._table_crc = [], 0
        stale = [r for r in self.ranks.ranks if r.version != self.table_version]
        self.counters["stale_rank_computes"] += len(stale)
        # the engine's own record of a stale read that matters: an old table with other content
        self._stale_tables = [
            r.index
            for r in stale
            if r.content().shape != staged.shape or not torch.equal(r.content(), staged)
        ]
        return [r.index for r in stale]

    def _batch_inputs(self, decode: list[Sequence], prefill: list[tuple[Sequence, int]]):
        """Each sequence's table row, and the step's token ids and positions (decode first)."""
        rows = self.table.rows
        tok, pos = [], []
        for s in decode:
            tok.append(s.tokens[-1])
            pos.append(s.num_computed)
        for s, n in prefill:
            tok += s.tokens[s.num_computed : s.num_computed + n]
            pos += range(s.num_computed, s.num_computed + n)
        return rows, tok, pos

    def _build_batch(self, decode: list[Sequence], prefill: list[tuple[Sequence, int]]):
        """Token ids, positions and, per rank, the slot mapping and attention tables, all read
        through that rank's own copy of the flat table."""
        bs, width = self.bm.block_size, self.table.table.width
        rows, tok, pos = self._batch_inputs(decode, prefill)
        dev = self.device
        nt, nd = len(tok), len(decode)
        dec_pos = pos[:nd]
        # Decode metadata in one host -> device copy. Entry (row, j) of the flat table is
        # row * width + j: base is each decode row's entry 0, ent the entry holding the token's
        # block, off the token's offset in that block.
        bases = [rows[s.id] * width for s in decode]
        ent = [b + p // bs for b, p in zip(bases, dec_pos)]
        meta = torch.tensor(
            tok + pos + [p + 1 for p in dec_pos] + bases + ent + [p % bs for p in dec_pos],
            device=dev,
        )
        tokens, positions = meta[:nt], meta[nt : 2 * nt]
        max_len = max(dec_pos) + 1 if nd else 0
        if nd:
            dec_lens, dec_base, dec_ent, dec_off = meta[2 * nt :].view(4, nd).unbind()
            torch_path = self.decode_attention is paged_decode_torch
            if (
                torch_path
            ):  # the mask every rank and layer shares (None when all rows are max_len long)
                mask = decode_mask(dec_lens, max_len, min(dec_pos) + 1)
            else:  # the kernel's dtype, converted once per step rather than per layer
                dec_lens = dec_lens.to(torch.int32)
            nblk_dec = -(-max_len // bs)
            dec_idx = torch.add(dec_base.unsqueeze(1), self._arange(nblk_dec)).view(
                -1
            )  # [nd * nblk_dec] entries
            hi = max(bases) + nblk_dec - 1  # the largest entry read (every ent is <= it)
        metas = []
        for rank in self.ranks.ranks:
            flat = rank.table
            last = flat.numel() - 1
            slots, dec_tables, plan, chunks = [], None, None, []
            if nd:  # flat addressing: an overlong row reads on into the next one, as a kernel would
                di, de = (
                    (dec_idx, dec_ent)
                    if hi <= last
                    else (dec_idx.clamp(max=last), dec_ent.clamp(max=last))
                )
                dec_tables = flat.index_select(0, di).view(nd, nblk_dec)
                slots.append(
                    torch.add(dec_off, flat.index_select(0, de), alpha=bs)
                )  # block * bs + offset, int64
                if torch_path:
                    plan = DecodePlan(decode_blocks(dec_tables, bs, max_len), max_len, mask)
            off = nd
            for s, n in prefill:
                start = s.num_computed
                nblk = -(-(start + n) // bs)
                trow = flat[(rows[s.id] * width + torch.arange(nblk, device=dev)).clamp_(max=last)]
                p = positions[off : off + n]
                slots.append(trow[p // bs].long() * bs + p % bs)
                chunks.append((off, n, start, trow))
                off += n
            metas.append(
                (torch.cat(slots) if len(slots) > 1 else slots[0], dec_tables, plan, chunks)
            )
        if self.record_writes:
            self._record_writes(decode, prefill, [m[0] for m in metas])
        self._dec_lens, self._dec_max_len = (dec_lens if nd else None), max_len
        return tokens, positions, metas

    def _record_writes(self, decode, prefill, slots_by_rank: list[torch.Tensor]) -> None:
        """The blocks each rank's writes land in, by sequence (the harness's record)."""
        bs, nb = self.bm.block_size, self.bm.num_blocks
        ids = [s.id for s in decode] + [s.id for s, n in prefill for _ in range(n)]
        self.written = {}
        for rank, slots in enumerate(slots_by_rank):
            for seq_id, block in zip(ids, (slots // bs).tolist()):
                # an unused entry (-1) lands in the last block
                self.written.setdefault(seq_id, {}).setdefault(block % nb, set()).add(rank)

    def _arange(self, n: int) -> torch.Tensor:
        """torch.arange(n) on the engine's device, cached (a view of a longer one)."""
        ar = getattr(self, "_arange_cache", None)
        if ar is None or ar.numel() < n:
            ar = self._arange_cache = torch.arange(max(2 * n, 64), device=self.device)
        return ar[:n]

    def _attend(self, nd: int, metas):
        scale, decode_attention = self.model.scale, self.decode_attention
        hkv_r = self.kv_heads_per_rank
        h_r = hkv_r * (self.config.model.num_heads // self.config.model.num_kv_heads)
        kv_views, dec_lens = self._kv_views, self._dec_lens
        max_len = self._dec_max_len  # int(dec_lens.max()), known on the host
        tp = len(metas)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outs = []
            for r, (slots, dec_tables, plan, chunks) in enumerate(metas):
                kc, vc = kv_views[r][layer]
                qr, kr, vr = (
                    (q, k, v)
                    if tp == 1
                    else (
                        q[:, r * h_r : (r + 1) * h_r],
                        k[:, r * hkv_r : (r + 1) * hkv_r],
                        v[:, r * hkv_r : (r + 1) * hkv_r],
                    )
                )
                write_kv(kc, vc, slots, kr, vr)
                parts = []
                if nd:
                    parts.append(
                        decode_attention(
                            qr[:nd] if chunks else qr,
                            kc,
                            vc,
                            dec_tables,
                            dec_lens,
                            scale,
                            max_len,
                            plan=plan,
                        )
                    )
                for off, n, start, trow in chunks:
                    parts.append(paged_prefill_torch(qr[off : off + n], kc, vc, trow, start, scale))
                outs.append(parts[0] if len(parts) == 1 else torch.cat(parts))
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

        return attend

    # -- lifecycle -----------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def close(self) -> None:
        """Release every block still held (idempotent)."""
        for s in list(self.running):
            self.running.remove(s)
            self.bm.free(s.id)
            self.table.drop(s.id)
            s.state = State.CANCELLED

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
