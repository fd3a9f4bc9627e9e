"""Telemetry sampled during a run: the harness process's RSS and CPU share (psutil), and, when the
run is on an NVIDIA GPU, its memory used, utilisation, SM clock, temperature and power (NVML).

A sample is taken at the first step, then only when both `every_steps` steps and `min_interval_s`
seconds have passed since the last one, so sampling never paces the run; each sample records its
own cost (`sample_us`). Without a GPU, `available` is False and `reason` says why, in words a
report can print as they are.

    KVCHAOS_TELEMETRY=0                  no samples at all
    KVCHAOS_TELEMETRY_EVERY=10           at least this many steps between samples
    KVCHAOS_TELEMETRY_INTERVAL_S=0.5     and at least this many seconds

`python -m kvchaos.harness.bench.telemetry` measures the overhead: the built-in suite with and
without telemetry.
"""

from __future__ import annotations

import os
import time

from kvchaos.engine.env import number

_NVML: dict = {}  # initialised once per process: {"nv": module} or {"error": reason}


def load_nvml():
    if not _NVML:
        try:
            import pynvml as nv
        except ImportError as e:
            _NVML["error"] = f"no NVIDIA GPU: NVML not available (nvidia-ml-py not installed: {e})"
            return _NVML
        try:
            nv.nvmlInit()
            _NVML["nv"] = nv
        except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded / ...: no usable GPU
            _NVML["error"] = f"no NVIDIA GPU: NVML not available ({e})"
    return _NVML


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class _Process:
    """RSS (psutil, or /proc where psutil is missing) and CPU share of this process since the last
    read. The CPU share comes from os.times, as psutil's cpu_percent computes it, without its read
    of /proc/self/stat (3 us instead of ~130 us on a sandboxed kernel)."""

    def __init__(self) -> None:
        try:
            import psutil

            self._rss = lambda p=psutil.Process(): p.memory_info().rss
            self.source = "psutil"
        except ImportError:
            self._rss = self._statm_rss
            self.source = "proc"
        self._last = (time.monotonic(), sum(os.times()[:2]))

    @staticmethod
    def _statm_rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def read(self) -> dict:
        now, cpu = time.monotonic(), sum(os.times()[:2])
        (t0, c0), self._last = self._last, (now, cpu)
        return {
            "rss_mb": round(self._rss() / 2**20, 1),
            "cpu_pct": round(100 * (cpu - c0) / max(now - t0, 1e-9), 1),
        }


class Telemetry:
    def __init__(
        self,
        device: str | None = "cpu",
        every_steps: int = 10,
        min_interval_s: float = 0.5,
        enabled: bool = True,
        clock=time.monotonic,
    ) -> None:
        self.enabled, self.every_steps, self.min_interval_s = (
            enabled,
            max(1, every_steps),
            min_interval_s,
        )
        self.clock = clock
        self.samples, self.cost_s = 0, 0.0
        self._last_step = self._last_t = None
        self.available, self.reason, self.gpu_name = False, None, None
        self._gpu: dict = {}
        self._cuda_index = None
        self._proc = _Process() if enabled else None
        if not enabled:
            self.reason = "telemetry switched off (KVCHAOS_TELEMETRY=0)"
            return
        st = load_nvml()
        if "error" in st:
            self.reason = st["error"]
        elif not str(device).startswith("cuda"):
            self.reason = f"run on the {device or 'cpu'}: GPU not sampled"
        else:
            self._open_gpu(st["nv"], device)

    @classmethod
    def from_env(cls, device: str | None) -> "Telemetry":
        env = os.environ.get
        return cls(
            device,
            every_steps=number("KVCHAOS_TELEMETRY_EVERY"),
            min_interval_s=number("KVCHAOS_TELEMETRY_INTERVAL_S"),
            enabled=env("KVCHAOS_TELEMETRY", "1") not in ("0", "", "off", "false"),
        )

    def _open_gpu(self, nv, device: str) -> None:
        import torch

        index = (
            int(device.split(":")[1])
            if ":" in device
            else (torch.cuda.current_device() if torch.cuda.is_available() else 0)
        )
        self._cuda_index = index if torch.cuda.is_available() else None
        try:
            # match by UUID: CUDA and NVML number devices differently under CUDA_VISIBLE_DEVICES
            try:
                uuid = str(torch.cuda.get_device_properties(index).uuid)
                h = nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            except Exception:
                h = nv.nvmlDeviceGetHandleByIndex(index)
            self.gpu_name = _text(nv.nvmlDeviceGetName(h))
        except nv.NVMLError as e:
            self.reason = f"NVIDIA GPU {index} not readable through NVML ({e})"
            return
        self._gpu = {
            "gpu_mem_used_mb": lambda: round(nv.nvmlDeviceGetMemoryInfo(h).used / 2**20, 1),
            "gpu_util_pct": lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu,
            "sm_clock_mhz": lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
            "temp_c": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
            "power_w": lambda: round(nv.nvmlDeviceGetPowerUsage(h) / 1000, 1),
        }
        self._nv = nv
        self.unsupported: list[str] = []
        self.available = True

    def status(self) -> dict:
        """Run-level: what is sampled, or why the GPU is not."""
        return {
            "enabled": self.enabled,
            "available": self.available,
            "reason": self.reason,
            "gpu": self.gpu_name,
            "process": self._proc.source if self._proc else None,
            "every_steps": self.every_steps,
            "min_interval_s": self.min_interval_s,
        }

    def summary(self) -> dict:
        return {
            "samples": self.samples,
            "cost_s": round(self.cost_s, 6),
            "mean_sample_us": round(1e6 * self.cost_s / self.samples, 1) if self.samples else None,
            "unsupported": getattr(self, "unsupported", []),
        }

    def sample(self) -> dict:
        t0 = time.perf_counter()
        s = self._proc.read() if self._proc else {}
        for name, read in list(self._gpu.items()):
            try:
                s[name] = read()
            except self._nv.NVMLError:  # e.g. NotSupported on this board: stop asking
                del self._gpu[name]
                self.unsupported.append(name)
        if self._cuda_index is not None:
            import torch

            s["torch_alloc_mb"] = round(torch.cuda.memory_allocated(self._cuda_index) / 2**20, 1)
        dt = time.perf_counter() - t0
        self.samples += 1
        self.cost_s += dt
        s["sample_us"] = round(dt * 1e6, 1)
        return s

    def due(self, step: int) -> bool:
        if not self.enabled:
            return False
        if self._last_step is None:
            return True
        return (
            step - self._last_step >= self.every_steps
            and self.clock() - self._last_t >= self.min_interval_s
        )

    def step_fields(self, step: int) -> dict:
        """{"telemetry": sample} when a sample is due at this step, else {}: merged into the step
        event."""
        if not self.due(step):
            return {}
        self._last_step, self._last_t = step, self.clock()
        return {"telemetry": self.sample()}
