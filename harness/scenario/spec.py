"""Scenario files: TOML, validated on load. A bad file gets one error naming the file, the key and
what is allowed."""

from __future__ import annotations

import csv
import dataclasses
import json
import re
import stat
import typing
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from kvchaos.engine.config import CacheConfig, EngineConfig, ModelConfig, OffloadConfig
from kvchaos.engine.errors import ConfigError, KVChaosError
from kvchaos.faults.base import CHECKER_NAMES
from kvchaos.harness.scenario import footprint, inputs
from kvchaos.harness.scenario.inputs import check_seed

BUILTIN_DIR = Path(__file__).resolve().parents[2] / "scenarios"
CHECKERS = CHECKER_NAMES


# A name becomes part of a run folder's name: safe characters, bounded, never a path.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_NAME = 100
MAX_FILE_BYTES = 1 << 20  # a scenario file is a few hundred bytes; /dev/zero is not one


class ScenarioError(KVChaosError, ValueError):
    """A scenario file is missing, unreadable or invalid; param: the key it names (faults.0.params
    .variant), where validation named one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_name(name: str) -> str:
    if len(name) > MAX_NAME or not NAME.fullmatch(name):
        shown = repr(name) if len(name) <= 40 else f"{name[:40]!r}... ({len(name)} characters)"
        raise ValueError(
            f"{shown}: a name is letters, digits, '.', '_' and '-', starting with a letter or "
            f"digit, at most {MAX_NAME} characters (it names the run folders)"
        )
    return name


class _Strict(BaseModel):
    # every float of a scenario is finite: TOML's nan and inf are refused where they are written
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class LengthDist(_Strict):
    dist: Literal["fixed", "uniform", "lognormal", "bimodal"] = "uniform"
    value: int = Field(16, ge=1)  # fixed (not clipped)
    min: int = 1  # uniform / clip
    max: int = 64  # uniform / clip
    # lognormal: bounded so that exp(log(median) + sigma * z) stays a float
    median: float = Field(16.0, gt=0.0, le=1e9)
    sigma: float = Field(0.5, ge=0.0, le=10.0)
    modes: tuple[int, int] = (8, 48)  # bimodal
    weight: float = Field(0.5, ge=0.0, le=1.0)  # bimodal: share of the first mode

    @model_validator(mode="after")
    def _check(self):
        if self.min < 1 or self.max < self.min:
            raise ValueError(f"need 1 <= min <= max, got min={self.min} max={self.max}")
        return self


class CancelSpec(_Strict):
    rate: float = Field(0.0, ge=0.0, le=1.0)  # share of requests cancelled at a random later step
    phases: list[
        Literal["waiting", "prefill", "decode", "preempted", "shared"]
    ] = []  # one targeted cancel each
    storm_step: int | None = Field(None, ge=1)  # cancel every live request at this step
    storm_fraction: float = Field(1.0, ge=0.0, le=1.0)


class PrefixSpec(_Strict):
    """Prompts sharing prefixes (system prompts, few-shot templates, conversations, samples)."""

    groups: int = Field(4, ge=0, le=1024)  # distinct shared prefixes
    prefix_len: LengthDist = LengthDist(dist="uniform", min=16, max=64)
    # requests starting with one group's prefix (the default judged too: groups = 0 needs 0)
    share: float = Field(0.8, ge=0.0, le=1.0, validate_default=True)
    repeat: float = Field(0.0, ge=0.0, le=1.0)  # requests repeating an earlier prompt exactly
    samples: int = Field(1, ge=1, le=64)  # n-1 more requests, same prompt, once the first decodes
    turns: int = Field(0, ge=0, le=64)  # follow-up turns, each after the previous one finished
    turn_len: LengthDist = LengthDist(dist="uniform", min=4, max=16)  # a turn's new user tokens
    segments: int = Field(0, ge=0, le=4096)  # > 0: prompts of block-aligned shared segments

    @field_validator("share")
    @classmethod
    def _share(cls, share: float, info: ValidationInfo) -> float:
        if share > 0 and info.data.get("groups") == 0:
            raise ValueError(f"share {share} needs groups >= 1 (the prefixes to share)")
        return share


class ShapeSpec(_Strict):
    """Rounds of the shapes real prefix-cache bugs need (harness/run/shapes.py), on any manager."""

    boilerplate: int = Field(0, ge=0, le=64)  # the same blocks after two prefixes, queue cycled
    prefill_aborts: int = Field(0, ge=0, le=64)  # a cancel after a prompt's first chunk
    pressure_hits: int = Field(0, ge=0, le=64)  # admissions with hits on a nearly full pool
    whole_blocks: int = Field(0, ge=0, le=64)  # a prompt of whole blocks, again once cached


class ThinkSpec(_Strict):
    """Sessions that sit idle holding their KV: a request pauses once it decodes (its turn handed
    to the user, or to a tool) and resumes after its think time (a host tier's cold requests)."""

    share: float = Field(1.0, ge=0.0, le=1.0)  # requests that pause
    think_steps: LengthDist = LengthDist(dist="uniform", min=4, max=12)  # steps idle
    pauses: int = Field(1, ge=1, le=16)  # each a few steps after the one before resumed


class Workload(_Strict):
    num_requests: int = Field(16, ge=0)
    arrival_rate: float = Field(1.0, gt=0.0)  # mean requests per step (Poisson)
    prompt_len: LengthDist = LengthDist(dist="uniform", min=4, max=32)
    output_len: LengthDist = LengthDist(dist="uniform", min=4, max=32)
    lengths_file: str | None = None  # CSV or JSONL of (prompt_len, output_len), replayed in order
    fork_groups: int = Field(0, ge=0)  # requests forked from a running parent, sharing its prefix
    fork_extra_tokens: int = Field(4, ge=0)
    cancel: CancelSpec = CancelSpec()
    prefix: PrefixSpec | None = None  # absent: no shared prefixes
    shapes: ShapeSpec | None = None  # absent: none of the prefix-cache bug shapes
    think: ThinkSpec | None = None  # absent: no request sits idle

    @field_validator("lengths_file")
    @classmethod
    def _lengths_file(cls, path: str | None) -> str | None:
        return None if path is None else inputs.path(path)


class FaultSpec(_Strict):
    name: Literal[
        "table_overflow",
        "refcount_leak",
        "staging_stall",
        "ordering_race",
        "prefix_cache",
        "async_free",
        "offload",
    ]
    defect: bool = True  # plant the defect, or only pull the trigger
    params: dict = {}


class Expectation(_Strict):
    outcome: Literal["clean", "detect"] = "clean"
    checkers: list[str] = []  # detect: any one of these must fire ...
    # ... within this many steps of the defect firing (or per planted fault: {name = steps})
    within_steps: int | dict[str, int] = 20

    @model_validator(mode="after")
    def _check(self):
        w = self.within_steps
        windows = w if isinstance(w, dict) else {"": w}
        if any(not isinstance(v, int) or v < 0 for v in windows.values()):
            raise ValueError(f"within_steps: expected steps >= 0, got {self.within_steps!r}")
        unknown = [c for c in self.checkers if c not in CHECKERS]
        if unknown:
            raise ValueError(f"unknown checker {unknown[0]!r}; allowed: {list(CHECKERS)}")
        if self.outcome == "detect" and not self.checkers:
            raise ValueError("outcome 'detect' needs at least one checker")
        return self


class Run(_Strict):
    max_steps: int = Field(400, ge=1)
    snapshot_every: int = Field(1, ge=1)
    latency_slo_ratio: float = Field(
        2.0, gt=1.0
    )  # latency checker: sustained ratio to the early baseline
    latency_signal: Literal["host_s", "latency_s", "cpu_s"] = "host_s"  # the step timing it judges
    # latency checker: how much slower than what it is compared with (besides the ratio) counts
    latency_floor_ms: float = Field(0.5, ge=0.0)
    liveness_bound_steps: int = Field(200, ge=1)  # a request waiting longer than this is starved


class ScenarioMeta(_Strict):
    name: str
    description: str = ""
    tags: list[str] = []
    seeds: list[int] = [0, 1, 2]

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return check_name(name)

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, seeds: list[int]) -> list[int]:
        if not seeds:
            raise ValueError("no seeds: give at least one (e.g. seeds = [0])")
        for s in seeds:
            check_seed(s)
        if len(set(seeds)) != len(seeds):
            twice = next(s for s in seeds if seeds.count(s) > 1)
            raise ValueError(f"seed {twice} is listed twice")
        return seeds


class Scenario(_Strict):
    scenario: ScenarioMeta
    engine: dict = {}  # EngineConfig fields; model and cache as nested tables
    workload: Workload = Workload()
    faults: list[FaultSpec] = []
    expect: Expectation = Expectation()
    run: Run = Run()
    source: str | None = Field(None, exclude=True)

    @property
    def name(self) -> str:
        return self.scenario.name

    @property
    def markers(self) -> list[str]:
        from kvchaos.faults import REGISTRY  # here, not at the top: see parse_scenario

        marks = ["scenario"] + [f"fault_{f.name}" for f in self.faults] + list(self.scenario.tags)
        if self.engine_config().tp_size > 1 and "distributed" in self.scenario.tags:
            marks.append("distributed")
        # judged by the latency checker (expected to fire, or a trigger it must see through):
        # the verdict depends on measured time, so it runs apart from a busy machine's suite
        detectors = {d for f in self.faults for d in REGISTRY[f.name].detectors}
        if "latency" in {*self.expect.checkers, *detectors}:
            marks.append("timing")
        return sorted(set(marks))

    def engine_config(self, device: str | None = None, seed: int = 0) -> EngineConfig:
        e = dict(self.engine)
        model = ModelConfig(**e.pop("model", {}))
        cache = CacheConfig(**e.pop("cache", {}))
        if "offload" in e:
            e["offload"] = OffloadConfig(**e["offload"])
        if device:
            e["device"] = device
        return EngineConfig(model=model, cache=cache, seed=seed, **e)

    @model_validator(mode="after")
    def _check_engine(self, info: ValidationInfo):
        _check_engine_section(self.engine)
        planted = any(f.defect for f in self.faults)
        if self.expect.outcome == "detect" and not planted:
            raise ValueError("expect.outcome 'detect' needs a fault with defect = true")
        if self.expect.outcome == "clean" and planted:
            raise ValueError(
                "expect.outcome 'clean' with a planted defect: use 'detect', or set defect = false"
            )
        try:
            self.engine_config()
        except TypeError as e:
            raise ValueError(f"engine: {e}") from None
        except ConfigError as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith("engine.") else f"engine.{msg}") from None
        # sizes no memory here can hold: refused now, not by a MemoryError an hour in
        device = (info.context or {}).get("device") or self.engine.get("device") or "cpu"
        footprint.check(self, "cpu" if device == "auto" else device)
        return self


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def _check_engine_section(engine: dict) -> None:
    """The [engine] table and its model / cache tables: known keys, values of the field's type."""
    for where, cls, data in (
        ("engine", EngineConfig, engine),
        ("engine.model", ModelConfig, engine.get("model", {})),
        ("engine.cache", CacheConfig, engine.get("cache", {})),
        ("engine.offload", OffloadConfig, engine.get("offload", {})),
    ):
        if not isinstance(data, dict):
            raise ValueError(f"{where}: expected a table, got {data!r}")
        fields = {
            f.name: f.type
            for f in dataclasses.fields(cls)
            if f.name not in ("seed", "model", "cache", "offload")
        }
        for key, value in data.items():
            if cls is EngineConfig and key in ("model", "cache", "offload"):
                continue
            if key not in fields:
                why = " (the seed comes from the run: --seed)" if key == "seed" else ""
                raise ValueError(f"{where}.{key}: unknown key{why}; allowed: {sorted(fields)}")
            ok = _TYPES.get(fields[key])
            if ok and (not isinstance(value, ok) or (isinstance(value, bool) and bool not in ok)):
                raise ValueError(f"{where}.{key}: expected {fields[key]}, got {value!r}")


def _where(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def _allowed_keys(loc: tuple) -> list[str]:
    """The keys the table at loc[:-1] takes (for an unknown key at loc)."""
    model = Scenario
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        ann = field.annotation if field else None
        sub = [
            a
            for a in (ann, *typing.get_args(ann))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        if not sub:
            return []
        model = sub[0]
    return sorted(k for k, f in model.model_fields.items() if not f.exclude)


def parse_scenario(data: dict, source: str = "<scenario>", device: str | None = None) -> Scenario:
    """device: where it will run (memory is judged there); default its engine.device, else cpu."""
    try:
        sc = Scenario.model_validate(data, context={"device": device})
    except ValidationError as e:
        err = e.errors()[0]
        more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = f"unknown key; allowed: {_allowed_keys(err['loc'])}"
        elif err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        elif err["type"] != "missing" and not isinstance(err.get("input"), (dict, list)):
            msg = f"{msg}, got {err.get('input')!r}"
        where = f"{_where(err['loc'])}: " if err["loc"] else ""  # top-level checks name their key
        param = _where(err["loc"]) if err["loc"] else None
        raise ScenarioError(f"{source}: {where}{msg}{more}", param) from None
    from kvchaos.faults import (
        REGISTRY,
        ParamError,
    )  # here, not at the top: faults imports the workload, which imports this

    for i, f in enumerate(
        sc.faults
    ):  # names and values, now rather than as an ERROR when the run arms it
        try:
            REGISTRY[f.name].check_params(f.params, sc.engine_config())
        except ParamError as e:
            key = f"faults.{i}.params.{e.key}"
            raise ScenarioError(f"{source}: {key}: {e.reason}", key) from None
    if sc.workload.lengths_file:
        try:
            read_lengths(sc.workload.lengths_file)
        except ScenarioError as e:
            raise ScenarioError(
                f"{source}: workload.lengths_file: {e}", "workload.lengths_file"
            ) from None
    sc.source = source
    return sc


def load_scenario(path: str | Path, device: str | None = None) -> Scenario:
    p = Path(path)
    if not p.exists():
        named = BUILTIN_DIR / f"{path}.toml"
        if named.exists():
            p = named
        else:
            raise ScenarioError(
                f"{path}: no such scenario file or built-in scenario "
                f"(built-ins: {', '.join(s.name for s in builtin_scenarios())})"
            )
    try:
        data = tomllib.loads(read_text_file(p))
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{p}: not valid TOML: {e}") from None
    lf = (
        data.get("workload", {}).get("lengths_file")
        if isinstance(data.get("workload"), dict)
        else None
    )
    if (
        isinstance(lf, str) and lf.strip() and not Path(lf).is_absolute()
    ):  # relative to the scenario file, not the cwd
        data["workload"]["lengths_file"] = str(p.parent / lf)
    return parse_scenario(data, str(p), device)


def read_text_file(p: Path, limit: int = MAX_FILE_BYTES) -> str:
    """A small UTF-8 text file's contents, or one ScenarioError naming it and what it is instead:
    a folder (a run folder, even), a device, a binary or oversized file."""
    if p.is_dir():
        if (p / "history.jsonl").exists() or (p / "results.json").exists():
            raise ScenarioError(
                f"{p}: a run folder, not a scenario file (kvchaos replay {p} re-runs it; "
                f"its scenario is {p / 'scenario.toml'})"
            )
        raise ScenarioError(f"{p}: a folder, not a scenario file")
    try:
        mode = p.stat().st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):  # a pipe: `run /dev/stdin < x.toml`
            raise ScenarioError(f"{p}: not a regular file")
        with open(p, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise ScenarioError(f"{p}: cannot read it: {e.strerror}") from None
    if len(raw) > limit:
        raise ScenarioError(f"{p}: over {limit >> 10} KiB: not a scenario file")
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ScenarioError(f"{p}: UTF-16 text: save it as UTF-8")
    if b"\0" in raw:
        raise ScenarioError(f"{p}: a binary file, not a TOML scenario")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ScenarioError(
            f"{p}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})"
        ) from None


def builtin_scenarios(device: str | None = None) -> list[Scenario]:
    return [load_scenario(p, device) for p in sorted(BUILTIN_DIR.glob("*.toml"))]


def read_lengths(path: str) -> list[tuple[int, int]]:
    """CSV (prompt_len,output_len per row, header optional) or JSONL
    ({"prompt_len":, "output_len":})."""
    p = Path(path)
    try:
        if p.exists() and not p.is_file():  # a folder, or a device such as /dev/zero
            raise ScenarioError(f"{path}: not a regular file")
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ScenarioError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ScenarioError(f"{path}: not UTF-8 text (at offset {e.start})") from None
    out = []
    if p.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    r = json.loads(line)
                    a, b = r["prompt_len"], r["output_len"]
                except (ValueError, KeyError, TypeError):
                    a = b = None
                # whole numbers only: 2.7, true or Infinity is no length
                if not all(isinstance(x, int) and not isinstance(x, bool) for x in (a, b)):
                    raise ScenarioError(
                        f'{path}:{n}: expected {{"prompt_len": int, "output_len": int}}'
                    )
                out.append((n, a, b))
    else:
        for n, row in enumerate(csv.reader(text.splitlines()), 1):
            if not row or (n == 1 and not row[0].strip().lstrip("+-").isdigit()):
                continue  # blank line or header
            try:
                out.append((n, int(row[0]), int(row[1])))
            except (ValueError, IndexError):
                raise ScenarioError(f"{path}:{n}: expected prompt_len,output_len") from None
    for n, a, b in out:
        if a < 1 or b < 1:
            raise ScenarioError(
                f"{path}:{n}: lengths must be >= 1, got prompt_len={a} output_len={b}"
            )
    if not out:
        raise ScenarioError(f"{path}: no lengths in the file")
    return [(a, b) for _, a, b in out]
