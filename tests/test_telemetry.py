"""Telemetry on the CPU: process fields, the plain no-GPU reason, the sampling schedule, the GPU
fields through a stand-in NVML module, and the runner's history carrying all of it."""

from __future__ import annotations

import sys
import types

import pytest

from kvchaos.harness.run import telemetry
from kvchaos.harness.run.telemetry import Telemetry


class FakeNVMLError(Exception):
    pass


def fake_nvml(init_error: str | None = None, unsupported: tuple = ()) -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    nv.NVMLError = FakeNVMLError
    nv.NVML_CLOCK_SM, nv.NVML_TEMPERATURE_GPU = 1, 0
    calls = {"init": 0}

    def init():
        calls["init"] += 1
        if init_error:
            raise FakeNVMLError(init_error)

    def field(name, value):
        def read(*_):
            if name in unsupported:
                raise FakeNVMLError("Not Supported")
            return value

        return read

    nv.nvmlInit = init
    nv.calls = calls
    nv.nvmlDeviceGetHandleByUUID = field("uuid", "h")
    nv.nvmlDeviceGetHandleByIndex = field("index", "h")
    nv.nvmlDeviceGetName = field("name", b"NVIDIA H200")
    nv.nvmlDeviceGetMemoryInfo = field("mem", types.SimpleNamespace(used=3 * 2**30))
    nv.nvmlDeviceGetUtilizationRates = field("util", types.SimpleNamespace(gpu=87, memory=40))
    nv.nvmlDeviceGetClockInfo = field("clock", 1980)
    nv.nvmlDeviceGetTemperature = field("temp", 51)
    nv.nvmlDeviceGetPowerUsage = field("power", 412_500)
    return nv


@pytest.fixture
def nvml(monkeypatch):
    """Installs a stand-in pynvml (or none) and forgets the once-per-process NVML state."""

    def install(mod):
        monkeypatch.setattr(telemetry, "_NVML", {})
        monkeypatch.setitem(sys.modules, "pynvml", mod)
        return mod

    return install


def test_cpu_sample_has_process_fields_and_cost():
    s = Telemetry("cpu").sample()
    assert s["rss_mb"] > 10 and s["cpu_pct"] >= 0 and s["sample_us"] > 0
    assert not any(k.startswith("gpu") for k in s)


def test_process_fields_without_psutil(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)
    tel = Telemetry("cpu")
    s = tel.sample()
    assert tel.status()["process"] == "proc" and s["rss_mb"] > 10 and s["cpu_pct"] >= 0


def test_nvml_absent_reason_is_plain(nvml):
    nvml(fake_nvml(init_error="NVML Shared Library Not Found"))
    tel = Telemetry("cuda")
    assert not tel.available
    assert tel.reason == "no NVIDIA GPU: NVML not available (NVML Shared Library Not Found)"
    assert tel.status()["available"] is False and tel.status()["reason"] == tel.reason
    assert "gpu_mem_used_mb" not in tel.sample()


def test_nvml_package_missing_reason(nvml):
    nvml(None)  # `import pynvml` raises ImportError
    tel = Telemetry("cuda")
    assert not tel.available and tel.reason.startswith(
        "no NVIDIA GPU: NVML not available (nvidia-ml-py not installed"
    )


def test_nvml_initialised_once_per_process(nvml):
    nv = nvml(fake_nvml())
    Telemetry("cuda:0"), Telemetry("cuda:0"), Telemetry("cpu")
    assert nv.calls["init"] == 1


def test_gpu_fields_through_nvml(nvml):
    nvml(fake_nvml())
    tel = Telemetry("cuda:0")
    assert tel.available and tel.reason is None and tel.status()["gpu"] == "NVIDIA H200"
    s = tel.sample()
    assert s["gpu_mem_used_mb"] == 3072.0 and s["gpu_util_pct"] == 87 and s["sm_clock_mhz"] == 1980
    assert s["temp_c"] == 51 and s["power_w"] == 412.5 and s["rss_mb"] > 0


def test_unsupported_gpu_field_is_dropped_not_fatal(nvml):
    nvml(fake_nvml(unsupported=("power",)))
    tel = Telemetry("cuda:0")
    s1, s2 = tel.sample(), tel.sample()
    assert "power_w" not in s1 and "power_w" not in s2 and s2["temp_c"] == 51
    assert tel.summary()["unsupported"] == ["power_w"] and tel.summary()["samples"] == 2


def test_gpu_present_but_run_on_cpu(nvml):
    nvml(fake_nvml())
    tel = Telemetry("cpu")
    assert not tel.available and tel.reason == "run on the cpu: GPU not sampled"


def test_schedule_every_n_steps_and_interval_whichever_is_later():
    now = [0.0]
    tel = Telemetry("cpu", every_steps=10, min_interval_s=0.5, clock=lambda: now[0])
    sampled = []
    for step in range(1, 61):
        now[0] += (
            0.01 if step < 30 else 0.2
        )  # fast steps: the 0.5 s gate decides; slow ones: the 10-step gate
        if tel.step_fields(step):
            sampled.append(step)
    assert sampled == [1, 31, 41, 51]
    assert tel.summary()["samples"] == len(sampled)


def test_switched_off_by_env(monkeypatch):
    monkeypatch.setenv("KVCHAOS_TELEMETRY", "0")
    tel = Telemetry.from_env("cpu")
    assert not tel.enabled and tel.step_fields(1) == {} and "switched off" in tel.status()["reason"]


def test_runner_history_carries_telemetry(monkeypatch, tmp_path):
    from kvchaos.harness.history.log import read_history
    from kvchaos.harness.run.runner import run_scenario
    from kvchaos.harness.scenario.spec import load_scenario

    sc = load_scenario("table-overflow-clean")
    monkeypatch.setenv("KVCHAOS_TELEMETRY_EVERY", "5")
    monkeypatch.setenv("KVCHAOS_TELEMETRY_INTERVAL_S", "0")
    r = run_scenario(sc, 0, device="cpu", report_dir=tmp_path)
    ev = read_history(r.run_dir / "history.jsonl")
    start = next(e for e in ev if e["e"] == "run_start")
    assert (
        start["telemetry"]["enabled"] and start["telemetry"]["reason"]
    )  # no GPU sampled here, and why
    steps = [e for e in ev if e["e"] == "step"]
    sampled = [e["step"] for e in steps if "telemetry" in e]
    assert sampled == list(range(1, steps[-1]["step"] + 1, 5))
    assert all(e["telemetry"]["rss_mb"] > 0 for e in steps if "telemetry" in e)
    end = next(e for e in ev if e["e"] == "run_end")
    assert end["telemetry"]["samples"] == len(sampled)
    # Telemetry is machine data: the deterministic digest must not see it.
    monkeypatch.setenv("KVCHAOS_TELEMETRY", "0")
    off = run_scenario(sc, 0, device="cpu", report_dir=tmp_path)
    assert not any(
        "telemetry" in e for e in read_history(off.run_dir / "history.jsonl") if e["e"] == "step"
    )
    assert off.results["history_digest"] == r.results["history_digest"]
