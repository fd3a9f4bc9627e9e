"""The engine's fault seams: the small, named set of places where a fault may change behaviour.
Defaults are the remediated engine. The engine reads them; it never imports a fault.

Besides these, the block manager's table has `bound_check` (refuse writes past a row's width).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


def _no_delay(rank: int, step: int) -> int:
    return 0


def _always_free(seq, reason: str) -> bool:
    return True


def _never(seq, reason: str) -> bool:
    return False


def _never_pair(seq, blocks: list) -> bool:
    return False


def _never_one(seq) -> bool:
    return False


def _never_rows(seqs: list) -> bool:
    return False


def _no_load(seq) -> int:
    return 0


def _sampled(seq) -> None:
    return None


def _ignore(kind: str, data: dict) -> None:
    return None


def _nothing() -> None:
    return None


def _in_order(rank: int, step: int) -> bool:
    return False


@dataclass
class Seams:
    # Reject (or, by policy, make room for) a request that can never fit a table row.
    admission_check: bool = True
    # Set: the blocks admission judges a request to need against a row's width,
    # admission_blocks(total_tokens, prompt_tokens). None (the default): every token's,
    # ceil(total / block_size). A planted defect miscounts (an off-by-one, a token limit).
    admission_blocks: Callable[[int, int], int] | None = None
    # Set: the row stride the kernels index the flat table with (row * stride + index). None (the
    # default): the table's own width, whatever it was resized to.
    kernel_stride: int | None = None
    # The kernels' geometry is the manager's: a KV pool sized, or a kernel block size asked,
    # apart from its num_blocks / block_size is aligned to them (engine/geometry.py). Off (a
    # planted defect): as asked, the pool addressed past its end.
    geometry_check: bool = True
    # Re-allocate the host staging buffer when it is not valid in this process.
    staging_check: bool = True
    # Ranks acknowledge the current table version before computing.
    rank_sync: bool = True
    # Steps by which rank r's table update for a step arrives late (0 = on time).
    rank_delay: Callable[[int, int], int] = _no_delay
    # Set: what rank r holds of an update that reaches it (rank, step, the update tensor): a
    # torn or reordered copy. None (the default): the update, whole.
    rank_receive: Callable[[int, int, object], object] | None = None
    # A rank on the step's version acknowledges its table's checksum too: one holding other
    # content (a torn or reordered update) is sent the whole table again before computing.
    rank_verify: bool = True
    # Steps by which rank r's copy-on-write copies of a step land late (0 = before it computes).
    # With rank_sync, a rank waits for them before computing.
    rank_copy_delay: Callable[[int, int], int] = _no_delay
    # Whether rank r's tokens of a step reach its KV writes out of position order (rank, step).
    tokens_out_of_order: Callable[[int, int], bool] = _in_order
    # Each rank writes position p at offset p % block_size of its block, whatever order its
    # tokens arrive in; off, a rank whose tokens arrive out of order writes each block reversed.
    slots_by_position: bool = True
    # Whether to release a sequence's blocks as it leaves (reason: finish, cancel, preempt, error).
    free_on_exit: Callable[[object, str], bool] = _always_free
    # Steps an admitted request waits in the waiting queue for its KV to land from elsewhere (a
    # disaggregated prefill's transfer: vLLM's WAITING_FOR_REMOTE_KVS, SGLang's decode prealloc
    # queue), holding the blocks its admission reserved; asked at each admission. 0: it runs.
    kv_load_steps: Callable[[object], int] = _no_load
    # Called for each sequence about to take its sampled token; raising RequestFailed is that
    # request's own error in the step: the engine ends it in error (release reason "error").
    on_sample: Callable[[object], None] = _sampled
    # Asynchronous scheduling: release a sequence while the step in flight still writes its
    # blocks (reason as above); False: wait for that step first (engine/inflight.py).
    free_in_flight: Callable[[object, str], bool] = _never
    # ... and restage the one staging buffer while the step in flight's table copy still reads
    # it, told (at each upload) the sequences whose rows would mix two steps; False:
    # double-buffered staging.
    reuse_staging: Callable[[list], bool] = _never_rows
    # Host tier ([engine.offload]): a store reads blocks the step in flight still writes (seq,
    # why: preempt | cold); False: it waits for that step first (engine/offload.py).
    store_early: Callable[[object, str], bool] = _never
    # ... and a restored sequence computes on its new blocks before their copy completed (seq);
    # False: it is scheduled once the restore completed.
    restore_flip: Callable[[object], bool] = _never_one
    # ... and a sequence released (seq, reason) while its restore is in flight: freed at once, the
    # load still writing its blocks; False: the restore completes first.
    free_loading: Callable[[object, str], bool] = _never
    # ... and a restored sequence's blocks written again (seq, their logical indices): their host
    # copies stay valid, so its next store skips them; False: they are dropped (copied again).
    stale_host: Callable[[object, list], bool] = _never_pair
    # Engine-internal events (preemption, copy-on-write, staging re-allocation) for the history.
    on_event: Callable[[str, dict], None] = field(default=_ignore)
    # Called once a step's table is uploaded, before any rank computes: the table the kernels read.
    on_upload: Callable[[], None] = field(default=_nothing)
    # Set: told each step's batch as each rank computes it, on_batch(rank, reads, writes); writes
    # (seq, pos, token, slot) per computed token, reads (seq, n_ctx, blocks) per sequence. None
    # (the default) costs nothing (Engine._build_batch).
    on_batch: Callable[[int, list, list], None] | None = None
