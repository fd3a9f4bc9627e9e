"""Values from the command line, checked before anything runs: a bad one is one line naming the
flag and what it takes (exit 2), never an ERROR run per scenario."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from kvchaos.engine.errors import ConfigError, KVChaosError

if TYPE_CHECKING:
    from kvchaos.harness.scenario.spec import Scenario

MAX_SEED = 2**63 - 1  # seeds are int64: torch, JSON readers and numpy all take them

MAX_SEEDS = 100_000  # a batch is one run per seed: more is a typo, not a plan
MAX_WORLD_SIZE = 64  # real ranks are processes (or GPUs) on one machine


class OneLineParser(argparse.ArgumentParser):
    """argparse prints the whole usage before a bad flag; this says only what is wrong."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def flag(check):
    """An argparse type from a check that raises ValueError with its own words."""

    def convert(text: str):
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = check.__name__
    return convert


def check_seed(seed: int) -> int:
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed {seed}: seeds are 0 .. 2**63-1")
    return seed


def _int(text: str, what: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{text!r}: expected {what}") from None


def seed(text: str) -> int:
    return check_seed(_int(text, "a seed (0 .. 2**63-1)"))


def seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise ValueError(f"{text!r}: expected seconds, e.g. 30 or 2.5") from None
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"{text!r}: expected a number of seconds > 0")
    return s


def path(text: str) -> str:
    """A path as typed. An empty or blank one is a slip, not a name: Path("") is the working
    directory, and a folder named " " is nobody's plan."""
    if not text.strip():
        raise ValueError(f"{text!r}: an empty path")
    return text


def device(text: str) -> str:
    from kvchaos.engine.config import DEVICE  # here: a command's --help needs none of the config

    if text != "auto" and not DEVICE.fullmatch(text):
        raise ValueError(f"{text!r}: expected auto, cpu, cuda or cuda:N")
    return text


def world_size(text: str) -> int:
    n = _int(text, "a number of ranks")
    if not 1 <= n <= MAX_WORLD_SIZE:
        raise ValueError(f"{n}: expected 1 .. {MAX_WORLD_SIZE} ranks")
    return n


def parse_seeds(one: int | None, seeds: str | None) -> list[int] | None:
    """--seed N: that seed; --seeds N: seeds 0..N-1; --seeds 3,7,11: those."""
    if one is not None:
        return [check_seed(one)]
    if seeds is None:
        return None
    where = f"--seeds {seeds!r}"
    if "," not in seeds:
        try:
            n = int(seeds)
        except ValueError:
            raise KVChaosError(
                f"{where}: expected a count (e.g. 20) or a list (e.g. 0,3,7)"
            ) from None
        if n < 1:
            raise KVChaosError(f"--seeds {seeds}: the count must be >= 1")
        if n > MAX_SEEDS:
            raise KVChaosError(f"--seeds {seeds}: at most {MAX_SEEDS} seeds in a batch")
        return list(range(n))
    out = []
    for i, s in enumerate(seeds.split(","), 1):
        if not s.strip():
            raise KVChaosError(f"{where}: entry {i} is empty")
        try:
            out.append(check_seed(_int(s, "a seed")))
        except ValueError as e:
            raise KVChaosError(f"{where}: entry {i}: {e}") from None
    if len(set(out)) != len(out):
        twice = next(s for s in out if out.count(s) > 1)
        raise KVChaosError(f"{where}: seed {twice} is listed twice")
    return out


def check_overrides(scenarios, device: str, tp_mode: str | None, ranks: int | None) -> None:
    """--tp-mode / --world-size against each scenario's engine (ranks must divide its KV heads)."""
    tp = {k: v for k, v in (("tp_mode", tp_mode), ("tp_size", ranks)) if v is not None}
    if not tp:
        return
    for sc in scenarios:
        try:
            dataclasses.replace(sc.engine_config(device=device), **tp)
        except ConfigError as e:
            what = f"--world-size {ranks}" if ranks is not None else f"--tp-mode {tp_mode}"
            raise KVChaosError(f"{what}: scenario {sc.name}: {e}") from None


def replay_command(
    sc: Scenario,
    seed: int,
    device: str,
    block_manager_spec: str | None = None,
    tp: dict | None = None,
    run_dir: Path | None = None,
) -> str:
    """The command that runs this again, as results.json records it: a built-in scenario by its
    name; any other path (a scenario file, the run folder's scenario.toml for one built in memory,
    a manager's file) relative to the report folder (run_dir's parent) when it lies in the folder
    that holds the report folder, so the record stays true where the reports are copied with
    their project. Reports show it relative to where they are read."""
    from kvchaos.harness.scenario.spec import BUILTIN_DIR

    base = run_dir.parent if run_dir is not None else None
    src = Path(sc.source) if sc.source else None
    if src is not None and src.exists():
        builtin = src.resolve() == (BUILTIN_DIR / f"{src.stem}.toml").resolve()
        target = src.stem if builtin else portable_path(src, base)
    elif run_dir is not None:  # built in memory (a fixture's dict, a soak mix): the run's copy
        target = portable_path(run_dir / "scenario.toml", base)
    else:
        target = sc.name
    bm = f" --block-manager {portable_spec(block_manager_spec, base)}" if block_manager_spec else ""
    tp = tp or {}
    tp_flags = (f" --tp-mode {tp['tp_mode']}" if "tp_mode" in tp else "") + (
        f" --world-size {tp['tp_size']}" if "tp_size" in tp else ""
    )
    return f"kvchaos run {shlex.quote(target)} --seed {seed} --device {device}{bm}{tp_flags}"


def portable_path(path: Path | str, base: Path | None) -> str:
    """path relative to base (the report folder) when both lie in base's parent folder (the
    project), else absolute."""
    p = Path(path).absolute()
    if base is None:
        return str(p)
    base = Path(base).absolute()
    for a, b in ((p, base), (p.resolve(), base.resolve())):
        if a.is_relative_to(b.parent):
            return os.path.relpath(a, b)
    return str(p)


def portable_spec(spec: str, base: Path | None) -> str:
    """A block manager spec; one that names a file (FILE.py:ATTR) with the file made portable."""
    path, colon, attr = spec.rpartition(":")
    if colon and path.endswith(".py") and Path(path).exists():
        return shlex.quote(f"{portable_path(path, base)}:{attr}")
    return shlex.quote(spec)
