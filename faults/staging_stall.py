"""Failure mode 3: host staging-buffer stall. The staging buffer of the per-step table upload is
invalidated (as after a worker fork: its pinned pages are no longer the process's). An engine that
keeps using it pays a page fault for every page it touches, more pages go bad each step, and
per-step latency climbs, then plateaus. Outputs stay correct."""

from __future__ import annotations

import os
import time

from kvchaos.engine.staging import StagingBuffer
from kvchaos.faults.base import STEP, Fault, Num


def busy_wait(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class InvalidatedStaging(StagingBuffer):
    """A staging buffer inherited across a fork: owned by another pid. On CUDA it is pageable
    (so the host-to-device copy really is synchronous). Pages go bad a few more each step until all
    are; every bad page touched costs a page fault, a calibrated busy-wait on the CPU."""

    def __init__(self, numel: int, fault: "StagingStall") -> None:
        super().__init__(numel, pinned=False)
        self.pid = -os.getpid()  # not this process's
        self.fault = fault
        self.pages = max(1, -(-numel * 4 // fault.p["page_bytes"]))
        self.bad = 0
        self.per_step = -(-self.pages // fault.p["ramp_steps"])
        self.cost_per_page_s = fault.p["plateau_us"] * 1e-6 / self.pages

    def stage(self, host):
        f = self.fault
        self.bad = min(self.pages, self.bad + self.per_step)
        cost = self.bad * self.cost_per_page_s
        busy_wait(cost)
        f.charged(self.bad, cost)
        return super().stage(host)


class StagingStall(Fault):
    name = "staging_stall"
    detectors = ("latency",)
    root_cause = (
        "The host staging buffer of the block-table upload was invalidated (a worker fork left "
        "its pinned pages to another process) and the engine kept using it: every upload touched "
        "bad pages and paid a page fault each, so per-step latency climbed, then plateaued."
    )
    remediation = (
        "Tag the staging buffer with its owner (pid / generation), check it before every upload, "
        "and re-allocate it (pinned) when it is not this process's."
    )
    # ramp_steps: steps until every page is bad; plateau_us: the stall per upload once they all are
    defaults = {"at_step": 20, "page_bytes": 16, "ramp_steps": 12, "plateau_us": 3000.0}
    # page_bytes and ramp_steps divide: at least 1
    domains = {
        "at_step": STEP,
        "page_bytes": Num(int, ge=1),
        "ramp_steps": Num(int, ge=1),
        "plateau_us": Num(float, ge=0),
    }

    def arm(self, engine, emit) -> None:
        super().arm(engine, emit)
        if not self.defect:
            pass  # the trigger still fires: the remediated engine must notice and re-allocate
        engine.seams.staging_check = not self.defect
        self.faults_charged = 0
        self.seconds_charged = 0.0
        self._step = 0
        self._reallocs = engine.counters["staging_reallocs"]

    def before_step(self, engine, step) -> None:
        self._step = step
        if step == self.p["at_step"]:
            engine.staging = InvalidatedStaging(engine.staging.tensor.numel(), self)
            self.trigger(
                step,
                {
                    "what": "staging buffer invalidated (as after a fork)",
                    "pages": engine.staging.pages,
                },
            )

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

    @classmethod
    def explains(cls, finding: dict, truth: dict) -> str | None:
        first = truth.get("first_step")
        if first is not None and finding["checker"] == "latency" and finding["step"] >= first:
            return "cause"  # every step after the invalidation pays: no request is singled out
        return None

    def verify(self) -> dict:
        return {
            **super().verify(),
            "page_faults_charged": self.faults_charged,
            "stall_seconds_charged": round(self.seconds_charged, 6),
        }
