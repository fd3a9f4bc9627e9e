"""The engine's table upload, a part of its step: the host table staged (timed beside its
calibration), published to every rank, synced or verified as the seams say, and each rank's
copy-on-write copies, in step or late. A mixin of Engine: it reads the engine's own state."""

from __future__ import annotations

import os
import time
import zlib

import torch

from kvchaos.engine.staging import StagingBuffer


class TableUpload:
    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        late, self.step_copies = [], self.step_copies + list(copies)
        for rank in range(len(self.kv_pools)):
            d = self.seams.rank_copy_delay(rank, self.step_count)
            if d > 0 or any(q == rank for _, q, _ in self._late_copies):  # behind those in flight
                self._late_copies.append((self.step_count + max(d, 0), rank, copies))
                late.append(rank)
            else:
                self._copy_on(rank, copies)
        self.counters["cow_copies"] += len(copies)
        data = {"copies": copies, "late_ranks": late} if late else {"copies": copies}
        self.seams.on_event("cow", data)

    def _copy_on(self, rank: int, copies: list[tuple[int, int]]) -> None:
        pool = self.kv_pools[rank]
        nb = pool.shape[2]  # a block past a pool sized short wraps to its start (geometry.py)
        src = torch.tensor([c[0] % nb for c in copies], device=self.device)
        dst = torch.tensor([c[1] % nb for c in copies], device=self.device)
        pool[:, :, dst] = pool[:, :, src]

    def _stage(self, host: torch.Tensor) -> torch.Tensor:
        """The staging copy, timed (stage_s), beside its calibration (probe_s): the same copy
        through a buffer this process allocated (as it allocates its own) and first touched right
        after the last upload's copy, so its pages have been left as long as the engine's own.
        A copy into the last probe's buffer goes first (untimed): whichever copy came first would
        pay for the code and the host table coming back into cache. The calibration's time
        (calib_s) is left out of the step's timings."""
        t0 = time.perf_counter()
        probe, n = self._probe, host.numel()
        probed = probe is not None and probe.tensor.numel() == n
        if probed:
            self._warm.stage(host)
        t1 = time.perf_counter()
        staged = self.staging.stage(host)
        t2 = time.perf_counter()
        if probed:
            probe.stage(host)
        t3 = time.perf_counter()
        self._warm = probe if probed else StagingBuffer(n, self._pinned)
        self._probe = StagingBuffer(n, self._pinned)  # the next upload's
        self._probe.stage(host)  # its first touch (a pageable one faults here)
        t4 = time.perf_counter()
        self._stage_s, self._probe_s = t2 - t1, t3 - t2 if probed else 0.0
        self._calib_s = (t1 - t0) + (t4 - t2)
        return staged

    def _upload_table(self) -> list[int]:
        """host table -> staging -> every rank. Returns the ranks left on an old version."""
        host = self.table.table.host_tensor
        if self.staging.tensor.numel() != host.numel():
            self.staging = StagingBuffer(host.numel(), self._pinned)
        elif self.seams.staging_check and not self.staging.valid():
            self.staging = StagingBuffer(host.numel(), self._pinned)
            self.counters["staging_reallocs"] += 1
            self.seams.on_event("staging_realloc", {"pid": os.getpid()})
        staged = self._stage(host)
        self.seams.on_upload()
        self.table_version += 1
        seams = self.seams
        self.ranks.publish(
            staged, self.table_version, self.step_count, seams.rank_delay, seams.rank_receive
        )
        self.ranks.deliver(self.step_count)
        if seams.rank_sync:
            self.counters["rank_sync_waits"] += self.ranks.sync()
        if seams.rank_verify:  # re-sent whole: counted with the waits
            self.counters["rank_sync_waits"] += self.ranks.verify(staged, self.table_version)
        if self.inflight is not None:  # after the ranks' checks: the staged source is what mixed
            self._staged_in_flight(staged)
        self._land_copies()
        if len(self.ranks.ranks) > 1:  # what each rank computes with vs what the scheduler uploaded
            self._crcs = [r.crc() for r in self.ranks.ranks]
            self._table_crc = zlib.crc32(memoryview(self.table.table.host))
        else:
            self._crcs, self._table_crc = [], 0
        stale = [r for r in self.ranks.ranks if r.version != self.table_version]
        self.counters["stale_rank_computes"] += len(stale)
        # the engine's own record of a stale read that matters: a table with other content (an old
        # version, or the step's version torn or overtaken)
        self._stale_tables = [
            r.index
            for r in self.ranks.ranks
            if r.content().shape != staged.shape or not torch.equal(r.content(), staged)
        ]
        return [r.index for r in stale]

    def _land_copies(self) -> None:
        """Copy-on-write copies still in flight on a rank: those due land now; with rank_sync every
        one does (waited for). `copies_in_flight` is the engine's record of what each rank
        computes this step without."""
        if not self._late_copies:
            return
        step, sync, keep = self.step_count, self.seams.rank_sync, []
        for due, rank, copies in self._late_copies:
            if due <= step or sync:
                self._copy_on(rank, copies)
                self.counters["rank_sync_waits"] += sync and due > step
                self.seams.on_event("cow_landed", {"rank": rank, "copies": copies})
            else:
                keep.append((due, rank, copies))
        self._late_copies = keep
        self.copies_in_flight = {}
        for _, rank, copies in keep:
            self.copies_in_flight.setdefault(rank, []).extend(copies)
