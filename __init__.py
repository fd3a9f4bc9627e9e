"""kvchaos: a chaos and fault-injection harness for paged-KV-cache LLM inference engines.

One import name: kvchaos.engine (the system under test), kvchaos.faults (the failure modes),
kvchaos.harness (the judge and the tools around it), kvchaos.scenarios (the built-in scenarios)."""


def __getattr__(name: str):
    if name != "__version__":
        raise AttributeError(f"module 'kvchaos' has no attribute {name!r}")
    from importlib import metadata  # on first use: every command's start would pay for it

    try:
        return metadata.version("kvchaos")
    except metadata.PackageNotFoundError:  # not installed: a bare checkout
        return "0+unknown"
