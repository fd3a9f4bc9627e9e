"""The reference paged-KV engine: the system under test."""

from kvchaos.engine.config import CacheConfig, EngineConfig, ModelConfig
from kvchaos.engine.engine import Engine
from kvchaos.engine.errors import (
    ConfigError,
    InvalidRequest,
    KVChaosError,
    OutOfBlocks,
    RequestRejected,
    TableOverflow,
)
from kvchaos.engine.protocols import KVManager, Snapshot
from kvchaos.engine.sequence import State, StepOutput, StepStats

__all__ = [
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "Engine",
    "ConfigError",
    "InvalidRequest",
    "KVChaosError",
    "OutOfBlocks",
    "RequestRejected",
    "TableOverflow",
    "KVManager",
    "Snapshot",
    "State",
    "StepOutput",
    "StepStats",
]
