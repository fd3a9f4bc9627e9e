"""Failure mode 3: host staging-buffer stall. The staging buffer of the per-step table upload is
not the process's own (as after a worker fork: memory locks are not inherited, its pinned pages
are no longer the process's), and an engine that keeps using it pays for every page it touches.
Outputs stay correct. Three variants, each a shape the stall takes in the field:

  ramp          the article's curve: invalidated mid-run, a few more of its pages are reclaimed
                each step until all are, so per-step latency climbs, then plateaus.
  from_start    the worker forked before serving (the article's own case): the buffer is the
                parent's from the first upload, so no early step of the run is sound to compare
                with. Every page is reclaimed before every upload.
  bursts        intermittent and small: every page reclaimed, only in bursts of `burst_steps`
                every `burst_every` steps from at_step (reclaim under memory pressure comes and
                goes); on a serving-size table a few times the sound copy.

The cost is real in every variant: the planted buffer is pageable (an anonymous mapping, never
mlock'ed), and the fault hands its pages back to the kernel before an upload (MADV_DONTNEED, as
reclaim takes unlocked pages; outside the step's timings), so the upload's copy page-faults each
one in again. "Fired" is the kernel's count: an upload through dropped pages fires where
getrusage's minor-fault count rose across the copy (the counts are recorded, as `minflt`, and
left out of the digest). A page fault costs about a microsecond, so the stall is material on a
serving-size table (50 pages and up), and the scenarios set `[run] latency_floor_ms` for it.
Where the platform cannot drop pages (no MADV_DONTNEED), from_start and bursts record
not_applicable and cost nothing; the ramp falls back to a modelled cost, a busy-wait of
`plateau_us` once every page is bad (a share of it per bad page before), and says so in
not_applicable: the one busy-wait left.

On CUDA the planted buffer is pageable, so the host-to-device copy from it is synchronous too
(tests/test_gpu.py shows the copy call returning only after the work queued ahead of it).
Remediation: the engine checks the buffer's owner before every upload and re-allocates it pinned
(page-locked: mlock on the CPU, cudaHostAlloc on CUDA). The article's write-combined flag
(cudaHostAllocWriteCombined) is not in torch: StagingBuffer asks cudaHostAlloc for it through
ctypes where a CUDA runtime library loads, and says why not where it does not; the engine's own
buffer is plain pinned (the host reads its staged table back for the ranks' checks, and reads of
write-combined memory bypass the cache)."""

from __future__ import annotations

import os
import resource
import time

from typing_extensions import NotRequired, TypedDict

from kvchaos.engine.staging import StagingBuffer
from kvchaos.faults import base
from kvchaos.faults.base import STEP, Fault, Num, Variant

NO_DROP = "this platform cannot drop a buffer's pages (no MADV_DONTNEED)"
VARIANTS = {  # as an incident quotes them
    "ramp": Variant(
        "The host staging buffer of the block-table upload was invalidated (a worker fork left "
        "its pinned pages to another process) and the engine kept using it: its pages were no "
        "longer locked, reclaim took more of them each step, and every upload page-faulted them "
        "in again, so per-step latency climbed, then plateaued.",
        "Tag the staging buffer with its owner (pid / generation), check it before every upload, "
        "and re-allocate it (pinned) when it is not this process's.",
    ),
    "from_start": Variant(
        "The worker was forked after its staging buffer was allocated (memory locks are not "
        "inherited across fork): it served from the first step through pages that were not "
        "locked for it, which the kernel took back, so every table upload page-faulted the "
        "buffer in again. No step of the run was sound, so its own early steps hid the stall.",
        "Allocate the staging buffer in the serving process after the fork (pinned: mlock, "
        "cudaHostAlloc; write-combined for a buffer the host only writes), and check its owner "
        "before every upload.",
    ),
    "bursts": Variant(
        "The staging buffer was pageable (not the process's pinned allocation), so memory "
        "pressure reclaimed its pages from time to time and the uploads after each reclaim "
        "page-faulted the table in again: short bursts of slow steps, a few times the sound "
        "copy's time.",
        "Keep the staging buffer page-locked (re-allocate it pinned when it is not the "
        "process's own), so reclaim cannot take its pages.",
    ),
}


def busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def minor_faults() -> int:
    """The kernel's count of this process's minor page faults (every thread's: a large copy is
    split across torch's threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class Faulted(TypedDict):
    step: int
    pages: int  # dropped before the upload (the ramp's fallback: modelled bad pages)


class Truth(base.Truth):
    variant: NotRequired[str]
    faulted: NotRequired[list[Faulted]]  # uploads through dropped pages that faulted
    not_applicable: NotRequired[str | None]
    minflt: NotRequired[dict[str, int]]  # step -> the kernel's minor faults across its copy
    unfaulted: NotRequired[list[int]]  # uploads through dropped pages with no fault counted


class InvalidatedStaging(StagingBuffer):
    """A staging buffer inherited across a fork: owned by another pid, pageable (on CUDA too, so
    the host-to-device copy from it really is synchronous). The fault drops its real pages before
    an upload and the copy faults them in, counted by the kernel; the ramp's fallback, where no
    page can be dropped, waits `modelled_s` instead."""

    def __init__(self, numel: int, fault: "StagingStall") -> None:
        super().__init__(numel, pinned=False)
        self.pid = -os.getpid()  # not this process's
        self.tensor.zero_()  # resident, as a buffer in use is: only reclaim takes its pages
        self.fault = fault
        self.dropped = 0  # real pages handed back since the last upload
        self.modelled = (0, 0.0)  # the fallback's bad pages and their wait, for the next upload

    def stage(self, host):
        pages, wait = self.modelled
        if wait:
            busy_wait(wait)
            self.modelled = (0, 0.0)
            self.fault.faulted_upload(pages, None)
            return super().stage(host)
        before = minor_faults()  # two getrusage calls (~1 us) inside the timed copy
        staged = super().stage(host)
        self.fault.faulted_upload(self.dropped, minor_faults() - before)
        self.dropped = 0
        return staged


class StagingStall(Fault):
    name = "staging_stall"
    detectors = ("latency",)
    truth = Truth
    # ramp_steps: steps until every page is reclaimed (the ramp's); plateau_us: the ramp's
    # fallback stall per upload once all are, where no page can be dropped; burst_steps of every
    # burst_every steps drop the pages (bursts'). page_bytes: the modelled ramp's page, unused
    # since its pages are the kernel's; accepted and recorded as before, so scenario files and
    # histories written with it load and replay as they were
    defaults = {
        "at_step": 20,
        "page_bytes": 16,
        "ramp_steps": 12,
        "plateau_us": 3000.0,
        "variant": "ramp",
        "burst_steps": 6,
        "burst_every": 20,
    }
    domains = {
        "at_step": STEP,
        "page_bytes": Num(int, ge=1),
        "ramp_steps": Num(int, ge=1),
        "plateau_us": Num(float, ge=0),
        "burst_steps": Num(int, ge=1),
        "burst_every": Num(int, ge=1),
    }
    variants = VARIANTS  # its own text: the default's (ramp)

    def arm(self, engine, emit) -> None:
        super().arm(engine, emit)
        # the trigger fires either way: the remediated engine must notice and re-allocate
        engine.seams.staging_check = not self.defect
        self.faulted: list[dict] = []
        self.minflt: dict[int, int] = {}  # step -> the kernel's count across its copy
        self.unfaulted: list[int] = []  # uploads through dropped pages the kernel saw no fault in
        self.na: str | None = None
        self._step = 0
        self._reallocs = engine.counters["staging_reallocs"]

    def _start(self) -> int:
        return 1 if self.p["variant"] == "from_start" else self.p["at_step"]

    def before_step(self, engine, step) -> None:
        self._step = step
        if step == self._start():
            engine.staging = InvalidatedStaging(engine.staging.tensor.numel(), self)
            what = "staging buffer invalidated (as after a fork)"
            if self.p["variant"] == "from_start":
                what = "serving from a staging buffer allocated before the fork"
            self.trigger(step, {"what": what, "pages": engine.staging.page_count()})
        buf = engine.staging
        if not (isinstance(buf, InvalidatedStaging) and buf.fault is self):
            return
        share = self._dropping(step, buf.page_count())
        if not share:
            return
        n = buf.drop_pages(0, share)  # reclaim, outside the step's timings
        buf.dropped += n
        if n:
            return
        if self.na is None:
            self.na = NO_DROP
            if self.p["variant"] == "ramp":
                self.na += ": the ramp's cost is modelled, a busy-wait"
            self.emit("not_applicable", {"reason": self.na}, step)
        if self.p["variant"] == "ramp":
            buf.modelled = (share, self.p["plateau_us"] * 1e-6 * share / buf.page_count())

    def _dropping(self, step: int, pages: int) -> int:
        """Pages reclaimed before this step's upload."""
        v, p = self.p["variant"], self.p
        if v == "ramp":
            return min(pages, (step - p["at_step"] + 1) * -(-pages // p["ramp_steps"]))
        if v == "bursts" and (step - p["at_step"]) % p["burst_every"] >= p["burst_steps"]:
            return 0
        return pages

    def after_step(self, engine, step, output) -> None:
        n = engine.counters["staging_reallocs"]
        self.remediated += n - self._reallocs  # the engine noticed and re-allocated
        self._reallocs = n

    def faulted_upload(self, pages: int, minflt: int | None) -> None:
        """The engine staged through the planted buffer with `pages` of it handed back; minflt:
        the kernel's minor faults across the copy (None: the ramp's modelled fallback). Fired
        where the kernel counted a fault (or the fallback charged its wait)."""
        if not pages or (self.faulted and self.faulted[-1]["step"] == self._step):
            return
        if minflt is not None:
            self.minflt[self._step] = minflt
            if minflt <= 0:
                self.unfaulted.append(self._step)
                return
        self.faulted.append({"step": self._step, "pages": pages})
        self.fired_steps.append(self._step)
        if len(self.fired_steps) == 1:
            self.emit("fired", {"pages_faulted": pages}, self._step)

    @classmethod
    def explains(cls, finding: dict, truth: dict) -> str | None:
        first = truth.get("first_step")
        if first is None or finding["checker"] != "latency" or finding["step"] < first:
            return None
        faulted = {x["step"] for x in truth.get("faulted", [])}
        if finding.get("kind") == "staging_slow" and faulted:  # its slow uploads reach a burst
            return "cause" if faulted.intersection(finding["evidence"].get("steps", ())) else None
        return "cause"  # every step after the invalidation pays: no request is singled out

    def verify(self) -> dict:
        truth = {
            **super().verify(),
            "variant": self.p["variant"],
            "not_applicable": getattr(self, "na", None),
            "faulted": getattr(self, "faulted", []),
            "pages_faulted": sum(x["pages"] for x in getattr(self, "faulted", [])),
            # measured: left out of the digest (UNSTABLE_KEYS), as a step's timings are
            "minflt": {str(k): v for k, v in getattr(self, "minflt", {}).items()},
        }
        if getattr(self, "unfaulted", None):  # pages dropped, no fault counted: nothing paid
            truth["unfaulted"] = self.unfaulted
        return truth
