"""Block managers by name: the references, the shipped adapters' short names, and a recorded
spec read in today's names. Plain strings: reading a run's record imports no manager."""

from __future__ import annotations

from pathlib import Path

import kvchaos

ROOT = Path(kvchaos.__file__).resolve().parent
# Before one import name, kvchaos's folders were top-level packages: recorded runs name them so.
OLD_TOP_LEVEL = ("engine", "faults", "harness", "scenarios")
REFERENCE = "kvchaos.engine.block_manager:BlockManager"  # the reference block manager
REFERENCE_PREFIX = "kvchaos.engine.prefix_manager:PrefixCachingManager"  # ... caching prefixes
REFERENCES = (REFERENCE, REFERENCE_PREFIX)


def reference_spec(cache_config) -> str:
    """The reference manager a run without --block-manager gets, by [engine.cache]."""
    return REFERENCE_PREFIX if cache_config.prefix_caching else REFERENCE


ALIASES = {  # shipped adapters' short names
    "vllm": "kvchaos.harness.adapters.vllm:VLLMManager",
    "sglang": "kvchaos.harness.adapters.sglang:SGLangManager",
}


def canonical_spec(spec: str | None) -> str | None:
    """A recorded spec in today's names: 'engine.block_manager:BlockManager' (recorded before
    kvchaos had one import name) -> 'kvchaos.engine.block_manager:BlockManager'; an alias
    ('vllm') -> the adapter it names."""
    if not spec:
        return spec
    spec = ALIASES.get(spec, spec)
    mod, sep, attr = spec.partition(":")
    if (
        mod.split(".")[0] in OLD_TOP_LEVEL
        and (ROOT / Path(*mod.split("."))).with_suffix(".py").is_file()
    ):
        return f"kvchaos.{mod}{sep}{attr}"
    return spec
