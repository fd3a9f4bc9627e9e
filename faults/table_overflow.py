"""Failure mode 1: block-table overflow. A request needs more blocks than a table row holds; with
no bound check the write lands in the next row of the flat table and silently corrupts a
neighbour."""

from __future__ import annotations

from typing_extensions import NotRequired

from kvchaos.faults import base
from kvchaos.faults.base import BOOL, COUNT, STEP, Fault, Num
from kvchaos.faults.plan import Action

REMEDIES = ("overlong_rejected", "table_resizes")  # the engine's answers to an over-long request


class Truth(base.Truth):
    overlong: NotRequired[list[str]]  # the requests only the missing bound check let in


class TableOverflow(Fault):
    name = "table_overflow"
    detectors = ("table_integrity", "oracle_divergence")
    truth = Truth
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
        self.overlong = []  # the requests it made longer than a row: only the defect admits them
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
            self.overlong.append(f"long{i}")
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
                    # the last generated token's KV is never stored: one more makes it spill
                    cap - cap // 2 + 2,
                    origin=self.name,
                )
            )
            self.overlong.append("edge_over")

    def arm(self, engine, emit) -> None:
        super().arm(engine, emit)
        if self.defect:
            engine.seams.admission_check = False
            engine.table.table.bound_check = False
        self._seen = self._looked = engine.table.table.overflow_writes
        self.overflowing: dict[str, int] = {}  # request -> its row, for requests that overflowed
        self._counts = {k: engine.counters[k] for k in ("overlong_requests", *REMEDIES)}
        upload = engine.seams.on_upload

        def look() -> None:  # mid-step, after the appends: every row still has its owner
            self._who(engine)
            upload()

        engine.seams.on_upload = look

    def _who(self, engine) -> None:
        """What the unchecked writes touched: the rows written into, the blocks they name, and
        every request that has held one of those rows or blocks since (a spilled entry stays in
        the row for its next owner, and sends that owner's writes into the named block, whoever
        holds it by then)."""
        table = engine.table.table
        n = table.overflow_writes
        new = table.overflow_log[self._looked : n]
        self._looked = n
        rows = {r for r, _, _ in new} | {r + i // table.width for r, i, _ in new}
        self.touch(rows=rows, blocks={b for _, _, b in new})
        if not self.touched["rows"]:
            return
        snap, w = engine.snapshot(), table.width
        owner = {row: req for req, row in snap.seq_rows.items()}
        self.overflowing.update({owner[r]: r for r, _, _ in new if r in owner})
        for req, row in self.overflowing.items():  # the entries it addresses past its row, today
            if snap.seq_rows.get(req) == row:
                spill = snap.table[row * w + w : row * w + len(snap.seq_blocks[req])]
                # an unused entry (-1) addresses the pool's last block, as a raw kernel would
                self.touch(blocks={b % snap.num_blocks for b in spill})
        rows, blocks = self.touched["rows"], self.touched["blocks"]
        self.touch(requests={req for req, row in snap.seq_rows.items() if row in rows})
        self.touch(requests={req for req, bs in snap.seq_blocks.items() if blocks & set(bs)})

    def after_step(self, engine, step, output) -> None:
        c = engine.counters
        for _ in range(c["overlong_requests"] - self._counts["overlong_requests"]):
            self.trigger(step)  # a request longer than a row reached admission
        self.remediated += sum(c[k] - self._counts[k] for k in REMEDIES)
        self._counts = {k: c[k] for k in self._counts}
        table = engine.table.table
        n = table.overflow_writes
        if n > self._seen:
            self._who(engine)  # a step that uploaded nothing
            self.fired(step, {"overflow_writes": n - self._seen, "table_width": table.width})
            self._seen = n

    def verify(self) -> dict:
        return {
            **super().verify(),
            "overflow_writes": self._seen,
            "overlong": getattr(self, "overlong", []),
        }

    @classmethod
    def explains(cls, finding: dict, truth: dict) -> str | None:
        if truth.get("first_step") is None or finding["step"] < truth["first_step"]:
            return None
        reqs, rows = set(truth["touched"]["requests"]), set(truth["touched"]["rows"])
        ev = finding.get("evidence", {})
        if finding["checker"] == "table_integrity" and (
            ev.get("req") in reqs or ev.get("owner") in reqs or ev.get("row") in rows
        ):
            return "cause"
        if finding["checker"] == "oracle_divergence" and ev.get("req") in reqs:
            return "cause"
        if finding["checker"] == "kv_reads" and (
            ev.get("req") in reqs or ev.get("block") in set(truth["touched"]["blocks"])
        ):  # read through a spilled entry, or KV a spilled write left
            return "consequence" if finding.get("kind") == "poisoned_read" else "cause"
        touched = set(truth["touched"]["blocks"])
        if finding["checker"] == "prefix_cache" and (
            set(ev.get("writers") or ()) & reqs
            or ev.get("block") in touched
            or ev.get("parent_block") in touched
        ):  # a spilled write landed in a cached block, or in the block it continues
            return "cause"
        if finding.get("kind") in ("starvation", "unfinished") and ev.get("blocking") in set(
            truth.get("overlong", [])
        ):
            return "consequence"  # the queue waits on a request only the defect let in
        return None
