"""Failure mode 1: block-table overflow. A request needs more blocks than a table row holds; with
no bound check the write lands in the next row of the flat table and silently corrupts a
neighbour."""

from __future__ import annotations

from kvchaos.faults.base import BOOL, COUNT, STEP, Fault, Num
from kvchaos.faults.plan import Action


class TableOverflow(Fault):
    name = "table_overflow"
    detectors = ("table_integrity", "oracle_divergence")
    root_cause = (
        "No bound check on the block-table index: a sequence longer than max_blocks_per_seq x "
        "block_size wrote its next block id at row * width + index with index >= width, i.e. "
        "into the next row of the flat table, which the neighbouring sequence (and the kernel) "
        "then read."
    )
    remediation = (
        "Check the length at admission: reject a request that can never fit with a 429-style "
        "error, or resize the table by policy; refuse any table write past a row's width."
    )
    defaults = {
        "at_step": 3,
        "long_requests": 1,
        "overshoot": 1.5,
        "boundary": True,
        "neighbours": 3,
    }
    # overshoot: the long request's length in rows; at most one row, it fits and is no trigger
    domains = {
        "at_step": STEP,
        "long_requests": COUNT,
        "overshoot": Num(float, gt=1),
        "boundary": BOOL,
        "neighbours": COUNT,
    }

    def shape(self, plan, cfg) -> None:
        cap = cfg.cache.max_tokens_per_seq
        step = self.p["at_step"]
        # neighbours first: they take the rows after the long request's, so an overflow has a victim
        for i in range(self.p["long_requests"]):
            total = int(cap * self.p["overshoot"])
            prompt = max(1, cap // 4)
            plan.add(
                Action(
                    step,
                    "submit",
                    f"long{i}",
                    plan.prompt(prompt),
                    total - prompt,
                    origin=self.name,
                )
            )
        for i in range(self.p["neighbours"]):
            plan.add(
                Action(step, "submit", f"nb{i}", plan.prompt(8), cap - 8, origin=self.name)
            )  # outlive the overflow
        if self.p["boundary"]:  # right at the edge: exactly a full row (fits), and one token over
            plan.add(
                Action(
                    step + 1,
                    "submit",
                    "edge_fit",
                    plan.prompt(cap // 2),
                    cap - cap // 2,
                    origin=self.name,
                )
            )
            plan.add(
                Action(
                    step + 1,
                    "submit",
                    "edge_over",
                    plan.prompt(cap // 2),
                    cap - cap // 2 + 1,
                    origin=self.name,
                )
            )

    def arm(self, engine, emit) -> None:
        super().arm(engine, emit)
        if self.defect:
            engine.seams.admission_check = False
            engine.bm.table.bound_check = False
        self._seen = engine.bm.table.overflow_writes

    def after_step(self, engine, step, output) -> None:
        n = engine.bm.table.overflow_writes
        if n > self._seen:
            self.fired(
                step, {"overflow_writes": n - self._seen, "table_width": engine.bm.table.width}
            )
            self._seen = n

    def verify(self) -> dict:
        return {**super().verify(), "overflow_writes": self._seen}
