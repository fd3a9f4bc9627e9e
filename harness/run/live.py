"""One run's live state: the engine on the scenario's config and block manager, the faults armed
on its seams, the workload plan's pending actions, logits waiting for the oracle. The loop drives
it step by step and appends every event to the History."""

from __future__ import annotations

import time
from dataclasses import replace

from kvchaos.engine.distributed import DistEngine
from kvchaos.engine.engine import Engine
from kvchaos.engine.errors import InvalidRequest, RequestRejected
from kvchaos.engine.sequence import State
from kvchaos.faults import make_fault
from kvchaos.faults.plan import Action
from kvchaos.harness.check.snapshots import judge
from kvchaos.harness.history.log import History
from kvchaos.harness.run.cache_state import CacheWatch
from kvchaos.harness.run.kv_record import RankRecords
from kvchaos.harness.run.kv_tier import KINDS as TIER_KINDS
from kvchaos.harness.run.kv_tier import TierRecord
from kvchaos.harness.run.oracle import Oracle
from kvchaos.harness.run.oracle_feed import OracleFeed
from kvchaos.harness.run.telemetry import Telemetry
from kvchaos.harness.run.workload import build_plan
from kvchaos.harness.run.writes import unslotted_writes
from kvchaos.harness.scenario.spec import Scenario


class LiveRun:
    """One run's live state: engine, faults, pending actions, logits awaiting the oracle."""

    def __init__(
        self,
        sc: Scenario,
        seed: int,
        device: str,
        history: History,
        block_manager=None,
        tp: dict | None = None,
        cluster=None,
        observe: bool = True,
    ) -> None:
        self.sc, self.seed, self.h = sc, seed, history
        # observe=False: the engine and workload alone, nothing recorded (the overhead baseline)
        self.observe = observe
        self.cfg = replace(sc.engine_config(device=device, seed=seed), **(tp or {}))
        cc = self.cfg.cache
        bm = (
            block_manager(cc.num_blocks, cc.block_size, cc.max_num_seqs, cc.max_blocks_per_seq)
            if block_manager is not None
            else None
        )
        self.engine = (
            Engine(self.cfg, bm)
            if self.cfg.tp_mode == "simulated"
            else DistEngine(self.cfg, bm, cluster)
        )
        self.faults = [make_fault(f.name, f.defect, f.params, seed) for f in sc.faults]
        self.plan = build_plan(
            sc.workload,
            self.cfg.model.vocab_size,
            seed,
            self.cfg.cache.block_size,
            self.cfg.cache,
            self.cfg.max_prefill_tokens,
        )
        for f in self.faults:
            f.shape(self.plan, self.cfg)
        self.actions = self.plan.by_step()
        self.pending: list = []  # actions waiting for their request to reach a phase
        self.snapped = -1  # the step of the last snapshot
        self.rejected: set[str] = set()
        # The oracle is fed each request's prompt as planned, never the engine's copy of it.
        self.planned = {a.req: list(a.prompt) for a in self.plan.actions if a.op == "submit"}
        self.oracle = OracleFeed(Oracle(self.engine.model), self.engine, history, self.planned)
        self.last_snap = (-1, None)  # (step, Snapshot) of the latest snapshot
        # the fields of the latest snapshot that passed, its cache as cache_delta keeps it (judge)
        self.passed: dict = {}
        self.observe_s = 0.0  # the harness's own time inside the step now running (snapshots)
        self.observe_cpu = 0.0  # ... and its CPU time
        self.engine.record_writes = observe
        if observe:  # every call into the manager, in the history (not in its digest)
            self.engine.bm.start_log()
        self.kv: RankRecords | None = None  # the per-block writer record, armed with a cache
        self.kv_tier: TierRecord | None = None  # ... and the host tier's copies in it
        self.telemetry = Telemetry.from_env(device)

    def snapshot(self, step: int) -> None:
        e = self.engine
        self.snapped = step
        snap = e.snapshot()
        wrong, d, cache = judge(snap, e, self.cfg.cache.num_blocks, self.passed)
        if wrong:  # the manager's word fails its own shape or the harness's record: a finding
            self.h.append({"e": "snapshot_invalid", "step": step, "problem": wrong})
            return
        self.last_snap = (step, snap)
        live = e.scheduler.live()  # (those waiting for their KV to land hold blocks too)
        live = self.passed["live"] if live == self.passed.get("live") else live  # as judge does
        self.passed = {
            **d,
            "live": live,
            # a cache is diffed against the last one shown (a snapshot without one keeps it)
            "cache": self.passed.get("cache") if cache is None else cache,
        }
        ev = {"e": "snapshot", "step": step, **d, "live": live}
        stride = e.kernel_stride()
        if stride is not None:  # the kernels read this table at another stride: judged as read
            ev["kernel_stride"] = stride
        ev.update(e.kernel_geometry())  # ... or in another block size, or a pool sized short
        self.h.append(ev)

    def _check_writes(self, step: int) -> None:
        """The blocks each sequence's KV was written to this step (the engine's slot mapping, the
        harness's own record) must be ones the snapshot of this step lists for it, none free;
        and every position written must have a slot reserved (unslotted_write)."""
        snap_step, snap = self.last_snap
        snap = snap if snap_step == step else None
        if self.engine.unslotted or snap is not None:
            for ev in unslotted_writes(self.engine, snap, step):
                self.h.append(ev)
        if snap is None:
            return
        free, held = set(snap.free), snap.seq_blocks
        for req, blocks in self.engine.written.items():
            owned = held.get(req, ())  # a few blocks a step: no set of them
            stray = sorted(b for b in blocks if b not in owned or b in free)
            if stray:
                self.h.append(
                    {
                        "e": "foreign_write",
                        "step": step,
                        "req": req,
                        "blocks": stray,
                        "owned": sorted(set(owned)),
                        "ranks": sorted(set().union(*(blocks[b] for b in stray))),
                    }
                )

    def _check_landed(self, step: int) -> None:
        """Asynchronous scheduling: in-flight writes of a released sequence landed in this step
        (or before it, between steps); the blocks must still be its own by the snapshot."""
        landed, self.engine.inflight.landed = self.engine.inflight.landed, []
        if self.last_snap[0] != step:
            self.snapshot(step)
        snap_step, snap = self.last_snap
        if snap_step != step:  # the manager's snapshot failed its own shape: a finding already
            return
        free, held = set(snap.free), snap.seq_blocks
        for x in landed:
            owned = held.get(x["req"], ())
            stray = sorted(b for b in x["blocks"] if b not in owned or b in free)
            ranks = sorted({w[0] for w in x["writes"]})
            if stray:
                ev = {"step": step, "req": x["req"], "blocks": stray, "owned": sorted(set(owned))}
                self.h.append({"e": "foreign_write", **ev, "ranks": ranks})

    def arm(self) -> None:
        """Attach the faults to the engine's seams (after run_start: the history opens with it).
        Snapshots are taken as each step's table is uploaded, so checkers see the very table the
        kernels read (a row spilled into and cleaned up within one step is still caught)."""
        e = self.engine
        every = self.sc.run.snapshot_every
        if self.observe:

            def on_upload() -> None:
                if e.step_count % every == 0:
                    self.snapshot(e.step_count)

            e.seams.on_upload = on_upload
        if self.observe and "prefix_cache" in e.capabilities:  # reads of KV other requests wrote
            self.kv = RankRecords(e.bm.num_blocks, e.bm.block_size, len(e.ranks.ranks))
            pool = lambda: e.kv_pools[0].shape[2]  # noqa: E731
            self.kv_tier = TierRecord(self.kv, e.tier, pool) if e.tier is not None else None
            self.cache_watch = CacheWatch(e.bm.block_size)
            e.seams.on_batch = self.kv.on_batch
            self.h.append({"e": "kv_record", "step": 0, "ranks": len(e.ranks.ranks)})
        e.seams.on_event = self._engine_event
        for f in self.faults:
            f.arm(
                e,
                lambda kind, detail, step=None, f=f: self.h.append(
                    {
                        "e": "fault",
                        "step": e.step_count if step is None else step,
                        "fault": f.name,
                        "kind": kind,
                        "detail": detail,
                    }
                ),
            )
            self.h.append(
                {"e": "fault", "step": 0, "fault": f.name, "kind": "armed", "detail": f.describe()}
            )
        looks = e.seams.on_upload  # the snapshot, and what faults look at there (their truth)

        def timed_upload_hook() -> None:  # the harness's time and the faults': not the engine's
            t, c = time.perf_counter(), time.thread_time()
            looks()
            self.observe_s += time.perf_counter() - t
            self.observe_cpu += time.thread_time() - c

        e.seams.on_upload = timed_upload_hook

    def _engine_event(self, kind: str, data: dict) -> None:
        if self.kv is not None:  # copies reach the record before the step's writes
            seqs, step = self.engine.seqs, self.engine.step_count
            self.kv.on_engine(kind, data, step, lambda q: seqs[q].tokens)
            if kind in TIER_KINDS and self.kv_tier is not None:
                self.kv_tier.on(kind, data)
            elif kind == "hit":
                self.kv.hit(data["req"], data["blocks"])
                self.cache_watch.hit(step, data["req"], seqs[data["req"]].tokens, data["blocks"])
        self.h.append({"e": "engine", "step": self.engine.step_count, "kind": kind, "data": data})

    def _check_reads(self, step: int) -> None:
        """Commit the step's batch to the writer record: each read of KV written for other
        tokens (or never written, or computed from a wrong read) is a kv_read event."""
        seqs = self.engine.seqs
        for f in self.kv.commit(step, lambda s: seqs[s].tokens):
            self.h.append({"e": "kv_read", "step": step, **f})
        snap_step, snap = self.last_snap
        if snap_step == step:  # the cache as the manager tells it, against what was written
            state = self.passed.get("cache")
            for ev in self.cache_watch.check(self.kv.records[0], snap.cache, step, state):
                self.h.append(ev)

    # -- actions ----------------------------------------------------------------------
    def _phase(self, req: str) -> str | None:
        seq = self.engine.seqs.get(req)
        if seq is None:
            return None
        if seq.state is State.RUNNING:
            snap = self.engine.snapshot()
            blocks = snap.seq_blocks.get(req, [])
            if any(snap.ref_counts[b] > 1 for b in blocks):
                return "shared"
        if seq.state is State.WAITING and seq.id in self.engine.scheduler.loading:
            return "loading"  # waiting, holding the blocks its KV lands in
        c = self.engine.tier.copies.get(req) if self.engine.tier is not None else None
        if seq.tier == "restoring" and c is not None and c.done:
            return "landing"  # restoring, some of its blocks landed (a host tier's bandwidth)
        return seq.phase

    def _waits(self, a) -> bool | None:
        """True: a waits for its target's phase; None: drop it; False: do it now. A fork or
        cancel of an ended request is dropped; a turn, or a submit `after` one, goes ahead."""
        own = ("cancel", "pause", "resume")
        target = a.req if a.op in own else a.after if a.op == "submit" else a.parent
        if target is None:
            return False
        seq = self.engine.seqs.get(target)
        if seq is None:
            if target not in self.rejected:
                return True  # not submitted yet
            if a.op == "turn":  # nothing to continue: its own turns are dropped after it
                self.rejected.add(a.req)
            return False if a.op == "submit" else None
        if seq.done:
            return False if a.op in ("submit", "turn") else None
        if a.when is not None:
            phase = self._phase(target)
            return phase != a.when and not (a.when == "decode" and phase == "shared")
        return False

    def _continued(self, a) -> list[int]:
        """The planned prompt of a fork's child or a conversation's next turn: the parent's
        planned prompt, its generated tokens (which the parent's own check verifies), then the
        action's own new tokens."""
        parent = self.engine.seqs[a.parent]
        return (
            self.planned.get(a.parent, parent.tokens[: parent.prompt_len])
            + parent.tokens[parent.prompt_len :]
            + list(a.prompt)
        )

    def _submitted(self, a, step: int, prompt_len: int, **links) -> None:
        e = self.engine
        # with a prefix cache, the ids the manager is given: the reference replays them
        ids = {"prompt_ids": e.seqs[a.req].tokens[:prompt_len]} if self.kv is not None else {}
        self.h.append(
            {
                "e": "submit",
                "step": step,
                "req": a.req,
                "prompt_len": prompt_len,
                "max_new": a.max_new,
                **links,
                "origin": a.origin,
                **ids,
            }
        )

    def _do(self, a, step: int) -> bool:
        """Apply an action; False if it must wait (phase not reached yet)."""
        e = self.engine
        waits = self._waits(a)
        if waits is None:
            return True
        if waits:
            return False
        try:
            if a.op == "submit":
                e.add_request(a.req, a.prompt, a.max_new)
                self._submitted(a, step, len(a.prompt), parent=None)
            elif a.op == "fork":
                self.planned[a.req] = self._continued(a)
                e.fork(a.parent, a.req, a.max_new, a.prompt)
                self._submitted(a, step, len(e.seqs[a.req].tokens), parent=a.parent)
            elif a.op == "turn":
                self.planned[a.req] = self._continued(a)
                e.add_request(a.req, e.seqs[a.parent].tokens + list(a.prompt), a.max_new)
                self._submitted(a, step, len(e.seqs[a.req].tokens), parent=None, turn_of=a.parent)
            elif a.op == "pause":  # a session's think time: idle, resumed after it
                if e.pause(a.req):
                    back = step + max(1, a.max_new)
                    self.actions.setdefault(back, []).append(
                        Action(back, "resume", a.req, origin=a.origin)
                    )
            elif a.op == "resume":
                e.resume(a.req)
            elif a.op == "cancel":
                seq = e.seqs.get(a.req)
                if seq is None or seq.done:
                    return True
                if not self.observe:
                    e.cancel(a.req)
                    return True
                phase, before = (
                    self._phase(a.req),
                    seq.phase,
                )  # before the cancel makes it "cancelled"
                snap = e.snapshot()
                blocks = snap.seq_blocks.get(a.req, [])
                e.cancel(a.req)
                self.h.append(
                    {
                        "e": "cancel",
                        "step": step,
                        "req": a.req,
                        "phase": before if phase in ("shared", "loading", "landing") else phase,
                        "shared": phase == "shared",
                        "blocks": blocks,
                        "origin": a.origin,
                    }
                )
                self.oracle.done(a.req, step)
        except (InvalidRequest, RequestRejected) as err:
            self.rejected.add(a.req)
            self.h.append(
                {
                    "e": "reject",
                    "step": step,
                    "req": a.req,
                    "error": type(err).__name__,
                    "message": str(err),
                    "origin": a.origin,
                }
            )
        return True

    def _log_calls(self, step: int) -> None:
        calls = self.engine.bm.drain()
        if calls:
            self.h.append({"e": "calls", "step": step, "calls": calls})

    # -- the loop ---------------------------------------------------------------------
    def run(self, deadline: float | None = None) -> str:
        e, h, run = self.engine, self.h, self.sc.run
        step = 0
        while step < run.max_steps:
            step = e.step_count + 1
            self.pending += self.actions.pop(step, [])
            self.pending = [a for a in self.pending if not self._do(a, step)]
            if not e.has_unfinished() and not self.actions:
                return "done"
            for f in self.faults:
                f.before_step(e, step)
            try:
                out = e.step()
            except BaseException:
                if self.kv is not None:
                    self.kv.abort(e.step_count)
                self._log_calls(e.step_count)  # the failing call is the last of them
                raise
            st = out.stats
            if self.kv is not None:
                self._check_reads(st.step)
            if self.observe and out.stats.decode_tokens + out.stats.prefill_tokens:
                self._check_writes(st.step)
            if self.observe and e.tier is not None:  # computed on a restore in flight
                for req, blocks, issued in e.tier.reads:
                    ev = {"step": st.step, "req": req, "blocks": blocks, "issued": issued}
                    h.append({"e": "tier_read", **ev})
            if self.observe and e.inflight is not None and e.inflight.landed:
                self._check_landed(st.step)
            for f in self.faults:
                f.after_step(e, st.step, out)
            if not self.observe:
                continue
            if self.snapped != st.step and st.step % run.snapshot_every == 0:
                self.snapshot(
                    st.step
                )  # nothing was uploaded (nothing could run): still look, every step
            # the harness's snapshots ran inside the step (the one at upload, those the boundary
            # takes to judge refusals): the step's timings are the engine's without them
            at_upload, box = self.observe_s, e.bm.snapshot_s
            spent_cpu, self.observe_cpu = self.observe_cpu + box[0], 0.0  # box: wall, as CPU
            spent, self.observe_s, box[0] = at_upload + box[0], 0.0, 0.0
            self._log_calls(st.step)
            h.append(
                {
                    "e": "step",
                    "step": st.step,
                    "latency_s": max(0.0, st.latency_s - spent),
                    "host_s": max(0.0, st.host_s - spent),
                    "upload_s": max(0.0, st.upload_s - at_upload),
                    "harness_s": spent,
                    "stage_s": st.stage_s,
                    "probe_s": st.probe_s,
                    "host_cpu_s": max(0.0, st.host_cpu_s - spent_cpu),
                    "wait_s": st.wait_s,
                    "cpu_s": st.cpu_s,
                    "free_blocks": st.free_blocks,
                    "running": st.num_running,
                    "waiting": st.num_waiting,
                    "prefill_tokens": st.prefill_tokens,
                    "decode_tokens": st.decode_tokens,
                    "preempted": st.preempted,
                    "tokens": out.tokens,
                    "finished": out.finished,
                    **({"failed": out.failed} if out.failed else {}),
                    "table_version": st.table_version,
                    "stale_ranks": st.stale_ranks,
                    "rank_crcs": st.rank_table_crcs,
                    "table_crc": st.table_crc,
                    **self.telemetry.step_fields(st.step),
                }
            )
            self.oracle.step(st.step, out)
            h.flush()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run exceeded its time limit at step {st.step}")
        return "max_steps"

    def finish(self, reason: str) -> dict:
        # The oracle first: what the queue holds is lost if anything after it fails.
        self.oracle.finish(self.engine.step_count)
        # The final state: after the last step's frees and any cancels that came after it.
        if self.observe:
            self._log_calls(self.engine.step_count + 1)
        self.snapshot(self.engine.step_count + 1)
        verify = {
            f.name: f.verify() if f.defect else {"planted": False, **f.verify()}
            for f in self.faults
        }
        self.h.append(
            {
                "e": "run_end",
                "step": self.engine.step_count,
                "reason": reason,
                "counters": dict(self.engine.counters),
                "manager_calls": dict(self.engine.bm.calls),
                "fault_verify": verify,
                "telemetry": self.telemetry.summary(),
                **(
                    {"kv_record": {**self.kv.stats(), "cache_untold": self.cache_watch.untold}}
                    if self.kv is not None
                    else {}
                ),
            }
        )
        return verify
