"""What every fault has: a trigger (workload shape or environment perturbation), a defect that can
be planted on the engine's seams, a schedule, verify() with evidence from counters, the checkers
expected to catch it, and the root cause and remediation an incident report quotes."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Literal, get_args

from typing_extensions import NotRequired, TypedDict  # pydantic takes typing's from 3.12 only

if TYPE_CHECKING:
    from kvchaos.engine.engine import Engine

# The checkers, by name: the one list. Faults name their detectors with it, scenarios their
# expected checkers, and harness/check/checkers.py runs one function for each, in this order.
CheckerName = Literal[
    "oracle_divergence",
    "block_accounting",
    "table_integrity",
    "latency",
    "cross_rank",
    "liveness",
    "manager_calls",
    "admission",
    "kv_reads",
    "prefix_cache",
    "offload",
]
CHECKER_NAMES: tuple[str, ...] = get_args(CheckerName)


class ParamError(ValueError):
    """A fault param with an unknown name or a value outside its domain. key is its path under the
    fault's params (paths.1 for a list's element): a scenario file names faults.N.params.key."""

    def __init__(self, fault: str, key: str, reason: str) -> None:
        super().__init__(f"fault {fault}: params.{key}: {reason}")
        self.key, self.reason = key, reason


@dataclass(frozen=True)
class Num:
    """kind int: an int; kind float: a finite int or float. Never a bool or a string, like the
    [engine] table's check (TOML values are typed already). Within bounds; None too if optional."""

    kind: type = int
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    optional: bool = False

    def __str__(self) -> str:
        s = "an int" if self.kind is int else "a number"
        if self.ge is not None and self.le is not None:
            s += f" in [{self.ge}, {self.le}]"
        else:
            s += "".join(
                f" {op} {b}"
                for op, b in ((">=", self.ge), (">", self.gt), ("<=", self.le))
                if b is not None
            )
        return s + (
            " or unset (None)" if self.optional else ""
        )  # TOML has no null: leave the key out

    def problem(self, v) -> tuple[str, str, object] | None:
        if v is None and self.optional:
            return None
        ok = (
            isinstance(v, int)
            if self.kind is int
            else isinstance(v, (int, float)) and math.isfinite(v)
        )
        ok = (
            ok
            and not isinstance(v, bool)
            and (self.ge is None or v >= self.ge)
            and (self.gt is None or v > self.gt)
            and (self.le is None or v <= self.le)
        )
        return None if ok else ("", str(self), v)


@dataclass(frozen=True)
class Bool:
    def __str__(self) -> str:
        return "true or false"

    def problem(self, v) -> tuple[str, str, object] | None:
        return None if isinstance(v, bool) else ("", str(self), v)


@dataclass(frozen=True)
class ListOf:
    """A list (repeats allowed, empty too) of the given choices; a bad element is named by index."""

    choices: tuple[str, ...]

    def __str__(self) -> str:
        return f"a list of {list(self.choices)}"

    def problem(self, v) -> tuple[str, str, object] | None:
        if not isinstance(v, list):
            return "", str(self), v
        bad = next((i for i, x in enumerate(v) if x not in self.choices), None)
        return None if bad is None else (f".{bad}", f"one of {list(self.choices)}", v[bad])


@dataclass(frozen=True)
class OneOf:
    """One of the given choices (a string)."""

    choices: tuple[str, ...]

    def __str__(self) -> str:
        return f"one of {list(self.choices)}"

    def problem(self, v) -> tuple[str, str, object] | None:
        return None if isinstance(v, str) and v in self.choices else ("", str(self), v)


# the domains the faults share. Steps count from 1: an action or trigger at step 0 never comes.
STEP = Num(int, ge=1)
COUNT = Num(int, ge=0)
FRACTION = Num(float, ge=0, le=1)
BOOL = Bool()


class Touched(TypedDict):
    requests: list[str]
    rows: list[int]
    blocks: list[int]


class Truth(TypedDict):
    """A fault's ground truth as verify() records it in run_end: the keys the verdict and the
    fault's explains read (NotRequired: read with a default). A stored history is judged from it
    alone, so `kvchaos analyze` checks it against this first; each fault adds its own keys."""

    fired: bool
    first_step: int | None
    triggered: int
    remediated: NotRequired[int]
    touched: Touched


@dataclass(frozen=True)
class Variant:
    """One of a fault's params.variant choices: the root cause and remediation an incident quotes
    for it and the checkers expected to catch it; empty (None): the fault's own."""

    root_cause: str = ""
    remediation: str = ""
    detectors: tuple[CheckerName, ...] | None = None


class Fault:
    name: str = ""
    detectors: tuple[CheckerName, ...] = ()
    truth: ClassVar[type] = Truth  # what verify() records that explains() reads
    root_cause: str = ""
    remediation: str = ""
    defaults: dict = {}
    domains: dict = {}  # param -> Num / Bool / ListOf: what values it takes (same keys as defaults)
    any_manager = True  # False: it plants in the reference manager only (else not applicable)
    # params.variant's choices, in order (its domain is built from them; defaults names one)
    variants: ClassVar[dict[str, Variant]] = {}
    bare_default = False  # its default variant labelled by the bare name, as recorded before

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        if cls.variants:
            cls.domains = {**cls.domains, "variant": OneOf(tuple(cls.variants))}
        # a fault's author learns at import, not from a KeyError
        if set(cls.domains) != set(cls.defaults):
            raise TypeError(
                f"fault {cls.name or cls.__name__}: domains {sorted(cls.domains)} "
                f"must name exactly the params of defaults {sorted(cls.defaults)}"
            )
        if cls.variants and cls.defaults["variant"] not in cls.variants:
            raise TypeError(f"fault {cls.name}: default variant {cls.defaults['variant']!r}")
        if "variants" in cls.__dict__ and "root_cause" not in cls.__dict__:  # its default's text
            v = cls.variants[cls.defaults["variant"]]
            cls.root_cause, cls.remediation = v.root_cause, v.remediation

    @classmethod
    def variant_names(cls) -> tuple[str, ...]:
        return tuple(cls.variants)

    @classmethod
    def variant_of(cls, params: dict | None = None) -> str | None:
        """The variant the params choose (the default where they name none); None: it has none."""
        return (params or {}).get("variant", cls.defaults["variant"]) if cls.variants else None

    @classmethod
    def check_params(cls, params: dict, engine_config=None) -> dict:
        """The params over the defaults, or a ParamError: an unknown name, a value outside its
        domain, or (given the engine config) one that does not fit the engine. The one check a
        scenario file gets at load and a fault gets when constructed."""
        unknown = sorted(set(params) - set(cls.defaults))
        if unknown:
            raise ParamError(
                cls.name,
                unknown[0],
                f"unknown param of fault {cls.name}; allowed: {sorted(cls.defaults)}",
            )
        for key, value in params.items():
            bad = cls.domains[key].problem(value)
            if bad:
                sub, expected, got = bad
                raise ParamError(cls.name, key + sub, f"expected {expected}, got {got!r}")
        p = {**cls.defaults, **params}
        if engine_config is not None:
            cls.check_engine(p, engine_config)
        return p

    @classmethod
    def check_engine(cls, p: dict, engine_config) -> None:
        """Domains that depend on the engine (e.g. a rank index): raise ParamError."""

    def __init__(self, defect: bool, params: dict, seed: int) -> None:
        self.defect = defect
        self.p = self.check_params(params)
        self.rng = random.Random(f"{seed}/fault/{self.name}")
        self.emit: Callable[..., None] = lambda kind, detail, step=None: None
        self.fired_steps: list[int] = []
        # Ground truth, from what the fault injected and what the engine did (never a checker):
        self.triggered: list[int] = []  # steps at which the trigger was pulled
        self.remediated = 0  # times the engine's remediation acted
        self.touched: dict[str, set] = {"requests": set(), "rows": set(), "blocks": set()}
        if self.variants:  # the chosen variant's text, where it has its own
            v = self.variants[self.p["variant"]]
            self.root_cause = v.root_cause or self.root_cause
            self.remediation = v.remediation or self.remediation

    @classmethod
    def label(cls, params: dict | None = None) -> str:
        """How incidents and the soak name it: its name, with the variant the params choose."""
        v = cls.variant_of(params)
        bare = v is None or (cls.bare_default and v == cls.defaults["variant"])
        return cls.name if bare else f"{cls.name}/{v}"

    @classmethod
    def detectors_for(cls, params: dict | None = None) -> tuple:
        """The checkers expected to catch the variant the params choose."""
        v = cls.variants.get(cls.variant_of(params) or "")
        return cls.detectors if v is None or v.detectors is None else v.detectors

    def shape(self, plan, engine_config) -> None:
        """Add the trigger's requests and cancels to the workload plan."""

    def arm(self, engine: Engine, emit: Callable[[str, dict], None]) -> None:
        """Attach to the engine's seams. emit(kind, detail, step=None) records a fault event."""
        self.check_engine(
            self.p, engine.config
        )  # at load too; again here for a fault built in code
        self.emit = emit

    def before_step(self, engine: Engine, step: int) -> None:
        """Environment perturbations on a schedule."""

    def after_step(self, engine: Engine, step: int, output) -> None:
        """Read counters: record the steps at which the defect fired."""

    def fired(self, step: int, detail: dict) -> None:
        self.fired_steps.append(step)
        self.emit("fired", detail, step)

    def trigger(self, step: int, detail: dict | None = None) -> None:
        """The trigger was pulled (with or without the defect planted)."""
        self.triggered.append(step)
        if detail is not None:
            self.emit("trigger", detail, step)

    def touch(self, requests=(), rows=(), blocks=()) -> None:
        self.touched["requests"].update(requests)
        self.touched["rows"].update(rows)
        self.touched["blocks"].update(blocks)

    def verify(self) -> dict:
        """Ground truth, from counters: did the trigger fire, did the planted defect fire (and
        when, how often), did the remediation act, and what the defect touched."""
        return {
            "fired": bool(self.fired_steps),
            "first_step": self.fired_steps[0] if self.fired_steps else None,
            "times": len(self.fired_steps),
            "triggered": len(self.triggered),
            "first_triggered": self.triggered[0] if self.triggered else None,
            "remediated": self.remediated,
            "touched": {k: sorted(v) for k, v in self.touched.items()},
        }

    @classmethod
    def explains(cls, finding: dict, truth: dict) -> str | None:
        """How this fault, having fired with the ground truth `truth` (its verify()), explains a
        finding (a Finding as a dict): "cause" (what the defect touched, at or after it fired),
        "consequence" (a declared, computable knock-on effect; never counts as the catch), or
        None. Pure: a stored run is re-judged from its history alone."""
        return None

    def describe(self) -> dict:
        return {
            "name": self.name,
            "label": self.label(self.p),
            "defect": self.defect,
            "params": self.p,
            "detectors": list(self.detectors),
            "root_cause": self.root_cause,
            "remediation": self.remediation,
        }
