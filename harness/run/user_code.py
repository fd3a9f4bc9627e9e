"""The door a user's code comes in by: 'module:attr' specs (a block manager class or factory).

Two copies of kvchaos's modules in one process (the old top-level `engine.*` names, or a checkout
on sys.path beside the installed package) would give two `OutOfBlocks` classes: a manager's correct
refusal would then escape the engine as an unexpected exception. Loading refuses that, naming the
`kvchaos.*` import to use instead.

`validate_manager` is the check before any run: the factory builds a manager on a tiny pool (of a
block size it declares it supports: `block_sizes`, optional), the manager declares protocol v2
and has its attributes, and a short smoke sequence (admit, block_ids, append, end_step, fork,
release, snapshot) runs. What is not a manager at all (nothing to import, not callable, a wrong
signature, no v2 declaration, members missing or of the wrong type) is bad input: ValueError.
A manager whose smoke call raises or answers what the protocol does not allow has a bug:
SmokeFailure, with the calls made, which the doors record as a FAIL run (harness/run/door.py).
Whether its answers are true is for the runs' checkers and `kvchaos conformance` to judge.

Shipped adapters have short names (ALIASES): `--block-manager vllm` is vLLM v1's KVCacheManager."""

from __future__ import annotations

import importlib
import inspect
import numbers
import os
import sys
import traceback
from pathlib import Path

from kvchaos.harness.scenario.managers import ALIASES, OLD_TOP_LEVEL, ROOT, canonical_spec

MIN_COPY_BYTES = 200  # an empty __init__.py of the same name is no copy


def _own_files() -> dict[str, list[Path]]:
    """kvchaos's module files by base name."""
    out: dict[str, list[Path]] = {}
    for folder in OLD_TOP_LEVEL:
        for path in (ROOT / folder).rglob("*.py"):
            out.setdefault(path.name, []).append(path)
    return out


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["kvchaos", *parts])


def second_copies() -> list[tuple[str, str]]:
    """(loaded name, kvchaos name) for each module loaded outside `kvchaos.*` whose file is one of
    kvchaos's own files (the same path, or the same bytes)."""
    own = None
    found = []
    for name, mod in list(sys.modules.items()):
        file = getattr(mod, "__file__", None)
        if not file or name == "kvchaos" or name.startswith("kvchaos.") or name == "__main__":
            continue
        if name.split(".")[0] not in OLD_TOP_LEVEL and ".engine" not in name:
            continue  # cheap filter: copies keep kvchaos's package names
        own = own if own is not None else _own_files()
        path = Path(file)
        for candidate in own.get(path.name, ()):
            try:
                size = path.stat().st_size
                same = os.path.samefile(path, candidate) or (
                    size >= MIN_COPY_BYTES
                    and size == candidate.stat().st_size
                    and path.read_bytes() == candidate.read_bytes()
                )
            except OSError:
                continue
            if same:
                found.append((name, _module_name(candidate)))
                break
    return sorted(found)


def load_object(spec: str):
    """'module:attr' -> the object. ValueError (bad input: one line) when the module cannot be
    imported, lacks the attribute, or brought in a second copy of kvchaos's modules."""
    mod, _, attr = canonical_spec(spec).partition(":")  # messages name the spec as given
    if not mod or not attr:
        raise ValueError(f"{spec!r}: expected module:attr, or an adapter: {', '.join(ALIASES)}")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as pytest makes its rootdir importable
    try:
        obj = importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if e.name is None or not (mod == e.name or mod.startswith(e.name + ".")):
            raise ValueError(f"{spec!r}: importing {mod} raised ModuleNotFoundError: {e}") from None
        raise ValueError(
            f"{spec!r}: cannot import {mod}: {e} (kvchaos looks in the current directory, "
            f"{os.getcwd()}, and on PYTHONPATH: run from the folder that holds "
            f"{mod.split('.')[0]}, or add that folder to PYTHONPATH)"
        ) from None
    except Exception as e:  # a syntax error, or a module that raises on import
        raise ValueError(
            f"{spec!r}: importing {mod} raised {type(e).__name__}: {_line(e)}"
        ) from None
    copies = second_copies()
    if copies:
        name, ours = max(copies, key=lambda c: len(c[0]))  # the most specific module
        raise ValueError(
            f"{spec!r}: {mod} imported {name}, a second copy of kvchaos's {ours}: "
            f"import {ours} instead (two copies of OutOfBlocks turn a refusal into a crash)"
        )
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{spec!r}: {mod} has no attribute {attr}")
        obj = getattr(obj, part)
    return obj


# -- the check before any run ----------------------------------------------------------------
SMOKE_POOL = (8, 2, 4, 4)  # num_blocks, block_size, max_num_seqs, max_blocks_per_seq
TABLE_MEMBERS = ("rows", "width", "host_tensor")  # what the engine reads of `table`
SNAPSHOT_FIELDS = {  # Snapshot.to_dict(): each field's type
    "num_blocks": int,
    "free": list,
    "ref_counts": list,
    "seq_blocks": dict,
    "seq_rows": dict,
    "table": list,
    "table_width": int,
}


class _Refused(Exception):
    """The smoke sequence found the manager unusable: one line."""


class _Failed(Exception):
    """A smoke call raised or answered what the protocol does not allow: the manager's bug."""

    def __init__(self, text: str, shown: str, args: tuple, error: BaseException) -> None:
        super().__init__(text)
        self.shown, self.args_, self.error = shown, args, error


class SmokeFailure(ValueError):
    """A manager failed the smoke sequence: a bug, recorded as a FAIL run (harness/run/door.py).
    A ValueError whose text is one line, for a caller that can only refuse it. calls: the smoke
    calls made, each {"call", "answer"}, the failing one last; call: the one that failed, shown
    with its arguments."""

    def __init__(self, text: str, *, spec: str, pool: tuple, capabilities: list, failed: _Failed,
                 calls: list) -> None:  # fmt: skip
        super().__init__(text)
        self.spec, self.pool, self.capabilities, self.calls = spec, pool, capabilities, calls
        self.call = failed.shown
        self.args_ = [repr(a) for a in failed.args_]
        e = failed.error
        self.error = type(e).__name__
        self.message = str(e).strip() or type(e).__name__
        self.traceback = "".join(traceback.format_exception(e))

    def to_dict(self) -> dict:
        """Plain data (it crosses from the checking worker to its parent)."""
        keys = ("spec", "pool", "capabilities", "calls", "call", "args_", "error", "message")
        return {"text": str(self), **{k: getattr(self, k) for k in keys + ("traceback",)}}

    @classmethod
    def from_dict(cls, d: dict) -> "SmokeFailure":
        out = cls.__new__(cls)
        ValueError.__init__(out, d["text"])
        for k, v in d.items():
            if k != "text":
                setattr(out, k, v)
        out.pool = tuple(out.pool)
        return out


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _read(bm, name: str):
    try:
        value = getattr(bm, name)
    except Exception as e:
        text = f"reading {name} raised {type(e).__name__}: {_line(e)}"
        raise _Failed(text, f"reading {name}", (), e) from None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise _Refused(f"{name} is {type(value).__name__} {value!r}, not an int")
    return value


def _snapshot(bm, calls: list, fields=SNAPSHOT_FIELDS) -> None:
    from kvchaos.engine.boundary import BadAnswer

    snap = _call(bm, calls, "snapshot")
    try:
        d = snap.to_dict()
    except Exception:
        text = f"returned {type(snap).__name__}, not a kvchaos.engine.protocols.Snapshot"
        raise _Failed(f"snapshot() {text}", "snapshot()", (), BadAnswer(text)) from None
    for name, kind in fields.items():
        if not isinstance(d.get(name), kind) or isinstance(d.get(name), bool):
            got = type(d.get(name)).__name__ if name in d else "nothing"
            text = f"field {name} is {got}, not {kind.__name__}"
            raise _Failed(f"snapshot() {text}", "snapshot()", (), BadAnswer(text))


MEMBERS = (
    "block_size",
    "num_blocks",
    "num_free_blocks",
    "admit",
    "append",
    "block_ids",
    "release",
    "snapshot",
)  # kvchaos.engine.protocols.KVManager
OWN_TABLE_MEMBERS = ("table", "num_free_rows", "resize_table")
BUILT_TABLE_SNAPSHOT_FIELDS = {  # the table fields are the engine's
    k: SNAPSHOT_FIELDS[k] for k in ("num_blocks", "free", "ref_counts", "seq_blocks")
}
_REFUSED = object()  # a call answered OutOfBlocks


def _call(bm, calls: list, name: str, *args):
    """One call of the smoke sequence, logged in calls; its answer held to what the engine's
    boundary accepts (engine.boundary). A refusal (OutOfBlocks) is an answer: _REFUSED."""
    from kvchaos.engine.boundary import BadAnswer, check_answer, copied, describe, log_entry
    from kvchaos.engine.errors import OutOfBlocks

    shown = describe(name, args)
    # "logged": the call as the history's call log keeps it (a FAIL run's calls event)
    said = {"call": shown, "answer": None, "logged": log_entry(name, args, None)}
    calls.append(said)
    try:
        out = copied(getattr(bm, name)(*args))  # a live snapshot: judged as it was at the call
    except OutOfBlocks as e:
        said["answer"] = f"refused: OutOfBlocks: {_line(e)}"
        said["logged"][2] = {"refused": _line(e)}
        return _REFUSED
    except (Exception, SystemExit) as e:
        said["answer"] = f"raised {type(e).__name__}: {_line(e)}"
        said["logged"][2] = {"raised": f"{type(e).__name__}: {_line(e)}"}
        raise _Failed(f"{shown} {said['answer']}", shown, args, e) from None
    said["answer"] = _shown(out)
    if name != "snapshot":  # a read: its answer is judged below, not logged
        said["logged"] = log_entry(name, args, out)
    try:
        check_answer(name, out, args, bm.num_blocks)
    except BadAnswer as e:
        raise _Failed(f"{shown} {e}", shown, args, e) from None
    return out


def _shown(answer) -> str:
    try:
        text = repr(answer)
    except Exception as e:  # the answer's own repr is not the smoke sequence's to judge
        text = f"<{type(answer).__name__}: repr raised {type(e).__name__}>"
    return text if len(text) <= 200 else text[:197] + "..."


def _smoke(bm, calls: list) -> None:
    """A few sequences' lives on the tiny pool: admissions sharing a prefix, growth, the optional
    calls it declares, every release reason; the table only when the manager owns one."""
    from kvchaos.engine.protocols import capabilities

    caps = capabilities(bm)
    wanted = MEMBERS + (OWN_TABLE_MEMBERS if "own_table" in caps else ())
    missing = [n for n in wanted if not _has(bm, n)]
    if missing:
        raise _Refused(
            f"{type(bm).__name__} declares kvchaos_protocol = 2 but lacks {', '.join(missing)} "
            "(kvchaos.engine.protocols.KVManager)"
        )
    for name in ("num_blocks", "num_free_blocks", "block_size"):
        _read(bm, name)
    n = bm.num_blocks
    reserved = getattr(bm, "reserved_blocks", ())
    if not isinstance(reserved, (tuple, list)) or not all(
        isinstance(b, int) and not isinstance(b, bool) and 0 <= b < n for b in reserved
    ):
        raise _Refused(f"reserved_blocks is {reserved!r}, not a tuple of block ids in [0, {n})")
    fields = SNAPSHOT_FIELDS if "own_table" in caps else BUILT_TABLE_SNAPSHOT_FIELDS
    if "own_table" in caps:
        _read(bm, "num_free_rows")
        missing = [f"table.{m}" for m in TABLE_MEMBERS if not _has(bm.table, m)]
        if missing:
            raise _Refused(f"{type(bm).__name__} owns a table that lacks {', '.join(missing)}")
    step = (
        (lambda done: _call(bm, calls, "end_step", done))
        if "end_step" in caps
        else (lambda _: None)
    )
    prompt = [1, 2, 3, 4, 5]
    if _call(bm, calls, "admit", "smoke-a", prompt, 5, 4) is not _REFUSED:
        _call(bm, calls, "block_ids", "smoke-a")
        step({"smoke-a": 5})
        if _call(bm, calls, "append", "smoke-a", [6]) is not _REFUSED:
            step({"smoke-a": 6})
    _snapshot(bm, calls, fields)
    if "fork" in caps and _call(bm, calls, "fork", "smoke-a", "smoke-b") is not _REFUSED:
        _call(bm, calls, "append", "smoke-b", [7])
        _snapshot(bm, calls, fields)
    if (
        _call(bm, calls, "admit", "smoke-c", prompt + [8, 9], 7, 6) is not _REFUSED
    ):  # a hit, with a cache
        _call(bm, calls, "block_ids", "smoke-c")
        _snapshot(bm, calls, fields)
    for seq, why in (("smoke-a", "finished"), ("smoke-a", "finished"), ("smoke-b", "aborted")):
        _call(bm, calls, "release", seq, why)
    for seq, why in (("smoke-c", "preempted"), ("never-seen", "error")):  # release is idempotent
        _call(bm, calls, "release", seq, why)
    _snapshot(bm, calls, fields)


def _has(obj, name: str) -> bool:
    """Without calling a property: a getter that raises is the smoke sequence's to report."""
    try:
        inspect.getattr_static(obj, name)
        return True
    except AttributeError:
        return hasattr(obj, name)  # __getattr__ forwarding


def smoke_pool(factory) -> tuple[int, int, int, int]:
    """The tiny pool of the check: SMOKE_POOL at a block size the factory declares it supports
    (its `block_sizes`, when it declares them: 2 if among them, else the smallest)."""
    from kvchaos.engine.protocols import declared_block_sizes

    sizes = declared_block_sizes(factory)
    bs = SMOKE_POOL[1] if sizes is None or SMOKE_POOL[1] in sizes else min(sizes)
    return (SMOKE_POOL[0], bs, *SMOKE_POOL[2:])


def validate_manager(spec: str):
    """The block manager factory 'module:attr' names, checked before any run: ValueError (one
    line, bad input) when it cannot be loaded, called on a tiny pool, does not declare protocol
    v2 or lacks its attributes; SmokeFailure (a ValueError too) when a call of the smoke
    sequence raises or answers what the protocol does not allow. Returns the factory."""
    factory = load_object(spec)
    if not callable(factory):
        raise ValueError(
            f"{spec!r} is {type(factory).__name__}, not a block manager class or factory"
        )
    try:
        pool = smoke_pool(factory)
    except ValueError as e:
        raise ValueError(f"{spec!r}: {e}") from None
    args = ", ".join(map(str, pool))
    try:
        bm = factory(*pool)
    except Exception as e:
        raise ValueError(
            f"{spec!r}: calling it on a tiny pool ({args}: num_blocks, block_size, max_num_seqs, "
            f"max_blocks_per_seq) raised {type(e).__name__}: {_line(e)}"
        ) from None
    if bm is None:
        raise ValueError(f"{spec!r}({args}) returned None, not a block manager")
    from kvchaos.engine.protocols import NOT_V2, capabilities, protocol_version  # no torch yet

    if protocol_version(bm) < 2:
        raise ValueError(f"{spec!r}: {type(bm).__name__} {NOT_V2}")
    calls: list[dict] = []
    try:
        _smoke(bm, calls)
    except _Refused as e:
        raise ValueError(f"{spec!r} on a tiny pool ({args}): {e}") from None
    except _Failed as e:
        raise SmokeFailure(
            f"{spec!r} on a tiny pool ({args}): {e}",
            spec=spec,
            pool=pool,
            capabilities=sorted(capabilities(bm)),
            failed=e,
            calls=calls,
        ) from None
    return factory


def supported(scs: list, sizes: tuple[int, ...] | None, spec: str, named: bool) -> list:
    """The scenarios whose block size the manager supports (sizes: its block_sizes; None: any).
    ValueError (bad input) for a named scenario it does not support, or when none is left; the
    built-ins it does not support are left out, one line on stderr saying so."""
    if sizes is None:
        return scs
    size = {s.name: s.engine_config().cache.block_size for s in scs}
    left = [s for s in scs if size[s.name] not in sizes]
    if left and (named or len(left) == len(scs)):
        s = left[0]
        raise ValueError(
            f"scenario {s.name}: block_size {size[s.name]}, but {spec!r} supports block sizes "
            f"{', '.join(map(str, sizes))} (its block_sizes)"
        )
    if left:
        print(
            f"kvchaos: left out {len(left)} scenarios of a block size {spec} does not support "
            f"({', '.join(map(str, sizes))}): {', '.join(s.name for s in left)}",
            file=sys.stderr,
        )
    return [s for s in scs if s not in left]
