"""The commands' table: each tool command's module and help line, and every command's exit codes
(one table, printed by each --help and by `kvchaos --help`; tests/test_cli.py checks the tools'
own constants against it)."""

from __future__ import annotations

from kvchaos.harness.check.verdict import EXIT_CODES, MEANING, SEVERITY

EXIT_USAGE, EXIT_INTERRUPTED = 2, 130
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
    "ledger": (
        "kvchaos.harness.tools.soak_fleet",
        "merge soak ledgers (a fleet's shards) into one",
    ),
    "replay": ("kvchaos.harness.tools.replay", "re-run a stored run and compare its history"),
    "explain": (
        "kvchaos.harness.tools.explain",
        "name the call into the manager behind each finding of a stored run",
    ),
    "shrink": (
        "kvchaos.harness.tools.shrink",
        "reduce a failing run to a minimal scenario and a pytest file",
    ),
    "selftest": (
        "kvchaos.harness.tools.selftest",
        "plant canary bugs in the block manager: is each caught?",
    ),
    "gpu-check": (
        "kvchaos.harness.bench.gpu_check",
        "the prepared GPU check: gpu tests, CUDA scenarios, kernel bench, soak",
    ),
    "clean": (
        "kvchaos.harness.tools.clean",
        "delete run folders older than an age from a report folder, rebuild its index",
    ),
    "conformance": (
        "kvchaos.harness.conformance.suite",
        "test your block manager against the protocol's properties (Hypothesis, shrunk)",
    ),
    "advise": (
        "kvchaos.harness.tools.advise",
        "advise a KV block size from the traffic's request lengths, for a model's shape",
    ),
}

# Exit codes, per command: (code, name, meaning). The tools' own constants are checked against
# this table by tests/test_cli.py, so the help cannot drift from what they return.
_VERDICTS = [(c, v, MEANING[v]) for v, c in EXIT_CODES.items()]
EXITS = {
    "list": [(0, "listed", "")],
    "run": _VERDICTS,
    "analyze": _VERDICTS,
    "replay": [(0, "identical", ""), (1, "different", "the history differs from the recorded one")],
    "explain": [
        (0, "named", "a call named for a finding (or no finding to explain)"),
        (1, "none named", "findings against the manager, no call named (the lines say why)"),
    ],
    "shrink": [
        (0, "shrunk", "a smaller scenario and its test written (or it was already minimal)"),
        (1, "not reproduced", "the re-run does not show the recorded verdict"),
    ],
    "soak": [
        (0, "nothing unexpected", "only PASS and INCONCLUSIVE runs"),
        (10, "MISSED", ""),
        (11, "FAIL", ""),
        (14, "nondeterminism", "a replayed run's history differed from the original"),
        (13, "ERROR", "a run the harness broke in, or a seed whose own draw was invalid"),
        (15, "disk cap", "stopped at --max-disk before the budget was spent"),
    ],
    "ledger": [(0, "merged", "every run of the ledgers in OUT, each once")],
    "gpu-check": [
        (0, "ok", "every stage ok"),
        (1, "failed", "a stage failed, errored or timed out"),
        (3, "no CUDA", "no CUDA device"),
        (4, "incomplete", "nothing failed, but a stage could not run (missing package, budget)"),
    ],
    "selftest": [
        (0, "all killed", "every canary caught by a checker's finding; the reference held"),
        (1, "not killed", "a canary survived, only crashed, or broke the harness"),
        (3, "reference flagged", "the reference manager failed a run (wins over 1)"),
    ],
    "bench": [(0, "measured", "targets are reported, never asserted")],
    "clean": [(0, "cleaned", "the old run folders removed (or listed, with --dry-run)")],
    "advise": [(0, "advised", "the table and a recommendation (advice, never a verdict)")],
    "conformance": [
        (0, "conforms", "every applicable property passed"),
        (1, "failed", "a property failed: its shrunk reproducer is printed"),
        (11, "FAIL", "the check before any run failed: its run folder is printed"),
    ],
}
EXIT_NOTES = {
    "run": "several runs exit with the most serious: " + " > ".join(SEVERITY),
    "analyze": "the re-checked verdict of the stored run",
    "soak": "the first that applies: MISSED, FAIL, nondeterminism, ERROR, disk cap",
}
COMMON_EXITS = [
    (EXIT_USAGE, "bad input", "one line on stderr, nothing run"),
    (EXIT_INTERRUPTED, "interrupted", "Ctrl-C; what was recorded is on disk"),
]


def exit_epilog(command: str) -> str:
    """One command's exit codes, for its --help."""
    lines = ["exit codes:"]
    for code, name, meaning in EXITS.get(command, []) + COMMON_EXITS:  # a new tool: never a crash
        lines.append(f"  {code:>3}  {name}" + (f": {meaning}" if meaning else ""))
    if command in EXIT_NOTES:
        lines.append(f"  ({EXIT_NOTES[command]})")
    return "\n".join(lines)


def main_epilog(commands) -> str:
    """Every command's exit codes, for `kvchaos --help`."""
    width = max(len(c) for c in commands)
    lines = ["exit codes (each command's --help explains them):"]
    for cmd in commands:
        codes = ", ".join(f"{c} {n}" for c, n, _ in EXITS.get(cmd, [])) or "see its --help"
        lines.append(f"  {cmd:<{width}}  {codes}")
    common = ", ".join(f"{c} {n}" for c, n, _ in COMMON_EXITS)
    lines.append(f"  {'all':<{width}}  {common}")
    return "\n".join(lines)
