"""Errors the engine raises. Each names what is wrong; none leaves the engine half-changed."""


class KVChaosError(Exception):
    """Base class for every error kvchaos raises on purpose."""


class ConfigError(KVChaosError, ValueError):
    """A configuration value is invalid."""


class InvalidRequest(KVChaosError, ValueError):
    """A request is malformed (empty prompt, token outside the vocabulary, ...)."""


class RequestRejected(KVChaosError):
    """429-style: the request can never fit under this configuration. The engine is unchanged."""

    status = 429


class OutOfBlocks(KVChaosError):
    """The pool has no free block. The scheduler preempts or waits; only misuse surfaces it."""


class RequestFailed(KVChaosError):
    """One request's work failed inside a step (a sampling, grammar or KV-load error): the engine
    ends that request in error, releasing what it holds, and the step goes on for the others."""


class TableOverflow(KVChaosError):
    """A block-table write past a row's width was refused (the bound check held)."""
