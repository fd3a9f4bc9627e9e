"""The reference paged-KV engine: the system under test.

Names load on first use: `from kvchaos.engine.errors import OutOfBlocks` (or config, protocols)
must not pay for torch, which the engine, the model and the kernels import."""

from __future__ import annotations

import importlib

_WHERE = {
    "CacheConfig": "config",
    "EngineConfig": "config",
    "ModelConfig": "config",
    "Engine": "engine",
    "ConfigError": "errors",
    "InvalidRequest": "errors",
    "KVChaosError": "errors",
    "OutOfBlocks": "errors",
    "RequestFailed": "errors",
    "RequestRejected": "errors",
    "TableOverflow": "errors",
    "Snapshot": "protocols",
    "State": "sequence",
    "StepOutput": "sequence",
    "StepStats": "sequence",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'kvchaos.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvchaos.engine.{_WHERE[name]}"), name)
