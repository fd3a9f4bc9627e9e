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
  load_abort  (a host tier, `[engine.offload]`) an abort while an asynchronous restore from the
            host tier is in flight frees the blocks the load still writes (vLLM's scheduler
            `finish_requests` while WAITING_FOR_REMOTE_KVS, fixed by vllm#32255); with a copy
            bandwidth the abort comes once the load partly landed, the rest landing late
  staging   the one pinned staging buffer is restaged for step N+1 while step N's non-blocking
            table copy still reads it, so a device table mixes two steps (the class of
            LMCache#4830 and cudf#22284: a pinned source reused under an async copy); the fix
            double-buffers the staging

The trigger (a release while the step in flight wrote the sequence's blocks: the hazard window)
is the same in clean and detect runs; the engine's remediation waits for that step before it
frees (a fence, counted). Ground truth comes from the engine: the writes that landed in blocks
their writer no longer held, and who held those blocks then."""

from __future__ import annotations

from typing_extensions import NotRequired, TypedDict

from kvchaos.engine.inflight import holders
from kvchaos.faults import base
from kvchaos.faults.base import COUNT, Fault, ParamError, Variant
from kvchaos.faults.offload import no_tier
from kvchaos.faults.plan import Action

# the exit's seam name
REASON = {"finish": "finish", "abort": "cancel", "preempt": "preempt", "load_abort": "cancel"}
VARIANTS = {  # as an incident quotes them
    "finish": Variant(
        "A request finished on step N's output was freed at once, while step N+1, scheduled "
        "asynchronously before that output was known, still wrote its KV: the writes landed "
        "after the manager had taken the blocks back and handed them to another request (vLLM's "
        "async scheduler: vllm-ascend#14055; vllm#45357 defers the free).",
        "Free a finished request's blocks only after the step that last wrote them has "
        "completed: defer the free to that step's completion, or wait for it (a fence).",
    ),
    "abort": Variant(
        "An aborted request's blocks were freed while an asynchronous write into them (the step "
        "in flight, or a KV load) had not landed: vLLM's scheduler finish_requests on a request "
        "WAITING_FOR_REMOTE_KVS freed blocks the connector was still loading (vllm#32255 "
        "delays that free).",
        "On abort, free only after every in-flight write into the request's blocks completed "
        "(defer the free to the load's or step's completion).",
    ),
    "preempt": Variant(
        "A request preempted while the step in flight still wrote its blocks had them freed at "
        "once; the request the preemption made room for was handed them, and the late writes "
        "landed over its KV (vllm-ascend#14055, vllm#45357).",
        "A preemption frees only after the step that last wrote the victim's blocks has "
        "completed: wait for it before handing the blocks out.",
    ),
    "staging": Variant(
        "The block table was staged for step N+1 into the one pinned buffer step N's "
        "non-blocking host-to-device copy was still reading: the device table mixed rows of two "
        "steps, and sequences whose rows changed wrote and read KV through the step before's "
        "entries (a pinned source reused under an async copy: LMCache#4830, cudf#22284).",
        "Double-buffer the staging: each step stages into the buffer no copy in flight reads "
        "(or waits for the copy before restaging).",
    ),
    "load_abort": Variant(
        "A request aborted while its KV was being loaded back from the host tier had its blocks "
        "freed at once: the load landed after the manager had handed them to another request "
        "(vLLM's scheduler finish_requests on a request WAITING_FOR_REMOTE_KVS; vllm#32255 "
        "delays the free).",
        "On abort, free a request's blocks only after its in-flight load completed (or wait for "
        "it).",
        detectors=("offload", "oracle_divergence"),  # the tier's load, not a step's
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


class Copied(TypedDict):
    step: int
    src: int  # held late writes (landed there, or copied there since)
    dst: int  # took src's slots by copy-on-write: the late writes with them


class Mixed(TypedDict):
    step: int
    rows: list[int]
    seqs: list[str]  # computed through the step before's rows
    blocks: list[int]  # the mixed rows' (now and as staged): written over, elsewhere, or never


class Truth(base.Truth):
    mixed: NotRequired[list[Mixed]]
    landed: NotRequired[list[Landed]]
    copied: NotRequired[list[Copied]]  # only when a copy-on-write carried late writes
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
    domains = {"cancels": COUNT}
    variants = VARIANTS

    @classmethod
    def check_engine(cls, p: dict, cfg) -> None:
        if p["variant"] == "load_abort":
            if cfg.offload is None:
                raise ParamError(cls.name, "variant", "plants in the host tier: [engine.offload]")
            return
        if not cfg.async_scheduling:
            raise ParamError(
                cls.name,
                "variant",
                "plants in asynchronous scheduling: set [engine] async_scheduling = true",
            )
        if p["variant"] == "staging" and cfg.tp_size != 1:
            raise ParamError(
                cls.name, "variant", f"staging mixes one rank's table: tp_size 1, got {cfg.tp_size}"
            )

    def shape(self, plan, cfg) -> None:
        if self.p["variant"] not in ("abort", "load_abort"):
            return
        when = "decode" if self.p["variant"] == "abort" else "restoring"  # a load in flight
        if when == "restoring" and cfg.offload.blocks_per_step:
            when = "landing"  # with a bandwidth: a load partly landed
        subs = [a for a in plan.actions if a.op == "submit"]
        for a in subs[1 :: max(1, len(subs) // max(1, self.p["cancels"]))][: self.p["cancels"]]:
            plan.add(Action(a.step, "cancel", a.req, when=when, origin=self.name))

    def arm(self, engine, emit) -> None:
        super().arm(engine, emit)
        self.engine, self.seen = engine, 0
        self.landed: list[dict] = []
        self.copied: list[dict] = []
        self.freed: list[str] = []
        self.victims: dict[str, int] = {}  # req -> step it first held a block written late
        self.mixed: list[dict] = []
        self.tainted: set[int] = set()  # (staging) blocks holding KV computed through one
        if self.p["variant"] == "staging":
            engine.seams.reuse_staging = self._reuse
            return
        why = REASON[self.p["variant"]]
        if self.p["variant"] == "load_abort":
            self.late_seen, self.na = 0, no_tier(engine, "load_abort", emit)
            if not self.na:
                engine.seams.free_loading = self._free_loading
            return

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

    def _reuse(self, seqs: list) -> bool:
        """The hazard window: this step's table differs from the one the copy in flight reads."""
        t, step = self.engine.table, self.engine.step_count
        if self.tainted:  # this step's rows, before any sequence of it finishes
            for q, r in t.rows.items():
                if q not in self.victims and not self.tainted.isdisjoint(t.table.row(r)):
                    self.victims[q] = step
        if not seqs:
            return False
        self.trigger(step, {"seqs": seqs})
        if self.defect:
            return True
        self.remediated += 1  # double-buffered: the copy in flight reads its own buffer
        return False

    def _free_loading(self, seq, reason: str) -> bool:
        """The hazard window: seq aborted while its restore from the host tier is in flight."""
        step = self.engine.step_count
        self.trigger(step, {"req": seq.id, "why": reason})
        if not self.defect:
            self.remediated += 1  # the load completes, then the blocks go back
            return False
        self.freed.append(seq.id)
        self.touch(requests=[seq.id])
        return True

    def after_step(self, engine, step: int, output) -> None:
        if self.p["variant"] == "staging":
            return self._after_mixed(engine, step)
        if self.p["variant"] == "load_abort":
            return None if self.na else self._after_late(engine, step)
        self._follow_copies(engine, step)
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
        for b in _late_blocks(self.landed, self.copied):
            for q in holders(engine.table, b):
                if q not in self.victims:
                    self.victims[q] = step
                    self.touch(requests=[q])

    def _after_late(self, engine, step: int) -> None:
        """Loads of aborted requests that landed (the engine's offload_late), and their holders."""
        self._follow_copies(engine, step)
        for x in engine.tier.late[self.late_seen :]:
            held = {b: h for b, h in x["holders"].items() if h}
            d = {"step": step, "req": x["req"], "written": x["issued"], "blocks": x["blocks"]}
            self.landed.append({**d, "holders": held})
            self.touch(requests=[x["req"], *(q for h in held.values() for q in h)])
            self.touch(blocks=x["blocks"])
            self.fired(step, {**d, "holders": held})
            for h in held.values():
                for q in h:
                    self.victims.setdefault(q, step)
        self.late_seen = len(engine.tier.late)

    def _follow_copies(self, engine, step: int) -> None:
        """This step's copy-on-write copies of blocks holding late writes: the copies hold them
        too. The copies ran before the step's batch, so before this step's writes landed."""
        late = set(_late_blocks(self.landed, self.copied))
        for src, dst in engine.step_copies:
            if src in late:
                self.copied.append({"step": step, "src": src, "dst": dst})
                self.touch(blocks=[dst])

    def _after_mixed(self, engine, step: int) -> None:
        for x in engine.inflight.mixed[len(self.mixed) :]:
            mine = {q: set(engine.table.table.row(r)) for q, r in engine.table.rows.items()}
            own = {b for q in x["seqs"] for b in mine.get(q, ()) if b >= 0}
            # and the rows' blocks as the engine staged them (a sequence done by now has no row)
            own = sorted(own | set(x.get("blocks", ())))
            d = {"step": step, "rows": x["rows"], "seqs": x["seqs"], "blocks": own}
            self.mixed.append(d)
            self.touch(requests=x["seqs"], rows=x["rows"], blocks=own)
            self.fired(step, d)
            # who holds the blocks the mixed rows' sequences wrote but do not own: victims
            for q in x["seqs"]:
                for b in engine.written.get(q, {}):
                    if b in mine.get(q, ()):
                        continue
                    self.touch(blocks=[b])
                    for h in holders(engine.table, b):
                        self.victims.setdefault(h, step)
        if not self.mixed:
            return
        # KV computed through a mixed table spreads: blocks a mixed sequence or a victim wrote
        # or holds (written elsewhere, or never) are tainted, and whoever holds one reads it
        bad = {q for x in self.mixed for q in x["seqs"]} | set(self.victims)
        t = engine.table
        for q, blocks in engine.written.items():
            if q in bad:
                self.tainted.update(blocks)
        for q in bad & set(t.rows):
            self.tainted.update(b for b in t.table.row(t.rows[q]) if b >= 0)

    def verify(self) -> dict:
        return {
            **super().verify(),
            "variant": self.p["variant"],
            "landed": getattr(self, "landed", []),
            **({"copied": self.copied} if getattr(self, "copied", None) else {}),
            "mixed": getattr(self, "mixed", []),
            "freed_early": getattr(self, "freed", []),
            "victims": [{"step": t, "req": q} for q, t in getattr(self, "victims", {}).items()],
            **({"not_applicable": self.na} if getattr(self, "na", None) else {}),
        }

    @classmethod
    def explains(cls, finding: dict, truth: dict) -> str | None:
        s, ev, kind = finding["step"], finding.get("evidence") or {}, finding.get("kind")
        checker = finding.get("checker")
        if truth.get("variant") == "staging":
            return _explains_mixed(finding, truth)
        landed = [x for x in truth.get("landed", []) if x["step"] <= s]
        if not landed:
            return None
        writers = {x["req"] for x in landed}
        blocks = set(_late_blocks(landed, [c for c in truth.get("copied", ()) if c["step"] <= s]))
        victims = {v["req"] for v in truth.get("victims", []) if v["step"] <= s}
        if checker == "offload" and kind == "landed_after_free":
            return "cause" if ev.get("req") in writers else None
        if checker == "offload" and kind == "store_content":  # a holder's store, written over
            hit = ev.get("req") in victims and bool(set(ev.get("blocks") or ()) & blocks)
            return "consequence" if hit else None
        if checker == "table_integrity" and kind == "foreign_write":
            named = set(ev.get("blocks") or ())
            return "cause" if ev.get("req") in writers and named and named <= blocks else None
        if checker == "kv_reads":
            if kind == "wrong_read" and ev.get("writer") in writers and ev.get("block") in blocks:
                return "cause"
            # the late write itself (its writer, as it landed), where a host tier's store and
            # restore, or a prefix hit's load, carried it since: the record follows the KV
            late = {(x["req"], x["step"]) for x in landed}
            if kind == "wrong_read" and (ev.get("writer"), ev.get("writer_step")) in late:
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


def _explains_mixed(finding: dict, truth: dict) -> str | None:
    """staging: a sequence that computed through the step before's rows, by its own reads and
    writes; a holder of a block it wrote over."""
    s, ev, kind = finding["step"], finding.get("evidence") or {}, finding.get("kind")
    checker = finding.get("checker")
    done = [x for x in truth.get("mixed", []) if x["step"] <= s]
    mixed = {q for x in done for q in x["seqs"]}
    blocks = {b for x in done for b in x.get("blocks", ())}
    victims = {v["req"] for v in truth.get("victims", []) if v["step"] <= s}
    if not mixed:
        return None
    if checker == "table_integrity" and kind in ("foreign_write", "unslotted_write"):
        return "cause" if ev.get("req") in mixed else None
    if checker == "kv_reads" and kind in ("wrong_read", "unwritten_read"):
        hit = {ev.get("req"), ev.get("writer")} & (mixed | victims) or ev.get("block") in blocks
        return "cause" if hit else None
    if checker == "kv_reads":
        return "consequence" if ev.get("origin") in mixed | victims else None
    if checker == "oracle_divergence" and kind == "divergence":
        return "cause" if ev.get("req") in mixed | victims else None
    if checker == "prefix_cache" and kind in ("cache_content", "hit_blocks"):
        if ev.get("block") in blocks or ev.get("req") in mixed:
            return "cause"
        tainted = set(ev.get("writers") or ()) & (mixed | victims)
        return "consequence" if tainted or ev.get("parent_block") in blocks else None
    return None


def _late_blocks(landed: list[dict], copied: list[dict]) -> list[int]:
    """The blocks late writes landed in (as a set iterates them: who is a victim first is kept in
    that order), then the copies copy-on-write made of them."""
    late = {b for x in landed for b in x["blocks"]}
    return [*late, *dict.fromkeys(c["dst"] for c in copied if c["dst"] not in late)]
