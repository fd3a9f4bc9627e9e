"""Shrink: reduce a stored run to a minimal scenario that still shows the same verdict and
fingerprint, and write it as a TOML scenario and a ready-to-run pytest regression test.

  kvchaos shrink reports/20250101-120000-table-overflow-detect-s0 [--max-runs 200]

Greedy reduction over the scenario: drop faults, fewer requests, shorter prompts and outputs,
fewer forks and cancels, smaller fault parameters (neighbours, long requests, boundary, cancel
phases, ...), a narrower block table and smaller pool (an overflow comes sooner), faster
arrivals, fewer steps. Each candidate is one run (same seed and device, kept
in memory only); it is kept when the verdict is the same, the original's primary fingerprint
(see harness/tools/fingerprint.py) still shows, no new fingerprint appears, the run is no
bigger (requests, steps) and the scenario is smaller. Writes RUN_DIR/minimal/scenario.toml and
RUN_DIR/minimal/test_*.py, for a FAIL against the manager also test_*_calls.py (its calls, no
engine: harness/tools/shrink_calls.py), and sets results.json's minimal_reproducer (the run's
incident reports point to them).

Exit codes: 0 shrunk (or already minimal), 1 the run does not reproduce, 2 bad input.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import time
from pathlib import Path
from typing import Callable, Iterator

from kvchaos.harness.check.verdict import EXIT_CODES, MISSED, PASS, current
from kvchaos.harness.history.results import write_results
from kvchaos.harness.scenario import options
from kvchaos.harness.scenario.spec import MAX_NAME

EXIT_NOT_REPRODUCED = 1
MAX_ARRIVAL_RATE = 64.0


def _uniq_below(n: int, xs) -> list[int]:
    out = []
    for x in xs:
        if 0 <= x < n and x not in out:
            out.append(x)
    return out


# -- reducers: scenario dict -> candidate dicts, most aggressive first ------------------------
def drop_faults(d: dict, ctx) -> Iterator[dict]:
    for i in range(len(d.get("faults", []))):
        c = copy.deepcopy(d)
        del c["faults"][i]
        if not c["faults"]:
            del c["faults"]
        yield c


def fewer_requests(d: dict, ctx) -> Iterator[dict]:
    n = ctx.sc.workload.num_requests
    for k in _uniq_below(n, (0, n // 4, n // 2, n - 1)):
        c = copy.deepcopy(d)
        c.setdefault("workload", {})["num_requests"] = k
        yield c


def fewer_forks(d: dict, ctx) -> Iterator[dict]:
    g = ctx.sc.workload.fork_groups
    for k in _uniq_below(g, (0, g // 2, g - 1)):
        c = copy.deepcopy(d)
        c.setdefault("workload", {})["fork_groups"] = k
        yield c


def fewer_cancels(d: dict, ctx) -> Iterator[dict]:
    cancel = ctx.sc.workload.cancel
    if cancel.rate > 0:
        yield _set(d, ("workload", "cancel", "rate"), 0.0)
    if cancel.storm_step is not None:
        c = copy.deepcopy(d)
        del c["workload"]["cancel"]["storm_step"]
        yield c
    for sub in _sublists(cancel.phases):
        yield _set(d, ("workload", "cancel", "phases"), sub)


def shorter_lengths(d: dict, ctx) -> Iterator[dict]:
    for key in ("prompt_len", "output_len"):
        dist = getattr(ctx.sc.workload, key)
        top = dist.value if dist.dist == "fixed" else dist.max
        for v in _uniq_below(top, (1, top // 4, top // 2)):
            if v >= 1:
                yield _set(d, ("workload", key), {"dist": "fixed", "value": v, "min": 1, "max": v})


def faster_arrivals(d: dict, ctx) -> Iterator[dict]:
    rate = ctx.sc.workload.arrival_rate
    if rate < MAX_ARRIVAL_RATE and ctx.sc.workload.num_requests > 1:
        yield _set(d, ("workload", "arrival_rate"), MAX_ARRIVAL_RATE)
        yield _set(d, ("workload", "arrival_rate"), min(MAX_ARRIVAL_RATE, rate * 4))


def smaller_fault_params(d: dict, ctx) -> Iterator[dict]:
    from kvchaos.faults import REGISTRY

    for i, f in enumerate(d.get("faults", [])):
        effective = {**REGISTRY[f["name"]].defaults, **f.get("params", {})}
        for key, v in effective.items():
            for smaller in _smaller(v):
                c = copy.deepcopy(d)
                c["faults"][i].setdefault("params", {})[key] = smaller
                yield c


def smaller_engine(d: dict, ctx) -> Iterator[dict]:
    """A narrower table and smaller pool: an over-long request overflows sooner, in fewer steps."""
    cc = ctx.sc.engine_config().cache
    for key, vals in (
        (
            "max_blocks_per_seq",
            (cc.max_blocks_per_seq // 4, cc.max_blocks_per_seq // 2, cc.max_blocks_per_seq - 1),
        ),
        ("block_size", (cc.block_size // 2,)),
        ("num_blocks", (cc.num_blocks // 2, cc.num_blocks * 3 // 4)),
        ("max_num_seqs", (2, cc.max_num_seqs // 2)),
    ):
        for v in _uniq_below(getattr(cc, key), vals):
            if v >= 1:
                yield _set(d, ("engine", "cache", key), v)


def fewer_keys(d: dict, ctx) -> Iterator[dict]:
    """Leave out what no longer matters (it takes its default): a shorter file to read."""
    for key in list(d.get("workload", {})):
        if key != "num_requests":
            c = copy.deepcopy(d)
            del c["workload"][key]
            yield c
    for i, f in enumerate(d.get("faults", [])):
        for key in list(f.get("params", {})):
            c = copy.deepcopy(d)
            del c["faults"][i]["params"][key]
            yield c


def fewer_steps(d: dict, ctx) -> Iterator[dict]:
    cap = min(ctx.sc.run.max_steps, ctx.best_steps + 1)
    for k in (cap // 2, cap * 3 // 4, cap):
        if 1 <= k < ctx.sc.run.max_steps:
            yield _set(d, ("run", "max_steps"), k)


REDUCERS: list[Callable] = [
    drop_faults,
    fewer_requests,
    fewer_forks,
    fewer_cancels,
    smaller_engine,
    smaller_fault_params,
    shorter_lengths,
    faster_arrivals,
    fewer_steps,
    fewer_keys,
]


def _smaller(v) -> list:
    if isinstance(v, bool):
        return [False] if v else []
    if isinstance(v, int):
        return _uniq_below(v, (0, 1, v // 2, v - 1))
    if isinstance(v, float):
        out = [round(v / 2, 6)] if v > 0 else []
        return out + ([round(1 + (v - 1) / 2, 6)] if v > 1 else [])
    if isinstance(v, list):
        return _sublists(v)
    return []


def _sublists(xs: list) -> list[list]:
    if not xs:
        return []
    return [[]] + ([xs[:i] + xs[i + 1 :] for i in range(len(xs))] if len(xs) > 1 else [])


def _set(d: dict, path: tuple, value) -> dict:
    c = copy.deepcopy(d)
    node = c
    for k in path[:-1]:
        node = node.setdefault(k, {})
    node[path[-1]] = value
    return c


# -- the search ---------------------------------------------------------------------------------
def _smaller_run(out: dict, key: str, best_out: dict, best: dict) -> bool:
    """No more requests, no more steps, and smaller overall (a shorter file counts): strictly
    decreasing, so the search cannot go round in circles."""
    return (
        out["requests"] <= best_out["requests"]
        and out["steps"] <= best_out["steps"]
        and (out["requests"], out["steps"], len(key))
        < (best_out["requests"], best_out["steps"], len(json.dumps(best, sort_keys=True)))
    )


class _Ctx:
    def __init__(self, sc, best_steps: int) -> None:
        self.sc, self.best_steps = sc, best_steps


def _outcome(sc, data: dict, seed: int, device: str, timeout_s: float, setup: dict) -> dict:
    from kvchaos.harness.run.runner import run_scenario
    from kvchaos.harness.tools.fingerprint import fingerprints

    r = run_scenario(sc, seed, device, None, timeout_s=timeout_s, **setup)
    fps = fingerprints(r.results, data.get("faults", []))
    return {
        "verdict": r.verdict,
        "fps": [tuple(x["fp"]) for x in fps],
        "steps": r.results["steps"],
        "requests": (r.results.get("metrics") or {}).get("requests", 0),
        "summary": r.summary,
        "results": r.results,  # the minimal run's: its calls reproducer (shrink_calls)
    }


def _fp_key(fp: tuple) -> tuple:
    """A fingerprint as shrinking compares it: the failure mode only where it is the subject (a
    MISSED defect); elsewhere it is attributed from the faults present, which shrinking removes."""
    return fp if fp[0] == MISSED else (fp[0], "*", *fp[2:])


def _matches(target: dict, got: dict) -> bool:
    if got["verdict"] != target["verdict"]:
        return False
    have = {_fp_key(fp) for fp in got["fps"]}
    if target["fps"] and _fp_key(target["fps"][0]) not in have:
        return False
    return have <= {_fp_key(fp) for fp in target["fps"]}


def shrink(
    data: dict,
    seed: int,
    device: str,
    target: dict,
    first: dict,
    max_runs: int,
    timeout_s: float,
    log: Callable[[str], None] = lambda s: None,
    setup: dict | None = None,
) -> tuple[dict, dict, int]:
    """(minimal scenario dict, its outcome, runs used). target: the outcome to keep; first: the
    outcome of re-running data as it is (one run, counted). setup: the recorded block manager
    and ranks (run_scenario keywords)."""
    from kvchaos.harness.scenario.spec import ScenarioError, parse_scenario

    best, best_out, runs = copy.deepcopy(data), first, 1
    seen = {json.dumps(best, sort_keys=True)}
    progress = True
    while progress and runs < max_runs:
        progress = False
        for reducer in REDUCERS:
            accepted = True
            while accepted and runs < max_runs:
                accepted = False
                ctx = _Ctx(parse_scenario(best, "<shrink>"), best_out["steps"])
                for cand in reducer(best, ctx):
                    key = json.dumps(cand, sort_keys=True)
                    if key in seen:
                        continue
                    seen.add(key)
                    try:
                        sc = parse_scenario(cand, "<shrink>")
                    except ScenarioError:
                        continue
                    if runs >= max_runs:
                        break
                    out = _outcome(sc, cand, seed, device, timeout_s, setup or {})
                    runs += 1
                    if _matches(target, out) and _smaller_run(out, key, best_out, best):
                        best, best_out, accepted = cand, out, True
                        progress = True
                        log(
                            f"  {reducer.__name__}: {out['requests']} requests, "
                            f"{out['steps']} steps"
                        )
                        break
    return best, best_out, runs


# -- the outputs ----------------------------------------------------------------------------------
def _ident(text: str) -> str:
    return re.sub(r"\W+", "_", text).strip("_").lower() or "scenario"


def _setup_args(setup: dict | None) -> str:
    """The recorded block manager and real ranks as kvchaos_run keywords (the reference manager
    and simulated ranks are the defaults)."""
    setup = setup or {}
    keep = {"block_manager_spec": setup.get("block_manager_spec")}
    if setup.get("tp_mode") == "distributed":
        keep.update(tp_mode="distributed", world_size=setup.get("world_size"))
    return "".join(f", {k}={v!r}" for k, v in keep.items() if v)


def regression_test(
    name: str,
    seed: int,
    run_dir: Path,
    target: dict,
    before: dict,
    after: dict,
    expect_detect: bool,
    setup: dict | None = None,
) -> str:
    primary = target["fps"][0] if target["fps"] else None
    finding = ""
    if expect_detect and primary is not None and primary[0] == "DETECTED":
        finding = (
            f"\n    assert {(primary[2], primary[3])!r} in "
            "{(f.checker, f.kind) for f in r.findings}, "
            f'"the detection no longer names the same finding"'
        )
    shown = " / ".join(primary) if primary else target["verdict"]
    doc = (
        f'"""Regression test from `kvchaos shrink {run_dir}`: {name} seed {seed}, reduced from '
        f"{before['requests']} requests / {before['steps']} steps to "
        f"{after['requests']} / {after['steps']}.\n"
        f"The original run showed {target['verdict']} ({shown}). The test asserts PASS: "
        + ("the planted defect is still caught" if expect_detect else "the run is clean")
        + (
            ", so it fails until the harness or engine is fixed."
            if target["verdict"] != PASS
            else "."
        )
        + '"""'
    )
    return f'''{doc}
from pathlib import Path

SCENARIO = Path(__file__).with_name("scenario.toml")


def test_{_ident(name)}_seed{seed}(kvchaos_run):
    r = kvchaos_run(SCENARIO, seed={seed}{_setup_args(setup)})
    assert r.verdict == "PASS", f"{{r.verdict}}: {{r.summary}}"{finding}
'''


def write_outputs(
    run_dir: Path,
    data: dict,
    seed: int,
    target: dict,
    before: dict,
    after: dict,
    runs: int,
    setup: dict | None = None,
) -> dict:
    from kvchaos.harness.scenario.toml_writer import dumps

    out_dir = run_dir / "minimal"
    out_dir.mkdir(exist_ok=True)
    name = data["scenario"]["name"].removesuffix("-min")[: MAX_NAME - 4] + "-min"  # a valid name
    primary = " / ".join(target["fps"][0]) if target["fps"] else target["verdict"]
    data = copy.deepcopy(data)
    meta = data["scenario"]
    meta.update(
        name=name,
        seeds=[seed],
        description=f"Shrunk by kvchaos shrink from {run_dir} (seed {seed}): "
        f"{target['verdict']}, {primary}. "
        f"{before['requests']} requests / {before['steps']} steps -> "
        f"{after['requests']} / {after['steps']}.",
    )
    meta["tags"] = [t for t in meta.get("tags", []) if t != "soak"]
    scenario_path = out_dir / "scenario.toml"
    scenario_path.write_text(dumps(data), encoding="utf-8")
    test_path = out_dir / f"test_{_ident(name)}_s{seed}.py"
    test_path.write_text(
        regression_test(
            name,
            seed,
            run_dir,
            target,
            before,
            after,
            data.get("expect", {}).get("outcome") == "detect",
            setup,
        ),
        encoding="utf-8",
    )
    return {
        "scenario_path": str(scenario_path),
        "test_path": str(test_path),
        "seed": seed,
        "command": f"python -m pytest {test_path}",
        "verdict": target["verdict"],
        "fingerprint": primary,
        "before": before,
        "after": after,
        "runs": runs,
    }


def _update_results(run_dir: Path, results: dict, minimal: dict) -> None:
    results["minimal_reproducer"] = minimal
    if (run_dir / "history.jsonl").is_file():
        try:
            from kvchaos.harness.report.render import write_reports  # the incidents again

            write_reports(run_dir, results, plots=True)  # keep the figure analyze drew
            return
        except ImportError:
            pass
    write_results(run_dir, results)


# -- the command --------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument(
        "run_dir",
        type=options.PATH,
        metavar="RUN_DIR",
        help="a run folder (holds results.json and scenario.toml/.json)",
    )
    p.add_argument(
        "--max-runs",
        type=int,
        default=200,
        metavar="N",
        help="at most N candidate runs (default 200)",
    )
    options.add(p, "device", default_means="the recorded one", lead="run the candidates there")
    options.add(p, "timeout", default_means="10x the first re-run, at least 30 s")


def main(args) -> int:
    from kvchaos.harness.run.user_code import validate_manager
    from kvchaos.harness.tools.fingerprint import fingerprints
    from kvchaos.harness.tools.replay import load_run, recorded_setup
    from kvchaos.harness.tools.shrink_calls import reproduce

    if args.max_runs < 1:
        raise ValueError(f"--max-runs {args.max_runs}: must be >= 1")
    run_dir = Path(args.run_dir)
    sc, data, results = load_run(run_dir)
    if "verdict" not in results:
        raise ValueError(f"{run_dir / 'results.json'}: no verdict: not a finished kvchaos run")
    if not isinstance(results["verdict"], str) or current(results["verdict"]) not in EXIT_CODES:
        raise ValueError(
            f"{run_dir / 'results.json'}: verdict {str(results['verdict'])[:40]!r}: expected one "
            f"of {', '.join(EXIT_CODES)}"
        )
    seed, device = results["seed"], args.device or results["device"]
    setup = recorded_setup(run_dir, results)
    if setup["block_manager_spec"]:  # bad input (exit 2) before anything runs
        validate_manager(setup["block_manager_spec"])
    target = {
        "verdict": results["verdict"],
        "fps": [tuple(x["fp"]) for x in fingerprints(results, data.get("faults", []))],
    }
    t0 = time.perf_counter()
    first = _outcome(sc, data, seed, device, args.timeout, setup)
    if not _matches(target, first):
        print(
            f"the run does not reproduce: recorded {target['verdict']} ({_fp(target)}), "
            f"the re-run gave {first['verdict']} ({_fp(first)}): {first['summary']}"
        )
        return EXIT_NOT_REPRODUCED
    timeout = args.timeout or max(30.0, 10 * (time.perf_counter() - t0))
    before = {"requests": first["requests"], "steps": first["steps"]}
    print(f"shrinking {sc.name} seed {seed} on {device}: {target['verdict']}, {_fp(target)}")
    best, after, runs = shrink(
        data, seed, device, target, first, args.max_runs, timeout, print, setup
    )
    shrunk = {"requests": after["requests"], "steps": after["steps"]}
    minimal = write_outputs(run_dir, best, seed, target, before, shrunk, runs, setup)
    minimal.update(reproduce(best, seed, device, setup, after["results"], run_dir, minimal))
    _update_results(run_dir, results, minimal)
    print(f"before: {before['requests']} requests, {before['steps']} steps")
    print(
        f"after:  {after['requests']} requests, {after['steps']} steps  ({runs} runs, "
        f"{time.perf_counter() - t0:.1f} s)"
    )
    print(
        f"scenario: {minimal['scenario_path']}\ntest:     {minimal['test_path']}\n"
        f"run it:   {minimal['command']}\ncalls:    "
        + (minimal.get("calls_test_path") or f"none: {minimal.get('calls_note')}")
    )
    return 0


def _fp(outcome: dict) -> str:
    return " / ".join(outcome["fps"][0]) if outcome["fps"] else "no finding"
