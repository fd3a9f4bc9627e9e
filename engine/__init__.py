"""The reference paged-KV engine: the system under test."""
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from engine.errors import ConfigError, InvalidRequest, KVChaosError, OutOfBlocks, RequestRejected, TableOverflow
from engine.protocols import BlockManagerProtocol, Snapshot
from engine.sequence import State, StepOutput, StepStats

__all__ = ["CacheConfig", "EngineConfig", "ModelConfig", "Engine", "ConfigError", "InvalidRequest",
           "KVChaosError", "OutOfBlocks", "RequestRejected", "TableOverflow", "BlockManagerProtocol",
           "Snapshot", "State", "StepOutput", "StepStats"]
