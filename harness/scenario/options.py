"""The options every command shares, declared once: --device, --seed/--seeds, --timeout,
--block-manager and --report-dir, each with one help text, for the commands (argparse) and for
pytest (--kvchaos-*). A command says what its default means; the rest is the same everywhere."""

from __future__ import annotations

from kvchaos.harness.scenario import inputs

DEFAULT_TIMEOUT_S = 300.0  # per run; the built-in scenarios take seconds on a CPU
DEFAULT_CHECK_TIMEOUT_S = 60.0  # the block manager's check before any run, its import apart
DEFAULT_REPORT_DIR = "reports"
PATH = inputs.flag(inputs.path)  # the argparse type of every path a command takes
HELP = {
    "device": "auto (cuda when present, else cpu), cpu, cuda or cuda:N",
    "seed": "run this one seed",
    "seeds": "a count N (seeds 0..N-1) or a list 0,3,7",
    "timeout": "per-run time limit in seconds, enforced even inside a step: a run still going is "
    "stopped; a call into the block manager that did not return is a FAIL naming it, a hang "
    "elsewhere an ERROR",
    "block_manager": "your own (protocol v2: kvchaos.engine.protocols.KVManager), "
    "called as ATTR(num_blocks, block_size, max_num_seqs, max_blocks_per_seq); 'vllm': vLLM's "
    "own KVCacheManager from the installed vllm; 'sglang': SGLang's RadixCache and paged "
    "allocator from the installed sglang (docs/adapters.md)",
    "report_dir": "where run folders go",
    "check_timeout": "time limit in seconds of the block manager's check before any run (a smoke "
    "sequence on a tiny pool, in a fresh worker), its module's import not counted: a check "
    "still going then is bad input",
}
FLAGS = {
    "device": "--device",
    "seed": "--seed",
    "seeds": "--seeds",
    "timeout": "--timeout",
    "block_manager": "--block-manager",
    "report_dir": "--report-dir",
    "check_timeout": "--check-timeout",
}
KWARGS = {
    "device": dict(type=inputs.flag(inputs.device)),
    "seed": dict(type=inputs.flag(inputs.seed), metavar="N"),
    "seeds": dict(metavar="N|LIST"),
    "timeout": dict(type=inputs.flag(inputs.seconds), metavar="S"),
    "block_manager": dict(metavar="MODULE:ATTR"),
    "report_dir": dict(type=PATH, metavar="DIR"),
    "check_timeout": dict(type=inputs.flag(inputs.seconds), metavar="S"),
}


def _help(name: str, default, default_means: str | None, lead: str | None) -> str:
    lead = lead or ("the block manager" if name == "block_manager" else None)
    text = f"{lead}: {HELP[name]}" if lead else HELP[name]
    if default_means:
        return f"{text} (default: {default_means})"
    return (
        f"{text} (default: {default:g})"
        if isinstance(default, float)
        else (f"{text} (default: {default})" if default is not None else text)
    )


def add(
    p,
    name: str,
    default=None,
    default_means: str | None = None,
    lead: str | None = None,
    flag: str | None = None,
    **extra,
) -> None:
    """Declare one shared option on an argparse parser (or a mutually exclusive group).
    default_means: what the default is, in words, when it is not a plain value ("the recorded
    one"); lead: what the option does in this command, before the shared text; flag: another
    name for it (soak's --per-run-timeout)."""
    p.add_argument(
        flag or FLAGS[name],
        default=default,
        help=_help(name, default, default_means, lead),
        **{**KWARGS[name], **extra},
    )


def add_seeds(p, default_means: str = "each scenario's own seeds") -> None:
    """--seed N or --seeds N|LIST, one or the other."""
    g = p.add_mutually_exclusive_group()
    add(g, "seed")
    add(g, "seeds", default_means=default_means)


def add_pytest(group) -> None:
    """The same options for pytest's scenario items, as --kvchaos-*. Values are strings here and
    checked in pytest_configure (inputs), so a bad one is one usage error."""
    for name, default, means in (
        ("device", "cpu", None),
        ("seeds", None, "each scenario's own seeds"),
        ("report_dir", None, "reports/ in the rootdir; kvchaos_run: the test's tmp_path"),
        ("block_manager", None, "the reference"),
        ("timeout", None, f"{DEFAULT_TIMEOUT_S:g}, as kvchaos run"),
        ("check_timeout", None, f"{DEFAULT_CHECK_TIMEOUT_S:g}, as kvchaos run"),
    ):
        group.addoption(
            "--kvchaos-" + FLAGS[name].removeprefix("--"),
            default=default,
            metavar=KWARGS[name].get("metavar"),
            **({"type": float} if name in ("timeout", "check_timeout") else {}),
            help=_help(name, default, means, "scenario items" if name == "device" else None),
        )
