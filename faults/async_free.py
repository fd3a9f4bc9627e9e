"""Failure mode 6: under asynchronous scheduling (`[engine] async_scheduling`), a sequence's
blocks go back to the manager while the step in flight still writes them; that step's writes
land after the next step was scheduled, into blocks the manager may have handed to another
request (engine/inflight.py). Variants, by the exit that frees too early:

  finish    vLLM's async scheduler (vllm#19970): a request finished on step N's output is freed
            while step N+1, scheduled before that output was known, still writes its KV
            (vllm-ascend#14055; fixed in vLLM by deferring the free, vllm#45357)
  abort     vLLM's scheduler `finish_requests` on a request WAITING_FOR_REMOTE_KVS freed blocks
            an asynchronous KV load still wrote (fixed by delaying the free, vllm#32255); here
            the write in flight is the step's
  preempt   a request preempted while the step in flight still writes its blocks has them handed
            to the request the preemption made room for (vllm-ascend#14055, vllm#45357)

The trigger (a release while the step in flight wrote the sequence's blocks: the hazard window)
is the same in clean and detect runs; the engine's remediation waits for that step before it
frees (a fence, counted). Ground truth comes from the engine: the writes that landed in blocks
their writer no longer held, and who held those blocks then."""

from __future__ import annotations

from typing_extensions import NotRequired, TypedDict

from kvchaos.engine.inflight import holders
from kvchaos.faults import base
from kvchaos.faults.base import COUNT, Fault, OneOf, ParamError
from kvchaos.faults.plan import Action

VARIANTS = ("finish", "abort", "preempt")
REASON = {"finish": "finish", "abort": "cancel", "preempt": "preempt"}  # the exit's seam name
TEXT = {  # variant: (root cause, remediation), as an incident quotes them
    "finish": (
        "A request finished on step N's output was freed at once, while step N+1, scheduled "
        "asynchronously before that output was known, still wrote its KV: the writes landed "
        "after the manager had taken the blocks back and handed them to another request (vLLM's "
        "async scheduler: vllm-ascend#14055; vllm#45357 defers the free).",
        "Free a finished request's blocks only after the step that last wrote them has "
        "completed: defer the free to that step's completion, or wait for it (a fence).",
    ),
    "abort": (
        "An aborted request's blocks were freed while an asynchronous write into them (the step "
        "in flight, or a KV load) had not landed: vLLM's scheduler finish_requests on a request "
        "WAITING_FOR_REMOTE_KVS freed blocks the connector was still loading (vllm#32255 "
        "delays that free).",
        "On abort, free only after every in-flight write into the request's blocks completed "
        "(defer the free to the load's or step's completion).",
    ),
    "preempt": (
        "A request preempted while the step in flight still wrote its blocks had them freed at "
        "once; the request the preemption made room for was handed them, and the late writes "
        "landed over its KV (vllm-ascend#14055, vllm#45357).",
        "A preemption frees only after the step that last wrote the victim's blocks has "
        "completed: wait for it before handing the blocks out.",
    ),
}


class Landed(TypedDict):
    step: int
    req: str  # the writer, freed early
    written: int  # the step that wrote
    blocks: list[int]
    holders: dict[str, list[str]]  # block -> who held it when the writes landed


class Victim(TypedDict):
    step: int
    req: str  # held a block a late write landed in (then, or since: the slot stays wrong)


class Truth(base.Truth):
    landed: NotRequired[list[Landed]]
    freed_early: NotRequired[list[str]]
    victims: NotRequired[list[Victim]]


class AsyncFree(Fault):
    name = "async_free"
    detectors = ("table_integrity", "kv_reads", "oracle_divergence", "prefix_cache")
    truth = Truth
    root_cause = "Blocks were freed while the asynchronously scheduled step still wrote them."
    remediation = "Free only after the step that last wrote the blocks has completed."
    defaults = {"variant": "finish", "cancels": 4}
    # cancels: (abort) requests cancelled while decoding, so the step in flight wrote them
    domains = {"variant": OneOf(VARIANTS), "cancels": COUNT}

    def __init__(self, defect: bool, params: dict, seed: int) -> None:
        super().__init__(defect, params, seed)
        self.root_cause, self.remediation = TEXT[self.p["variant"]]

    @classmethod
    def label(cls, params: dict | None = None) -> str:
        return f"{cls.name}/{(params or {}).get('variant', cls.defaults['variant'])}"

    @classmethod
    def check_engine(cls, p: dict, cfg) -> None:
        if not cfg.async_scheduling:
            raise ParamError(
                cls.name,
                "variant",
                "plants in asynchronous scheduling: set [engine] async_scheduling = true",
            )

    def shape(self, plan, cfg) -> None:
        if self.p["variant"] != "abort":
            return
        subs = [a for a in plan.actions if a.op == "submit"]
        for a in subs[1 :: max(1, len(subs) // max(1, self.p["cancels"]))][: self.p["cancels"]]:
            plan.add(Action(a.step, "cancel", a.req, when="decode", origin=self.name))

    def arm(self, engine, emit) -> None:
        super().arm(engine, emit)
        self.engine, self.seen = engine, 0
        self.landed: list[dict] = []
        self.freed: list[str] = []
        self.victims: dict[str, int] = {}  # req -> step it first held a block written late
        why = REASON[self.p["variant"]]

        def free_in_flight(seq, reason: str) -> bool:
            """The hazard window: seq leaves while the step in flight wrote its blocks."""
            if reason != why:
                return False
            step = engine.step_count
            self.trigger(step, {"req": seq.id, "why": reason, "inflight": engine.inflight.step})
            if self.defect:
                self.freed.append(seq.id)
                self.touch(requests=[seq.id])
                return True
            self.remediated += 1  # the engine waits for the step, then frees
            return False

        engine.seams.free_in_flight = free_in_flight

    def after_step(self, engine, step: int, output) -> None:
        log = engine.inflight.log
        for x in log[self.seen :]:
            held = {b: h for b, h in x["holders"].items() if h}
            d = {"step": step, "req": x["req"], "written": x["written"], "blocks": x["blocks"]}
            self.landed.append({**d, "holders": held})
            self.touch(requests=[x["req"], *(q for h in held.values() for q in h)])
            self.touch(blocks=x["blocks"])
            self.fired(step, {**d, "holders": held})
        self.seen = len(log)
        # a holder since the writes landed (the writer too: a preempted request readmitted)
        for b in {b for x in self.landed for b in x["blocks"]}:
            for q in holders(engine.table, b):
                if q not in self.victims:
                    self.victims[q] = step
                    self.touch(requests=[q])

    def verify(self) -> dict:
        return {
            **super().verify(),
            "variant": self.p["variant"],
            "landed": getattr(self, "landed", []),
            "freed_early": getattr(self, "freed", []),
            "victims": [{"step": t, "req": q} for q, t in getattr(self, "victims", {}).items()],
        }

    @classmethod
    def explains(cls, finding: dict, truth: dict) -> str | None:
        s, ev, kind = finding["step"], finding.get("evidence") or {}, finding.get("kind")
        checker = finding.get("checker")
        landed = [x for x in truth.get("landed", []) if x["step"] <= s]
        if not landed:
            return None
        writers = {x["req"] for x in landed}
        blocks = {b for x in landed for b in x["blocks"]}
        victims = {v["req"] for v in truth.get("victims", []) if v["step"] <= s}
        if checker == "table_integrity" and kind == "foreign_write":
            named = set(ev.get("blocks") or ())
            return "cause" if ev.get("req") in writers and named and named <= blocks else None
        if checker == "kv_reads":
            if kind == "wrong_read" and ev.get("writer") in writers and ev.get("block") in blocks:
                return "cause"
            return "consequence" if ev.get("origin") in victims else None
        if checker == "oracle_divergence" and kind == "divergence":
            return "cause" if ev.get("req") in victims else None
        if checker == "prefix_cache" and kind == "cache_content":
            if ev.get("block") in blocks:
                return "cause"
            # keyed over KV a victim computed from the late writes, or after such a block
            tainted = set(ev.get("writers") or ()) & victims or ev.get("parent_block") in blocks
            return "consequence" if tainted else None
        return None
