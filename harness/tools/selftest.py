"""Test the tester: run every canary (the reference block manager with one realistic bug planted,
one per operation family: harness/tools/canaries.py) through the built-in clean scenarios, and
print which checker killed it, on which scenario and seed, at which step it was known.

  kvchaos selftest                                   # every canary, every clean built-in, 3 seeds
  kvchaos selftest --canary fork-no-incref --scenario baseline-clean --seeds 1
  kvchaos selftest --format json

A canary is killed by a FINDING when a run FAILs on a checker's finding; only by a CRASH when the
run's only findings are exceptions escaping the manager (manager_calls, kind "exception": the
harness saw the bug only because it blew up); ERROR when it broke the harness instead; SURVIVED
when every run passed (a FAIL on a latency finding alone counts as passed: wall-clock noise).
Runs go scenario by scenario, seed by seed, and stop at the first FINDING (a crash does not stop
the search for one). The reference manager runs every selected run as the control: it must pass
them all, else the kills mean nothing. Each kill's replay command re-runs it with its reports
(`kvchaos run ... --block-manager kvchaos.harness.tools.canaries:CLASS`)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import kvchaos
from kvchaos.engine.errors import KVChaosError
from kvchaos.harness.check.verdict import ERROR, FAIL
from kvchaos.harness.scenario import options
from kvchaos.harness.tools.canaries import CANARIES, Canary

EXIT_NOT_KILLED = 1  # a canary survived, only crashed, or broke the harness
EXIT_REFERENCE_FLAGGED = 3  # the reference manager failed a run: the kill table means nothing
DEFAULT_SEEDS = 3
FINDING, CRASH, SURVIVED = "FINDING", "CRASH", "SURVIVED"
# A run's outcome, weakest kill first: a canary keeps the strongest it met.
RANK = [SURVIVED, ERROR, CRASH, FINDING]


@dataclass
class Kill:
    """How one manager fared over its runs (the control's too)."""

    canary: str
    family: str
    bug: str
    status: str = SURVIVED
    scenario: str | None = None
    seed: int | None = None
    checker: str | None = None
    kind: str | None = None
    step: int | None = None
    known_at: int | None = None
    message: str = ""
    replay: str | None = None
    runs: int = 0
    wall_s: float = 0.0


# Wall-clock checkers: a neighbour on a shared machine can fire them, and no replay reproduces
# that, so they neither kill a canary nor flag the control (the canaries are correctness bugs).
TIMING = ("latency",)
PREFIX_FAMILY = "prefix cache"


def is_crash(f) -> bool:
    return f.checker == "manager_calls" and f.kind == "exception"


def classify(r) -> tuple[str, object | None]:
    """One run: (FINDING | CRASH | ERROR, the earliest-known finding) or (SURVIVED, None)."""
    order = sorted(
        (f for f in r.findings if f.checker not in TIMING), key=lambda f: (f.known, f.step)
    )
    if r.verdict == FAIL and order:
        seen = [f for f in order if not is_crash(f)]
        return (FINDING, seen[0]) if seen else (CRASH, order[0])
    if r.verdict == ERROR:
        return ERROR, order[0] if order else None
    return SURVIVED, None


def hunt(name: str, family: str, bug: str, manager, jobs, device: str = "cpu", stop=True) -> Kill:
    """Run manager on (scenario, seed) jobs until one FAILs on a finding (stop=False: all)."""
    from kvchaos.harness.run.runner import run_scenario

    k, t0 = Kill(name, family, bug), time.perf_counter()
    for sc, seed in jobs:
        r = run_scenario(sc, seed, device, None, block_manager=manager)
        k.runs += 1
        status, f = classify(r)
        if RANK.index(status) > RANK.index(k.status):  # the strongest kill so far
            k.status, k.scenario, k.seed, k.replay = status, sc.name, seed, r.results.get("replay")
            k.message = f.message if f else r.summary
            if f is not None:
                k.checker, k.kind, k.step, k.known_at = f.checker, f.kind, f.step, f.known
        if stop and status == FINDING:
            break
    k.wall_s = round(time.perf_counter() - t0, 2)
    return k


def clean_scenarios(names: list[str] | None):
    """The built-in clean scenarios, or the named ones (each must expect "clean")."""
    from kvchaos.harness.scenario.spec import builtin_scenarios, load_scenario

    if not names:
        return [s for s in builtin_scenarios() if s.expect.outcome == "clean"]
    scs = [load_scenario(n) for n in names]
    bad = [s.name for s in scs if s.expect.outcome != "clean"]
    if bad:
        raise KVChaosError(
            f"--scenario {', '.join(bad)}: not a clean scenario (a canary is judged on runs where "
            "any finding is a bug)"
        )
    return scs


def pick_canaries(names: list[str] | None) -> list[Canary]:
    if not names:
        return list(CANARIES)
    known = {c.name: c for c in CANARIES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise KVChaosError(f"--canary {', '.join(unknown)}: unknown (canaries: {', '.join(known)})")
    return [known[n] for n in names]


def parse_seeds(text: str | None) -> list[int]:
    """N: seeds 0..N-1; 3,7,11: those."""
    if text is None:
        return list(range(DEFAULT_SEEDS))
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()] if "," in text else None
        n = int(text) if seeds is None else len(seeds)
    except ValueError:
        raise KVChaosError(
            f"--seeds {text!r}: expected a count (e.g. 3) or a list (e.g. 0,4)"
        ) from None
    if n < 1:
        raise KVChaosError(f"--seeds {text}: the count must be >= 1")
    return seeds if seeds is not None else list(range(n))


def selftest(canaries: list[Canary], scenarios, seeds: list[int], device: str = "cpu"):
    """(kills, control): each canary's Kill, and the reference manager's over every job."""
    from kvchaos.engine.block_manager import BlockManager
    from kvchaos.engine.prefix_manager import PrefixCachingManager

    jobs = [(sc, seed) for sc in scenarios for seed in seeds]
    kills = [hunt(c.name, c.family, c.bug, c.manager, jobs, device) for c in canaries]
    # the controls run every job: one FAIL anywhere voids the table. Each canary's reference:
    # the plain manager and, for the prefix-cache family, the one with prefix caching.
    refs = [BlockManager]
    refs += [PrefixCachingManager] if any(c.family == PREFIX_FAMILY for c in canaries) else []
    controls = [
        hunt("reference", "control", f"none: {m.__module__}:{m.__name__}", m, jobs, device, False)
        for m in refs
    ]
    control = max(controls, key=lambda k: RANK.index(k.status))
    control.runs = sum(k.runs for k in controls)
    control.bug = ", ".join(k.bug for k in controls)
    return kills, control


def exit_code(kills: list[Kill], control: Kill) -> int:
    if control.status != SURVIVED:
        return EXIT_REFERENCE_FLAGGED
    return 0 if all(k.status == FINDING for k in kills) else EXIT_NOT_KILLED


COLUMNS = ("canary", "family", "killed", "checker", "scenario", "seed", "known at", "runs")


def _row(k: Kill) -> list[str]:
    checker = f"{k.checker} ({k.kind})" if k.checker else "-"
    known = "-" if k.known_at is None else str(k.known_at)
    seed = "-" if k.seed is None else str(k.seed)
    return [k.canary, k.family, k.status, checker, k.scenario or "-", seed, known, str(k.runs)]


def render_text(kills: list[Kill], control: Kill, tty: bool) -> list:
    """A rich table on a terminal, plain aligned text in a log or a pipe; then each canary not
    killed by a finding (and a flagged control) with what was seen and how to re-run it."""
    rows = [_row(k) for k in kills]
    n = sum(k.status == FINDING for k in kills)
    held = "survived" if control.status == SURVIVED else control.status
    runs = f"{control.runs} run{'s' * (control.runs != 1)}"
    foot = [
        f"killed by a finding: {n}/{len(kills)}",
        f"reference manager (control): {held} ({runs})",
    ]
    missed = [k for k in kills if k.status != FINDING]
    for k in missed + ([control] if control.status != SURVIVED else []):
        foot.append(f"  {k.canary}: {k.status}" + (f": {k.message}" if k.message else ""))
        foot += [f"    replay: {k.replay}"] if k.replay else []
    if not tty:
        widths = [max(len(x) for x in col) for col in zip(COLUMNS, *rows)]
        table = [
            "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [COLUMNS, *rows]
        ]
        return ["\n".join(table + foot)]
    from rich.markup import escape
    from rich.table import Table

    colour = {FINDING: "green", CRASH: "yellow"}
    t = Table(title="kvchaos selftest: canary kill table")
    for col in COLUMNS:
        t.add_column(col, overflow="fold")  # names wrap, never cut
    for r in rows:
        t.add_row(*[escape(c) for c in r[:2]], f"[{colour.get(r[2], 'red')}]{r[2]}[/]", *r[3:])
    return [t, "\n".join(foot)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--seeds",
        metavar="N|LIST",
        help=f"a count N (seeds 0..N-1) or a list 0,3,7 (default: {DEFAULT_SEEDS})",
    )
    p.add_argument(
        "--scenario",
        action="append",
        metavar="NAME",
        help="only this clean scenario (a built-in name or a file; repeatable; default: every "
        "built-in clean scenario)",
    )
    p.add_argument(
        "--canary",
        action="append",
        metavar="NAME",
        help=f"only this canary (repeatable): {', '.join(c.name for c in CANARIES)}",
    )
    options.add(p, "device", default="cpu")
    p.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="text: the kill table; json: one JSON document on stdout",
    )


def main(args) -> int:
    from kvchaos.harness.run.device import resolve_device

    canaries, seeds = pick_canaries(args.canary), parse_seeds(args.seeds)
    scenarios, device = clean_scenarios(args.scenario), resolve_device(args.device)
    if not scenarios:
        raise KVChaosError("no clean scenario to run the canaries on")
    t0 = time.perf_counter()
    kills, control = selftest(canaries, scenarios, seeds, device)
    code = exit_code(kills, control)
    if args.format == "json":
        doc = {
            "kvchaos": kvchaos.__version__,
            "command": "selftest",
            "exit_code": code,
            "killed_by_finding": sum(k.status == FINDING for k in kills),
            "canaries": [asdict(k) for k in kills],
            "reference": asdict(control),
            "scenarios": [s.name for s in scenarios],
            "seeds": seeds,
            "wall_s": round(time.perf_counter() - t0, 2),
        }
        print(json.dumps(doc, indent=1), flush=True)
        return code
    from rich.console import Console

    console = Console()
    for part in render_text(kills, control, console.is_terminal):
        if isinstance(part, str):
            print(part, flush=True)
        else:
            console.print(part)
    print(f"{sum(k.runs for k in kills) + control.runs} runs in {time.perf_counter() - t0:.1f} s")
    return code
