"""Real tensor-parallel ranks on torch.distributed (`tp_mode = "distributed"`): gloo between CPU
processes, NCCL with one GPU per rank. The default stays the in-process simulation (engine.ranks).

Rank 0 is the in-process Engine (scheduler, block manager, outputs) unchanged but for where its
table upload, batch and attention go. Every rank holds its own copy of the flat block table and the
pool of its num_kv_heads / world KV heads, and computes attention for its heads; the outputs are
all-gathered per layer, so rank 0's tokens and logits are bit-identical to the simulation's. The
rest of the model is tiny and replicated: every rank needs the whole hidden state for its q, k, v.

Table updates leave rank 0 through its RankGroup, the simulation's own queues: the ordering-race
trigger (the rank_delay seam) holds lag_rank's update there for lag_steps steps, the remediation
(rank_sync) drains every update in flight before the header goes out, and the defect is a rank
computing, unacknowledged, on whatever table it holds.

The pieces: the step on the wire (kvchaos.engine.wire), a rank's share of the work
(kvchaos.engine.shard), the group seen from rank 0 (kvchaos.engine.cluster), a follower rank
(kvchaos.engine.follower), and here rank 0's engine (DistEngine).
"""

from __future__ import annotations

import torch

from kvchaos.engine.cluster import Cluster
from kvchaos.engine.config import EngineConfig
from kvchaos.engine.engine import Engine
from kvchaos.engine.ranks import VirtualRank
from kvchaos.engine.shard import Shard, StaleTable
from kvchaos.engine.wire import Batch, Wire, step_capacity


class Link(VirtualRank):
    """Rank 0's end of the link to another rank: applying an update puts it on the wire, once the
    step's broadcast (which tells the rank what to expect) is out. A table equal to the last one
    sent travels as its version alone."""

    def __init__(self, index: int, device: torch.device, outbox: list) -> None:
        super().__init__(index, device)
        self.outbox, self.last = outbox, None

    def content(self) -> torch.Tensor:
        return self.table if self.last is None else self.last

    def start(self, shape: torch.Size) -> None:
        # the other rank computes with the initial table too, should its first update be late
        super().start(shape)
        self.apply(0, self.table)

    def apply(self, version: int, table: torch.Tensor) -> None:
        same = self.last is not None and torch.equal(self.last, table)
        if not same:
            self.last = table.clone()  # the staging buffer is reused
        self.outbox.append((self.index, version, None if same else self.last))
        self.version = version


class DistEngine(Engine):
    """Rank 0 of a real tensor-parallel group. `cluster`: a Cluster to run on (reused across runs);
    None launches one for this engine, shut down by close()."""

    def __init__(
        self, config: EngineConfig, block_manager=None, cluster: "Cluster | None" = None
    ) -> None:
        super().__init__(config, block_manager)
        world = config.tp_size
        self._outbox: list = []
        for r in range(1, world):
            self.ranks.ranks[r] = Link(r, self.device, self._outbox)
        self.kv_pools, self._kv_views = self.kv_pools[:1], self._kv_views[:1]  # rank 0's heads only
        self.shard = Shard(
            config, 0, world, self.device, self.ranks.ranks[0], self.model.scale, self.kv_pools[0]
        )
        self._own = cluster is None
        self.cluster = cluster if cluster is not None else Cluster()
        self.wire: Wire | None = None
        self._copies: list = []
        self._cap = step_capacity(config, world)
        self.rank_timers: list[dict] = []  # per rank, seconds by kind, filled by close()

    # Engine._upload_table publishes through self.ranks: rank 0's own copy is applied there, the
    # links queue the others' updates (and, with rank_sync, drain every update in flight).
    def step(self):
        if self.wire is None:
            self.wire = self.cluster.begin_run(self.config)
        w = self.wire
        t = w.t
        g0, w0 = t["gather"], t["bcast"] + t["table"] + t["ack"]
        try:
            out = super().step()
        except BaseException as e:
            if not w.busy:  # failed before the step's broadcast: the ranks are still in step
                raise
            self._fail(e)
        # the host side's waits on the other ranks are theirs, not this rank's host work
        st = out.stats
        st.wait_s = t["bcast"] + t["table"] + t["ack"] - w0
        st.host_s -= st.wait_s
        st.prep_s -= st.wait_s
        # the rest of the step's time: the model, the logits
        t["compute"] += st.latency_s - st.host_s - st.wait_s - (t["gather"] - g0)
        return out

    def _fail(self, e: BaseException):
        """The ranks are out of step with us: name the rank at fault, if any; kill the followers."""
        failure = (
            None
            if isinstance(e, StaleTable)
            else self.cluster.diagnose(self.wire.ops, self.step_count)
        )
        self.cluster.abort()
        self.wire = None
        if failure is None:
            raise e
        raise failure from e

    def _copy_blocks(self, copies) -> None:
        self._copies += copies
        super()._copy_blocks(copies)

    def _build_batch(self, decode, prefill):
        width = self.table.table.width
        rows, tok, pos = self._batch_inputs(decode, prefill)
        copies, self._copies = self._copies, []
        scrambled = self._scramble()
        msg = Batch.pack(
            self.step_count,
            self.table_version,
            self.seams.rank_sync,
            tok,
            pos,
            [rows[s.id] * width for s in decode],
            [(rows[s.id] * width, s.num_computed, n) for s, n in prefill],
            copies,
            [(r, v, 0 if table is None else table.numel()) for r, v, table in self._outbox],
            scrambled,
        )
        w = self.wire
        w.busy = True
        b = self._batch = Batch.unpack(w.broadcast_step(msg, self._cap), self.device)
        for r, _, table in self._outbox:
            if table is not None:
                w.send_table(r, table)
        self._outbox.clear()
        versions, crcs = self.shard.acknowledge(w, b)
        w.settle()
        links = self.ranks.ranks
        sent = [r.version for r in links]
        if versions != sent:  # the wire lost or reordered an update: nothing below can be trusted
            raise RuntimeError(
                f"step {b.step}: ranks acknowledged table versions {versions}, were sent {sent}"
            )
        if len(links) > 1:
            self._crcs = crcs
        metas = self.shard.resolve(b)
        if self.record_writes:  # another rank writes through the table sent it (its crc says so)
            slots = [self.shard.slots(b, r.content(), r.index) for r in links[1:]]
            self._record_writes(decode, prefill, [metas[0], *slots])
        if self.seams.on_batch is not None:

            def meta_of(r: int):  # what rank r computes with: the table sent it
                slots, dec, chunks = self.shard.resolve(b, links[r].content(), r) if r else metas
                return slots, dec and dec[0], chunks

            self._report_batch(decode, prefill, tok, pos, meta_of)
        return b.tokens, b.positions, metas

    def _attend(self, nd: int, metas):
        return self.shard.attend(self.wire, self._batch, metas)

    def close(self) -> None:
        super().close()
        try:
            if self.wire is not None:
                try:
                    self.rank_timers = self.cluster.end_run(self.wire, self._cap)
                    self.wire = None
                except BaseException as e:
                    self._fail(e)
        finally:
            if self._own:
                self.cluster.close()
