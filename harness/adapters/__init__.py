"""Adapters: real serving engines' block managers as kvchaos block managers (protocol v2).

- `kvchaos.harness.adapters.vllm:VLLMManager` (`--block-manager vllm`): vLLM v1's KVCacheManager,
  over the installed vllm (0.33.x).
- `kvchaos.harness.adapters.sglang:SGLangManager` (`--block-manager sglang`): SGLang's RadixCache
  over its PagedTokenToKVPoolAllocator, over the installed sglang (0.5.5.x).
- `kvchaos.harness.adapters.example:MyKVManager`: the worked example for your own engine's manager
  (docs/adapters.md).

Nothing here is imported until a spec names it: importing this package needs no vllm or sglang."""

from importlib import metadata


def require(package: str, series: str, pin: str, adapter: str) -> str:
    """The installed version of `package` when it is of `series` (e.g. "0.33": 0.33 and 0.33.*);
    else one line, as an ImportError (the door shows it and exits 2). pin: what to install."""
    try:
        version = metadata.version(package)
    except metadata.PackageNotFoundError:
        raise ImportError(
            f"{package} is not installed: the {adapter} adapter needs {package} {series}.x (pip "
            f"install --no-deps {pin} and its pure-Python dependencies: docs/adapters.md)"
        ) from None
    if version != series and not version.startswith(series + "."):
        raise ImportError(
            f"{package} {version} is installed; the {adapter} adapter supports {package} {series}.x"
        )
    return version
