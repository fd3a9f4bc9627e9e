"""Failure mode 2: reference-count leak on cancel. One cancel path skips the free, so the
cancelled sequence's blocks never return to the pool; under a cancel storm the pool drains.
params.variant picks the leak class (faults/leak_variants.py); "any" is the article's case."""

from __future__ import annotations

from typing_extensions import NotRequired, TypedDict

from kvchaos.engine.block_manager import BlockManager
from kvchaos.engine.block_pool import PrefixBlockPool
from kvchaos.engine.errors import RequestFailed
from kvchaos.engine.prefix_manager import PrefixCachingManager
from kvchaos.engine.sequence import State
from kvchaos.faults import base, leak_variants
from kvchaos.faults.base import FRACTION, Fault, ListOf, Num, ParamError
from kvchaos.faults.leak_variants import ENGINE_PATH, RATE_STRIDE, VARIANTS
from kvchaos.faults.plan import Action

PATHS = ("waiting", "prefill", "decode", "preempted", "shared")


class Leak(TypedDict):
    step: NotRequired[int]
    req: str
    blocks: list[int]  # the blocks whose free was skipped


class Truth(base.Truth):
    leaks: NotRequired[list[Leak]]
    variant: NotRequired[str]
    not_applicable: NotRequired[str | None]
    free_trend: NotRequired[list[list[int]]]  # [step, blocks lost so far] at each leak


class RefcountLeak(Fault):
    name = "refcount_leak"
    detectors = ("block_accounting", "liveness")  # retry: manager_calls too (its refusal)
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
        "variant": "any",
        "cancels": 4,
    }
    # params added after its first runs: described only when set, so the histories of runs that
    # leave them unset stay what they were
    LATER = ("variant", "cancels")
    domains = {
        "paths": ListOf(PATHS),
        "fraction": FRACTION,
        "cancel_phases": ListOf(PATHS),
        "storm_step": Num(int, ge=1, optional=True),
        "storm_fraction": FRACTION,
        "cancels": Num(int, ge=1, le=64),  # a variant's trigger rounds
    }  # storm_step None: no storm
    variants, bare_default = VARIANTS, True

    def __init__(self, defect: bool, params: dict, seed: int) -> None:
        super().__init__(defect, params, seed)
        self.schedule: dict[str, int] = {}  # waiting, engine_abort: their requests (shape)

    def describe(self) -> dict:
        d = super().describe()
        d["params"] = {
            k: v for k, v in d["params"].items() if k not in self.LATER or v != self.defaults[k]
        }
        return d

    @classmethod
    def check_engine(cls, p: dict, cfg) -> None:
        v, cc = p["variant"], cfg.cache
        if v == "retry" and not cc.prefix_caching:
            raise ParamError(
                cls.name,
                "variant",
                "retry leaks a refused admission's cache hit: set [engine.cache] "
                "prefix_caching = true",
            )
        if v == "retry" and leak_variants.retry_need(cfg) + 4 >= cc.num_blocks:
            raise ParamError(
                cls.name,
                "variant",
                f"retry's fillers hold all but {leak_variants.retry_need(cfg) - 1} blocks: "
                f"[engine.cache] num_blocks {cc.num_blocks} is too small",
            )
        if v == "prefill" and cc.max_tokens_per_seq - 4 <= cfg.max_prefill_tokens:
            raise ParamError(
                cls.name,
                "variant",
                f"prefill's requests need more than one chunk ({cfg.max_prefill_tokens} "
                f"tokens) within a row of {cc.max_tokens_per_seq}",
            )

    def shape(self, plan, cfg) -> None:
        if self.p["variant"] != "any":
            v = self.p["variant"]
            self.schedule = leak_variants.shape(v, self.p["cancels"], plan, cfg, self.rng)
            return
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
        self.engine, self.na, self.cancels_seen = engine, None, 0
        v = self.p["variant"]
        self.phase_offset = self.rng.randrange(RATE_STRIDE) if v == "rate" else 0
        if v not in ENGINE_PATH:
            self._arm_manager(engine, emit, v)
            return
        paths = set(self.p["paths"]) if v in ("any", "rate") else {v}
        frac, rng = self.p["fraction"], self.rng
        exit_reason = "error" if v == "engine_abort" else "cancel"
        self._arm_schedule(engine, v)

        def free_on_exit(seq, reason: str) -> bool:
            """The trigger is a cancel on one of the paths of a request holding blocks (for
            engine_abort, the engine's own abort of a failed request); with the defect planted,
            that exit skips the free; else the free happens (remediation)."""
            if reason != exit_reason or (v == "engine_abort" and seq.state is not State.FAILED):
                return True  # (engine_abort: a failed step's "error" preemption is no abort)
            snap = engine.snapshot()  # once per exit: the protocol's only view of ref counts
            blocks = snap.seq_blocks.get(seq.id, [])
            shared = any(snap.ref_counts[b] > 1 for b in blocks)
            path = v if v in ("waiting", "engine_abort") and seq.phase in (v, "failed") else None
            path = path or ("shared" if shared else seq.phase)
            if path not in paths or not blocks:
                return True
            step = engine.step_count + (1 if reason == "cancel" else 0)
            if reason == "cancel":  # (engine_abort's trigger is its raise)
                self.trigger(step)
            if v == "rate":  # one cancel in RATE_STRIDE, from a seeded offset
                self.cancels_seen += 1
                leak = (self.cancels_seen + self.phase_offset) % RATE_STRIDE == 0
            else:
                leak = rng.random() < frac
            if self.defect and leak:
                self._leak(step, seq.id, path, blocks)
                return False
            self.remediated += 1
            return True

        engine.seams.free_on_exit = free_on_exit

    def _arm_schedule(self, engine, v: str) -> None:
        """waiting: its requests' KV lands LOAD_STEPS after admission (their first only);
        engine_abort: each of its requests raises RequestFailed at its scheduled token."""
        sched, asked = self.schedule, set()
        if v == "waiting":

            def kv_load_steps(seq) -> int:
                if seq.id not in sched or seq.id in asked:
                    return 0
                asked.add(seq.id)
                return sched[seq.id]

            engine.seams.kv_load_steps = kv_load_steps
        elif v == "engine_abort":

            def on_sample(seq) -> None:
                k = sched.get(seq.id)
                if k is None or seq.num_generated + 1 != k:
                    return
                self.trigger(engine.step_count, {"req": seq.id, "token": k})
                raise RequestFailed(f"request {seq.id}: sampling failed at token {k} (planted)")

            engine.seams.on_sample = on_sample

    def _leak(self, step: int, req: str, path: str, blocks: list[int]) -> None:
        x = {"req": req, "path": path, "blocks": blocks, "step": step}
        self.leaked.append(x)
        self.touch(requests=[req], blocks=blocks)
        if self.p["variant"] == "any":  # (the article's case records what it always did)
            self.fired(step, {"req": req, "path": path, "blocks": blocks})
            return
        lost = sum(len(y["blocks"]) for y in self.leaked)
        self.fired(step, {**x, "leaked_so_far": lost})

    def _arm_manager(self, engine, emit, v: str) -> None:
        """preempted, partial: the reference managers' release_skips; retry: the prefix pool's
        check_before_touch. Another manager: not applicable, said so."""
        m = getattr(engine.bm, "manager", engine.bm)
        ref = isinstance(m, (BlockManager, PrefixCachingManager))
        pool = getattr(m, "pool", None)
        if v == "retry" and not isinstance(pool, PrefixBlockPool):
            ref = False
        if not ref:
            what = "PrefixCachingManager" if v == "retry" else "BlockManager, PrefixCachingManager"
            self.na = f"{v} plants in the reference managers ({what}), not in {type(m).__name__}"
            emit("not_applicable", {"reason": self.na}, 0)
            return
        if v == "retry":
            pool.seams.on_refused = self._refused
            pool.seams.check_before_touch = not self.defect
            return
        refs = pool.ref
        reason = "aborted" if v == "partial" else "preempted"

        def release_skips(seq_id: str, why: str, blocks: list) -> list:
            shared = [b for b in blocks if refs[b] > 1]
            if why != reason or not blocks or (v == "partial" and not shared):
                return []
            step = engine.step_count + (0 if v == "preempted" else 1)
            self.trigger(step)
            if not self.defect:
                self.remediated += 1
                return []
            kept = shared if v == "partial" else list(blocks)
            self._leak(step, seq_id, "shared" if v == "partial" else "preempted", kept)
            return kept

        m.release_skips = release_skips

    def _refused(self, seq_id: str, hit: list) -> None:
        """A refused admission with a cache hit: the defect leaves the hit touched."""
        if not hit:
            return
        step = self.engine.step_count
        self.trigger(step)
        if self.defect:
            self._leak(step, seq_id, "retry", list(hit))
        else:
            self.remediated += 1

    def verify(self) -> dict:
        out = {
            **super().verify(),
            "skipped_frees": len(self.leaked),
            "leaked_blocks": sum(len(x["blocks"]) for x in self.leaked),
            "leaks": self.leaked,
        }
        if self.p["variant"] != "any":  # (the article's case records what it always did)
            out["variant"] = self.p["variant"]
            out["not_applicable"] = getattr(self, "na", None)
            trend, lost = [], 0
            for x in self.leaked:
                lost += len(x["blocks"])
                trend.append([x["step"], lost])
            out["free_trend"] = trend  # [step, blocks lost so far]: the pool's drain
        return out

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
        if kind == "refusal_changed_state":  # retry: the refusal left its hit touched
            return "cause" if ev.get("seq") in reqs else None
        if kind in ("refcount", "free_referenced", "conservation"):
            named = set(ev.get("blocks") or [])
            return "cause" if named and named <= blocks else None
        if kind == "end_leak":
            missing = ev.get("total", 0) - ev.get("free", 0)
            return "cause" if 0 < missing <= len(blocks) else None
        if finding.get("checker") == "offload" and kind == "tier_map":
            # a leaked request's release never reached the manager: it still names the device
            # blocks a restore gave it (the tier map still has it stored out)
            named = set(ev.get("blocks") or [])
            return "consequence" if ev.get("req") in reqs and named and named <= blocks else None
        if kind in ("starvation", "unfinished"):
            # only while the leak shrinks the usable pool below what the queue needs to move
            need, pool = ev.get("blocked_need"), ev.get("num_blocks")
            ok = need is not None and pool is not None and pool - len(blocks) < need <= pool
            return "consequence" if ok else None
        return None
