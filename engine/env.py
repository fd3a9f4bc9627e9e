"""The numbers kvchaos reads from its environment: one table, each value checked where it is
read, and all of them before a command starts (a bad one is the command's usage error, exit 2,
not a traceback inside a run's worker or a rank)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Var:
    kind: type  # int or float
    default: float
    low: float  # the least value allowed
    means: str


VARS: dict[str, Var] = {
    "KVCHAOS_RANK_TIMEOUT": Var(kind=float, default=60.0, low=0.001, means="seconds a rank waits"),
    "KVCHAOS_CPU_THREADS": Var(kind=int, default=1, low=1, means="torch threads on the CPU"),
    "KVCHAOS_TELEMETRY_EVERY": Var(kind=int, default=10, low=1, means="steps between samples"),
    "KVCHAOS_TELEMETRY_INTERVAL_S": Var(
        kind=float, default=0.5, low=0.0, means="least seconds between samples"
    ),
}


def number(name: str):
    """The variable's value (its default when unset or empty); ValueError naming it if it is not
    a number of its kind, at least its low bound."""
    var, raw = VARS[name], os.environ.get(name, "").strip()
    if not raw:
        return var.kind(var.default)
    try:
        value = var.kind(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < var.low:
        kind = "an int" if var.kind is int else "a number"
        raise ValueError(f"{name}={raw!r}: expected {kind} >= {var.low:g} ({var.means})")
    return value


def check() -> None:
    """Every variable of the table read once: the first bad one raises."""
    for name in VARS:
        number(name)
