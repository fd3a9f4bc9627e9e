"""kvchaos explain RUN: name the call into the manager behind each kind of finding of a stored
run. Replays the run (its scenario, seed and manager, in this process with the run's hash seed)
with a snapshot after every call in the steps around each finding, writes each named call into
results.json (findings gain "call"), rewrites the reports, and prints one line a finding."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from kvchaos.harness.tools.replay import load_run, recorded_setup

EXIT_NONE = 1  # findings against the manager, none named
DEFAULT_BUDGET_STEPS = 2000  # kvchaos.harness.run.explain's (its module loads torch)


def explain_run(run_dir: Path, budget_steps: int = DEFAULT_BUDGET_STEPS) -> dict:
    from kvchaos.harness.history.log import read_history
    from kvchaos.harness.history.results import write_results
    from kvchaos.harness.report.analyze import analyze
    from kvchaos.harness.run.device import resolve_device
    from kvchaos.harness.run.runner import localize_findings
    from kvchaos.harness.run.user_code import load_object

    sc, _, results = load_run(run_dir)
    setup = recorded_setup(run_dir, results)
    if setup["tp_mode"] == "distributed":
        raise ValueError(f"{run_dir}: a run on real ranks is not replayed call by call")
    spec = setup["block_manager_spec"]
    manager = load_object(spec) if spec else None
    tp = {"tp_mode": "simulated", "tp_size": setup["world_size"]} if setup["world_size"] else {}
    events = read_history(run_dir / "history.jsonl")
    device = resolve_device(results["device"])
    loc = localize_findings(
        sc, results["seed"], device, manager, spec, tp, events, results["checkers"], budget_steps
    )
    results["localization"] = loc
    write_results(run_dir, results)
    analyze(run_dir)
    return loc


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = __doc__.split("\n\n")[0] + (
        '\n\nA FAIL run on the CPU is explained as it ends (results.json\'s "localization");'
        "\nthis command does it for any stored run, or again with a larger budget."
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder, e.g. reports/latest")
    p.add_argument(
        "--budget-steps",
        type=int,
        default=DEFAULT_BUDGET_STEPS,
        metavar="N",
        help=f"replay at most N steps (default {DEFAULT_BUDGET_STEPS}); past it, nothing is named",
    )


def main(args) -> int:
    run_dir = Path(args.run_dir)
    _, _, results = load_run(run_dir)
    seed = results.get("python_hash_seed")
    if seed not in (None, "random") and os.environ.get("PYTHONHASHSEED") != seed:
        # the manager's sets and dicts of strings ordered as in the run: a fresh interpreter
        env = {**os.environ, "PYTHONHASHSEED": seed}
        cmd = [sys.executable, "-m", "kvchaos", "explain", str(run_dir)]
        return subprocess.call([*cmd, "--budget-steps", str(args.budget_steps)], env=env)
    if args.budget_steps < 1:
        print(f"kvchaos explain: --budget-steps {args.budget_steps}: must be at least 1")
        return 2
    loc = explain_run(run_dir, args.budget_steps)
    for line in loc["lines"] or ["no findings against the manager to explain"]:
        print(line)
    named = any(": no call: " not in line for line in loc["lines"] if " at step " in line)
    return 0 if named or not loc["lines"] else EXIT_NONE
