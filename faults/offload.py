"""Failure mode 7: the host KV tier (`[engine.offload]`, engine/offload.py) copies blocks out and
back asynchronously, and the copies are not ordered with the compute or the table. Variants:

  store_before_compute  vLLM's simple KV offload worker launched the GPU-to-CPU store of a
                        step's blocks before the compute stream finished writing them (fixed by
                        PR #46278: the store waits on an event recorded after the forward); here,
                        under asynchronous scheduling, a store (preemption or cold) reads blocks
                        the step in flight still writes, so the host copy lacks its KV. The
                        restored request computes on it.
  restore_race          KV restored from the CPU copy corrupted under load (vLLM #45704, #31210,
                        Dynamo #5068): the table flips to the restored blocks, and the request
                        computes, before the host-to-device copy completed (with a copy
                        bandwidth: once its first block landed, before the last).
  stale_host            a restored request's host copy is kept as valid (write-back avoidance, as
                        SGLang's hierarchical cache keeps host copies) and the block is written
                        again (its last, partial block grows) without the copy being marked
                        stale: the next store skips it, and the restore after brings back KV
                        older than the request's (the class of vLLM #45704, Dynamo #5068).
  host_slot_freed       a completed store gives its host slots back to the host pool while the
                        request stored out still needs them (an offload cache evicting blocks a
                        pending load references, the class of vLLM #31210): the next store
                        overwrites them, and the restore reads another request's KV.

The trigger (a store while the step in flight wrote the blocks; a restore) is the same in clean
and detect runs; the remediation orders the copy after the compute (a fence, counted), and
schedules a restored request once its copy completed. Ground truth comes from the engine: the
store that read early and the blocks it read; the restored request that computed while its copy
was in flight; the stored request whose host slots were given back."""

from __future__ import annotations

from typing_extensions import NotRequired, TypedDict

from kvchaos.faults import base
from kvchaos.faults.base import Fault, ParamError, Variant

VARIANTS = {  # as an incident quotes them
    "store_before_compute": Variant(
        "The device-to-host store of a request's blocks was issued while the step still "
        "writing them was in flight: the host copy missed that step's KV, and the request "
        "restored from it computed on KV never written (vLLM's simple KV offload worker, fixed "
        "by vllm#46278).",
        "Order the store after the compute: wait on an event recorded after the step that last "
        "wrote the blocks (here: the fence before the copy).",
    ),
    "restore_race": Variant(
        "A restored request's table named its new device blocks, and it computed on them, "
        "before the host-to-device copy into them completed: it read whatever the blocks held "
        "before, and the late copy then landed over its new KV (vllm#45704, vllm#31210, "
        "Dynamo#5068).",
        "Flip the table (schedule the request) only once the restore's copy completed; track "
        "completion per block.",
    ),
    "stale_host": Variant(
        "A restored request's host copy of a block stayed marked valid after the block was "
        "written again (its last block grew): the next store skipped the block as already on "
        "the host, and the request restored from that copy computed on KV older than its own "
        "(the class of vllm#45704, Dynamo#5068).",
        "Mark a block's host copy stale when the device block is written; a store copies every "
        "block whose host copy is not current.",
    ),
    "host_slot_freed": Variant(
        "A completed store returned its host slots to the host pool while the request stored "
        "out still referenced them: another store was handed them and overwrote the copy, and "
        "the request restored from them read another request's KV (the class of vllm#31210).",
        "Free a host slot only when no stored request or pending load references it (after its "
        "restore completed, or on release).",
    ),
}


def no_tier(engine, variant: str, emit) -> str | None:
    """Why a variant planted in the host tier cannot plant here (the manager offers no
    "offload"), said once as not_applicable; None where the tier is there."""
    if engine.tier is not None:
        return None
    m = getattr(engine.bm, "manager", engine.bm)
    why = f"{variant} plants in the host tier: {type(m).__name__} declares no 'offload'"
    emit("not_applicable", {"reason": why}, 0)
    return why


class Early(TypedDict):
    step: int
    req: str  # the request whose store read early, or kept stale copies (restored from them)
    blocks: list[int]  # stale_host: logical block indices


class Freed(TypedDict):
    step: int
    req: str  # stored out, its host slots given back
    slots: list[int]


class Truth(base.Truth):
    early: NotRequired[list[Early]]
    raced: NotRequired[list[Early]]  # restore_race: computed before its restore completed
    freed: NotRequired[list[Freed]]  # host_slot_freed: slots given back while held


class Offload(Fault):
    name = "offload"
    detectors = ("offload", "oracle_divergence")
    truth = Truth
    root_cause = "A host-tier copy was not ordered with the compute or the table flip."
    remediation = "Order every copy after the compute it reads, and the table flip after the copy."
    defaults = {"variant": "store_before_compute"}
    variants = VARIANTS
    any_manager = False  # the tier needs a reference's "offload" (either, with host blocks)

    @classmethod
    def check_engine(cls, p: dict, cfg) -> None:
        if cfg.offload is None:
            raise ParamError(cls.name, "variant", "plants in the host tier: add [engine.offload]")
        if p["variant"] == "store_before_compute" and not cfg.async_scheduling:
            raise ParamError(
                cls.name,
                "variant",
                "a store races the step in flight: set [engine] async_scheduling = true",
            )

    def arm(self, engine, emit) -> None:
        super().arm(engine, emit)
        self.engine = engine
        self.early: list[dict] = []
        self.raced: list[dict] = []
        self.flipped: dict[str, int] = {}  # req -> the step its restore was issued
        self.freed: list[dict] = []
        variant = self.p["variant"]
        self.na = no_tier(engine, variant, emit)
        if self.na:
            return
        if variant == "store_before_compute":
            engine.seams.store_early = self._store_early
        elif variant == "restore_race":
            engine.seams.restore_flip = self._flip
        elif variant == "stale_host":
            self.dirty: dict[str, set[int]] = {}  # req -> blocks kept valid though written
            engine.seams.stale_host = self._stale
        else:  # the manager's own seam (the references')
            engine.bm.host_frees_early = self._frees_early

    def _store_early(self, seq, why: str) -> bool:
        """The hazard window: a store of blocks the step in flight still writes."""
        e, step = self.engine, self.engine.step_count
        bs = e.bm.block_size
        blocks = sorted({w[3] // bs for w in e.inflight.writes[seq.id] if w[0] == 0})
        self.trigger(step, {"req": seq.id, "why": why, "inflight": e.inflight.step})
        if not self.defect:
            self.remediated += 1  # the engine fences: the step completes, then the copy
            return False
        d = {"step": step, "req": seq.id, "blocks": blocks}
        self.early.append(d)
        self.touch(requests=[seq.id], blocks=blocks)
        self.fired(step, d)
        return True

    def _flip(self, seq) -> bool:
        """The hazard window: a restore issued (its copy in flight)."""
        step = self.engine.step_count
        self.trigger(step, {"req": seq.id})
        if not self.defect:
            self.remediated += 1  # scheduled once the copy completed
            return False
        self.flipped[seq.id] = step
        return True

    def _stale(self, seq, blocks: list) -> bool:
        """The hazard window: a restored request writes blocks its host copy still holds."""
        step = self.engine.step_count
        self.trigger(step, {"req": seq.id, "blocks": blocks})
        if not self.defect:
            self.remediated += 1  # the host copies are dropped: the next store copies them
            return False
        self.dirty.setdefault(seq.id, set()).update(blocks)
        return True

    def _frees_early(self, req: str) -> bool:
        """The hazard window: a store completed, its request stored out, slots still held."""
        step = self.engine.step_count
        self.trigger(step, {"req": req})
        if not self.defect:
            self.remediated += 1  # the slots stay held until the restore completed
            return False
        slots = list(self.engine.bm.host_slots[req])
        d = {"step": step, "req": req, "slots": slots}
        self.freed.append(d)
        self.touch(requests=[req])
        self.fired(step, d)
        return True

    def after_step(self, engine, step: int, output) -> None:
        if self.na:
            return
        if self.p["variant"] == "stale_host":
            for req, kept in engine.tier.reused:  # a store took host copies as they were
                stale = sorted(self.dirty.pop(req, set()) & set(kept))
                if stale:
                    d = {"step": step, "req": req, "blocks": stale}
                    self.early.append(d)
                    self.touch(requests=[req], blocks=stale)
                    self.fired(step, d)
            return
        if not self.flipped:
            return
        for req, blocks, _ in engine.tier.reads:  # the engine's own note, as it computed
            if self.flipped.pop(req, None) is not None:
                d = {"step": step, "req": req, "blocks": blocks}
                self.raced.append(d)
                self.touch(requests=[req], blocks=blocks)
                self.fired(step, d)
        copies = engine.tier.copies
        for req in [q for q in self.flipped if q not in copies]:
            del self.flipped[req]  # completed before it computed: nothing read early

    def verify(self) -> dict:
        return {
            **super().verify(),
            "variant": self.p["variant"],
            "early": getattr(self, "early", []),
            "raced": getattr(self, "raced", []),
            "freed": getattr(self, "freed", []),
            **({"not_applicable": self.na} if getattr(self, "na", None) else {}),
        }

    @classmethod
    def explains(cls, finding: dict, truth: dict) -> str | None:
        s, ev, kind = finding["step"], finding.get("evidence") or {}, finding.get("kind")
        done = [x for k in ("early", "raced", "freed") for x in truth.get(k, []) if x["step"] <= s]
        reqs = {x["req"] for x in done}
        if not reqs:
            return None
        variant = truth.get("variant")
        if finding.get("checker") == "offload":
            if variant in ("store_before_compute", "stale_host"):
                return "cause" if kind == "store_content" and ev.get("req") in reqs else None
            if variant == "restore_race":
                named = kind in ("read_in_flight", "restore_content") and ev.get("req") in reqs
                return "cause" if named else None
            slots = {x for d in done for x in d.get("slots", ())}
            mine = ev.get("req") in reqs or bool(slots & set(ev.get("slots") or ()))
            return "cause" if kind in ("tier_map", "restore_content") and mine else None
        if finding.get("checker") == "oracle_divergence" and kind == "divergence":
            return "consequence" if ev.get("req") in reqs else None
        # a raced restore's blocks: computed on before the copy landed, then the late copy
        # landed over what was computed (a prefix cache keyed them and serves them on)
        raced = {b for x in truth.get("raced", []) if x["step"] <= s for b in x["blocks"]}
        over = ev.get("block") in raced
        if finding.get("checker") == "kv_reads":  # the writer record (a prefix cache's runs)
            if kind in ("wrong_read", "unwritten_read") and ev.get("req") in reqs:
                # the request that computed on what the copy had not brought; slots given back
                # early may not have been written over (the offload checker's restore_content
                # says when they were): no catch of its own
                return "consequence" if variant == "host_slot_freed" else "cause"
            return "consequence" if ev.get("origin") in reqs or over else None
        if finding.get("checker") == "prefix_cache" and kind == "cache_content":
            after = ev.get("parent_block") in raced  # keyed after such a block
            return "consequence" if set(ev.get("writers") or ()) & reqs or over or after else None
        return None
