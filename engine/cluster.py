"""The ranks of a real tensor-parallel group, seen from rank 0 (Cluster): launching the followers,
the process group, and the store through which runs start and followers report.

A rank that dies or stops answering fails a collective on rank 0 (a closed connection at once, or
the group's timeout). Rank 0 names it (exit status, the error it posted, or the progress it last
reported), kills the other followers and raises RankFailure, which the runner records as ERROR.

Rank 0 launches the followers (`python -m kvchaos.engine.follower`, the torchrun environment), or
torchrun launches every rank, and ranks > 0 call kvchaos.engine.follower.serve().
"""

from __future__ import annotations

import atexit
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from kvchaos.engine import env
from kvchaos.engine.config import EngineConfig
from kvchaos.engine.errors import ConfigError, KVChaosError
from kvchaos.engine.wire import END, HEAD, TIMERS, Wire

STARTUP_S = 300.0  # importing torch on a loaded box takes a while; a crash is seen at once anyway


class RankFailure(KVChaosError):
    """A rank died or stopped answering. `ranks` names them."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


def external_launch() -> bool:
    """Started by torchrun (or any launcher that sets its environment), rather than by us."""
    return (
        "RANK" in os.environ
        and "WORLD_SIZE" in os.environ
        and "KVCHAOS_PARENT_PID" not in os.environ
    )


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: str, rank: int) -> torch.device:
    """One GPU per rank: a launcher's LOCAL_RANK, else the configured GPU plus the rank."""
    d = torch.device(device)
    return (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", (d.index or 0) + rank)))
        if d.type == "cuda"
        else d
    )


class Cluster:
    """The ranks of one group, seen from rank 0: the followers (child processes it launches, or
    torchrun's), the process group, and a store that starts runs and holds what followers report
    (readiness, progress, errors). Launched on the first run and reused by later ones; relaunched
    when a run needs another world size or device, or after a failure."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout_s = env.number("KVCHAOS_RANK_TIMEOUT") if timeout_s is None else timeout_s
        self.key: tuple | None = None  # (world, backend, first GPU's index) while up
        self.procs: dict[int, subprocess.Popen] = {}
        self.runs = 0

    def begin_run(self, cfg: EngineConfig) -> Wire:
        dev = rank_device(cfg.device, 0)
        if self.key != (cfg.tp_size, _backend(dev), dev.index):  # rank r sits on GPU index + r
            self.close()
            self._start(cfg.tp_size, dev)
        self.runs += 1
        self.store.set(f"run/{self.runs}", json.dumps(cfg.to_dict()))
        self.wire.t = dict.fromkeys(TIMERS, 0.0)
        return self.wire

    def end_run(self, wire: Wire, cap: int) -> list[dict]:
        """Ends the run on every rank; returns each rank's seconds by kind of work."""
        wire.broadcast_step([END] + [0] * (HEAD - 1), cap)
        mine = torch.tensor([wire.t[k] for k in TIMERS], dtype=torch.float64, device=wire.dev)
        return [dict(zip(TIMERS, t.tolist())) for t in wire.gather(mine, "ack")]

    def _start(self, world: int, dev: torch.device) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "a torch.distributed process group is already up in this process: "
                "one kvchaos Cluster at a time"
            )
        backend = _backend(dev)
        timeout = dt.timedelta(seconds=self.timeout_s)
        if external_launch():
            if int(os.environ["RANK"]) != 0 or int(os.environ["WORLD_SIZE"]) != world:
                raise ValueError(
                    f"the launcher started rank {os.environ['RANK']} of "
                    f"{os.environ['WORLD_SIZE']}; "
                    f"this run needs rank 0 of {world} (--world-size)"
                )
            base = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=dt.timedelta(seconds=STARTUP_S),
            )
        else:
            if backend == "nccl" and dev.index + world > torch.cuda.device_count():
                raise ConfigError(
                    f"{world} NCCL ranks need one GPU each from cuda:{dev.index}; "
                    f"this machine has {torch.cuda.device_count()} (use --tp-mode simulated)"
                )
            base = dist.TCPStore(
                "127.0.0.1",
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=dt.timedelta(seconds=STARTUP_S),
            )
            env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(base.port),
                "WORLD_SIZE": str(world),
                "KVCHAOS_PARENT_PID": str(os.getpid()),
                "KVCHAOS_RANK_TIMEOUT": str(self.timeout_s),
            }
            for r in range(1, world):
                self.procs[r] = subprocess.Popen(
                    [sys.executable, "-m", "kvchaos.engine.follower"],
                    env={**env, "RANK": str(r), "LOCAL_RANK": str((dev.index or 0) + r)},
                )
        atexit.register(self.close)
        self._base, self.store = base, dist.PrefixStore("kvchaos", base)
        self.key, self.runs = (world, backend, dev.index), 0
        try:
            self.store.set("group", backend)
            deadline = time.monotonic() + STARTUP_S
            while world > 1 and not self.store.check([f"ready/{r}" for r in range(1, world)]):
                dead = self._exited()
                if dead or time.monotonic() > deadline:
                    who = "; ".join(f"rank {r} {w}" for r, w in dead.items())
                    raise RankFailure(
                        f"{who or 'ranks did not start'} before joining the group", sorted(dead)
                    )
                time.sleep(0.02)
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("pg", base),
                rank=0,
                world_size=world,
                timeout=timeout,
            )
        except BaseException:
            self.abort()
            raise
        self.wire = Wire(dev if backend == "nccl" else torch.device("cpu"), world)

    def _exited(self) -> dict[int, str]:
        out = {}
        for r, p in self.procs.items():
            rc = p.poll()
            if rc is not None:
                out[r] = f"died ({signal.Signals(-rc).name})" if rc < 0 else f"exited (code {rc})"
        return out

    def diagnose(self, ops: int, step: int) -> RankFailure | None:
        """Which ranks are at fault: those that died without a word (crashed, killed), else those
        alive whose progress is behind ours (hung), else those that posted an error. A rank that
        errored because a peer went away is listed after the cause. None if every rank looks
        healthy: the fault is rank 0's own."""
        # a dead peer's closed connection is seen before its exit status
        deadline = time.monotonic() + 2.0
        while self.procs and not self._exited() and time.monotonic() < deadline:
            time.sleep(0.02)
        exited, errors, seen = self._exited(), {}, {}
        for r in range(1, self.key[0]):
            # the store lives in this process (or the launcher): if it is gone, so is the group
            try:
                if self.store.check([f"error/{r}"]):
                    errors[r] = self.store.get(f"error/{r}").decode()
                if self.store.check([f"progress/{r}"]):
                    seen[r] = int(self.store.get(f"progress/{r}"))
            except Exception:
                pass
        cause = {r: w for r, w in exited.items() if r not in errors}
        if not cause:  # progress is posted a beat late: judged only after the group's timeout
            cause = {
                r: f"hung: no answer within {self.timeout_s:g} s "
                f"(it reached collective {n}, rank 0 collective {ops})"
                for r, n in seen.items()
                if r not in exited and n < ops
            }
        then = {r: f"{exited.get(r, 'failed')}: {e}" for r, e in errors.items()}
        if not cause:
            cause, then = then, {}
        if not cause:
            return None
        msg = "; ".join(f"rank {r} {w}" for r, w in sorted(cause.items())) + f", at step {step}"
        if then:
            msg += " (then " + "; ".join(f"rank {r} {w}" for r, w in sorted(then.items())) + ")"
        return RankFailure(msg, sorted(cause))

    def abort(self) -> None:
        """Kill the followers (they may be mid-collective) and drop the group."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        self._teardown()

    def close(self) -> None:
        """Tell the followers to exit, wait for them (killing any that linger), drop the group."""
        if self.key is None:
            return
        try:
            self.store.set(f"run/{self.runs + 1}", "shutdown")
        except Exception:
            pass
        deadline = time.monotonic() + 10.0
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        self._teardown()

    def _teardown(self) -> None:
        for p in self.procs.values():
            p.wait()
        self.procs = {}
        if dist.is_initialized():
            dist.destroy_process_group()
        self.key, self.store, self._base = None, None, None
        atexit.unregister(self.close)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
