"""A follower rank (rank > 0) of a real tensor-parallel group: it joins the group, then serves rank
0's runs, idling on the store between them, until rank 0 says shutdown. A watchdog thread posts
its progress for rank 0's diagnosis and exits the process if its parent is gone.

Launched by rank 0 as `python -m kvchaos.engine.follower`, or by torchrun (ranks > 0 call serve()).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from kvchaos.engine import env
from kvchaos.engine.cluster import rank_device
from kvchaos.engine.config import CacheConfig, EngineConfig, ModelConfig
from kvchaos.engine.model import Model
from kvchaos.engine.ranks import VirtualRank
from kvchaos.engine.shard import Shard
from kvchaos.engine.wire import END, TIMERS, Batch, Wire, step_capacity

TEST_FAULT_ENV = "KVCHAOS_TP_TEST_FAULT"  # test-only: "die:RANK:STEP" or "hang:RANK:STEP"


def config_from_dict(d: dict) -> EngineConfig:
    d = dict(d)
    return EngineConfig(
        model=ModelConfig(**d.pop("model")), cache=CacheConfig(**d.pop("cache")), **d
    )


def _watch(
    parent: int | None, store_args: tuple, rank: int, wire_of, stop: threading.Event
) -> None:
    """Post this rank's progress for rank 0's diagnosis; exit if the parent is gone (no orphans)."""
    store = dist.PrefixStore("kvchaos", dist.TCPStore(*store_args, is_master=False))
    last = -1
    while not stop.wait(0.2):
        if parent is not None and os.getppid() != parent:
            os._exit(1)
        ops = wire_of().ops if wire_of() else 0
        if ops != last:
            try:
                store.set(f"progress/{rank}", str(ops))
            except Exception:
                return
            last = ops


def _test_fault(rank: int):
    kind, r, s = (os.environ.get(TEST_FAULT_ENV, "::").split(":") + ["", ""])[:3]
    if not kind or int(r) != rank:
        return lambda step: None

    def hook(step: int) -> None:
        if step == int(s):
            if kind == "die":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(1e6)  # hang

    return hook


def serve() -> int:
    """A follower's life: join the group, then serve runs until rank 0 says shutdown."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    parent = int(os.environ["KVCHAOS_PARENT_PID"]) if "KVCHAOS_PARENT_PID" in os.environ else None
    if parent is not None and os.getppid() != parent:
        return 1
    # two spinning threads per rank thrash
    torch.set_num_threads(env.number("KVCHAOS_CPU_THREADS"))
    timeout = env.number("KVCHAOS_RANK_TIMEOUT")
    store_args = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    # a follower idles on the store between runs
    base = dist.TCPStore(*store_args, is_master=False, timeout=dt.timedelta(days=7))
    store = dist.PrefixStore("kvchaos", base)
    holder: dict = {}
    stop = threading.Event()
    threading.Thread(
        target=_watch,
        args=(parent, store_args, rank, lambda: holder.get("wire"), stop),
        daemon=True,
    ).start()
    try:
        store.wait(["group"])
        backend = store.get("group").decode()
        if backend == "nccl":
            torch.cuda.set_device(rank_device("cuda", rank))
        store.set(f"ready/{rank}", "1")
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg", base),
            rank=rank,
            world_size=world,
            timeout=dt.timedelta(seconds=timeout),
        )
        wire = holder["wire"] = Wire(
            rank_device("cuda", rank) if backend == "nccl" else torch.device("cpu"), world
        )
        n = 0
        while True:
            n += 1
            store.wait([f"run/{n}"])
            msg = store.get(f"run/{n}").decode()
            if msg == "shutdown":
                return 0
            cfg = config_from_dict(json.loads(msg))
            _serve_run(cfg, rank, world, rank_device(cfg.device, rank), wire)
    except BaseException as e:
        try:
            store.set(f"error/{rank}", f"{type(e).__name__}: {e}")
        except Exception:
            pass
        raise
    finally:
        stop.set()
        if dist.is_initialized():
            dist.destroy_process_group()


@torch.inference_mode()
def _serve_run(cfg: EngineConfig, rank: int, world: int, dev: torch.device, wire: Wire) -> None:
    model = Model(cfg.model, cfg.seed, dev)
    shard = Shard(cfg, rank, world, dev, VirtualRank(rank, dev), model.scale)
    wire.t = dict.fromkeys(TIMERS, 0.0)
    hook = _test_fault(rank)
    cap = step_capacity(cfg, world)
    while True:
        b = Batch.unpack(wire.broadcast_step(None, cap), dev)
        if b.op == END:
            mine = torch.tensor([wire.t[k] for k in TIMERS], dtype=torch.float64, device=wire.dev)
            wire.gather(mine, "ack")
            return
        hook(b.step)
        shard.receive(wire, b)
        shard.copy_blocks(b.copies)
        shard.acknowledge(wire, b)
        t0, g0 = time.perf_counter(), wire.t["gather"]
        model.forward(b.tokens, b.positions, shard.attend(wire, b, shard.resolve(b)))
        wire.t["compute"] += time.perf_counter() - t0 - (wire.t["gather"] - g0)


if __name__ == "__main__":
    sys.exit(serve())
