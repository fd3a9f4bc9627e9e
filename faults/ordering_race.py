"""Failure mode 4: cross-GPU ordering race. Tensor-parallel ranks each hold a copy of the block
table; one rank's update arrives late. With no version check before compute, that rank reads a
stale table for a step and writes/reads K/V at the wrong slots."""

from __future__ import annotations

from typing_extensions import NotRequired, TypedDict

from kvchaos.faults import base
from kvchaos.faults.base import FRACTION, STEP, Fault, Num, ParamError


class StaleStep(TypedDict):
    step: int
    ranks: list[int]  # the ranks still on the old table
    requests: list[str]  # the requests live then


class Truth(base.Truth):
    stale: NotRequired[list[StaleStep]]


class OrderingRace(Fault):
    name = "ordering_race"
    detectors = ("cross_rank", "oracle_divergence")
    truth = Truth
    root_cause = (
        "A rank computed before its block-table update had landed: no acknowledgement of the "
        "table version before compute, so it read a stale table and used the wrong KV slots."
    )
    remediation = (
        "Ranks acknowledge the table version before computing (barrier / event sync); a stale "
        "version is refused."
    )
    defaults = {"lag_rank": 1, "lag_steps": 1, "probability": 0.3, "from_step": 3}
    # lag_steps 0: no lag (the update lands on time); lag_rank's upper bound: the engine's tp_size
    domains = {
        "lag_rank": Num(int, ge=0),
        "lag_steps": Num(int, ge=1),
        "probability": FRACTION,
        "from_step": STEP,
    }

    @classmethod
    def check_engine(cls, p, engine_config) -> None:
        tp = engine_config.tp_size
        if tp >= 2 and not p["lag_rank"] < tp:  # tp_size < 2 is an error of its own, at arm
            raise ParamError(
                cls.name,
                "lag_rank",
                f"expected an int in [0, {tp - 1}] (a rank of engine.tp_size = "
                f"{tp}), got {p['lag_rank']!r}",
            )

    def arm(self, engine, emit) -> None:
        super().arm(engine, emit)
        if engine.config.tp_size < 2:
            raise ValueError("fault ordering_race needs engine.tp_size >= 2")
        engine.seams.rank_sync = not self.defect
        rng, p = self.rng, self.p

        def rank_delay(rank: int, step: int) -> int:
            if rank == p["lag_rank"] and step >= p["from_step"] and rng.random() < p["probability"]:
                self.trigger(step, {"rank": rank, "late_by_steps": p["lag_steps"], "at": step})
                return p["lag_steps"]
            return 0

        engine.seams.rank_delay = rank_delay
        self.stale_reads = 0
        self.stale: list[dict] = []
        self._waits = engine.counters["rank_sync_waits"]

    def after_step(self, engine, step, output) -> None:
        waits = engine.counters["rank_sync_waits"]
        self.remediated += waits - self._waits  # updates in flight waited for before computing
        self._waits = waits
        # The engine's own record: ranks that computed on an old table with other content.
        ranks = output.stats.stale_tables
        if ranks:
            live = sorted({s.id for s in engine.scheduler.running} | set(output.finished))
            snap = engine.snapshot()  # stale writes may land in any block held then
            self.touch(blocks={b for bs in snap.seq_blocks.values() for b in bs})
            self.stale_reads += 1
            self.stale.append({"step": step, "ranks": ranks, "requests": live})
            self.touch(requests=live)
            self.fired(step, {"ranks": ranks, "table_version": output.stats.table_version})

    def before_step(self, engine, step) -> None:
        # a fork made now shares blocks written on a stale table, and may be done within the
        # step; a block handed out fresh is written by its new owner before it is read
        if self.stale:
            self._holders(engine.snapshot())

    def _holders(self, snap) -> None:
        """Whoever holds a block written on a stale table since (a fork, a reuse) is touched."""
        blocks = self.touched["blocks"]
        held = {r for r, bs in snap.seq_blocks.items() if blocks.intersection(bs)}
        self.touch(requests=held)
        self.stale[-1]["requests"] = sorted(set(self.stale[-1]["requests"]) | held)

    def verify(self) -> dict:
        return {**super().verify(), "stale_reads_served": self.stale_reads, "stale": self.stale}

    @classmethod
    def explains(cls, finding: dict, truth: dict) -> str | None:
        stale = truth.get("stale") or []
        if not stale or finding["step"] < stale[0]["step"]:
            return None
        ev = finding.get("evidence", {})
        if finding["checker"] == "cross_rank":
            at = {x["step"]: set(x["ranks"]) for x in stale}
            return "cause" if at.get(finding["step"], set()) & set(ev.get("ranks", [])) else None
        if finding.get("kind") in ("foreign_write", "unslotted_write"):  # by a rank stale then
            x = next((x for x in stale if x["step"] == finding["step"]), None)
            stray = x and set(ev.get("ranks", x["ranks"])) & set(x["ranks"])
            return "cause" if stray and ev.get("req") in x["requests"] else None
        if finding["checker"] == "oracle_divergence":
            live = {r for x in stale for r in x["requests"]}
            return "cause" if ev.get("req") in live else None
        if finding["checker"] == "kv_reads":  # a rank's own record: it read or wrote stale
            lagged = {r for x in stale if x["step"] <= finding["step"] for r in x["ranks"]}
            now = next((x for x in stale if x["step"] == finding["step"]), {"ranks": []})
            held = ev.get("block") in set(truth["touched"]["blocks"])
            if ev.get("rank") in lagged and (held or ev.get("rank") in now["ranks"]):
                return "consequence" if finding.get("kind") == "poisoned_read" else "cause"
            # a later read on that rank of KV its request computed through the stale table
            # (so written elsewhere there): a knock-on of the stale step
            misled = {
                q
                for x in stale
                if x["step"] <= finding["step"] and ev.get("rank") in x["ranks"]
                for q in x["requests"]
            }
            if ev.get("rank") in lagged and {ev.get("req"), ev.get("writer")} & misled:
                return "consequence"
        return None
