"""Adapters: real serving engines' block managers as kvchaos block managers (protocol v2).

- `kvchaos.harness.adapters.vllm:VLLMManager` (`--block-manager vllm`): vLLM v1's KVCacheManager,
  over the installed vllm (0.33.x).
- `kvchaos.harness.adapters.sglang:SGLangManager` (`--block-manager sglang`): SGLang's RadixCache
  over its PagedTokenToKVPoolAllocator, over the installed sglang (0.5.5.x).
- `kvchaos.harness.adapters.example:MyKVManager`: the worked example for your own engine's manager
  (docs/adapters.md).

Nothing here is imported until a spec names it: importing this package needs no vllm or sglang."""
