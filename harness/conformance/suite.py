"""Conformance: the protocol's properties, tested against your block manager.

  kvchaos conformance --block-manager mypkg.bm:MyBlockManager

Hypothesis drives the manager through random histories on small pools, as the engine would
(kvchaos.harness.conformance.v2: admissions from shared templates so its cache hits, growth,
decode batches, fork, end_step, every release reason, failed steps, resize of an own table), and
judges each property of PROPERTIES_V2 after every call: a refused call changes nothing; every
sequence reads, at each computed position (cache hits too), its own KV, so copy-on-write keeps
every holder's data; release is idempotent, for any reason; each snapshot passes the checks a run
makes of it against what the harness saw; with "own_table", its table rows after every call. A
property that needs a capability the manager does not declare (prefix_cache, fork, seq_tokens,
own_table, append_decode, ...) is reported "not applicable". A failure is shrunk to a short
history and printed as the calls into the manager that show it (`m.admit('s1', ...)`, with the
sequence ids the failure names). The same seed gives the same result. The same tests run
under pytest: `pytest --kvchaos-block-manager mypkg.bm:MyBlockManager` collects one item a
property.

A manager that fails the check before any run (a smoke call raises or answers what the
protocol does not allow) is not tested further: its FAIL run is recorded under --report-dir, as
`kvchaos run` records it, and the command exits 11.

Exit codes: 0 every applicable property passed, 1 one failed, 11 the check before any run
failed, 2 bad input."""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import seed as use_seed
from hypothesis.reporting import with_reporter
from hypothesis.stateful import run_state_machine_as_test

from kvchaos.engine.protocols import capabilities, declared_block_sizes
from kvchaos.harness.conformance.common import Violation
from kvchaos.harness.conformance.v2 import PROPERTIES_V2, ConformanceMachineV2, sized_setup
from kvchaos.harness.run.user_code import SmokeFailure, validate_manager
from kvchaos.harness.scenario import options

EXIT_FAILED = 1
EXIT_DOOR_FAILED = 11  # kvchaos run's FAIL: the check before any run recorded a bug
EXAMPLES, STEPS = 200, 30  # 200 histories of 30 steps: ~2 s on the reference
SHRINK_STEPS = 500  # histories run while shrinking a failure: 5-30 s for the canaries


@dataclass
class PropertyResult:
    name: str
    says: str
    status: str  # "passed", "failed", "not exercised" (never judged) or "not applicable"
    judged: int = 0  # judgements made of it, over every history run
    message: str = ""
    # the shrunk history's calls into the manager, as Python: `m = Manager(8, 2, 12, 8)`, then
    # `m.admit('s1', [0, 3], 2, 1)`, ... (the sequence ids the message names)
    reproducer: list[str] = field(default_factory=list)
    shrunk: bool = True  # False: shrinking stopped at its step bound; a shorter one may exist
    steps: list[str] = field(default_factory=list)  # the same history as Hypothesis's rule steps


def _violation(error: BaseException) -> Violation | None:
    """The Violation behind a failure (Hypothesis may wrap it, e.g. as flaky)."""
    if isinstance(error, Violation):
        return error
    for inner in getattr(error, "exceptions", ()):
        found = _violation(inner)
        if found is not None:
            return found
    return None


class ShrinkBound:
    """Whether shrinking was stopped at its bound (Hypothesis then reports the shortest failing
    history it has seen)."""

    cut = False


@contextmanager
def _shrinking_at_most(steps: int):
    """Hypothesis shrinks a failure for up to 5 minutes, so how far it gets (and how many
    judgements it makes) depends on the machine's speed. Bounded by a count instead: at most
    `steps` histories run after the first failure was found. Its runner is replaced for the
    while (its own MAX_SHRINKS counts only the shrinks that succeed, not the tries between)."""
    from hypothesis import core
    from hypothesis.internal.conjecture.engine import ExitReason

    bound, real = ShrinkBound(), core.ConjectureRunner

    class Bounded(real):
        tried = 0

        def test_function(self, data) -> None:
            super().test_function(data)
            if self.interesting_test_cases:  # a failure found: what runs now is shrinking
                self.tried += 1
                if self.tried >= steps:
                    bound.cut = True
                    self.exit_with(ExitReason.max_shrinks)

    core.ConjectureRunner = Bounded
    try:
        yield bound
    finally:
        core.ConjectureRunner = real


def run_conformance(
    factory,
    examples: int = EXAMPLES,
    seed: int = 0,
    steps: int = STEPS,
    shrink_steps: int = SHRINK_STEPS,
) -> list[PropertyResult]:
    """Every property of PROPERTIES_V2 for the manager `factory` builds: passed, failed (with
    the steps that show it, shrunk in at most shrink_steps histories) or not applicable. Runs the
    machine again without each property that failed, until the rest pass. The same arguments give
    the same results."""
    sizes = declared_block_sizes(factory)  # a manager's own, else the machine's (1, 2, 4)
    caps = capabilities(factory(16, 4 if sizes is None or 4 in sizes else sizes[0], 4, 8))
    props = PROPERTIES_V2
    judged = {p for p, (need, _) in props.items() if need is None or need in caps}
    tally: Counter = Counter()
    failed: dict[str, tuple] = {}
    config = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,  # nothing written into the user's folder
        print_blob=False,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
    )
    while True:
        machine = type(
            "BlockManagerConformance",
            (ConformanceMachineV2,),
            {"factory": factory, "enabled": frozenset(judged - set(failed)), "tally": tally}
            | ({"setup": sized_setup(sizes)} if sizes else {}),
        )
        said: list[str] = []  # Hypothesis's reports (the steps come as the error's notes)
        try:
            with _shrinking_at_most(shrink_steps) as bound, with_reporter(said.append):
                run_state_machine_as_test(use_seed(seed)(machine), settings=config)
            break
        except Exception as e:
            v = _violation(e)
            if v is None or v.prop in failed:
                raise
            notes = getattr(v, "__notes__", None) or getattr(e, "__notes__", ())
            steps_ = [n for n in notes if n.startswith("state") or " = state." in n]
            cut = bound.cut or any("stopped because" in line for line in said)  # its 5 minutes
            calls = [*v.calls, f"# here {v.prop} fails"]
            failed[v.prop] = (str(v).partition(": ")[2], calls, not cut, steps_)
    out = []
    for name, (need, says) in props.items():
        if name not in judged:
            out.append(
                PropertyResult(name, says, "not applicable", message=f"declares no {need!r}")
            )
        elif name in failed:
            out.append(PropertyResult(name, says, "failed", tally[name], *failed[name]))
        else:
            status = "passed" if tally[name] else "not exercised"
            out.append(PropertyResult(name, says, status, tally[name]))
    return out


def describe_failure(r: PropertyResult) -> list[str]:
    how = "shrunk" if r.shrunk else "shrinking stopped at its step bound"
    return [f"{r.name} FAILED: {r.message}", f"  reproducer ({how}, the calls into it):"] + [
        f"    {line}" for line in r.reproducer
    ]


def describe(spec: str, results: list[PropertyResult], examples: int, seed: int) -> str:
    width = max(len(r.name) for r in results)
    lines = [
        f"kvchaos conformance: {spec} ({examples} histories, seed {seed})",
        f"{'property':<{width}}  {'result':<14}  {'checks':>7}  what it says",
    ]
    for r in results:
        checks = str(r.judged) if r.status != "not applicable" else "-"
        result = "FAILED" if r.status == "failed" else r.status
        says = r.says + (f" (the manager {r.message})" if r.status == "not applicable" else "")
        lines.append(f"{r.name:<{width}}  {result:<14}  {checks:>7}  {says}")
    bad = [r for r in results if r.status == "failed"]
    for r in bad:
        lines += ["", *describe_failure(r)]
    count = Counter(r.status for r in results)
    applicable_ = len(results) - count["not applicable"]
    unseen = (
        f"; {count['not exercised']} not exercised (no history reached them"
        + (" past the failures" if bad else ": try more --examples")
        + ")"
        if count["not exercised"]
        else ""
    )
    if bad:
        summary = f"{len(bad)} of {applicable_} applicable properties failed{unseen}"
        again = f"kvchaos conformance --block-manager {spec} --examples {examples} --seed {seed}"
        lines += ["", summary, f"the same histories again: {again}"]
    else:
        lines += ["", f"{count['passed']} of {applicable_} applicable properties passed{unseen}"]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    options.add(p, "block_manager", lead="the block manager under test", required=True)
    p.add_argument(
        "--examples",
        type=int,
        default=EXAMPLES,
        metavar="N",
        help=f"random histories per run (default {EXAMPLES})",
    )
    p.add_argument("--seed", type=int, default=0, help="the histories' seed (default 0)")
    p.add_argument(
        "--steps", type=int, default=STEPS, metavar="N", help=f"calls per history ({STEPS})"
    )
    p.add_argument(
        "--shrink-steps",
        type=int,
        default=SHRINK_STEPS,
        metavar="N",
        help="histories tried while shrinking each failure to a short one, a count (not a time): "
        f"the same seed, the same reproducer (default {SHRINK_STEPS})",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    options.add(
        p,
        "report_dir",
        default=options.DEFAULT_REPORT_DIR,
        lead="where the run of a manager failing the check before any run goes",
    )


@contextmanager
def _hypothesis_home():
    """Hypothesis keeps caches (its character tables) under ./.hypothesis even without an example
    database: the command keeps them in the user's cache folder instead, nothing in theirs."""
    from hypothesis import configuration

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    configuration.set_hypothesis_home_dir(base / "kvchaos" / "hypothesis")
    try:
        yield
    finally:
        configuration.set_hypothesis_home_dir(None)  # its default again


def main(args) -> int:
    counts = ("--examples", args.examples), ("--steps", args.steps)
    for flag, value in (*counts, ("--shrink-steps", args.shrink_steps)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1")
    try:
        factory = validate_manager(args.block_manager)
    except SmokeFailure as failed:
        from kvchaos.harness.run.door import door_run  # (loads torch: not for --help)

        r = door_run(failed, Path(args.report_dir))
        print(f"{r.verdict}: {r.summary}\nrun folder: {r.run_dir}\nreplay: {r.results['replay']}")
        return EXIT_DOOR_FAILED
    with _hypothesis_home():
        results = run_conformance(factory, args.examples, args.seed, args.steps, args.shrink_steps)
    failed = any(r.status == "failed" for r in results)
    if args.json:
        doc = {"block_manager": args.block_manager, "examples": args.examples, "seed": args.seed}
        print(
            json.dumps(
                {**doc, "passed": not failed, "properties": [asdict(r) for r in results]}, indent=1
            )
        )
    else:
        print(describe(args.block_manager, results, args.examples, args.seed))
    return EXIT_FAILED if failed else 0


# -- under pytest: one item a property ---------------------------------------------------------
class ConformanceFailure(Exception):
    pass


class ConformanceItem(pytest.Item):
    """One property of the conformance suite for --kvchaos-block-manager. The suite runs once a
    session (at the first such item); each item reports its own property."""

    def __init__(self, *, prop: str, spec: str, **kw) -> None:
        super().__init__(**kw)
        self.prop, self.spec = prop, spec
        self.add_marker("conformance")

    def runtest(self) -> None:
        cfg = self.config
        if not hasattr(cfg, "_kvchaos_conformance"):
            cfg._kvchaos_conformance = run_conformance(validate_manager(self.spec))
        r = next(r for r in cfg._kvchaos_conformance if r.name == self.prop)
        if r.status == "not applicable":
            pytest.skip(f"not applicable: {self.spec} {r.message}")
        if r.status == "not exercised":
            pytest.skip(f"not exercised: no history of {self.spec} reached it")
        if r.status == "failed":
            raise ConformanceFailure(r)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ConformanceFailure):
            return "\n".join(describe_failure(excinfo.value.args[0]))
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"kvchaos conformance {self.prop} of {self.spec}"


def conformance_items(session, spec: str) -> list[ConformanceItem]:
    return [
        ConformanceItem.from_parent(
            session,
            name=f"conformance[{name}]",
            nodeid=f"kvchaos-conformance::{name}",
            prop=name,
            spec=spec,
        )
        for name in PROPERTIES_V2
    ]
