"""Host staging buffer for the per-step block-table upload (host -> staging -> device).

On CUDA it is pinned memory and the device copy is asynchronous. A staging buffer is valid only in
the process that allocated it: after a fork its pinned pages are not the child's, so the engine
checks `pid` before every upload and re-allocates (the remediation for the staging stall).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class StagingBuffer:
    def __init__(self, numel: int, pinned: bool) -> None:
        import torch  # here: the staging fault subclasses this, and a scenario loads without torch

        self.tensor = torch.empty(numel, dtype=torch.int32, pin_memory=pinned)
        self.pinned = pinned
        self.pid = os.getpid()

    def valid(self) -> bool:
        return self.pid == os.getpid()

    def stage(self, host: torch.Tensor) -> torch.Tensor:
        self.tensor.copy_(host)
        return self.tensor
