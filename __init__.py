"""kvchaos: a chaos and fault-injection harness for paged-KV-cache LLM inference engines.

One import name: kvchaos.engine (the system under test), kvchaos.faults (the failure modes),
kvchaos.harness (the judge and the tools around it), kvchaos.scenarios (the built-in scenarios)."""

from importlib import metadata

try:
    __version__ = metadata.version("kvchaos")
except metadata.PackageNotFoundError:  # not installed: a bare checkout
    __version__ = "0+unknown"
