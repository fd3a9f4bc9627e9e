"""The soak's Ray executor: each run a Ray task (one GPU per task on GPU nodes, so Ray sets
CUDA_VISIBLE_DEVICES; one CPU otherwise) that makes the run as every soak does (soak_exec.attempt:
a fresh isolated worker on that node). Ray schedules; the driver keeps N tasks in flight, takes
results as they stream back (ray.wait) and keeps one ledger and one summary. A run folder comes
back as bytes when the node does not share the driver's runs/ folder (its marker file says), and
stays where it is when it does. A task whose worker or node was lost is submitted once more and
marked; lost again, it is an ERROR in the ledger: never counted twice, never lost."""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

from kvchaos.harness.report.paths import rel_command
from kvchaos.harness.tools.soak_exec import WAIT_S, Context, attempt, shared

INSTALL = "pip install 'kvchaos[ray]'"
# a task's worker or node gone (its run may have been fine): submitted once more
LOST = (
    "WorkerCrashedError",
    "NodeDiedError",
    "LocalRayletDiedError",
    "ObjectLostError",
    "OwnerDiedError",
    "ObjectReconstructionFailedError",
    "ObjectFetchTimedOutError",
    "ActorDiedError",
    "ActorUnavailableError",
)


def require_ray():
    try:
        import ray
    except ImportError:
        raise ValueError(f"--executor ray needs Ray, which is not installed: {INSTALL}") from None
    return ray


def fleet_task(job: dict, ctx: Context) -> dict:
    """On a node: the job's attempt; its run folder as bytes unless the node shares runs/."""
    here = shared(ctx.runs_dir, ctx.marker)
    local = ctx if here else dataclasses.replace(ctx, runs_dir=tempfile.mkdtemp(prefix="kvchaos-"))
    from kvchaos.harness.run import isolate

    os.environ.update(ctx.env)  # the run's worker takes this process's environment
    isolate.start_server(ctx.block_manager)  # once a Ray worker: a shipped adapter imported there
    t0 = time.monotonic()
    try:
        r = attempt(job, local)
        r["duration_s"] = time.monotonic() - t0
        if not here and r["run_dir"] and not r["cut"]:
            r["folder"] = pack(Path(r["run_dir"]))
    finally:
        if not here:
            shutil.rmtree(local.runs_dir, ignore_errors=True)
    return r


def pack(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    return buf.getvalue()


def unpack(data: bytes, runs_dir: Path) -> Path:
    """A run folder that came back as bytes, under the driver's runs/ (a fresh name if taken)."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        name = tar.getnames()[0].split("/")[0]
        dest, n = runs_dir / name, 1
        while dest.exists():
            n += 1
            dest = runs_dir / f"{name}-{n}"
        with tempfile.TemporaryDirectory(dir=runs_dir) as tmp:
            tar.extractall(tmp, filter="data")
            (Path(tmp) / name).rename(dest)
    return dest


class RayExecutor:
    """N tasks in flight on a Ray cluster (joined, or started on this machine)."""

    name = "ray"

    def __init__(self, soak) -> None:
        ray = self.ray = require_ray()
        a = soak.args
        if not ray.is_initialized():  # a caller's ray.init() stands (tests, notebooks)
            address = a.ray_address or os.environ.get("RAY_ADDRESS")
            ray.init(address=address, log_to_driver=False) if address else ray.init(
                log_to_driver=False, include_dashboard=False
            )
        res = ray.cluster_resources()
        gpus, cpus = int(res.get("GPU", 0)), int(res.get("CPU", 1))
        self.gpu = gpus > 0 and a.device in ("auto", "cuda")
        self.device = "cuda" if self.gpu else soak.device
        self.workers = a.workers or (gpus if self.gpu else max(1, cpus))
        one = {"num_gpus": 1} if self.gpu else {"num_cpus": 1}
        self.task = ray.remote(fleet_task).options(max_retries=0, **one)
        self.lost_types = tuple(
            t for t in (getattr(ray.exceptions, n, None) for n in LOST) if isinstance(t, type)
        )
        self.runs_dir = Path(soak.ctx.runs_dir)
        self.soak = soak
        self.refs: dict = {}  # ObjectRef -> job

    def describe(self) -> str:
        per = "1 GPU" if self.gpu else "1 CPU"
        return f"Ray, {self.workers} tasks in flight ({per} each)"

    def free(self) -> int:
        return self.workers - len(self.refs)

    def in_flight(self) -> int:
        return len(self.refs)

    def submit(self, job: dict) -> None:
        self.refs[self.task.remote(job, self.soak.ctx)] = job

    def wait(self, tick) -> list[tuple[dict, dict]]:
        ready, _ = self.ray.wait(list(self.refs), num_returns=1, timeout=WAIT_S)
        tick()
        out = []
        for ref in ready:
            job = self.refs.pop(ref)
            out.append((job, self._result(ref, job)))
        return out

    def _result(self, ref, job: dict) -> dict:
        try:
            r = self.ray.get(ref)
        except self.lost_types as e:
            return {"lost": f"{type(e).__name__}: {_first_line(e)}"}
        except self.ray.exceptions.RayTaskError as e:  # kvchaos failed on the node: not the run
            return {"lost": f"the task raised {_first_line(e)}"}
        data = r.pop("folder", None)
        if data is not None:  # the node's own folder: here now, its command from here
            r["run_dir"] = str(unpack(data, self.runs_dir))
            r["command"] = rel_command(r["replay_line"], base=self.runs_dir)
        return r

    def shutdown(self) -> None:
        for ref in list(self.refs):  # a stopped soak's runs in flight: not recorded
            self.ray.cancel(ref, force=True)
        self.refs.clear()


def _first_line(e: BaseException) -> str:
    lines = [x for x in str(e).splitlines() if x.strip()]
    return lines[-1].strip()[:300] if lines else type(e).__name__
