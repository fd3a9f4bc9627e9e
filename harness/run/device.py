"""Where a run computes: the one place a device name is resolved."""

from __future__ import annotations

from kvchaos.engine import env


def resolve_device(device: str | None) -> str:
    """auto -> cuda when present, else cpu. On the CPU, torch gets KVCHAOS_CPU_THREADS threads
    (default 1): the reference model is tiny, and two spinning threads on a shared two-core box
    run some twenty times slower than one."""
    import torch

    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: there are {torch.cuda.device_count()} CUDA devices")
    if device == "cpu":
        torch.set_num_threads(env.number("KVCHAOS_CPU_THREADS"))
    return device
