"""The boundary between the engine and a block manager (the reference one or a user's).

Every call into the manager goes through here. The call in progress is recorded before it is made
(a hang or a process death can then name it), and an exception escaping it becomes ManagerError,
naming the call and its arguments: a finding against the manager, never the harness's own ERROR.
A refusal (OutOfBlocks, "no room") is an answer, not a crash: it passes through unchanged for the
engine to schedule around."""

from __future__ import annotations

import traceback

from kvchaos.engine.errors import KVChaosError, OutOfBlocks

CALLS = ("blocks_needed", "append", "append_decode", "fork", "free", "resize_table", "snapshot")
PROPERTIES = ("num_blocks", "num_free_blocks", "num_free_rows")


class ManagerError(KVChaosError):
    """An exception escaped a call into the block manager."""

    def __init__(self, call: str, args: tuple, error: BaseException) -> None:
        self.call, self.args_, self.error = call, args, error
        self.traceback = "".join(traceback.format_exception(error))
        super().__init__(f"{describe(call, args)} raised {type(error).__name__}: {error}")


def describe(call: str, args: tuple) -> str:
    shown = ", ".join(repr(a) if not isinstance(a, list) or len(a) < 9 else "[...]" for a in args)
    return f"{call}({shown})"


class Boundary:
    """Wraps a block manager: same attributes, every protocol call recorded and guarded."""

    def __init__(self, manager) -> None:
        object.__setattr__(self, "manager", manager)
        object.__setattr__(self, "in_progress", None)  # (call, args) while a call runs
        object.__setattr__(self, "calls", dict.fromkeys(CALLS, 0))  # calls made, by name
        for name in CALLS:
            if hasattr(manager, name):
                object.__setattr__(self, name, self._guard(name, getattr(manager, name)))

    def _guard(self, name: str, fn):
        calls = self.calls

        manager = self.manager
        grows = name in ("append", "append_decode", "fork")

        def call(*args, **kw):
            calls[name] += 1
            if kw:
                args = args + tuple(f"{k}={v}" for k, v in kw.items())  # shown, not passed
            object.__setattr__(self, "in_progress", (name, args))
            try:
                free = manager.num_free_blocks if grows else None
                out = fn(*args[: len(args) - len(kw)], **kw)
            except OutOfBlocks as refusal:
                object.__setattr__(self, "in_progress", None)
                if grows and manager.num_free_blocks != free:  # a refusal must change nothing
                    refusal.changed = f"free blocks {free} -> {manager.num_free_blocks}"
                raise
            except Exception as e:
                raise ManagerError(name, args, e) from e
            object.__setattr__(self, "in_progress", None)
            return out

        call.__name__ = name
        return call

    def _read(self, name: str):
        object.__setattr__(self, "in_progress", (name, ()))
        try:
            out = getattr(self.manager, name)
        except Exception as e:
            raise ManagerError(name, (), e) from e
        object.__setattr__(self, "in_progress", None)
        return out

    num_blocks = property(lambda self: self._read("num_blocks"))
    num_free_blocks = property(lambda self: self._read("num_free_blocks"))
    num_free_rows = property(lambda self: self._read("num_free_rows"))

    def __getattr__(self, name: str):  # block_size, table, rows, ...: the manager's own
        return getattr(self.manager, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.manager, name, value)
