"""kvchaos command line: list and run scenarios, and the tools around them."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from kvchaos.engine.errors import KVChaosError
from kvchaos.harness.judge.verdict import EXIT_CODES, MEANING, PASS, worst

EXIT_USAGE = 2
# Subcommands that live in their own modules; each has add_arguments(parser) and main(args) -> int.
TOOLS = {
    "bench": (
        "kvchaos.harness.bench.suite",
        "measure the block manager, the engine and paged vs contiguous attention",
    ),
    "analyze": (
        "kvchaos.harness.report.analyze",
        "re-run the checkers on a stored run and rewrite its reports",
    ),
    "soak": ("kvchaos.harness.tools.soak", "run randomised scenarios until a time budget is spent"),
    "replay": ("kvchaos.harness.tools.replay", "re-run a stored run and compare its history"),
    "shrink": (
        "kvchaos.harness.tools.shrink",
        "reduce a failing run to a minimal scenario and a pytest file",
    ),
    "gpu-check": (
        "kvchaos.harness.bench.gpu_check",
        "the prepared GPU check: gpu tests, CUDA scenarios, kernel bench, soak",
    ),
}


def _exit_help() -> str:
    return (
        "exit codes: "
        + ", ".join(f"{v} {k}" for k, v in EXIT_CODES.items())
        + f", {EXIT_USAGE} bad input"
    )


def parse_seeds(seed: int | None, seeds: str | None) -> list[int] | None:
    """--seed N: that seed; --seeds N: seeds 0..N-1; --seeds 3,7,11: those."""
    if seed is not None:
        return [seed]
    if seeds is None:
        return None
    try:
        if "," in seeds:
            return [int(s) for s in seeds.split(",") if s.strip()]
        n = int(seeds)
    except ValueError:
        raise KVChaosError(
            f"--seeds {seeds!r}: expected a count (e.g. 20) or a list (e.g. 0,3,7)"
        ) from None
    if n < 1:
        raise KVChaosError(f"--seeds {seeds}: the count must be >= 1")
    return list(range(n))


def select_scenarios(names: list[str], tags: list[str] | None = None):
    from kvchaos.harness.judge.scenario import builtin_scenarios, load_scenario

    scs = [load_scenario(n) for n in names] if names else builtin_scenarios()
    if tags:
        scs = [s for s in scs if set(tags) & set(s.markers)]
    return scs


def cmd_list(args) -> int:
    from rich.console import Console
    from rich.table import Table

    scs = select_scenarios(args.scenarios, args.tag)
    t = Table(title="kvchaos scenarios")
    for col in ("name", "expect", "faults (defect planted?)", "markers", "seeds"):
        t.add_column(col)
    for s in scs:
        faults = (
            ", ".join(f"{f.name}{' (defect)' if f.defect else ' (trigger only)'}" for f in s.faults)
            or "-"
        )
        exp = s.expect.outcome + (
            f" by {'/'.join(s.expect.checkers)} in {s.expect.within_steps} steps"
            if s.expect.outcome == "detect"
            else ""
        )
        t.add_row(s.name, exp, faults, " ".join(s.markers), ",".join(map(str, s.scenario.seeds)))
    Console().print(t)
    return 0


def cmd_run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvchaos.engine.cluster import Cluster, external_launch
    from kvchaos.engine.follower import serve
    from kvchaos.harness.judge.runner import resolve_device, run_scenario
    from kvchaos.harness.judge.user_code import load_object
    from kvchaos.harness.report.render import publish

    if args.tp_mode == "distributed" and external_launch() and int(os.environ["RANK"]) > 0:
        return serve()  # under torchrun, ranks > 0 serve rank 0's runs
    console = Console()
    seeds = parse_seeds(args.seed, args.seeds)
    scs = select_scenarios(args.scenarios, args.tag)
    if not scs:
        raise KVChaosError("no scenario matches")
    device = resolve_device(args.device)
    if args.block_manager:
        load_object(
            args.block_manager
        )  # a bad --block-manager is bad input (exit 2), not an ERROR per run
    jobs = [(s, seed) for s in scs for seed in (seeds or s.scenario.seeds)]
    results = []
    try:
        with (
            Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
                disable=args.quiet,
            ) as progress,
            Cluster() as cluster,
        ):
            task = progress.add_task("running", total=len(jobs))
            for sc, seed in jobs:
                progress.update(task, description=f"{sc.name} seed {seed}")
                r = publish(
                    run_scenario(
                        sc,
                        seed,
                        device=device,
                        report_dir=Path(args.report_dir),
                        block_manager_spec=args.block_manager,
                        timeout_s=args.timeout,
                        tp_mode=args.tp_mode,
                        world_size=args.world_size,
                        cluster=cluster,
                    ),
                    index=False,
                )
                results.append(r)
                if (
                    r.results.get("reason") == "interrupted"
                ):  # Ctrl-C: stop here, the run's record is on disk
                    break
                if r.verdict != PASS and not args.quiet:
                    progress.console.print(
                        f"[red]{r.verdict}[/] {sc.name} seed {seed}: {r.summary}\n"
                        f"  replay: {r.results['replay']}  run: {r.run_dir}"
                    )
                progress.advance(task)
    finally:
        if results:  # once for the batch, whatever stopped it
            from kvchaos.harness.report.index import update_index

            try:
                update_index(Path(args.report_dir), newest=results[-1].run_dir)
            except Exception as e:  # the runs are on disk; only the listing is stale
                console.print(
                    f"[yellow]could not update {args.report_dir}/index.html: "
                    f"{type(e).__name__}: {e}[/]"
                )
    _print_table(console, results, args.quiet)
    if results[-1].results.get("reason") == "interrupted":
        raise KeyboardInterrupt
    return EXIT_CODES[worst([r.verdict for r in results])]


def _print_table(console, results, quiet: bool) -> None:
    from collections import defaultdict

    from rich.table import Table

    colour = {
        "PASS": "green",
        "MISSED": "red",
        "FAIL": "red",
        "ERROR": "red",
        "INCONCLUSIVE": "yellow",
    }
    by_sc = defaultdict(list)
    for r in results:
        by_sc[r.scenario].append(r)
    t = Table(title=f"kvchaos: {len(results)} runs")
    for col in ("scenario", "seeds", "verdicts", "time to detect (median steps)", "steps (median)"):
        t.add_column(col)
    for name, rs in by_sc.items():
        counts = defaultdict(int)
        for r in rs:
            counts[r.verdict] += 1
        ttd = sorted(v for r in rs for v in r.results.get("time_to_detect_steps", {}).values())
        steps = sorted(r.results.get("steps", 0) for r in rs)
        t.add_row(
            name,
            str(len(rs)),
            " ".join(f"[{colour[k]}]{k} {v}/{len(rs)}[/]" for k, v in counts.items()),
            str(ttd[len(ttd) // 2]) if ttd else "-",
            str(steps[len(steps) // 2]),
        )
    console.print(t)
    w = worst([r.verdict for r in results])
    console.print(f"overall: [{colour[w]}]{w}[/] ({MEANING[w]})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvchaos",
        description="Chaos and fault-injection harness for paged-KV-cache "
        "inference engines: provokes block-table overflow, ref-count leaks on cancel, "
        "staging-buffer stalls and cross-rank ordering races, checks every output against "
        "a contiguous-cache oracle and structural invariants, and writes incident reports.",
        epilog=_exit_help(),
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    ls = sub.add_parser("list", help="list scenarios with their tags and expectation")
    ls.add_argument(
        "scenarios",
        nargs="*",
        metavar="SCENARIO",
        help="files or built-in names (default: all built-ins)",
    )
    ls.add_argument(
        "--tag", action="append", help="only scenarios with this tag or marker (repeatable)"
    )
    ls.set_defaults(func=cmd_list)

    run = sub.add_parser(
        "run",
        help="run scenarios and print a table of verdicts",
        epilog=_exit_help(),
        description="Run each scenario with each seed: engine + workload + faults -> history -> "
        "checkers -> verdict. Each run writes a folder under --report-dir.",
    )
    run.add_argument(
        "scenarios",
        nargs="*",
        metavar="SCENARIO",
        help="scenario files or built-in names (default: every built-in scenario)",
    )
    g = run.add_mutually_exclusive_group()
    g.add_argument("--seed", type=int, help="run this one seed")
    g.add_argument(
        "--seeds",
        help="a count N (seeds 0..N-1) or a list 0,3,7 (default: each scenario's own seeds)",
    )
    run.add_argument(
        "--device", default="auto", help="auto (cuda when present, else cpu), cpu, cuda, cuda:N"
    )
    run.add_argument(
        "--report-dir", default="reports", help="where run folders go (default: reports)"
    )
    run.add_argument(
        "--block-manager",
        metavar="MODULE:ATTR",
        help="run under your own BlockManager "
        "(kvchaos.engine.protocols.BlockManagerProtocol), called as "
        "ATTR(num_blocks, block_size, max_num_seqs, max_blocks_per_seq)",
    )
    run.add_argument(
        "--tag", action="append", help="only scenarios with this tag or marker (repeatable)"
    )
    run.add_argument(
        "--timeout", type=float, default=None, metavar="S", help="per-run time limit in seconds"
    )
    run.add_argument(
        "--tp-mode",
        choices=["simulated", "distributed"],
        help="tensor-parallel ranks in this process, or real torch.distributed processes "
        "(gloo on the "
        "CPU, NCCL on GPUs; or launch under torchrun) (default: the scenario's engine.tp_mode)",
    )
    run.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="tensor-parallel ranks (overrides engine.tp_size)",
    )
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bar, only the table")
    run.set_defaults(func=cmd_run)

    for name, (module, help_) in TOOLS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        sp = sub.add_parser(
            name,
            help=help_,
            description=(mod.__doc__ or help_).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(sp)
        sp.set_defaults(func=mod.main)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KVChaosError as e:
        print(f"kvchaos: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as e:  # bad flag values that only the command can judge
        print(f"kvchaos: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvchaos: interrupted; what was recorded is on disk", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
