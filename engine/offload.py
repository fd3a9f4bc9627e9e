"""A host KV tier (`[engine.offload]`), as vLLM's KV offloading connector and SGLang's
hierarchical cache: a second, larger pool in host memory (pinned on CUDA, plain on the CPU) per
rank, same layout as the device pool. Preempted requests are stored out instead of recomputed,
and cold ones (idle `cold_steps` steps) are stored out; both are restored when they run again.
The manager places blocks on either tier (capability "offload", docs/protocol-v2.md section 10);
the engine copies and keeps the tier map beside the table (each logical block of a sequence:
device, host, or in flight). The kernels only ever read device-tier blocks: a sequence is
scheduled once its restore completed.

Copies are asynchronous with completion per sequence's blocks: on the CPU deferred by the step
count (`latency_steps`), no thread, so a seed gives the same history byte for byte. A store
reads the device blocks when it is issued (as a DMA on a side stream would) and completes
`latency_steps` later; only then does the manager free the device blocks (`offload_done`). A
preemption's store completes at once (the scheduler needs the room now: the engine waits for
it). A restore writes the device blocks when it completes. Every copy records a CRC of each
block it read and, at completion, of each block it wrote or left (the checkers compare them).

Seams (faults/offload.py, faults/async_free.py): `store_early` (the store reads blocks the step
in flight still writes, under async scheduling: the remediation waits for that step),
`restore_flip` (the sequence computes on its restored blocks before the copy completed) and
`free_loading` (a request released while its restore is in flight: the load lands later, into
blocks handed on) and `stale_host` (a restored request's host copy of a block stays valid after
the block is written: its next store skips it, as a write-back cache that misses a dirty bit).

The events of the history (engine events, built by keyword here): `offload_store`,
`offload_restore`, `offload_landed`, `offload_late`, `offload_tier` (occupancy and traffic, each
step)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from typing_extensions import TypedDict

from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.sequence import State

if TYPE_CHECKING:  # the harness's events import this module: a command starts without torch
    import torch

Why = Literal["preempt", "cold"]


class OffloadStore(TypedDict):
    """A store issued: device block -> host slot, read now, completing at `due`."""

    req: str
    why: Why
    pairs: list[list[int]]  # [device block, host slot] in logical order
    due: int
    crcs: list[int]  # each host copy as read (every rank's, chained)
    fenced: bool  # it waited for the step in flight that wrote the blocks (async scheduling)


class OffloadRestore(TypedDict):
    """A restore issued: host slot -> new device block, written when it completes at `due`."""

    req: str
    pairs: list[list[int]]  # [host slot, device block]
    due: int
    crcs: list[int]  # each host slot's content now
    flipped: bool  # the table named the new blocks to the kernels before the copy completed


class OffloadLanded(TypedDict):
    """A copy completed. store: each device block's CRC now (what the host copy must equal);
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


class OffloadTier(TypedDict):
    """Occupancy and traffic of the step (device blocks in use, host slots in use, in flight)."""

    device_used: int
    host_used: int
    in_flight: int  # sequences with a copy in flight
    stored: int  # blocks whose store completed this step
    restored: int  # ... whose restore completed


@dataclass(kw_only=True)
class Copy:
    kind: Literal["store", "restore"]
    req: str
    pairs: list[tuple[int, int]]
    issued: int
    due: int


@dataclass(kw_only=True)
class HostTier:
    """The host pools, the copies in flight and the tier map."""

    pools: list[torch.Tensor]  # per rank: [layers, K/V, host_blocks, block_size, heads, dim]
    latency: int
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

    @classmethod
    def build(cls, device_pools: list, host_blocks: int, latency: int) -> HostTier:
        import torch

        pools = []
        for p in device_pools:
            shape = (*p.shape[:2], host_blocks, *p.shape[3:])
            pin = p.device.type == "cuda"  # pinned for the asynchronous copy; plain on the CPU
            pools.append(torch.zeros(shape, dtype=p.dtype, device="cpu", pin_memory=pin))
        return cls(pools=pools, latency=latency)


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
        for rank, (dev, host) in enumerate(zip(self.kv_pools, tier.pools)):
            for i, (b, s) in enumerate(pairs):
                host[:, :, s] = kept[i][rank] if i in kept else dev[:, :, at(dev, b)]
            for r, slot in early:  # read before those writes landed: what the slot held before
                if r == rank and any(b == slot // bs for b, _ in pairs):
                    s = dict(pairs)[slot // bs]
                    host[:, :, s, slot % bs] = 0
        if kept:
            tier.reused.append((seq.id, sorted(i for i in kept if i < len(pairs))))
        due = step if why == "preempt" else step + tier.latency
        tier.copies[seq.id] = Copy(kind="store", req=seq.id, pairs=pairs, issued=step, due=due)
        tier.tiers[seq.id] = [["flight", b, s] for b, s in pairs]
        seq.tier = "storing"
        ev = OffloadStore(
            req=seq.id,
            why=why,
            pairs=[[b, s] for b, s in pairs],
            due=due,
            crcs=[crc(tier.pools, s) for _, s in pairs],
            fenced=fenced,
        )
        self.counters["offload_stores"] += 1
        self.seams.on_event("offload_store", dict(ev))
        if due <= step:
            self._tier_land(tier.copies.pop(seq.id))
        return True

    def _tier_restore(self, seq) -> bool:
        """Issue seq's restore (new device blocks from the manager). False: no room yet."""
        tier, step = self.tier, self.step_count
        try:
            self.table.place(seq.id)
            pairs = self.bm.offload_restore(seq.id)
        except OutOfBlocks:
            self.table.drop(seq.id)
            return False
        self.table.sync(seq.id)
        due = step + tier.latency
        tier.copies[seq.id] = Copy(kind="restore", req=seq.id, pairs=pairs, issued=step, due=due)
        tier.tiers[seq.id] = [["flight", b, s] for s, b in pairs]
        flipped = bool(self.seams.restore_flip(seq))
        seq.tier = "device" if flipped else "restoring"
        ev = OffloadRestore(
            req=seq.id,
            pairs=[[s, b] for s, b in pairs],
            due=due,
            crcs=[crc(tier.pools, s) for s, _ in pairs],
            flipped=flipped,
        )
        self.counters["offload_restores"] += 1
        self.seams.on_event("offload_restore", dict(ev))
        return True

    def _tier_land(self, c: Copy) -> None:
        """c completed: a restore writes the device blocks; the manager is told (offload_done)."""
        tier, seq = self.tier, self.seqs[c.req]
        if c.kind == "restore":
            for dev, host in zip(self.kv_pools, tier.pools):
                for s, b in c.pairs:
                    dev[:, :, at(dev, b)] = host[:, :, s]
            kept = {i: [h[:, :, s].clone() for h in tier.pools] for i, (s, _) in enumerate(c.pairs)}
            tier.kept[c.req] = kept
        written = [b for b, _ in c.pairs] if c.kind == "store" else [b for _, b in c.pairs]
        ev = OffloadLanded(
            req=c.req,
            kind=c.kind,
            issued=c.issued,
            pairs=[list(p) for p in c.pairs],
            crcs=[crc(self.kv_pools, b) for b in written],
        )
        self.bm.offload_done(c.req)
        if c.kind == "store":
            self.table.drop(c.req)
            tier.tiers[c.req] = [["host", s] for _, s in c.pairs]
            seq.tier = "host"
            tier.traffic["stored"] += len(c.pairs)
        else:
            tier.tiers.pop(c.req, None)  # on the device alone, as every other sequence
            seq.tier = "device"
            tier.traffic["restored"] += len(c.pairs)
        self.seams.on_event("offload_landed", dict(ev))

    def _tier_reads(self, decode: list, prefill: list) -> None:
        """Note the step's sequences computed on blocks whose restore is still in flight (the
        kernels read them: what the harness checks the tier map against)."""
        copies, kept, bs = self.tier.copies, self.tier.kept, self.bm.block_size
        for s, n in (*((d, 1) for d in decode), *prefill):
            c = copies.get(s.id)
            if c is not None and c.kind == "restore":
                self.tier.reads.append((s.id, [b for _, b in c.pairs], c.issued))
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
            c.due = self.step_count + 1  # lands once the next step computed
            tier.orphans.append((c, [h[:, :, [s for s, _ in c.pairs]].clone() for h in tier.pools]))
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
            if c.due > step:
                keep.append((c, content))
                continue
            blocks = [b for _, b in c.pairs]
            for dev, kv in zip(self.kv_pools, content):
                dev[:, :, [at(dev, b) for b in blocks]] = kv
            held = {str(b): holders(self.table, b) for b in blocks}
            ev = OffloadLate(req=c.req, issued=c.issued, blocks=blocks, holders=held)
            tier.late.append(ev)
            self.seams.on_event("offload_late", dict(ev))
        tier.orphans = keep

    def _tier_settle(self, seq) -> None:
        """seq leaves (or is stored) while its copy is in flight: the copy completes first."""
        c = self.tier.copies.pop(seq.id, None)
        if c is not None:
            self.counters["offload_fences"] += 1
            self._tier_land(c)

    def _tier_tick(self) -> None:
        """The step's start: due copies complete, cold sequences are stored out, waiting stored
        sequences restored (in queue order, while there is room), then the tier's telemetry."""
        tier, step, sched = self.tier, self.step_count, self.scheduler
        tier.traffic, tier.reads, tier.reused = {"stored": 0, "restored": 0}, [], []
        for req in [q for q, c in tier.copies.items() if c.due <= step]:
            self._tier_land(tier.copies.pop(req))
        if tier.orphans:
            self._tier_orphans()
        cold = self.config.offload.cold_steps
        if cold:
            for s in list(sched.idle):
                # (one an idle victim gave back holds nothing to store: it recomputes)
                if s.tier == "device" and s.holds and step - s.idle_since >= cold:
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
        self.seams.on_event("offload_tier", dict(ev))
