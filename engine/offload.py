"""A host KV tier (`[engine.offload]`), as vLLM's KV offloading connector and SGLang's
hierarchical cache: a second, larger pool in host memory (pinned on CUDA, plain on the CPU) per
rank, same layout as the device pool. Preempted requests are stored out instead of recomputed,
and cold ones (idle `cold_steps` steps) are stored out; both are restored when they run again.
The manager places blocks on either tier (capability "offload", docs/protocol-v2.md section 10);
the engine copies and keeps the tier map beside the table (each logical block of a sequence:
device, host, or in flight). The kernels only ever read device-tier blocks: a sequence is
scheduled once its restore completed.

Copies are asynchronous with completion per block: on the CPU deferred by the step count, no
thread, so a seed gives the same history byte for byte; on CUDA on a side stream, each block's
event waited for (engine/tier_stream.py). A copy's blocks are due `latency_steps` after it is
issued; with a bandwidth (`blocks_per_step`, shared by the copies in issue order) they land in
order over several steps, each its own due step, and the tier map follows each block (flight,
then host or device). A store reads the device blocks when it is issued (as a DMA on a side
stream would); once its last block landed the manager frees the device blocks (`offload_done`).
A preemption's store completes at once (the scheduler needs the room now: the engine waits for
it). A restore writes each device block when it lands; the request is scheduled once the last
did. Every copy records a CRC of each block it read and, as each lands, of each block it wrote or
left (the checkers compare them, block by block).

Seams (faults/offload.py, faults/async_free.py): `store_early` (the store reads blocks the step
in flight still writes, under async scheduling: the remediation waits for that step),
`restore_flip` (the sequence computes on its restored blocks before the copy completed: with
a bandwidth, once its first block landed, before the last) and
`free_loading` (a request released while its restore is in flight: the load lands later, into
blocks handed on) and `stale_host` (a restored request's host copy of a block stays valid after
the block is written: its next store skips it, as a write-back cache that misses a dirty bit).

The events of the history (engine events, built by keyword here): `offload_store`,
`offload_restore`, `offload_landed`, `offload_late`, `offload_tier` (occupancy and traffic, each
step)."""

from __future__ import annotations

import zlib
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.offload_events import (
    OffloadLanded,
    OffloadLate,
    OffloadRestore,
    OffloadStore,
    OffloadTier,
    Pause,
    Resume,
    Why,
)
from kvchaos.engine.sequence import State

if TYPE_CHECKING:  # the harness's events import this module: a command starts without torch
    import torch


@dataclass(kw_only=True)
class Copy:
    kind: Literal["store", "restore"]
    req: str
    pairs: list[tuple[int, int]]
    issued: int
    dues: list[int]  # each block's due step, in logical order (never decreasing)
    done: int = 0  # blocks landed (the first `done`)
    flip: bool = False  # (seam restore_flip, with a bandwidth) the table flips at a first landing
    marks: list = field(default_factory=list)  # CUDA: each block's event on the side stream
    # a restore: each landed block's host copy as it was read (logical block -> per rank), kept
    # valid once the copy completed
    read: dict[int, list] = field(default_factory=dict)
    hit: bool = False  # a prefix hit's blocks loaded (the sequence holds its other blocks)

    @property
    def due(self) -> int:
        """The step its last block is due."""
        return self.dues[-1] if self.dues else self.issued


@dataclass(kw_only=True)
class HostTier:
    """The host pools, the copies in flight and the tier map."""

    pools: list[torch.Tensor]  # per rank: [layers, K/V, host_blocks, block_size, heads, dim]
    latency: int
    bandwidth: int = 0  # blocks landing per step, shared in issue order; 0: unlimited
    booked: dict[int, int] = field(default_factory=dict)  # step -> blocks due in it
    side: object = None  # CUDA: the copy stream (tier_stream.SideStream); None on the CPU
    copies: dict[str, Copy] = field(default_factory=dict)  # one copy in flight per sequence
    tiers: dict[str, list[list]] = field(default_factory=dict)  # seq -> [tier, id] per block
    traffic: dict[str, int] = field(default_factory=lambda: {"stored": 0, "restored": 0})
    # loads of released requests still in flight: (copy, the host content it reads, per rank)
    orphans: list[tuple[Copy, list]] = field(default_factory=list)
    late: list[OffloadLate] = field(default_factory=list)  # every such load landed, in the run
    # restored sequences' host copies kept valid (write-back avoidance, as a hierarchical cache
    # keeps them): seq -> logical block -> its content per rank; a block written since drops out
    kept: dict[str, dict[int, list]] = field(default_factory=dict)
    reused: list[tuple[str, list[int]]] = field(default_factory=list)  # this step's stores'
    # this step: sequences computed while their restore was in flight (req, blocks, issued)
    reads: list[tuple[str, list[int], int]] = field(default_factory=list)
    # every device block a copy in wrote, in the run (step, req, blocks, "restore" | "hit" |
    # "late"): a restore's or a hit's load landing, or a released request's load landing late
    # (writes no batch records; in logical order)
    landings: list[tuple[int, str, list[int], str]] = field(default_factory=list)

    @classmethod
    def build(cls, device_pools: list, host_blocks: int, oc, counters: dict) -> HostTier:
        """The host pools (host_blocks, the manager's); on CUDA the side stream too (its counts
        go in `counters`). oc: the [engine.offload] config (its latency and bandwidth)."""
        import torch

        pools = []
        for p in device_pools:
            shape = (*p.shape[:2], host_blocks, *p.shape[3:])
            pin = p.device.type == "cuda"  # pinned for the asynchronous copy; plain on the CPU
            pools.append(torch.zeros(shape, dtype=p.dtype, device="cpu", pin_memory=pin))
        side = None
        if device_pools and device_pools[0].device.type == "cuda":
            from kvchaos.engine.tier_stream import SideStream

            side = SideStream(device_pools[0].device, counters)
        return cls(pools=pools, latency=oc.latency_steps, bandwidth=oc.blocks_per_step, side=side)

    def book(self, n: int, start: int, now: int, skip: set | None = None) -> list[int]:
        """n blocks' due steps from `start`: unlimited, all at start; else each the earliest
        step with bandwidth left after the blocks booked before it (first in, first out), and
        a block not copied (skip: its host copy kept) due with the block before it (or `now`).
        A copy completed early (the engine waited for it) keeps its bookings: no later copy
        overtakes an earlier one."""
        if not self.bandwidth:
            return [start] * n
        dues, s, prev = [], start, now
        for i in range(n):
            if skip and i in skip:
                dues.append(prev)
                continue
            while self.booked.get(s, 0) >= self.bandwidth:
                s += 1
            self.booked[s] = self.booked.get(s, 0) + 1
            dues.append(s)
            prev = s
        return dues


def crc(pools: list, index: int) -> int:
    """One block's content on every rank, chained (the device pool's or the host's)."""
    c = 0
    for p in pools:
        c = zlib.crc32(p[:, :, at(p, index)].contiguous().cpu().numpy().tobytes(), c)
    return c


def at(pool, block):
    """A device block's index in a pool: one past a pool sized short (a planted geometry defect,
    engine/geometry.py) wraps to its start, as the kernels' raw addresses do; else itself."""
    return block % pool.shape[2]


class TierSteps:
    """The Engine's half of the host tier (a mixin: self is the Engine)."""

    def _tier_store(self, seq, why: Why) -> bool:
        """Store seq's blocks out (its copy issued now). False: the host tier had no room (the
        sequence stays on the device; a preemption then releases it as without the tier)."""
        tier, step = self.tier, self.step_count
        fenced = False
        early: list[tuple[int, int]] = []  # (rank, slot) the step in flight still writes
        f = self.inflight
        if f is not None and f.wrote(seq.id):
            if self.seams.store_early(seq, why):
                early = [(w[0], w[3]) for w in f.writes[seq.id]]
            else:  # the remediation: the store waits for the step that last wrote the blocks
                self._complete()
                fenced = True
                self.counters["offload_fences"] += 1
        try:
            pairs = self.bm.offload_store(seq.id, seq.num_computed)
        except OutOfBlocks:
            self.counters["offload_refused"] += 1
            return False
        bs = self.bm.block_size
        kept = tier.kept.pop(seq.id, {})  # still valid on the host: not copied again
        n = len(pairs)
        dues = (
            [step] * n if why == "preempt" else tier.book(n, step + tier.latency, step, set(kept))
        )
        c = Copy(kind="store", req=seq.id, pairs=pairs, issued=step, dues=dues)
        if tier.side is not None:  # CUDA: on the side stream, after the step's writes unless early
            wrapped = [(at(self.kv_pools[0], b), h) for b, h in pairs]
            c.marks = tier.side.store(wrapped, self.kv_pools, tier.pools, set(kept), not early)
            tier.side.host_wait(c.marks)  # what it read, for the record (and the slots below)
        for rank, (dev, host) in enumerate(zip(self.kv_pools, tier.pools)):
            for i, (b, s) in enumerate(pairs):
                if i in kept:
                    host[:, :, s] = kept[i][rank]
                elif tier.side is None:
                    host[:, :, s] = dev[:, :, at(dev, b)]
            for r, slot in early:  # read before those writes landed: what the slot held before
                if r == rank and any(b == slot // bs for b, _ in pairs):
                    s = dict(pairs)[slot // bs]
                    host[:, :, s, slot % bs] = 0
        if kept:
            tier.reused.append((seq.id, sorted(i for i in kept if i < len(pairs))))
        tier.copies[seq.id] = c
        tier.tiers[seq.id] = [["flight", b, s] for b, s in pairs]
        seq.tier = "storing"
        ev = OffloadStore(
            req=seq.id,
            why=why,
            pairs=[[b, s] for b, s in pairs],
            due=c.due,
            crcs=[crc(tier.pools, s) for _, s in pairs],
            fenced=fenced,
        )
        if tier.bandwidth:
            ev["dues"] = dues
        self.counters["offload_stores"] += 1
        self.seams.on_event("offload_store", dict(ev))
        if c.dues[0] <= step:  # (a preemption's, or blocks whose host copy was kept)
            self._tier_land(c)
        return True

    def _tier_restore(self, seq) -> bool:
        """Issue seq's restore (new device blocks from the manager). False: no room yet."""
        try:
            self.table.place(seq.id)
            pairs = self.bm.offload_restore(seq.id)
        except OutOfBlocks:
            self.table.drop(seq.id)
            return False
        self.table.sync(seq.id)
        self._tier_load(seq, pairs, hit=False)
        self.counters["offload_restores"] += 1
        return True

    def tier_hits(self, seq) -> int:
        """Right after seq's admission: the blocks of its prefix hit found on the host tier alone
        (offload_hits) are copied in, and it waits, holding its blocks, until they land. Returns
        the steps it waits (0: no such hit, or (seam restore_flip) it runs at once)."""
        if "prefix_cache" not in self.capabilities:
            return 0
        pairs = self.bm.offload_hits(seq.id)
        if not pairs:
            return 0
        c = self._tier_load(seq, pairs, hit=True)
        self.counters["offload_hit_loads"] += 1
        if seq.tier == "device":  # flipped at once
            return 0
        # (the scheduler waits while it is restoring; flipped at a first landing: from then)
        return (c.dues[0] if c.flip else c.due) - self.step_count

    def _tier_load(self, seq, pairs: list, hit: bool) -> Copy:
        """A copy in from the host tier issued: a restore's, or a prefix hit's (hit)."""
        tier, step = self.tier, self.step_count
        dues = tier.book(len(pairs), step + tier.latency, step)
        c = Copy(kind="restore", req=seq.id, pairs=pairs, issued=step, dues=dues, hit=hit)
        tier.copies[seq.id] = c
        if tier.side is not None:  # CUDA: on the side stream now, each block's event awaited
            wrapped = [(h, at(self.kv_pools[0], b)) for h, b in pairs]
            c.marks = tier.side.restore(wrapped, self.kv_pools, tier.pools)
        tier.tiers[seq.id] = [["flight", b, s] for s, b in pairs]
        flipped = bool(self.seams.restore_flip(seq))
        # with a bandwidth the defect flips the table once the first block landed (a copy's
        # completion taken from its first block), before the last
        c.flip = flipped and bool(tier.bandwidth)
        seq.tier = "device" if flipped and not c.flip else "restoring"
        ev = OffloadRestore(
            req=seq.id,
            pairs=[[s, b] for s, b in pairs],
            due=c.due,
            crcs=[crc(tier.pools, s) for s, _ in pairs],
            flipped=flipped,
        )
        if hit:
            ev["hit"] = True
        if tier.bandwidth:
            ev["dues"] = dues
        self.seams.on_event("offload_restore", dict(ev))
        return c

    def _tier_land(self, c: Copy, every: bool = False) -> None:
        """c's blocks due by this step land, in order (every: all those left, the engine waits
        for the copy): a restore writes their device blocks, the tier map names their tier. Once
        the last landed the copy completed: the manager is told (offload_done)."""
        tier, seq, step = self.tier, self.seqs[c.req], self.step_count
        first, n = c.done, len(c.pairs)
        k = n if every else max(first, bisect_right(c.dues, step))
        if k == first:
            return
        done = k == n
        if done and tier.copies.get(c.req) is c:
            del tier.copies[c.req]
        part, c.done = c.pairs[first:k], k
        if c.kind == "restore":
            if tier.side is not None:  # the kernels read them after their copies, not before
                tier.side.compute_wait(c.marks[first:k])
            else:
                for dev, host in zip(self.kv_pools, tier.pools):
                    for s, b in part:
                        dev[:, :, at(dev, b)] = host[:, :, s]
            how = "hit" if c.hit else "restore"
            tier.landings.append((step, c.req, [b for _, b in part], how))
            if not c.hit:  # its own host copy, kept valid once done (a hit's: the cache's)
                for i in range(first, k):
                    c.read[i] = [h[:, :, c.pairs[i][0]].clone() for h in tier.pools]
                if done:
                    tier.kept[c.req] = c.read
        written = [b for b, _ in part] if c.kind == "store" else [b for _, b in part]
        ev = OffloadLanded(
            req=c.req,
            kind=c.kind,
            issued=c.issued,
            pairs=[list(p) for p in part],
            crcs=[crc(self.kv_pools, b) for b in written],
        )
        if done:
            self.bm.offload_done(c.req)
        row = tier.tiers.get(c.req)
        if c.kind == "store":
            tier.traffic["stored"] += len(part)
            if done:
                self.table.drop(c.req)
                tier.tiers[c.req] = [["host", s] for _, s in c.pairs]
                seq.tier = "host"
            elif row is not None:
                row[first:k] = [["host", s] for _, s in part]
        else:
            tier.traffic["restored"] += len(part)
            if done:
                tier.tiers.pop(c.req, None)  # on the device alone, as every other sequence
                seq.tier = "device"
            elif row is not None:
                row[first:k] = [["device", b] for _, b in part]
                if c.flip:  # the defect: its table flipped, it runs on the blocks still in flight
                    seq.tier = "device"
        self.seams.on_event("offload_landed", dict(ev))

    def _tier_reads(self, decode: list, prefill: list) -> None:
        """Note the step's sequences computed on blocks whose restore is still in flight (the
        kernels read them: what the harness checks the tier map against)."""
        copies, kept, bs = self.tier.copies, self.tier.kept, self.bm.block_size
        for s, n in (*((d, 1) for d in decode), *prefill):
            c = copies.get(s.id)
            if c is not None and c.kind == "restore":  # the blocks not landed yet
                self.tier.reads.append((s.id, [b for _, b in c.pairs[c.done :]], c.issued))
            mine = kept.get(s.id)
            if mine:  # blocks written now: their host copies are stale (the remediation drops them)
                first = s.num_computed // bs
                written = [i for i in range(first, (s.num_computed + n - 1) // bs + 1) if i in mine]
                if written and not self.seams.stale_host(s, written):
                    for i in written:
                        del mine[i]

    def _tier_release(self, seq, why: str) -> None:
        """seq's blocks go back: its copy in flight completes first (the remediation), or (seam
        free_loading) a restore in flight is left to land later, after the next step."""
        tier = self.tier
        c = tier.copies.get(seq.id)
        if c is not None and c.kind == "restore" and self.seams.free_loading(seq, why):
            del tier.copies[seq.id]
            left, bw = c.pairs[c.done :], tier.bandwidth  # (a partial restore: those not landed)
            # they land once the next step computed (with a bandwidth, in order from then)
            dues = [self.step_count + 1 + (i // bw if bw else 0) for i in range(len(left))]
            late = Copy(kind="restore", req=c.req, pairs=left, issued=c.issued, dues=dues)
            tier.orphans.append((late, [h[:, :, [s for s, _ in left]].clone() for h in tier.pools]))
        else:
            self._tier_settle(seq)
        tier.tiers.pop(seq.id, None)
        tier.kept.pop(seq.id, None)
        seq.tier = "device"

    def _tier_orphans(self) -> None:
        """Loads of released requests land: into blocks their request no longer holds."""
        from kvchaos.engine.inflight import holders

        tier, step, keep = self.tier, self.step_count, []
        for c, content in tier.orphans:
            first, k = c.done, bisect_right(c.dues, step)
            if k < len(c.pairs):
                keep.append((c, content))
            if k <= first:
                continue
            c.done, blocks = k, [b for _, b in c.pairs[first:k]]
            for dev, kv in zip(self.kv_pools, content):
                into = [at(dev, b) for b in blocks]
                dev[:, :, into] = kv if (first, k) == (0, len(c.pairs)) else kv[:, :, first:k]
            tier.landings.append((step, c.req, blocks, "late"))
            held = {str(b): holders(self.table, b) for b in blocks}
            ev = OffloadLate(req=c.req, issued=c.issued, blocks=blocks, holders=held)
            tier.late.append(ev)
            self.seams.on_event("offload_late", dict(ev))
        tier.orphans = keep

    def _tier_settle(self, seq) -> None:
        """seq leaves (or is stored) while its copy is in flight: the copy completes first."""
        c = self.tier.copies.get(seq.id)
        if c is not None:
            self.counters["offload_fences"] += 1
            self._tier_land(c, every=True)

    def _tier_tick(self) -> None:
        """The step's start: due copies complete, cold sequences are stored out, waiting stored
        sequences restored (in queue order, while there is room), then the tier's telemetry."""
        tier, step, sched = self.tier, self.step_count, self.scheduler
        tier.traffic, tier.reads, tier.reused = {"stored": 0, "restored": 0}, [], []
        if tier.booked:  # steps gone by
            tier.booked = {s: n for s, n in tier.booked.items() if s >= step}
        for c in [c for c in tier.copies.values() if c.dues[c.done] <= step]:
            self._tier_land(c)
        if tier.orphans:
            self._tier_orphans()
        cold = self.config.offload.cold_steps
        if cold:
            for s in list(sched.idle):
                # (one an idle victim gave back holds nothing to store: it recomputes; one
                # whose copy is in flight, its table flipped early, waits for it to land)
                ready = s.tier == "device" and s.holds and s.id not in tier.copies
                if ready and step - s.idle_since >= cold:
                    self._tier_store(s, "cold")
        head = sched.waiting[0] if sched.waiting else None
        # the first in line, once its blocks and its next token fit (nobody overtakes it)
        if head is not None and head.tier == "host":
            if self.bm.num_free_blocks > len(tier.tiers[head.id]):
                self._tier_restore(head)
        self._tier_telemetry()

    # -- sessions: idle sequences (the workload's think time) ---------------------------
    def pause(self, request_id: str) -> bool:
        """A decoding request sits idle holding its blocks (cold once idle cold_steps steps: the
        host tier stores it out). False (a no-op) unless it is decoding."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.state is not State.RUNNING or seq.uncomputed != 1:
            return False
        self.scheduler.pause(seq, self.step_count)
        self.seams.on_event("pause", dict(Pause(req=request_id)))
        return True

    def resume(self, request_id: str) -> bool:
        """An idle request waits to run again (restored first where stored out)."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.state is not State.IDLE:
            return False
        self.scheduler.resume(seq)
        self.seams.on_event("resume", dict(Resume(req=request_id, tier=seq.tier)))
        return True

    def _tier_telemetry(self) -> None:
        tier = self.tier
        host = self.bm.host_blocks - self.bm.num_free_host_blocks
        ev = OffloadTier(
            device_used=self.bm.num_blocks - self.bm.num_free_blocks,
            host_used=host,
            in_flight=len(tier.copies),
            stored=tier.traffic["stored"],
            restored=tier.traffic["restored"],
        )
        if tier.bandwidth:
            ev["blocks_in_flight"] = sum(len(c.pairs) - c.done for c in tier.copies.values())
        self.seams.on_event("offload_tier", dict(ev))
