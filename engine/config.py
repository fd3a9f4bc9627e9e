"""Model, cache and engine configuration: plain dataclasses, validated on construction."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from kvchaos.engine.errors import ConfigError

if TYPE_CHECKING:
    import torch

# torch is imported where tensors are made, not here: a scenario loads (`kvchaos list`, pytest's
# collection) without it
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}  # name -> bytes per element
# where the engine runs: the one definition (the command line adds "auto")
DEVICE = re.compile(r"cpu|cuda(:\d+)?")
OVERFLOW_POLICIES = ("reject", "resize")
BACKENDS = ("auto", "torch", "triton")
TP_MODES = ("simulated", "distributed")


def _require(ok: bool, where: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: {msg}")


@dataclass(frozen=True)
class ModelConfig:
    """A small Llama-style decoder. The defaults run fast on two CPU cores."""

    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    vocab_size: int = 256
    max_position: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position",
        ):
            _require(
                getattr(self, name) > 0, f"model.{name}", f"must be > 0, got {getattr(self, name)}"
            )
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "model.num_kv_heads",
            f"num_heads ({self.num_heads}) must be a multiple of "
            f"num_kv_heads ({self.num_kv_heads})",
        )
        _require(
            self.head_dim % 2 == 0,
            "model.head_dim",
            "must be even (rotary embeddings pair dimensions)",
        )
        for name in ("rope_theta", "rms_eps"):  # a base and an epsilon: finite, positive
            v = getattr(self, name)
            _require(math.isfinite(v) and v > 0, f"model.{name}", f"must be a number > 0, got {v}")
        _require(
            self.dtype in DTYPES,
            "model.dtype",
            f"must be one of {list(DTYPES)}, got {self.dtype!r}",
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype]

    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head: 2 x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool and its flat block table (max_num_seqs rows x max_blocks_per_seq wide)."""

    block_size: int = 16
    num_blocks: int = 256
    max_blocks_per_seq: int = 32
    max_num_seqs: int = 16
    overflow_policy: str = "reject"
    watermark: float = 0.0  # fraction of blocks kept free at admission, to avoid instant preemption
    # the reference manager caches prefixes (PrefixCachingManager); false: the plain BlockManager
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_blocks_per_seq", "max_num_seqs"):
            _require(
                getattr(self, name) > 0, f"cache.{name}", f"must be > 0, got {getattr(self, name)}"
            )
        _require(
            self.overflow_policy in OVERFLOW_POLICIES,
            "cache.overflow_policy",
            f"must be one of {list(OVERFLOW_POLICIES)}, got {self.overflow_policy!r}",
        )
        _require(
            0.0 <= self.watermark < 1.0,
            "cache.watermark",
            f"must be in [0, 1), got {self.watermark}",
        )

    @property
    def max_tokens_per_seq(self) -> int:
        return self.max_blocks_per_seq * self.block_size


@dataclass(frozen=True)
class OffloadConfig:
    """`[engine.offload]`: a host KV tier beside the device pool (engine/offload.py). Absent: one
    tier, the engine (and its config hash) as it always was."""

    host_blocks: int = 256  # the host pool's blocks, per rank (same layout as the device pool)
    # a request idle (paused, holding blocks) this many steps is stored out; 0: never
    cold_steps: int = 2
    latency_steps: int = 1  # steps an asynchronous copy takes to complete (deferred, seeded)
    preempt: bool = True  # a preempted request is stored out instead of recomputed
    # the copy bandwidth: blocks landing per step, all copies sharing it in issue order (each
    # block its own due step); 0: unlimited, a copy's blocks land together
    blocks_per_step: int = 0

    def __post_init__(self) -> None:
        for name, low in (
            ("host_blocks", 1),
            ("cold_steps", 0),
            ("latency_steps", 1),
            ("blocks_per_step", 0),
        ):
            v = getattr(self, name)
            _require(
                isinstance(v, int) and not isinstance(v, bool) and v >= low,
                f"engine.offload.{name}",
                f"must be an int >= {low}, got {v!r}",
            )
        _require(
            isinstance(self.preempt, bool),
            "engine.offload.preempt",
            f"must be true or false, got {self.preempt!r}",
        )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    seed: int = 0
    device: str = "cpu"
    attention_backend: str = "auto"
    max_prefill_tokens: int = 256  # per-step prefill budget: longer prompts prefill in chunks
    tp_size: int = 1  # tensor-parallel ranks, each holding its own copy of the block table
    # ranks in this process (kvchaos.engine.ranks), or real processes (kvchaos.engine.distributed)
    tp_mode: str = "simulated"
    # step N+1 scheduled before step N's KV writes land (engine/inflight.py); off: a synchronous
    # step, and the config (its hash, the history) as it always was
    async_scheduling: bool = False
    offload: OffloadConfig | None = None  # a host KV tier; None: one tier (engine/offload.py)

    def __post_init__(self) -> None:
        _require(
            self.attention_backend in BACKENDS,
            "engine.attention_backend",
            f"must be one of {list(BACKENDS)}, got {self.attention_backend!r}",
        )
        _require(self.max_prefill_tokens > 0, "engine.max_prefill_tokens", "must be > 0")
        _require(
            self.tp_mode in TP_MODES,
            "engine.tp_mode",
            f"must be one of {list(TP_MODES)}, got {self.tp_mode!r}",
        )
        _require(
            self.tp_size > 0 and self.model.num_kv_heads % self.tp_size == 0,
            "engine.tp_size",
            f"must divide num_kv_heads ({self.model.num_kv_heads}), got {self.tp_size}",
        )
        _require(
            bool(DEVICE.fullmatch(self.device)),
            "engine.device",
            f"must be cpu, cuda or cuda:N, got {self.device!r}",
        )
        _require(
            not (self.async_scheduling and self.tp_mode == "distributed"),
            "engine.async_scheduling",
            "runs with tp_mode = 'simulated' only",
        )
        _require(
            not (self.offload is not None and self.tp_mode == "distributed"),
            "engine.offload",
            "runs with tp_mode = 'simulated' only",
        )

    def resolved_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.device.startswith("cuda") else "torch"

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.async_scheduling:  # off: the dict (and hash) every stored run has
            del d["async_scheduling"]
        if self.offload is None:
            del d["offload"]
        elif not self.offload.blocks_per_step:  # unlimited: the dict (and hash) it always had
            del d["offload"]["blocks_per_step"]
        return d

    def config_hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]
