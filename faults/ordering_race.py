"""Failure mode 4: cross-GPU ordering race. Tensor-parallel ranks each hold a copy of the block
table (and of their share of the KV pool); one rank's update lands late or wrong, and with no
check before compute that rank reads or writes K/V at the wrong slots. Six variants, each a bug
class shipped in a real engine, each planted on lag_rank through the engine's seams (whose
defaults are the remediation); variant text and triggers in faults/ordering_variants.py:

  lagged        (the default) a whole table version lands lag_steps late (the field report's
                NCCL block-table sync that lags on one GPU)
  torn          a rank applies part of an update under its version (vllm-ascend#12130,
                Megatron-LM#5715: an async host-to-device table copy overwritten mid-flight)
  reordered     update N+1 lands before N, and N over it (vllm#15332: a worker's scheduler
                output crossed with another step's in transport)
  cow_lag       the table in sync, the copy-on-write copy's data not yet on that rank
                (xLLM#1984, ik_llama.cpp#2083: a copy or a sync elided, KV read before written)
  scrambled     the article's symptom: a rank writes each block's tokens in the wrong order
                (vllm-ascend#14039: KV block order flipped on a copy; LMCache#4921)
  stale_unread  a stale row that nobody reads before it is refreshed (vllm#42273, vllm#39591:
                stale block-table entries harmless while masked): latent, never manifest
"""

from __future__ import annotations

from typing_extensions import NotRequired, TypedDict

from kvchaos.faults import base
from kvchaos.faults.base import FRACTION, STEP, Fault, Num, ParamError
from kvchaos.faults.ordering_variants import DEFAULT, KV_VARIANTS, VARIANTS, Triggers


class StaleStep(TypedDict):
    step: int
    ranks: list[int]  # the ranks still on the old table
    requests: list[str]  # the requests live then
    rows: NotRequired[list[int]]  # stale_unread: the rows that differed (held by nobody)


class KVStep(TypedDict):
    step: int
    ranks: list[int]  # the ranks that computed without their copies / wrote blocks reversed
    requests: list[str]  # the requests whose KV it touched (and, since, holders of its blocks)
    blocks: list[int]


class Truth(base.Truth):
    stale: NotRequired[list[StaleStep]]
    variant: NotRequired[str]
    late_copies: NotRequired[list[KVStep]]
    scrambled: NotRequired[list[KVStep]]
    not_applicable: NotRequired[str]  # cow_lag on a manager without forks


class OrderingRace(Fault):
    name = "ordering_race"
    detectors = ("cross_rank", "oracle_divergence")
    truth = Truth
    defaults = {
        "lag_rank": 1,
        "lag_steps": 1,
        "probability": 0.3,
        "from_step": 3,
        "variant": DEFAULT,
    }
    # lag_steps 0: no lag (the update lands on time); lag_rank's upper bound: the engine's tp_size
    domains = {
        "lag_rank": Num(int, ge=0),
        "lag_steps": Num(int, ge=1),
        "probability": FRACTION,
        "from_step": STEP,
    }
    variants, bare_default = VARIANTS, True  # its own text: the default's

    def __init__(self, defect: bool, params: dict, seed: int) -> None:
        super().__init__(defect, params, seed)
        self.detectors = self.detectors_for(self.p)  # its armed event names the variant's

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
        if p["variant"] == "cow_lag" and engine_config.tp_mode == "distributed":
            raise ParamError(
                cls.name,
                "variant",
                "cow_lag plants in simulated ranks (tp_mode = 'simulated'): real ranks take the "
                "step's copies from its broadcast",
            )

    def arm(self, engine, emit) -> None:
        super().arm(engine, emit)
        if engine.config.tp_size < 2:
            raise ValueError("fault ordering_race needs engine.tp_size >= 2")
        self.engine, v = engine, self.p["variant"]
        self.stale_reads = 0
        self.stale: list[dict] = []
        self.kv_steps: list[dict] = []  # cow_lag / scrambled: what the rank computed wrong
        self._waits = engine.counters["rank_sync_waits"]
        self._fixes = engine.order_fixes
        self.triggers = Triggers(self, engine)
        self.triggers.plant(v, engine.seams)
        self.na = None
        if v == "cow_lag" and "fork" not in engine.capabilities:  # no fork: no copy-on-write
            m = getattr(engine.bm, "manager", engine.bm)
            self.na = f"cow_lag needs forks (copy-on-write): {type(m).__name__} declares no 'fork'"
            emit("not_applicable", {"reason": self.na}, 0)

    def after_step(self, engine, step, output) -> None:
        waits = engine.counters["rank_sync_waits"]
        fixes = engine.order_fixes
        # updates (and copies) in flight waited for, or re-sent whole, before computing; tokens
        # out of order written by position all the same
        self.remediated += waits - self._waits + fixes - self._fixes
        self._waits, self._fixes = waits, fixes
        if self.p["variant"] in KV_VARIANTS:
            self._kv_step(engine, step, output)
            return
        # The engine's own record: ranks that computed on a table with other content.
        ranks = output.stats.stale_tables
        if ranks:
            live = sorted({s.id for s in engine.scheduler.running} | set(output.finished))
            snap = engine.snapshot()  # stale writes may land in any block held then
            self.touch(blocks={b for bs in snap.seq_blocks.values() for b in bs})
            self.stale_reads += 1
            self.stale.append({"step": step, "ranks": ranks, "requests": live})
            rows = self.triggers.unread_rows.get(step)
            if rows is not None:  # stale_unread: the rows that differed, held by nobody then
                self.stale[-1]["rows"] = rows
            self.touch(requests=live)
            self.fired(step, {"ranks": ranks, "table_version": output.stats.table_version})

    def _kv_step(self, engine, step, output) -> None:
        """The engine's own record: ranks that computed the step with copies still in flight
        (their destination blocks read before written), or that wrote its blocks reversed."""
        st = output.stats
        if not st.decode_tokens + st.prefill_tokens:
            return
        if self.p["variant"] == "cow_lag":
            late = engine.copies_in_flight
            ranks, blocks = sorted(late), {d for cs in late.values() for _, d in cs}
        else:
            ranks = list(engine.scrambled_ranks)
            blocks = set()
        if not ranks:
            return
        snap = engine.snapshot()
        if blocks:  # the copies' holders read them
            reqs = {r for r, bs in snap.seq_blocks.items() if blocks.intersection(bs)}
        else:  # every request of the step wrote its blocks reversed
            reqs = {s.id for s in engine.scheduler.running} | set(output.finished)
            blocks = {b for r in reqs for b in snap.seq_blocks.get(r, ())}
        x = {"step": step, "ranks": ranks, "requests": sorted(reqs), "blocks": sorted(blocks)}
        self.kv_steps.append(x)
        self.touch(requests=reqs, blocks=blocks)
        self.fired(step, {"ranks": ranks, "blocks": x["blocks"]})

    def before_step(self, engine, step) -> None:
        # a fork made now shares blocks written wrong, and may be done within the step; a block
        # handed out fresh is written by its new owner before it is read
        log = self.kv_steps or self.stale
        if log:
            self._holders(engine.snapshot(), log[-1])

    def _holders(self, snap, last: dict) -> None:
        """Whoever holds a block written wrong since (a fork, a reuse) is touched."""
        blocks = self.touched["blocks"]
        held = {r for r, bs in snap.seq_blocks.items() if blocks.intersection(bs)}
        self.touch(requests=held)
        last["requests"] = sorted(set(last["requests"]) | held)

    def verify(self) -> dict:
        out = {**super().verify(), "stale_reads_served": self.stale_reads, "stale": self.stale}
        v = self.p["variant"]
        if v != DEFAULT:  # (the default's record as it always was)
            out["variant"] = v
        if v in KV_VARIANTS:
            out["late_copies" if v == "cow_lag" else "scrambled"] = self.kv_steps
        if getattr(self, "na", None):  # (only then: the record of every other run as before)
            out["not_applicable"] = self.na
        return out

    def describe(self) -> dict:
        d = super().describe()
        if self.p["variant"] == DEFAULT:  # as recorded before variants: histories compare
            d["params"] = {k: x for k, x in d["params"].items() if k != "variant"}
        return d

    @classmethod
    def explains(cls, finding: dict, truth: dict) -> str | None:
        kv = truth.get("late_copies") or truth.get("scrambled")
        if kv:
            return _explains_kv(finding, kv, "late_copies" in truth)
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
        if finding["checker"] == "kv_reads" and finding.get("kind") == "poisoned_read":
            # KV computed from a wrong read by a request live in a stale step, read on any rank
            # (the wrong read's output is gathered from every rank)
            live = {r for x in stale if x["step"] <= finding["step"] for r in x["requests"]}
            if {ev.get("req"), ev.get("origin")} & live:
                return "consequence"
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


def _explains_kv(finding: dict, kv: list[dict], copies: bool) -> str | None:
    """cow_lag / scrambled: a read on the rank that computed wrong, by (or of KV written by) a
    request it touched, at or after it did; a divergence of such a request. A read of KV that a
    wrong read by such a request fed (poisoned), on any rank, is a consequence."""
    s, ev = finding["step"], finding.get("evidence") or {}
    before = [x for x in kv if x["step"] <= s]
    if not before:
        return None
    reqs = {r for x in before for r in x["requests"]}
    if finding["checker"] == "oracle_divergence":
        return "cause" if ev.get("req") in reqs else None
    if finding["checker"] != "kv_reads":
        return None
    if finding.get("kind") == "poisoned_read":  # on any rank: the wrong read's output is gathered
        return "consequence" if {ev.get("req"), ev.get("origin")} & reqs else None
    on_rank = [x for x in before if ev.get("rank") in x["ranks"]]
    if not on_rank:
        return None
    blocks = {b for x in on_rank for b in x["blocks"]}
    mine = {ev.get("req"), ev.get("writer")} & {r for x in on_rank for r in x["requests"]}
    if ev.get("block") in blocks and (mine or copies):
        return "cause"
    return "consequence" if mine else None
