"""Tensor-parallel ranks simulated in one process, deterministically. Each rank holds its own copy
of the block table and computes its share of the KV heads. Table updates are published to every
rank; a rank's update may arrive late (the `rank_delay` seam). The remediation is `sync`: before
computing, every rank applies the updates it is owed (it acknowledges the current version)."""

from __future__ import annotations

import zlib
from collections import deque

import torch


class VirtualRank:
    def __init__(self, index: int, device: torch.device) -> None:
        self.index = index
        self.device = device
        self.table = torch.empty(0, dtype=torch.int32, device=device)
        self.version = 0
        self.inbox: deque[tuple[int, int, torch.Tensor]] = deque()  # (due step, version, table)

    def apply(self, version: int, table: torch.Tensor) -> None:
        if self.table.shape == table.shape:
            self.table.copy_(table, non_blocking=True)
        else:
            self.table = table.to(self.device, copy=True)
        self.version = version

    def content(self) -> torch.Tensor:
        """The table this rank computes with."""
        return self.table

    def start(self, shape: torch.Size) -> None:
        """Version 0, the initial table, every entry unused: what a rank whose very first update
        is late computes with (not an empty tensor)."""
        self.table = torch.full(shape, -1, dtype=torch.int32, device=self.device)

    def crc(self) -> int:
        return zlib.crc32(self.table.cpu().numpy().tobytes())


class RankGroup:
    def __init__(self, size: int, device: torch.device) -> None:
        self.ranks = [VirtualRank(i, device) for i in range(size)]

    def publish(
        self, staged: torch.Tensor, version: int, step: int, delay_of, receive=None
    ) -> None:
        """receive (set): what a rank holds of an update that lands on time (torn, reordered)."""
        for r in self.ranks:
            if r.version == 0 and r.table.shape != staged.shape:
                r.start(staged.shape)
            d = delay_of(r.index, step)
            if d <= 0 and not r.inbox:
                r.apply(version, staged if receive is None else receive(r.index, step, staged))
            else:  # in flight: a private copy, since the staging buffer is reused next step
                r.inbox.append((step + max(d, 0), version, staged.clone()))

    def deliver(self, step: int) -> None:
        for r in self.ranks:
            while r.inbox and r.inbox[0][0] <= step:
                _, version, table = r.inbox.popleft()
                r.apply(version, table)

    def verify(self, staged: torch.Tensor, version: int) -> int:
        """Ranks on `version` whose table is not `staged` get it again, whole; returns how many."""
        resent = 0
        for r in self.ranks:
            if r.version == version and not torch.equal(r.content(), staged):
                r.apply(version, staged)
                resent += 1
        return resent

    def sync(self) -> int:
        """Wait for every update in flight; returns how many were waited for."""
        waited = 0
        for r in self.ranks:
            while r.inbox:
                _, version, table = r.inbox.popleft()
                r.apply(version, table)
                waited += 1
        return waited
