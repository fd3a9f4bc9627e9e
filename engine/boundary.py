"""The boundary between the engine and a block manager (the reference one or a user's).

Every call into the manager goes through here. The call in progress is recorded before it is made
(a hang or a process death can then name it), and an exception escaping it becomes ManagerError,
naming the call and its arguments: a finding against the manager, never the harness's own ERROR.
A refusal (OutOfBlocks, "no room") is an answer, not a crash: it passes through unchanged for the
engine to schedule around. Its answers are checked too (ANSWERS): a malformed one is a
ManagerError (BadAnswer) like an exception."""

from __future__ import annotations

import copy
import time
import traceback

from kvchaos.engine.errors import KVChaosError, OutOfBlocks
from kvchaos.engine.protocols import Snapshot, capabilities

CALLS = (
    "admit",
    "append",
    "append_decode",
    "block_ids",
    "blocks_needed",
    "fork",
    "release",
    "end_step",
    "resize_table",
    "snapshot",
)
# "offload" (a host tier): counted only for a manager that has them (run records as they were)
OFFLOAD_CALLS = ("offload_store", "offload_restore", "offload_done")
PROPERTIES = ("num_blocks", "num_free_blocks", "num_free_rows")
# Calls whose arguments carry a token list (at this index): the call log keeps its length only
TOKEN_ARG = {"admit": 1, "append": 1}
LOW_POOL_BLOCKS = 16  # at or below this many free blocks a refusal is plausible: snapshot first


class BadAnswer(ValueError):
    """A call into the block manager returned, but not an answer the protocol allows. rule: the
    conformance property it breaks, when one names it (else "answers")."""

    def __init__(self, message: str, rule: str = "answers") -> None:
        super().__init__(message)
        self.rule = rule


class ManagerError(KVChaosError):
    """An exception escaped a call into the block manager."""

    def __init__(self, call: str, args: tuple, error: BaseException) -> None:
        self.call, self.args_, self.error = call, args, error
        self.traceback = "".join(traceback.format_exception(error))
        what = "" if isinstance(error, BadAnswer) else f"raised {type(error).__name__}: "
        super().__init__(f"{describe(call, args)} {what}{error}")


def state_change(before, after) -> str | None:
    """What differs between two snapshots, in words (None when nothing observable does)."""
    out = []
    if set(before.free) != set(after.free):
        taken, given = (
            sorted(set(before.free) - set(after.free)),
            sorted(set(after.free) - set(before.free)),
        )
        out.append(f"free set: taken {taken[:8]}, returned {given[:8]}")
    refs = [b for b, (x, y) in enumerate(zip(before.ref_counts, after.ref_counts)) if x != y]
    if refs:
        b = refs[0]
        out.append(
            f"ref counts of {len(refs)} blocks (block {b}: {before.ref_counts[b]} -> "
            f"{after.ref_counts[b]})"
        )
    seqs = sorted(
        s
        for s in set(before.seq_blocks) | set(after.seq_blocks)
        if before.seq_blocks.get(s) != after.seq_blocks.get(s)
    )
    if seqs:
        s = seqs[0]
        out.append(
            f"blocks of {seqs[:4]} ({s}: {before.seq_blocks.get(s)} -> {after.seq_blocks.get(s)})"
        )
    if before.seq_rows != after.seq_rows or before.table != after.table:
        out.append("table rows")
    cached = [{(e["block"], e["key"]) for e in s.cache or ()} for s in (before, after)]
    if cached[0] != cached[1]:
        gone, new = sorted(cached[0] - cached[1]), sorted(cached[1] - cached[0])
        out.append(f"prefix cache: {len(gone)} entries gone {gone[:2]}, {len(new)} new {new[:2]}")
    return "; ".join(out) or None


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_admit(h, pool: int, seq_id, token_ids, num_new_tokens=None, max_computed=None) -> None:
    if not _int(h) or not 0 <= h <= len(token_ids):
        raise BadAnswer(f"answered {h!r}: computed tokens must be an int in [0, {len(token_ids)}]")
    if _int(max_computed) and h > max_computed:  # the engine computes what it asked for
        raise BadAnswer(
            f"answered {h}: more computed tokens than max_computed {max_computed} "
            "(the tokens from max_computed on are the engine's to compute)",
            rule="hit_over_cap",
        )


def _in_pool(ids, pool: int) -> bool:
    return not ids or (min(ids) >= 0 and max(ids) < pool)


def _check_copies(copies, pool: int, *_) -> None:
    if not isinstance(copies, (list, tuple)) or not all(
        isinstance(c, (list, tuple)) and len(c) == 2 and _int(c[0]) and _int(c[1]) for c in copies
    ):
        raise BadAnswer(f"answered {copies!r}: copies must be a list of (src, dst) block ids")
    if not _in_pool([b for c in copies for b in c], pool):
        raise BadAnswer(f"answered {copies!r}: a block id outside the pool [0, {pool})")


def _check_block_ids(ids, pool: int, *_) -> None:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise BadAnswer(f"answered {ids!r}: block ids must be a sequence of ints")
    if ids and set(map(type, ids)) != {int}:  # at C speed: asked for every sequence, every step
        raise BadAnswer(f"answered {list(ids)!r}: block ids must be ints")
    if not _in_pool(ids, pool):
        raise BadAnswer(f"answered {list(ids)!r}: a block id outside the pool [0, {pool})")


def _check_pairs(pairs, pool: int, *_) -> None:
    if not isinstance(pairs, list) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and _int(p[0]) and _int(p[1]) for p in pairs
    ):
        raise BadAnswer(f"answered {pairs!r}: a list of (device block, host slot) pairs")


def _check_release(freed, pool: int, *_) -> None:
    if not isinstance(freed, bool):
        raise BadAnswer(f"answered {freed!r}: release answers True or False")


# What an answer must be (a malformed one is a ManagerError: the manager's bug)
ANSWERS = {
    "admit": _check_admit,
    "append": _check_copies,
    "append_decode": _check_copies,
    "block_ids": _check_block_ids,
    "release": _check_release,
    "offload_store": _check_pairs,
    "offload_restore": _check_pairs,
    "offload_hits": _check_pairs,
}


def check_answer(name: str, out, args: tuple, pool: int) -> None:
    """Raise BadAnswer when a call's answer is malformed or names a block outside the pool
    (pool: the manager's num_blocks). The one check the boundary, the check at load and
    conformance make."""
    check = ANSWERS.get(name)
    if check is not None:
        check(out, pool, *args)


def logged(x):
    """An argument or answer as the call log keeps it: plain data, copied (a manager's answer may
    be its live state, which changes after the call)."""
    if isinstance(x, (list, tuple)):
        return [logged(v) for v in x]
    if isinstance(x, dict):
        return {k if isinstance(k, str) else str(k): logged(v) for k, v in x.items()}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


def log_entry(name: str, args: tuple, out, full_tokens: bool = False) -> list:
    """One call as the call log keeps it: [name, args, answer], plain data, token lists by length
    unless full_tokens."""
    shown = [logged(a) for a in args]
    at = TOKEN_ARG.get(name)
    if at is not None and not full_tokens and len(args) > at:
        shown[at] = f"<{len(args[at])} tokens>"
    return [name, shown, logged(out)]


def copied(snap):
    """A snapshot in lists and dicts of its own, as the manager gave it at the call: a manager may
    hand out its live state (its free list, its dicts), which its next call changes, while the
    harness keeps what it was told. Anything but a Snapshot is left as it is, for the checks."""
    if not isinstance(snap, Snapshot):
        return snap
    out = copy.copy(snap)
    out.__dict__.update((k, _own(v)) for k, v in snap.__dict__.items())
    return out


def _own(v):
    """A field's copy, each container of the type it had (the checks judge the types)."""
    if type(v) is list:
        return [_entry(e) for e in v] if v and type(v[0]) is dict else v.copy()  # cache: dicts
    if type(v) is dict:  # seq_blocks: lists; seq_rows, seq_tokens: ints
        return {k: x.copy() if type(x) is list else x for k, x in v.items()}
    return v


def _entry(e):
    if type(e) is not dict:
        return e
    out = e.copy()
    if type(out.get("tokens")) is list:
        out["tokens"] = out["tokens"].copy()
    return out


def describe(call: str, args: tuple) -> str:
    shown = ", ".join(repr(a) if not isinstance(a, list) or len(a) < 9 else "[...]" for a in args)
    return f"{call}({shown})"


class Boundary:
    """Wraps a block manager: same attributes, every protocol call recorded and guarded."""

    # Told (call, args) before each call into the manager and None after it returns: an isolated
    # worker (kvchaos.harness.run.isolate) sets it, so that its parent can name a call that hung
    # or ended the process. None (the default) costs one attribute read per call.
    watch = None
    # The call log: None (off), or a list each protocol call appends [name, args, answer] to,
    # answer {"refused": message} or {"raised": "Type: message"} for what came back instead.
    # Token lists are kept by length unless full_tokens (a reproducer needs them). Snapshots and
    # the count properties are reads, not logged.
    log: list | None = None
    full_tokens = False
    # Told (name, args) before and after each logged call that returns or refuses, while set
    # (call localization)
    before = None
    after = None

    def __init__(self, manager) -> None:
        object.__setattr__(self, "manager", manager)
        object.__setattr__(self, "in_progress", None)  # (call, args) while a call runs
        tier = OFFLOAD_CALLS if "offload" in capabilities(manager) else ()
        if tier and "prefix_cache" in capabilities(manager):
            tier += ("offload_hits",)  # a prefix hit on the host tier alone
        counted = CALLS + tier
        object.__setattr__(self, "calls", dict.fromkeys(counted, 0))  # calls made, by name
        object.__setattr__(self, "refusals", 0)
        # seconds spent snapshotting for refusals (the harness's cost inside a step's timings)
        object.__setattr__(self, "snapshot_s", [0.0])
        for name in counted:
            if hasattr(manager, name):
                object.__setattr__(self, name, self._guard(name, getattr(manager, name)))
        if hasattr(manager, "snapshot"):  # kept by the harness: copied at the call
            guarded = self.snapshot
            object.__setattr__(self, "snapshot", lambda: copied(guarded()))
        # answers are checked against the pool it sized (the KV pool is allocated by num_blocks)
        object.__setattr__(self, "sized_blocks", self._read("num_blocks"))

    def _guard(self, name: str, fn):
        calls = self.calls
        grows = name in ("admit", "append", "append_decode", "fork")
        check = ANSWERS.get(name)

        logs = name != "snapshot"

        def call(*args, **kw):
            calls[name] += 1
            if kw:
                args = args + tuple(f"{k}={v}" for k, v in kw.items())  # shown, not passed
            self._enter((name, args))
            log = self.log if logs else None
            if logs and self.before is not None:
                self.before(name, args)
            try:
                before = self._before_growth() if grows else None
                out = fn(*args[: len(args) - len(kw)], **kw)
                if check is not None:
                    check(out, self.sized_blocks, *args)
            except OutOfBlocks as refusal:
                if grows:  # a refusal must change nothing
                    refusal.changed = self._changed_by_refusal(before)
                if log is not None:
                    self._log(log, name, args, {"refused": str(refusal)})
                if logs and self.after is not None:
                    self.after(name, args)
                raise
            except (Exception, SystemExit) as e:  # sys.exit() in the manager: its bug too
                if log is not None:
                    self._log(log, name, args, {"raised": f"{type(e).__name__}: {e}"})
                raise ManagerError(name, args, e) from e
            finally:
                self._enter(None)
            if log is not None:
                self._log(log, name, args, out)
            if logs and self.after is not None:
                self.after(name, args)
            return out

        call.__name__ = name
        return call

    def _log(self, log: list, name: str, args: tuple, out) -> None:
        log.append(log_entry(name, args, out, self.full_tokens))

    def start_log(self, full_tokens: bool = False) -> None:
        """Log every protocol call from now on (full_tokens: token lists whole)."""
        object.__setattr__(self, "log", [])
        object.__setattr__(self, "full_tokens", full_tokens)

    def on_call(self, after, before=None) -> None:
        """after(name, args) is told of each logged call that returned or refused, before(name,
        args) of each before it is made (None: nobody)."""
        object.__setattr__(self, "after", after)
        object.__setattr__(self, "before", before)

    def drain(self) -> list:
        """The calls logged since the last drain (the log goes on)."""
        log = self.log
        if not log:
            return []
        object.__setattr__(self, "log", [])
        return log

    def _before_growth(self):
        """What a refusal of the coming call must leave as it is. A full snapshot when a refusal
        is plausible (the pool is low, or the manager has refused before); else the free count,
        so a pool with room pays no snapshot per call."""
        m = self.manager
        free = m.num_free_blocks
        if self.refusals or free <= max(LOW_POOL_BLOCKS, m.num_blocks // 8):
            t = time.perf_counter()
            snap = copied(m.snapshot())  # a live one would follow the call it is to judge
            self.snapshot_s[0] += time.perf_counter() - t
            return free, snap
        return free, None

    def _changed_by_refusal(self, before) -> str | None:
        object.__setattr__(self, "refusals", self.refusals + 1)
        free, snap = before
        after = self.manager.num_free_blocks
        if snap is None:
            return f"free blocks {free} -> {after}" if after != free else None
        t = time.perf_counter()
        now = self.manager.snapshot()
        self.snapshot_s[0] += time.perf_counter() - t
        return state_change(snap, now)

    def _enter(self, call: tuple | None) -> None:
        """Record the call in progress ((name, args), or None once it returned or raised)."""
        object.__setattr__(self, "in_progress", call)
        if Boundary.watch is not None:
            Boundary.watch(call)

    def _read(self, name: str):
        self._enter((name, ()))
        try:
            return getattr(self.manager, name)
        except (Exception, SystemExit) as e:
            raise ManagerError(name, (), e) from e
        finally:
            self._enter(None)

    num_blocks = property(lambda self: self._read("num_blocks"))
    num_free_blocks = property(lambda self: self._read("num_free_blocks"))
    num_free_rows = property(lambda self: self._read("num_free_rows"))

    def __getattr__(self, name: str):  # block_size, table, rows, ...: the manager's own
        return getattr(self.manager, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.manager, name, value)
