"""A v1 block manager (docs/protocol-v2.md section 1, "v1 through a shim") spoken to in v2.

The engine speaks only protocol v2. `as_v2` leaves a v2 manager as it is and wraps a v1 one (it
has `append(seq, n)` and `free(seq)`) in `V1Shim`: each v2 call becomes the v1 call it stands for,
without prefix caching (admit answers 0 computed tokens), so a v1 manager runs exactly as before.
The shim wraps the manager's Boundary: calls, refusals and exceptions are judged in the manager's
own v1 terms, as they always were. v1 is deprecated: a user's v1 manager class is warned about
once (FutureWarning, which Python shows by default), pointing to the migration table in
docs/adapters.md.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from kvchaos.engine.protocols import Reason, capabilities, protocol_version

_warned: set[type] = set()
DEPRECATE_V1 = True  # every door takes v2 and kvchaos's own managers speak it (#21)
MIGRATION = "docs/adapters.md, 'Moving a manager from the first protocol to v2'"


def is_v1(manager) -> bool:
    return protocol_version(manager) < 2 and all(
        callable(getattr(manager, name, None)) for name in ("append", "free")
    )


def _warn_once(manager) -> None:
    kind = type(manager)
    # a user's class, once: kvchaos's own modules are not the user's to migrate
    if not DEPRECATE_V1 or kind in _warned or kind.__module__.startswith("kvchaos."):
        return
    _warned.add(kind)
    warnings.warn(
        f"{kind.__name__} implements the v1 BlockManagerProtocol; it runs through a shim without "
        f"prefix caching; v1 support ends in 0.3: move it to protocol v2, see {MIGRATION}",
        FutureWarning,  # shown by default: it is the user who must act, not a library below
        stacklevel=3,
    )


def as_v2(manager, guarded=None):
    """The manager as the engine speaks to it: itself when v2, else a V1Shim over `guarded` (its
    Boundary; the manager itself when None)."""
    if not is_v1(manager):
        return guarded if guarded is not None else manager
    _warn_once(manager)
    return V1Shim(guarded if guarded is not None else manager, manager)


class V1Shim:
    """Protocol v2 over a v1 manager. Optional calls exist only where the v1 manager has them."""

    kvchaos_protocol = 2
    protocol = 1  # what the manager itself speaks (run records)
    estimates_unseen = True  # v1's blocks_needed answers for ids it has not seen too

    def __init__(self, v1, manager=None) -> None:
        inner = manager if manager is not None else v1
        object.__setattr__(self, "v1", v1)
        object.__setattr__(self, "capabilities", capabilities(inner) | {"own_table", "estimates"})
        for name in ("blocks_needed", "fork", "resize_table"):
            if hasattr(v1, name):
                object.__setattr__(self, name, getattr(v1, name))
        if hasattr(v1, "append_decode"):
            decode = v1.append_decode
            object.__setattr__(self, "append_decode", lambda seq_ids, token_ids: decode(seq_ids))

    def admit(
        self, seq_id: str, token_ids: Sequence[int], num_new_tokens: int, max_computed: int
    ) -> int:
        self.v1.append(seq_id, num_new_tokens)
        return 0  # no prefix cache: every known token is computed

    def append(self, seq_id: str, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        return self.v1.append(seq_id, len(token_ids))

    def release(self, seq_id: str, reason: Reason) -> bool:
        return self.v1.free(seq_id)

    def block_ids(self, seq_id: str) -> list[int]:
        """Its blocks from the manager's snapshot (harness use only: the engine reads a v1
        manager's own table, so a run never calls this)."""
        snap = self.v1.snapshot()
        return list(snap.seq_blocks.get(seq_id, ()))

    def snapshot(self):
        return self.v1.snapshot()

    @property
    def num_blocks(self) -> int:
        return self.v1.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.v1.num_free_blocks

    @property
    def num_free_rows(self) -> int:
        return self.v1.num_free_rows

    def __getattr__(self, name: str):  # block_size, table, rows, calls, manager: the v1 side's
        return getattr(self.v1, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.v1, name, value)
