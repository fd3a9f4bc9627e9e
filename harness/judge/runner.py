"""The runner: scenario + seed -> engine, workload, faults -> run -> history -> checkers -> verdict.
History first, check after: everything is on disk before any checker reads it."""

from __future__ import annotations

import datetime as dt
import functools
import importlib
import json
import os
import subprocess
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvchaos.engine.distributed import DistEngine
from kvchaos.engine.engine import Engine
from kvchaos.engine.errors import InvalidRequest, RequestRejected
from kvchaos.engine.sequence import State
from kvchaos.faults import make_fault
from kvchaos.harness.judge.checkers import run_checkers
from kvchaos.harness.judge.history import History
from kvchaos.harness.judge.oracle import Oracle
from kvchaos.harness.judge.scenario import Scenario
from kvchaos.harness.judge.telemetry import Telemetry
from kvchaos.harness.judge.toml_writer import dumps
from kvchaos.harness.judge.verdict import decide
from kvchaos.harness.judge.workload import build_plan

DEFAULT_REPORT_DIR = Path("reports")
# Requests that produce no more tokens wait for the oracle in a queue, checked in padded passes
# of up to this many (the reference model's cost is mostly per op); the rest at the run's end.
ORACLE_BATCH = 16


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def resolve_device(device: str | None) -> str:
    """auto -> cuda when present, else cpu. On the CPU, torch gets KVCHAOS_CPU_THREADS threads
    (default 1): the reference model is tiny, and two spinning threads on a shared two-core box
    run some twenty times slower than one."""
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available")
    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("KVCHAOS_CPU_THREADS", "1")))
    return device


def load_object(spec: str):
    """'module:attr' -> the object (a user's BlockManager class or factory)."""
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise ValueError(f"{spec!r}: expected module:attr")
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        raise ValueError(f"{spec!r}: cannot import {mod}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{spec!r}: {mod} has no attribute {attr}")
        obj = getattr(obj, part)
    return obj


@dataclass
class RunResult:
    scenario: str
    seed: int
    verdict: str
    run_dir: Path | None
    summary: str
    findings: list = field(default_factory=list)
    results: dict = field(default_factory=dict)
    events: list = field(default_factory=list, repr=False)  # the history, for the reports


class _Run:
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
        self.observe = observe  # False: the engine and workload alone, nothing recorded (the overhead baseline)
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
        self.oracle = Oracle(self.engine.model)
        self.faults = [make_fault(f.name, f.defect, f.params, seed) for f in sc.faults]
        self.plan = build_plan(sc.workload, self.cfg.model.vocab_size, seed)
        for f in self.faults:
            f.shape(self.plan, self.cfg)
        self.actions = self.plan.by_step()
        self.pending: list = []  # actions waiting for their request to reach a phase
        self.snapped = -1  # the step of the last snapshot
        self.rejected: set[str] = set()
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.token_steps: dict[str, list[int]] = {}
        self.oracle_results: list[dict] = []
        self.oracle_queue: list = []  # (step, token steps, Oracle.check_many item) of requests done producing
        self.telemetry = Telemetry.from_env(device)

    def snapshot(self, step: int) -> None:
        e = self.engine
        self.snapped = step
        self.h.append(
            {
                "e": "snapshot",
                "step": step,
                **e.bm.snapshot().to_dict(),
                "live": [s.id for s in e.running],
            }
        )

    def arm(self) -> None:
        """Attach the faults to the engine's seams (after run_start: the history opens with it).
        Snapshots are taken as each step's table is uploaded, so checkers see the very table the
        kernels read (a row spilled into and cleaned up within one step is still caught)."""
        e = self.engine
        every = self.sc.run.snapshot_every
        if self.observe:
            e.seams.on_upload = lambda: (
                self.snapshot(e.step_count) if e.step_count % every == 0 else None
            )
        e.seams.on_event = lambda kind, data: self.h.append(
            {"e": "engine", "step": e.step_count, "kind": kind, "data": data}
        )
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

    # -- actions ----------------------------------------------------------------------
    def _phase(self, req: str) -> str | None:
        seq = self.engine.seqs.get(req)
        if seq is None:
            return None
        if seq.state is State.RUNNING:
            snap = self.engine.bm.snapshot()
            blocks = snap.seq_blocks.get(req, [])
            if any(snap.ref_counts[b] > 1 for b in blocks):
                return "shared"
        return seq.phase

    def _do(self, a, step: int) -> bool:
        """Apply an action; False if it must wait (phase not reached yet)."""
        e = self.engine
        if a.op != "submit":
            target = a.req if a.op == "cancel" else a.parent
            seq = e.seqs.get(target)
            if seq is None:
                return target in self.rejected  # not submitted yet: wait; rejected: drop
            if seq.done:
                return True  # it ended first: nothing to do
            if a.when is not None:
                phase = self._phase(target)
                if phase != a.when and not (a.when == "decode" and phase == "shared"):
                    return False
        try:
            if a.op == "submit":
                e.add_request(a.req, a.prompt, a.max_new)
                self.h.append(
                    {
                        "e": "submit",
                        "step": step,
                        "req": a.req,
                        "prompt_len": len(a.prompt),
                        "max_new": a.max_new,
                        "parent": None,
                        "origin": a.origin,
                    }
                )
            elif a.op == "fork":
                e.fork(a.parent, a.req, a.max_new, a.prompt)
                self.h.append(
                    {
                        "e": "submit",
                        "step": step,
                        "req": a.req,
                        "prompt_len": len(e.seqs[a.req].tokens),
                        "max_new": a.max_new,
                        "parent": a.parent,
                        "origin": a.origin,
                    }
                )
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
                snap = e.bm.snapshot()
                blocks = snap.seq_blocks.get(a.req, [])
                e.cancel(a.req)
                self.h.append(
                    {
                        "e": "cancel",
                        "step": step,
                        "req": a.req,
                        "phase": before if phase == "shared" else phase,
                        "shared": phase == "shared",
                        "blocks": blocks,
                        "origin": a.origin,
                    }
                )
                self._oracle(a.req, step)
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

    def _oracle(self, req: str, step: int) -> None:
        """Queue a request that will produce no more tokens for the oracle; checked in batches."""
        rows = self.logits.pop(req, [])
        steps = self.token_steps.pop(req, [])
        if rows:
            seq = self.engine.seqs[req]
            self.oracle_queue.append(
                (step, steps, (req, list(seq.tokens), seq.prompt_len, torch.stack(rows)))
            )
            if len(self.oracle_queue) >= ORACLE_BATCH:
                self._check_oracle_queue()

    def _check_oracle_queue(self) -> None:
        queue, self.oracle_queue = self.oracle_queue, []
        for (step, steps, _), res in zip(queue, self.oracle.check_many([q[2] for q in queue])):
            r = res.to_dict()
            r["req"] = r.pop("request")
            r["divergence_step"] = (
                steps[r["first_divergence"]] if r["first_divergence"] is not None else None
            )
            self.h.append({"e": "oracle", "step": step, **r})
            self.oracle_results.append(r)

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
            out = e.step()
            st = out.stats
            for f in self.faults:
                f.after_step(e, st.step, out)
            if not self.observe:
                continue
            if self.snapped != st.step and st.step % run.snapshot_every == 0:
                self.snapshot(
                    st.step
                )  # nothing was uploaded (nothing could run): still look, every step
            h.append(
                {
                    "e": "step",
                    "step": st.step,
                    "latency_s": st.latency_s,
                    "host_s": st.host_s,
                    "cpu_s": st.cpu_s,
                    "free_blocks": st.free_blocks,
                    "running": st.num_running,
                    "waiting": st.num_waiting,
                    "prefill_tokens": st.prefill_tokens,
                    "decode_tokens": st.decode_tokens,
                    "preempted": st.preempted,
                    "tokens": out.tokens,
                    "finished": out.finished,
                    "table_version": st.table_version,
                    "stale_ranks": st.stale_ranks,
                    "rank_crcs": st.rank_table_crcs,
                    "table_crc": st.table_crc,
                    **self.telemetry.step_fields(st.step),
                }
            )
            for req, row in out.logits.items():
                self.logits.setdefault(req, []).append(row)
                self.token_steps.setdefault(req, []).append(st.step)
            for req in out.finished:
                self._oracle(req, st.step)
            h.flush()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run exceeded its time limit at step {st.step}")
        return "max_steps"

    def finish(self, reason: str) -> dict:
        # The oracle first: what the queue holds is lost if anything after it fails.
        for req in list(self.logits):  # still running at the end: check what they produced
            self._oracle(req, self.engine.step_count)
        self._check_oracle_queue()
        # The final state: after the last step's frees and any cancels that came after it.
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
                "fault_verify": verify,
                "telemetry": self.telemetry.summary(),
            }
        )
        return verify


def new_run_dir(report_dir: Path, name: str, seed: int) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = report_dir / f"{stamp}-{name}-s{seed}"
    d, n = base, 1
    while d.exists():
        n += 1
        d = base.with_name(f"{base.name}-{n}")
    d.mkdir(parents=True)
    return d


def run_scenario(
    sc: Scenario,
    seed: int,
    device: str | None = "cpu",
    report_dir: Path | str | None = DEFAULT_REPORT_DIR,
    block_manager=None,
    block_manager_spec: str | None = None,
    timeout_s: float | None = None,
    tp_mode: str | None = None,
    world_size: int | None = None,
    cluster=None,
) -> RunResult:
    """Run one scenario with one seed. report_dir=None keeps nothing on disk. tp_mode / world_size
    override the scenario's engine.tp_mode / tp_size; cluster: a kvchaos.engine.distributed.Cluster to reuse.
    Writes the run's record (scenario.toml, history.jsonl, results.json); reports are the caller's:
    kvchaos.harness.report.render.publish(result)."""
    tp = {k: v for k, v in (("tp_mode", tp_mode), ("tp_size", world_size)) if v is not None}
    device = resolve_device(device)
    run_dir = new_run_dir(Path(report_dir), sc.name, seed) if report_dir is not None else None
    if (
        run_dir is not None
    ):  # the scenario as resolved (defaults filled in): what replay and analyze read
        (run_dir / "scenario.toml").write_text(
            dumps(sc.model_dump(mode="json", exclude_none=True)), encoding="utf-8"
        )
    history = History(run_dir / "history.jsonl" if run_dir else None, keep=True)
    if (
        block_manager is not None and not block_manager_spec
    ):  # name it, for the history and the replay line
        block_manager_spec = (
            f"{block_manager.__module__}:{getattr(block_manager, '__qualname__', '?')}"
        )
    t0 = time.perf_counter()
    error = None
    reason = "error"
    run = None
    try:
        if block_manager is None and block_manager_spec:
            block_manager = load_object(block_manager_spec)
        run = _Run(sc, seed, device, history, block_manager, tp, cluster)
        cfg = run.cfg
        history.append(
            {
                "e": "run_start",
                "step": 0,
                "scenario": sc.name,
                "seed": seed,
                "config": cfg.to_dict(),
                "config_hash": cfg.config_hash(),
                "commit": git_commit(),
                "device": device,
                "time": dt.datetime.now().isoformat(timespec="seconds"),
                "block_manager": block_manager_spec or "kvchaos.engine.block_manager:BlockManager",
                "telemetry": run.telemetry.status(),
                "plan": [a.to_dict() for a in run.plan.actions],
            }
        )
        run.arm()
        reason = run.run(time.monotonic() + timeout_s if timeout_s else None)
    except KeyboardInterrupt:
        reason = "interrupted"
        error = {
            "error": "KeyboardInterrupt",
            "message": "interrupted by the user",
            "traceback": "",
        }
    except BaseException as ex:  # the engine broke (or the run could not start): ERROR, not a crash
        error = {
            "error": type(ex).__name__,
            "message": str(ex),
            "traceback": traceback.format_exc(),
        }
    if error:
        history.append({"e": "error", "step": run.engine.step_count if run else 0, **error})
    verify = {}
    if run is not None:
        try:
            verify = run.finish(reason)
        except KeyboardInterrupt:  # Ctrl-C while checking: the run's record is still written
            reason = "interrupted"
            error = error or {
                "error": "KeyboardInterrupt",
                "message": "interrupted by the user",
                "traceback": "",
            }
            history.append({"e": "error", "step": run.engine.step_count, **error})
        except Exception as ex:
            history.append(
                {
                    "e": "error",
                    "step": run.engine.step_count,
                    "error": type(ex).__name__,
                    "message": str(ex),
                    "traceback": traceback.format_exc(),
                }
            )
            error = error or {"error": type(ex).__name__, "message": str(ex)}
        try:
            run.engine.close()  # with real ranks: ends the run on them, or names the rank that failed
        except Exception as ex:
            history.append(
                {
                    "e": "error",
                    "step": run.engine.step_count,
                    "error": type(ex).__name__,
                    "message": str(ex),
                    "traceback": traceback.format_exc(),
                }
            )
            error = error or {"error": type(ex).__name__, "message": str(ex)}
    history.close()
    events = history.events
    checks, v = evaluate(sc, events, verify, error)
    results = {
        "scenario": sc.name,
        "seed": seed,
        "verdict": v.verdict,
        "summary": v.summary,
        "exit_code": v.exit_code,
        "commit": git_commit(),
        "config_hash": run.cfg.config_hash() if run else None,
        "device": device,
        "steps": run.engine.step_count if run else 0,
        "wall_s": round(time.perf_counter() - t0, 3),
        "reason": reason,
        "error": error,
        "expectation": sc.expect.model_dump(),
        "time_to_detect_steps": v.time_to_detect,
        "fault_verify": verify,
        "checkers": [c.to_dict() for c in checks],
        "history_digest": history.digest(),
        "metrics": _metrics(events),
        "replay": replay_command(sc, seed, device, block_manager_spec, tp, run_dir),
    }
    if (
        run_dir is not None
    ):  # the judge's record; the caller renders reports (kvchaos.harness.report.render.publish)
        (run_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    findings = [f for c in checks for f in c.findings]
    return RunResult(sc.name, seed, v.verdict, run_dir, v.summary, findings, results, events)


def evaluate(sc: Scenario, events: list[dict], verify: dict, error: dict | None):
    """Checkers + verdict from a history: how a run ends, and what `kvchaos analyze` recomputes."""
    checks = run_checkers(
        events,
        {
            "latency": {"slo_ratio": sc.run.latency_slo_ratio, "signal": sc.run.latency_signal},
            "liveness": {"bound_steps": sc.run.liveness_bound_steps},
        },
    )
    mark_manifest(checks, events)
    return checks, decide(sc, checks, verify, error)


def mark_manifest(checks: list, events: list[dict]) -> None:
    """A structural finding is manifest when outputs diverged too: on its own request where it names
    one, else anywhere in the run. Otherwise it stays latent."""
    diverged = {
        e["req"] for e in events if e.get("e") == "oracle" and e.get("first_divergence") is not None
    }
    if not diverged:
        return
    for c in checks:
        for f in c.findings:
            if f.manifest is False:
                reqs = {f.evidence.get(k) for k in ("req", "owner")} - {None}
                f.manifest = bool(reqs & diverged) if reqs else True


def replay_command(
    sc: Scenario,
    seed: int,
    device: str,
    block_manager_spec: str | None = None,
    tp: dict | None = None,
    run_dir: Path | None = None,
) -> str:
    if sc.source and Path(sc.source).exists():
        target = sc.source
    elif (
        run_dir is not None
    ):  # built in memory (a fixture's dict, a soak mix): the run folder's copy
        target = str(run_dir / "scenario.toml")
    else:
        target = sc.name
    bm = f" --block-manager {block_manager_spec}" if block_manager_spec else ""
    tp = tp or {}
    tp_flags = (f" --tp-mode {tp['tp_mode']}" if "tp_mode" in tp else "") + (
        f" --world-size {tp['tp_size']}" if "tp_size" in tp else ""
    )
    return f"kvchaos run {target} --seed {seed} --device {device}{bm}{tp_flags}"


def _metrics(events: list[dict]) -> dict:
    steps = [e for e in events if e.get("e") == "step"]
    if not steps:
        return {}
    lat = sorted(e["latency_s"] for e in steps)
    toks = sum(len(e["tokens"]) for e in steps)
    return {
        "steps": len(steps),
        "tokens": toks,
        "requests": sum(1 for e in events if e.get("e") == "submit"),
        "rejected": sum(1 for e in events if e.get("e") == "reject"),
        "cancelled": sum(1 for e in events if e.get("e") == "cancel"),
        "latency_p50_ms": lat[len(lat) // 2] * 1e3,
        "latency_p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
        "min_free_blocks": min(e["free_blocks"] for e in steps),
        "engine_s": sum(e["latency_s"] for e in steps),
    }
