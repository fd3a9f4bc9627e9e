"""Failure mode 3: host staging-buffer stall. The staging buffer of the per-step table upload is
not the process's own (as after a worker fork: memory locks are not inherited, its pinned pages
are no longer the process's), and an engine that keeps using it pays for every page it touches.
Outputs stay correct. Three variants, each a shape the stall takes in the field:

  ramp          the article's curve: invalidated mid-run, a few more pages go bad each step until
                all are, so per-step latency climbs, then plateaus. Its cost is modelled (a
                calibrated wait per bad page), so a tiny table shows the article's milliseconds.
  from_start    the worker forked before serving (the article's own case): the buffer is the
                parent's from the first upload, so no early step of the run is sound to compare
                with. A real cost: the buffer is pageable, and its pages go back to the kernel
                before every upload (MADV_DONTNEED, as reclaim takes unlocked pages), so each
                upload page-faults the table in again.
  bursts        intermittent and small: the same real page faults, only in bursts of
                `burst_steps` every `burst_every` steps from at_step (reclaim under memory
                pressure comes and goes); on a serving-size table a few times the sound copy.

On CUDA the planted buffer is pageable, so the host-to-device copy from it is synchronous too.
Remediation: the engine checks the buffer's owner before every upload and re-allocates it pinned
(page-locked: mlock on the CPU, cudaHostAlloc on CUDA, write-combined where asked)."""

from __future__ import annotations

import os
import time

from typing_extensions import NotRequired, TypedDict

from kvchaos.engine.staging import StagingBuffer
from kvchaos.faults import base
from kvchaos.faults.base import STEP, Fault, Num, OneOf

VARIANTS = ("ramp", "from_start", "bursts")
RAMP_PARAMS = ("at_step", "page_bytes", "ramp_steps", "plateau_us")  # as before the variants
TEXT = {  # variant: (root cause, remediation), as an incident quotes them
    "ramp": (
        "The host staging buffer of the block-table upload was invalidated (a worker fork left "
        "its pinned pages to another process) and the engine kept using it: every upload touched "
        "bad pages and paid a page fault each, so per-step latency climbed, then plateaued.",
        "Tag the staging buffer with its owner (pid / generation), check it before every upload, "
        "and re-allocate it (pinned) when it is not this process's.",
    ),
    "from_start": (
        "The worker was forked after its staging buffer was allocated (memory locks are not "
        "inherited across fork): it served from the first step through pages that were not "
        "locked for it, which the kernel took back, so every table upload page-faulted the "
        "buffer in again. No step of the run was sound, so its own early steps hid the stall.",
        "Allocate the staging buffer in the serving process after the fork (pinned: mlock, "
        "cudaHostAlloc; write-combined for a buffer the host only writes), and check its owner "
        "before every upload.",
    ),
    "bursts": (
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


class Faulted(TypedDict):
    step: int
    pages: int


class Truth(base.Truth):
    variant: NotRequired[str]
    faulted: NotRequired[list[Faulted]]  # uploads through dropped pages: (step, pages)
    not_applicable: NotRequired[str | None]


class InvalidatedStaging(StagingBuffer):
    """A staging buffer inherited across a fork: owned by another pid, pageable (on CUDA too, so
    the host-to-device copy from it really is synchronous). ramp: pages go bad a few more each
    step until all are; every bad page touched costs a page fault, a calibrated wait. The other
    variants: the fault drops its real pages before an upload, and the copy faults them in."""

    def __init__(self, numel: int, fault: "StagingStall") -> None:
        super().__init__(numel, pinned=False)
        self.pid = -os.getpid()  # not this process's
        self.fault = fault
        self.dropped = 0  # real pages handed back since the last upload
        if fault.p["variant"] != "ramp":
            return
        self.pages = max(1, -(-numel * 4 // fault.p["page_bytes"]))
        self.bad = 0
        self.per_step = -(-self.pages // fault.p["ramp_steps"])
        self.cost_per_page_s = fault.p["plateau_us"] * 1e-6 / self.pages

    def stage(self, host):
        f = self.fault
        if f.p["variant"] != "ramp":
            f.faulted_upload(self.dropped)
            self.dropped = 0
            return super().stage(host)
        self.bad = min(self.pages, self.bad + self.per_step)
        cost = self.bad * self.cost_per_page_s
        busy_wait(cost)
        f.charged(self.bad, cost)
        return super().stage(host)


class StagingStall(Fault):
    name = "staging_stall"
    detectors = ("latency",)
    truth = Truth
    root_cause, remediation = TEXT["ramp"]
    # ramp_steps: steps until every page is bad; plateau_us: the stall per upload once they all
    # are (both ramp's); burst_steps of every burst_every steps drop the pages (bursts')
    defaults = {
        "at_step": 20,
        "page_bytes": 16,
        "ramp_steps": 12,
        "plateau_us": 3000.0,
        "variant": "ramp",
        "burst_steps": 6,
        "burst_every": 20,
    }
    # page_bytes and ramp_steps divide: at least 1
    domains = {
        "at_step": STEP,
        "page_bytes": Num(int, ge=1),
        "ramp_steps": Num(int, ge=1),
        "plateau_us": Num(float, ge=0),
        "variant": OneOf(VARIANTS),
        "burst_steps": Num(int, ge=1),
        "burst_every": Num(int, ge=1),
    }

    def __init__(self, defect: bool, params: dict, seed: int) -> None:
        super().__init__(defect, params, seed)
        self.root_cause, self.remediation = TEXT[self.p["variant"]]

    @classmethod
    def label(cls, params: dict | None = None) -> str:
        return f"{cls.name}/{(params or {}).get('variant', cls.defaults['variant'])}"

    def describe(self) -> dict:
        d = super().describe()
        if self.p["variant"] == "ramp":  # recorded as before the variants: its histories replay
            d["params"] = {k: self.p[k] for k in RAMP_PARAMS}
            d["label"] = self.name
        return d

    def arm(self, engine, emit) -> None:
        super().arm(engine, emit)
        # the trigger fires either way: the remediated engine must notice and re-allocate
        engine.seams.staging_check = not self.defect
        self.faults_charged = 0
        self.seconds_charged = 0.0
        self.faulted: list[dict] = []
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
            buf = engine.staging
            pages = buf.pages if self.p["variant"] == "ramp" else buf.page_count()
            self.trigger(step, {"what": what, "pages": pages})
        buf = engine.staging
        if isinstance(buf, InvalidatedStaging) and buf.fault is self and self._dropping(step):
            n = buf.drop_pages(0, buf.page_count())  # reclaim, outside the step's timings
            buf.dropped += n
            if not n and self.na is None:
                self.na = "this platform cannot drop a buffer's pages (no MADV_DONTNEED)"
                self.emit("not_applicable", {"reason": self.na}, step)

    def _dropping(self, step: int) -> bool:
        v, p = self.p["variant"], self.p
        if v == "from_start":
            return True
        return v == "bursts" and (step - p["at_step"]) % p["burst_every"] < p["burst_steps"]

    def after_step(self, engine, step, output) -> None:
        n = engine.counters["staging_reallocs"]
        self.remediated += n - self._reallocs  # the engine noticed and re-allocated
        self._reallocs = n

    def charged(self, pages: int, seconds: float) -> None:
        self.faults_charged += pages
        self.seconds_charged += seconds
        if not self.fired_steps or self.fired_steps[-1] != self._step:
            self.fired_steps.append(self._step)
            if len(self.fired_steps) == 1:
                self.emit("fired", {"pages_faulted": pages}, self._step)

    def faulted_upload(self, pages: int) -> None:
        """The engine staged through the planted buffer with `pages` of it handed back."""
        if pages and (not self.faulted or self.faulted[-1]["step"] != self._step):
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
        if self.p["variant"] == "ramp":  # as before the variants
            return {
                **super().verify(),
                "page_faults_charged": self.faults_charged,
                "stall_seconds_charged": round(self.seconds_charged, 6),
            }
        return {
            **super().verify(),
            "variant": self.p["variant"],
            "not_applicable": getattr(self, "na", None),
            "faulted": getattr(self, "faulted", []),
            "pages_faulted": sum(x["pages"] for x in getattr(self, "faulted", [])),
        }
