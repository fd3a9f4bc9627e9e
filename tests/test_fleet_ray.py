"""The fleet soak on a local Ray cluster of two worker processes (`ray.init(num_cpus=2)`), in the
fleet lane (.ci/fleet-lane: ray installed, KVCHAOS_FLEET_LANE=1; skipped elsewhere): five runs
(about a minute) of a user's manager that hangs inside one call (that run FAILs, the soak goes
on); a Ray worker killed mid-run (its run resubmitted once and marked, counted once); a driver
killed and resumed (each seed once, none skipped); a run folder sent back as bytes from a node
without the driver's report folder."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvchaos.harness.cli import main as cli_main
from kvchaos.harness.tools.ledger import Ledger
from kvchaos.harness.tools.soak_space import shard_seed

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None or os.environ.get("KVCHAOS_FLEET_LANE") != "1",
        reason="the fleet lane (.ci/fleet-lane): ray installed and KVCHAOS_FLEET_LANE=1",
    ),
]
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray instance, two CPUs; its workers import the manager from tests/."""
    import ray

    flags = tmp_path_factory.mktemp("flags")
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT.parent), str(ROOT)])}
    ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env}
    )
    yield {"ray": ray, "flags": flags}
    ray.shutdown()


def _soak(tmp_path: Path, flag: Path, monkeypatch, *extra: str) -> tuple[int, list[dict], dict]:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("KVCHAOS_FLEET_FLAG", str(flag))
    argv = ["soak", "--executor", "ray", "--workers", "2", "--device", "cpu", "-q"]
    argv += ["--report-dir", str(tmp_path), "--seed-start", "0", *extra]
    rc = cli_main(argv)
    rows = Ledger(tmp_path / "ledger.sqlite").rows()
    (folder,) = [d for d in tmp_path.iterdir() if d.name.startswith("soak-")]
    return rc, rows, json.loads((folder / "soak.json").read_text())


def test_a_users_manager_on_ray_a_hang_fails_its_run_only(cluster, tmp_path, monkeypatch):
    spec = "tests.fleet_managers:HangsOnce"
    flag = cluster["flags"] / "hang"
    # bounded by its runs (about a minute here), so a loaded machine runs the same ones
    rc, rows, s = _soak(
        tmp_path, flag, monkeypatch, "--budget", "10m", "--max-runs", "5",
        "--per-run-timeout", "10", "--block-manager", spec,
    )  # fmt: skip
    assert flag.exists() and rc == 11
    hung = [r for r in rows if "did not return within" in (r["summary"] or "")]
    assert len(hung) == 1 and hung[0]["verdict"] == "FAIL", [r["summary"] for r in rows]
    assert len(rows) == 5  # the soak went on after it
    assert {r["block_manager"] for r in rows} == {spec}
    assert sorted(r["k"] for r in rows) == list(range(len(rows)))  # each once, none skipped
    assert s["runs"] == len(rows) and "Ray, 2 tasks in flight" in s["executor"]
    assert any("prefix_cache" in x for x in s["left_out"])


def test_a_ray_worker_killed_mid_run_is_resubmitted_once_and_marked(cluster, tmp_path, monkeypatch):
    flag = cluster["flags"] / "kill"
    rc, rows, s = _soak(
        tmp_path, flag, monkeypatch, "--budget", "5m", "--max-runs", "4",
        "--block-manager", "tests.fleet_managers:KillsItsRayWorkerOnce",
    )  # fmt: skip
    assert flag.exists()
    assert sorted(r["k"] for r in rows) == [0, 1, 2, 3]  # counted once, never lost
    (again,) = [r for r in rows if r["attempts"] == 2]
    assert "WorkerCrashedError" in again["resubmitted"] or "died" in again["resubmitted"]
    assert again["verdict"] != "ERROR" and s["resubmitted"] == 1
    kept = {str(Path(r["run_dir"]).name) for r in rows if r["run_dir"]}
    runs = Path(s["folder"], "runs").iterdir()
    on_disk = {d.name for d in runs if d.is_dir() and not d.is_symlink()}
    assert on_disk == kept  # what the lost worker left is gone


def test_a_killed_driver_resumes_each_seed_once(cluster, tmp_path, monkeypatch):
    ray = cluster["ray"]
    address = ray.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "kvchaos", "soak", "--executor", "ray", "--ray-address", address]
    cmd += ["--workers", "2", "--device", "cpu", "-q", "--budget", "10m", "--seed-start", "0"]
    cmd += ["--report-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT.parent), str(ROOT)])}
    driver = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    ledger = tmp_path / "ledger.sqlite"
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 240:
            if ledger.exists() and len(Ledger(ledger).rows()) >= 3:
                break
            time.sleep(0.5)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
    before = Ledger(ledger).rows()
    assert len(before) >= 3
    (folder,) = [d for d in tmp_path.iterdir() if d.name.startswith("soak-")]
    assert "in progress" in (folder / "soak-summary.md").read_text()  # a killed soak's summary
    rc, rows, s = _soak(tmp_path, cluster["flags"] / "unused", monkeypatch, "--budget", "5m",
                        "--resume", "--max-runs", "3")  # fmt: skip
    ks = sorted(r["k"] for r in rows)
    assert ks == list(range(len(rows))) and len(rows) == len(before) + 3  # no gap, none twice
    assert [r["seed"] for r in sorted(rows, key=lambda r: r["k"])] == [
        shard_seed(0, k, (1, 1)) for k in ks
    ]
    assert {r["soak"] for r in rows} == {s["soak"]} and s["runs"] == len(rows)


def test_a_node_without_the_report_folder_sends_the_run_folder_back(tmp_path):
    """fleet_task as a node runs it (called here: the marker does not match, as on a machine that
    does not share the driver's folder); the driver unpacks it under its runs/."""
    import dataclasses

    from kvchaos.harness.tools.soak_exec import Context, make_job
    from kvchaos.harness.tools.soak_ray import fleet_task, unpack

    runs = tmp_path / "runs"
    runs.mkdir()
    ctx = Context(device="cpu", runs_dir=str(runs), batch="b", block_manager=None,
                  per_run_timeout=60, deadline=time.time() + 120, marker="elsewhere")  # fmt: skip
    job = make_job(0, 0, (1, 1), None, None)
    r = fleet_task(job, dataclasses.replace(ctx))
    assert r["folder"] and not list(runs.iterdir())  # nothing written here
    got = unpack(r["folder"], runs)
    assert got.parent == runs and (got / "results.json").is_file()
    assert json.loads((got / "results.json").read_text())["history_digest"] == r["digest"]
