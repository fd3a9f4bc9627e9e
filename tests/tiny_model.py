"""The tiny model engine tests run (a step well under a millisecond on the CPU)."""

from kvchaos.engine.config import ModelConfig


def tiny_model(vocab_size: int = 61, max_position: int = 128) -> ModelConfig:
    return ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=vocab_size,
        max_position=max_position,
    )
