"""The door a user's code comes in by: 'module:attr' specs (a block manager class or factory).

Two copies of kvchaos's modules in one process (the old top-level `engine.*` names, or a checkout
on sys.path beside the installed package) would give two `OutOfBlocks` classes: a manager's correct
refusal would then escape the engine as an unexpected exception. Loading refuses that, naming the
`kvchaos.*` import to use instead."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import kvchaos

ROOT = Path(kvchaos.__file__).resolve().parent
# Before one import name, kvchaos's folders were top-level packages: recorded runs name them so.
OLD_TOP_LEVEL = ("engine", "faults", "harness", "scenarios")
REFERENCE = "kvchaos.engine.block_manager:BlockManager"  # the reference block manager
MIN_COPY_BYTES = 200  # an empty __init__.py of the same name is no copy


def canonical_spec(spec: str | None) -> str | None:
    """A recorded spec in today's names: 'engine.block_manager:BlockManager' (recorded before
    kvchaos had one import name) -> 'kvchaos.engine.block_manager:BlockManager'."""
    if not spec:
        return spec
    mod, sep, attr = spec.partition(":")
    if (
        mod.split(".")[0] in OLD_TOP_LEVEL
        and (ROOT / Path(*mod.split("."))).with_suffix(".py").is_file()
    ):
        return f"kvchaos.{mod}{sep}{attr}"
    return spec


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
    spec = canonical_spec(spec)
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise ValueError(f"{spec!r}: expected module:attr")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as pytest makes its rootdir importable
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        raise ValueError(
            f"{spec!r}: cannot import {mod}: {e} (searched: the current directory, PYTHONPATH)"
        ) from None
    except Exception as e:  # a syntax error, or a module that raises on import
        raise ValueError(f"{spec!r}: importing {mod} raised {type(e).__name__}: {e}") from None
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
