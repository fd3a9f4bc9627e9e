"""Host staging buffer for the per-step block-table upload (host -> staging -> device).

Pinned means page-locked. On CUDA: cudaHostAlloc'd memory (torch's pin_memory, or with the
write-combined flag through cudaHostAlloc itself: torch has no flag for it), whose device copy is
asynchronous; from pageable memory the copy is synchronous. On the CPU: an anonymous mapping
locked with mlock, whose pages neither reclaim nor madvise can take away; a pageable one can lose
them (MADV_DONTNEED, reclaim), and the next write to each page faults it back in.

A staging buffer is valid only in the process that allocated it: memory locks are not inherited
across fork(), so after a fork its pages are not the child's. The engine checks `pid` before
every upload and re-allocates (the remediation for the staging stall).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PAGE = mmap.PAGESIZE
CUDA_HOST_ALLOC_PORTABLE, CUDA_HOST_ALLOC_WRITE_COMBINED = 1, 4  # cudaHostAlloc's flags


def _libc():
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        lib.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return lib
    except (OSError, AttributeError, TypeError):  # no libc with mlock (Windows)
        return None


def _cudart():
    for name in ("libcudart.so.12", "libcudart.so.13", "libcudart.so", "cudart64_12.dll"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class StagingBuffer:
    """numel int32 of staging. pinned: page-locked (CUDA when there is one, else mlock); where
    the platform refuses (no CUDA runtime for write-combined, a memlock limit), `pinned` and
    `write_combined` say what was granted and `why` why not."""

    def __init__(self, numel: int, pinned: bool, write_combined: bool = False) -> None:
        import torch  # here: the staging fault subclasses this, and a scenario loads without torch

        self.pid = os.getpid()
        self.pinned = self.write_combined = False
        self.why = ""
        self.mem = None  # the mapping under a CPU buffer (None: torch's or CUDA's allocation)
        if pinned and torch.cuda.is_available():
            self.tensor = self._cuda_host(numel, write_combined)
            self.pinned = True
            return
        size = -(-max(1, numel * 4) // PAGE) * PAGE
        self.mem = mmap.mmap(-1, size)
        self.tensor = torch.frombuffer(self.mem, dtype=torch.int32, count=numel)
        if pinned:
            libc = _libc()
            if libc is None:
                self.why = "no mlock on this platform"
            elif libc.mlock(self.tensor.data_ptr(), size) != 0:
                self.why = f"mlock refused: {os.strerror(ctypes.get_errno())} (RLIMIT_MEMLOCK?)"
            else:
                self.pinned = True  # munmap, when the mapping goes, unlocks it

    def _cuda_host(self, numel: int, write_combined: bool) -> torch.Tensor:
        import torch

        lib = _cudart() if write_combined else None
        if lib is not None:
            ptr, n = ctypes.c_void_p(), max(1, numel * 4)
            flags = CUDA_HOST_ALLOC_PORTABLE | CUDA_HOST_ALLOC_WRITE_COMBINED
            if lib.cudaHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(n), ctypes.c_uint(flags)) == 0:
                raw = (ctypes.c_char * n).from_address(ptr.value)
                t = torch.frombuffer(raw, dtype=torch.int32, count=numel)
                weakref.finalize(t, lib.cudaFreeHost, ptr)  # freed with the last view of it
                self.write_combined = True
                return t
            self.why = "cudaHostAlloc(write-combined) failed: pinned without it"
        elif write_combined:
            self.why = "no CUDA runtime library for cudaHostAlloc: pinned, not write-combined"
        return torch.empty(numel, dtype=torch.int32, pin_memory=True)

    def valid(self) -> bool:
        return self.pid == os.getpid()

    def page_count(self) -> int:
        return -(-self.tensor.numel() * 4 // PAGE)

    def drop_pages(self, first: int, count: int) -> int:
        """Hand pages [first, first + count) back to the kernel (MADV_DONTNEED): the next write
        to each faults it in again. Pages actually dropped: 0 where the platform does not allow
        it (a pinned buffer, CUDA's memory, no madvise)."""
        count = min(count, self.page_count() - first)
        advise = getattr(mmap, "MADV_DONTNEED", None)
        if self.mem is None or self.pinned or advise is None or count <= 0:
            return 0
        try:
            self.mem.madvise(advise, first * PAGE, count * PAGE)
        except OSError:
            return 0
        return count

    def stage(self, host: torch.Tensor) -> torch.Tensor:
        self.tensor.copy_(host)
        return self.tensor
