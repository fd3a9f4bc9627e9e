"""The four failure modes of the source article and the prefix cache's, each with a trigger and a
plantable defect."""

from kvchaos.faults.async_free import AsyncFree
from kvchaos.faults.base import Fault, ParamError  # noqa: F401  ParamError: for kvchaos.harness.scenario.spec
from kvchaos.faults.offload import Offload
from kvchaos.faults.ordering_race import OrderingRace
from kvchaos.faults.prefix_cache import PrefixCache
from kvchaos.faults.refcount_leak import RefcountLeak
from kvchaos.faults.staging_stall import StagingStall
from kvchaos.faults.table_overflow import TableOverflow

REGISTRY: dict[str, type[Fault]] = {
    f.name: f
    for f in (
        TableOverflow,
        RefcountLeak,
        StagingStall,
        OrderingRace,
        PrefixCache,
        AsyncFree,
        Offload,
    )
}


def make_fault(name: str, defect: bool, params: dict, seed: int) -> Fault:
    return REGISTRY[name](defect, params, seed)
