"""The host tier's copies on CUDA (engine/offload.py): a dedicated side stream, as vLLM's
offloading worker and SGLang's hierarchical cache issue them.

NOT RUN ON A GPU YET: written and reviewed on a machine without CUDA; tests/test_offload_cuda.py
(marked `gpu`) is the first check and skips without CUDA. The CPU path never builds this class
and never touches torch.cuda.

A store enqueues each block's device-to-host copy (`non_blocking`, into the pinned host pool) on
the side stream; a restore each block's host-to-device copy; each block gets an event recorded
after its copies on every rank. The orderings are real waits:

- a store's side stream waits on an event recorded on the compute stream after the step's
  writes (the remediation); planted `store_early` skips that wait (`wait=False`);
- a restore's side stream waits on the compute stream too (the new blocks' last user), and the
  compute stream waits on a block's event when the block lands, its due step reached: planted
  `restore_flip` schedules the request before that, so its kernels read without the wait.

What stays modelled, as on the CPU: a block completes at its due step (the step count), so a
seed's history keeps its shape; the store's record of what it read (its CRCs) needs the host
copy, so the host waits for the store's events at issue (the copy is still ordered by the side
stream alone); and the engine synchronizes the device at each step's end, so the compute stream
is idle when a store is issued: the missing wait of `store_early` is real but has no window
here, and what that step has not landed is the asynchronous scheduler's model (the slots it
still writes are zeroed in the host copy, as on the CPU). A block's slice is strided in both
pools: PyTorch may stage it through a contiguous temporary (ordered on the side stream, not
overlapped with the host)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


COUNTS = (
    "offload_side_blocks",
    "offload_side_waits",
    "offload_compute_waits",
    "offload_host_waits",
)


class SideStream:
    """The tier's copy stream on one CUDA device, its events and its counts."""

    def __init__(self, device: torch.device, counts: dict[str, int]) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device)
        # (the engine's counters): blocks copied on the side stream; waits of the side stream on
        # the compute stream; of the compute stream on a restored block's event; of the host on a
        # stored block's event
        self.counts = counts
        for name in COUNTS:
            counts[name] = 0

    def _after_compute(self) -> None:
        """The side stream waits for what the compute stream has enqueued so far."""
        t = self.torch
        done = t.cuda.Event()
        done.record(t.cuda.current_stream(self.device))
        self.stream.wait_event(done)
        self.counts["offload_side_waits"] += 1

    def store(self, pairs, dev_pools, host_pools, skip: set, wait: bool) -> list:
        """(device block, host slot) pairs' copies out, each block's event; skip: logical
        indices not copied (their host copy kept); wait: after the compute stream's writes."""
        t = self.torch
        if wait:
            self._after_compute()
        marks = []
        with t.cuda.stream(self.stream):
            for i, (b, s) in enumerate(pairs):
                if i not in skip:
                    for dev, host in zip(dev_pools, host_pools):
                        host[:, :, s].copy_(dev[:, :, b], non_blocking=True)
                    self.counts["offload_side_blocks"] += 1
                marks.append(self._mark())
        return marks

    def restore(self, pairs, dev_pools, host_pools) -> list:
        """(host slot, device block) pairs' copies in, each block's event."""
        t = self.torch
        self._after_compute()  # the new blocks' last user (another request) wrote them there
        marks = []
        with t.cuda.stream(self.stream):
            for s, b in pairs:
                for dev, host in zip(dev_pools, host_pools):
                    dev[:, :, b].copy_(host[:, :, s], non_blocking=True)
                self.counts["offload_side_blocks"] += 1
                marks.append(self._mark())
        return marks

    def _mark(self):
        ev = self.torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def host_wait(self, marks: list) -> None:
        """The host waits for stored blocks' copies (their host slots read or written next)."""
        for m in marks:
            m.synchronize()
            self.counts["offload_host_waits"] += 1

    def compute_wait(self, marks: list) -> None:
        """The compute stream waits for restored blocks' copies before any kernel reads them."""
        cur = self.torch.cuda.current_stream(self.device)
        for m in marks:
            cur.wait_event(m)
            self.counts["offload_compute_waits"] += 1
