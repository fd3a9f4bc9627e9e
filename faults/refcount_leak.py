"""Failure mode 2: reference-count leak on cancel. One cancel path skips the free, so the
cancelled sequence's blocks never return to the pool; under a cancel storm the pool drains."""

from __future__ import annotations

from typing_extensions import NotRequired, TypedDict

from kvchaos.faults import base
from kvchaos.faults.base import FRACTION, Fault, ListOf, Num
from kvchaos.faults.plan import Action

PATHS = ("waiting", "prefill", "decode", "preempted", "shared")


class Leak(TypedDict):
    step: NotRequired[int]
    req: str
    blocks: list[int]  # the blocks whose free was skipped


class Truth(base.Truth):
    leaks: NotRequired[list[Leak]]


class RefcountLeak(Fault):
    name = "refcount_leak"
    detectors = ("block_accounting", "liveness")
    truth = Truth
    root_cause = (
        "A cancel path returned without releasing the sequence's blocks: their reference counts "
        "never dropped, so they stayed out of the free pool with no live owner."
    )
    remediation = (
        "Own blocks through a handle that frees on every exit path (context manager / "
        "try-finally) and make free idempotent, so cancel, finish, preempt and error all release."
    )
    defaults = {
        "paths": list(PATHS),
        "fraction": 1.0,
        "cancel_phases": ["prefill", "decode", "shared"],
        "storm_step": None,
        "storm_fraction": 0.5,
    }
    domains = {
        "paths": ListOf(PATHS),
        "fraction": FRACTION,
        "cancel_phases": ListOf(PATHS),
        "storm_step": Num(int, ge=1, optional=True),
        "storm_fraction": FRACTION,
    }  # storm_step None: no storm

    def shape(self, plan, cfg) -> None:
        subs = [a for a in plan.actions if a.op == "submit"]
        forks = [a for a in plan.actions if a.op == "fork"]
        for i, phase in enumerate(self.p["cancel_phases"]):
            if phase == "shared" and forks:
                plan.add(
                    Action(1, "cancel", forks[i % len(forks)].req, when="shared", origin=self.name)
                )
            elif subs and phase != "shared":
                t = subs[(2 * i + 1) % len(subs)]
                plan.add(Action(t.step, "cancel", t.req, when=phase, origin=self.name))
        if self.p["storm_step"] is not None:
            for a in subs:
                if a.step <= self.p["storm_step"] and self.rng.random() < self.p["storm_fraction"]:
                    plan.add(Action(self.p["storm_step"], "cancel", a.req, origin=self.name))

    def arm(self, engine, emit) -> None:
        super().arm(engine, emit)
        self.leaked: list[dict] = []
        paths, frac, rng = set(self.p["paths"]), self.p["fraction"], self.rng

        def free_on_exit(seq, reason: str) -> bool:
            """The trigger is a cancel on one of the paths of a request holding blocks; with the
            defect planted, that cancel skips the free; else the free happens (remediation)."""
            if reason != "cancel":
                return True
            snap = engine.snapshot()  # once per cancel: the protocol's only view of ref counts
            blocks = snap.seq_blocks.get(seq.id, [])
            shared = any(snap.ref_counts[b] > 1 for b in blocks)
            path = "shared" if shared else seq.phase
            if path not in paths or not blocks:
                return True
            step = engine.step_count + 1
            self.trigger(step)
            if self.defect and rng.random() < frac:
                self.leaked.append({"req": seq.id, "path": path, "blocks": blocks, "step": step})
                self.touch(requests=[seq.id], blocks=blocks)
                self.fired(step, {"req": seq.id, "path": path, "blocks": blocks})
                return False
            self.remediated += 1
            return True

        engine.seams.free_on_exit = free_on_exit

    def verify(self) -> dict:
        return {
            **super().verify(),
            "skipped_frees": len(self.leaked),
            "leaked_blocks": sum(len(x["blocks"]) for x in self.leaked),
            "leaks": self.leaked,
        }

    @classmethod
    def explains(cls, finding: dict, truth: dict) -> str | None:
        s, ev, kind = finding["step"], finding.get("evidence", {}), finding.get("kind")
        leaks = [x for x in truth.get("leaks", []) if x.get("step", 0) <= s]
        if not leaks:
            return None
        reqs = {x["req"] for x in leaks}
        blocks = {b for x in leaks for b in x["blocks"]}
        if kind == "leak":
            return "cause" if ev.get("req") in reqs else None
        if kind in ("refcount", "free_referenced", "conservation"):
            named = set(ev.get("blocks") or [])
            return "cause" if named and named <= blocks else None
        if kind == "end_leak":
            missing = ev.get("total", 0) - ev.get("free", 0)
            return "cause" if 0 < missing <= len(blocks) else None
        if kind in ("starvation", "unfinished"):
            # only while the leak shrinks the usable pool below what the queue needs to move
            need, pool = ev.get("blocked_need"), ev.get("num_blocks")
            ok = need is not None and pool is not None and pool - len(blocks) < need <= pool
            return "consequence" if ok else None
        return None
