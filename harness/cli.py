"""kvchaos command line: list and run scenarios, and the tools around them.

On a terminal `run` shows a progress bar and a table; in a log or a pipe (CI) it prints one plain
line per run and tables at full width, and `--format json` prints one JSON document instead."""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import sys
import time
from pathlib import Path

import kvchaos
from kvchaos.engine.env import check as check_env
from kvchaos.engine.errors import KVChaosError
from kvchaos.harness.check.verdict import EXIT_CODES, PASS, worst
from kvchaos.harness.commands import EXIT_INTERRUPTED, EXIT_USAGE, TOOLS, exit_epilog, main_epilog
from kvchaos.harness.scenario import inputs, options
from kvchaos.harness.scenario.inputs import parse_seeds


def select_scenarios(names: list[str], tags: list[str] | None = None, device: str | None = None):
    """device: where they will run (their memory is judged there)."""
    from kvchaos.harness.scenario.spec import builtin_scenarios, load_scenario

    scs = [load_scenario(n, device) for n in names] if names else builtin_scenarios(device)
    if tags:
        scs = [s for s in scs if set(tags) & set(s.markers)]
    return scs


WIDE = 10_000  # a log or a pipe has no width to fit: tables never truncate a name there


def _console():
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=WIDE)


def _print_json(doc) -> None:
    print(json.dumps(doc, indent=1, default=str), flush=True)


def cmd_list(args) -> int:
    from rich.markup import escape
    from rich.table import Table

    scs = select_scenarios(args.scenarios, args.tag)
    if args.format == "json":
        _print_json({"scenarios": [_scenario_doc(s) for s in scs]})
        return 0
    from kvchaos.faults import REGISTRY

    t = Table(title="kvchaos scenarios")
    for col in ("name", "expect", "faults (defect planted?)", "markers", "seeds"):
        t.add_column(col)
    for s in scs:
        faults = (
            ", ".join(
                f"{REGISTRY[f.name].label(f.params)}"  # the variant, where it has one
                f"{' (defect)' if f.defect else ' (trigger only)'}"
                for f in s.faults
            )
            or "-"
        )
        exp = s.expect.outcome + (
            f" by {'/'.join(s.expect.checkers)} in {s.expect.within_steps} steps"
            if s.expect.outcome == "detect"
            else ""
        )
        row = (s.name, exp, faults, " ".join(s.markers), ",".join(map(str, s.scenario.seeds)))
        t.add_row(*map(escape, row))
    _console().print(t)
    return 0


def _scenario_doc(s) -> dict:
    doc = {"name": s.name, "source": s.source, "expect": s.expect.model_dump()}
    doc["faults"] = [{"name": f.name, "defect": f.defect} for f in s.faults]
    return {**doc, "markers": list(s.markers), "seeds": list(s.scenario.seeds)}


def cmd_run(args) -> int:
    from kvchaos.harness.report.batch import details, print_table, run_doc, where
    from kvchaos.harness.run import isolate

    isolated = not args.in_process and "RANK" not in os.environ  # torchrun's ranks: in-process
    if isolated:
        isolate.start_server(args.block_manager)  # it imports torch while this process does too
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvchaos.engine.cluster import Cluster, external_launch
    from kvchaos.engine.follower import serve
    from kvchaos.engine.protocols import declared_block_sizes
    from kvchaos.harness.report.paths import report_dir_problem
    from kvchaos.harness.run.device import resolve_device
    from kvchaos.harness.run.user_code import SmokeFailure, supported, validate_manager

    if args.tp_mode == "distributed" and external_launch() and int(os.environ["RANK"]) > 0:
        return serve()  # under torchrun, ranks > 0 serve rank 0's runs
    as_json = args.format == "json"
    console = _console()
    seeds = parse_seeds(args.seed, args.seeds)
    device = resolve_device(args.device)
    scs = select_scenarios(args.scenarios, args.tag, device)
    if not scs:
        raise KVChaosError("no scenario matches")
    inputs.check_overrides(scs, device, args.tp_mode, args.world_size)
    if problem := report_dir_problem(args.report_dir):
        raise KVChaosError(f"--report-dir {args.report_dir}: {problem}")
    door = None  # a manager failing its check before any run: one FAIL run, nothing else runs
    if args.block_manager:  # what is not a manager is bad input (exit 2), not an ERROR per run
        try:
            if isolated:
                from kvchaos.harness.run.door import validate_isolated

                sizes = validate_isolated(args.block_manager, args.check_timeout)
            else:
                sizes = declared_block_sizes(validate_manager(args.block_manager))
            scs = supported(scs, sizes, args.block_manager, bool(args.scenarios))
        except SmokeFailure as failed:
            door, scs = failed, []
    jobs = [(s, seed) for s in scs for seed in (seeds or s.scenario.seeds)]
    report_dir = Path(args.report_dir)
    # a bar on a terminal; in a log, one plain line per run (stderr under --format json)
    live = console.is_terminal and not (as_json or args.quiet)
    log = None if args.quiet else (sys.stderr if as_json else sys.stdout)
    results, indexed, full = [], False, None
    if not args.in_process and (why := isolate.in_process_reason()):
        print(f"kvchaos: runs are not isolated: {why}", file=sys.stderr)
    try:
        with (
            Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
                disable=not live,
            ) as progress,
            Cluster() as cluster,
        ):
            task = progress.add_task("running", total=len(jobs))
            batch = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"  # the index groups by it
            if door is not None:
                from kvchaos.harness.run.door import door_run

                r = door_run(door, report_dir, index=False, batch=batch)
                results.append(r)
                if live:
                    progress.console.print(f"[red]{r.verdict}[/] {escape(details(r))}")
                elif log is not None:
                    print(f"[1/1] {r.verdict}: {details(r)}", file=log)
            for i, (sc, seed) in enumerate(jobs, 1):
                progress.update(task, description=escape(f"{sc.name} seed {seed}"))
                t0 = time.perf_counter()
                r = isolate.run(
                    sc,
                    seed,
                    isolated=not args.in_process,
                    cluster=cluster,
                    batch=batch,
                    device=device,
                    report_dir=report_dir,
                    block_manager_spec=args.block_manager,
                    timeout_s=args.timeout,
                    tp_mode=args.tp_mode,
                    world_size=args.world_size,
                )
                results.append(r)
                if live and r.verdict != PASS:
                    progress.console.print(f"[red]{r.verdict}[/] {escape(details(r))}")
                elif log is not None and not live:
                    line = f"[{i}/{len(jobs)}] {sc.name} seed {seed}: {r.verdict}"
                    line += f" ({time.perf_counter() - t0:.1f} s)"
                    print(line + ("" if r.verdict == PASS else f": {details(r)}"), file=log)
                    log.flush()  # CI shows each run as it ends
                if r.results.get("reason") == "interrupted":  # Ctrl-C: its record is on disk
                    break
                progress.advance(task)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        full = e  # a full disk: the finished runs stand, their summary is printed, then one line
    finally:
        if results and full is None:  # once for the batch, whatever stopped it
            from kvchaos.harness.report.index import update_index

            try:
                update_index(report_dir, newest=results[-1].run_dir)
                indexed = True
            except Exception as e:  # the runs are on disk; only the listing is stale
                print(
                    f"kvchaos: could not update {report_dir / 'index.html'}: "
                    f"{type(e).__name__}: {e}",
                    file=sys.stderr,
                )
    if full is not None:
        full = KVChaosError(
            f"{report_dir}: {full.strerror} (writing {full.filename or 'a run'}): stopped after "
            f"{len(results)} of {len(jobs)} runs, each finished one intact; index not updated"
        )
        if not results:
            raise full
    interrupted = results[-1].results.get("reason") == "interrupted"
    code = EXIT_INTERRUPTED if interrupted else EXIT_CODES[worst([r.verdict for r in results])]
    code = EXIT_USAGE if full else code
    if as_json:
        _print_json(run_doc(results, report_dir, indexed, code, interrupted))
    else:
        print_table(console, results)
    if full:
        raise full
    if not (as_json and args.quiet):
        print(where(report_dir, results[-1], indexed), file=sys.stderr if as_json else sys.stdout)
    if interrupted:
        raise KeyboardInterrupt
    return code


def _subparser(sub, name: str, help_: str, description: str):
    return sub.add_parser(
        name,
        help=help_,
        description=description,
        epilog=exit_epilog(name),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


class _Version(argparse.Action):
    """--version: the installed version, looked up only when asked (the lookup reads package
    metadata: every start would pay for it)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"kvchaos {kvchaos.__version__}")
        parser.exit()


def build_parser(load=None) -> argparse.ArgumentParser:
    """load: the tool commands whose modules declare their arguments (None: all). A command's
    start imports its own module alone: `kvchaos --help` and `kvchaos list` load no tool."""
    p = inputs.OneLineParser(
        prog="kvchaos",
        description="Chaos and fault-injection harness for paged-KV-cache inference engines:\n"
        "provokes block-table overflow, ref-count leaks on cancel, staging-buffer stalls and\n"
        "cross-rank ordering races, checks every output against a contiguous-cache oracle and\n"
        "structural invariants, and writes incident reports.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action=_Version, help="show the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    fmt = dict(
        choices=("text", "json"),
        default="text",
        help="text: a table (full width in a log or a pipe); json: one JSON document on stdout",
    )

    ls = _subparser(
        sub,
        "list",
        "list scenarios with their tags and expectation",
        "List scenarios: expectation, faults (planted or trigger only), markers and seeds.",
    )
    ls.add_argument(
        "scenarios",
        nargs="*",
        type=options.PATH,
        metavar="SCENARIO",
        help="files or built-in names (default: all built-ins)",
    )
    ls.add_argument(
        "--tag", action="append", help="only scenarios with this tag or marker (repeatable)"
    )
    ls.add_argument("--format", **fmt)
    ls.set_defaults(func=cmd_list)

    run = _subparser(
        sub,
        "run",
        "run scenarios and print a table of verdicts",
        "Run each scenario with each seed: engine + workload + faults -> history -> checkers ->\n"
        "verdict. Each run writes a folder under --report-dir; at the end the batch rebuilds\n"
        "REPORT_DIR/index.html, points REPORT_DIR/latest at its newest run and says where.\n"
        "On a terminal: a progress bar. In a log or a pipe: one line per run (scenario, seed,\n"
        "verdict, time). --format json: one JSON document on stdout (the runs: scenario, seed,\n"
        "verdict, summary, run_dir, replay, exit_code; and the batch's exit_code), progress\n"
        "lines on stderr.",
    )
    run.add_argument(
        "scenarios",
        nargs="*",
        type=options.PATH,
        metavar="SCENARIO",
        help="scenario files or built-in names (default: every built-in scenario)",
    )
    options.add_seeds(run)
    options.add(run, "device", default="auto")
    options.add(run, "report_dir", default=options.DEFAULT_REPORT_DIR)
    options.add(
        run, "block_manager", default_means="the reference", lead="the block manager to run under"
    )
    run.add_argument(
        "--tag", action="append", help="only scenarios with this tag or marker (repeatable)"
    )
    options.add(run, "timeout", default=options.DEFAULT_TIMEOUT_S)
    options.add(run, "check_timeout", default=options.DEFAULT_CHECK_TIMEOUT_S)
    run.add_argument(
        "--in-process",
        action="store_true",
        help="run in this process (for a debugger) instead of a fresh worker process per run, "
        "forked from one that imported torch once; a worker that hangs is killed at --timeout "
        "(in-process, the limit is checked between steps only), one that dies (os._exit, a "
        "signal) gets a verdict all the same. Distributed runs launch their ranks in the worker",
    )
    run.add_argument(
        "--tp-mode",
        choices=["simulated", "distributed"],
        help="tensor-parallel ranks in this process, or real torch.distributed processes (gloo "
        "on the CPU, NCCL on GPUs; or launch under torchrun) (default: the scenario's tp_mode)",
    )
    run.add_argument(
        "--world-size",
        type=inputs.flag(inputs.world_size),
        metavar="N",
        help="tensor-parallel ranks (overrides engine.tp_size)",
    )
    run.add_argument("--format", **fmt)
    run.add_argument(
        "-q", "--quiet", action="store_true", help="no progress (bar or lines), only the results"
    )
    run.set_defaults(func=cmd_run)

    for name, (module, help_) in TOOLS.items():
        if load is not None and name not in load:  # listed by name; its module stays unloaded
            _subparser(sub, name, help_, help_)
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        sp = _subparser(sub, name, help_, (mod.__doc__ or help_).strip())
        mod.add_arguments(sp)
        sp.epilog = exit_epilog(name)  # one table for every command's exit codes
        sp.set_defaults(func=mod.main)
    p.epilog = main_epilog(list(sub.choices))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(load=[command] if command in TOOLS else []).parse_args(argv)
    try:
        check_env()  # a bad number there is this command's usage error, not a worker's traceback
        return args.func(args)
    except (KVChaosError, ValueError) as e:  # ValueError: flag values only the command can judge
        message = str(e)
    except BrokenPipeError:  # `kvchaos ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except OSError as e:  # a path the command was given or writes to: named, with the reason
        if e.filename is None:
            raise
        message = f"{e.filename}: {e.strerror}"
    except KeyboardInterrupt:
        print("kvchaos: interrupted; what was recorded is on disk", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"kvchaos: error: {' / '.join(message.splitlines())}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
