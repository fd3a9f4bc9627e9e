"""Replay: re-run a stored run with its scenario, seed and device, and compare the history.

  kvchaos replay reports/20250101-120000-table-overflow-detect-s0

The scenario comes from RUN_DIR/scenario.toml (or scenario.json, as soak runs also store it), the
seed and device from RUN_DIR/results.json. The new history's digest (its deterministic part: see
UNSTABLE_KEYS in harness/history.py) is compared with the recorded one and, when
RUN_DIR/history.jsonl is there, event by event, naming the first event that differs. On the CPU a
replay must be identical.

Exit codes: 0 identical, 1 different, 2 bad input.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import tempfile
from pathlib import Path

from kvchaos.harness.history.log import (
    DIGEST_SKIP,
    UNSTABLE_KEYS,
    check_history,
    iter_history,
    stable_line,
)
from kvchaos.harness.run.user_code import SmokeFailure, validate_manager
from kvchaos.harness.scenario import inputs, options
from kvchaos.harness.scenario.managers import REFERENCES, canonical_spec

EXIT_DIFFERENT = 1
# Events that are the block manager's own answers: its snapshots and its refusals.
MANAGER_ANSWERS = ("snapshot", "snapshot_invalid", "sut_error")


def load_run(run_dir: str | Path):
    """(Scenario, scenario dict, results) of a stored run; one clear error if it is not one."""
    from kvchaos.harness.history.results import read_results
    from kvchaos.harness.scenario.spec import ScenarioError, load_scenario, parse_scenario, tomllib

    d = Path(run_dir)
    if not d.is_dir():
        raise ValueError(f"{run_dir}: {'not a folder' if d.exists() else 'no such run folder'}")
    results = read_results(d)
    if not results:
        raise ValueError(f"{run_dir}: no results.json (or an empty one): not a kvchaos run folder")
    for key, kind, check in (("seed", int, inputs.seed), ("device", str, inputs.device)):
        if key not in results:
            raise ValueError(f"{d / 'results.json'}: no {key!r}: not a kvchaos run's results")
        try:
            if type(results[key]) is not kind:
                raise ValueError(f"{results[key]!r}: expected {kind.__name__}")
            check(str(results[key]))
        except ValueError as e:
            raise ValueError(f"{d / 'results.json'}: {key}: {e}") from None
    if (d / "history.jsonl").exists():
        check_history(d / "history.jsonl")
    toml_path, json_path = d / "scenario.toml", d / "scenario.json"
    if toml_path.exists():
        sc = load_scenario(toml_path)
        data = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    elif json_path.exists():
        try:
            data = json.loads(json_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ScenarioError(f"{json_path}: not valid JSON: {e}") from None
        sc = parse_scenario(data, str(json_path))
    else:
        raise ValueError(
            f"{run_dir}: neither scenario.toml nor scenario.json: the run cannot be replayed "
            f"(runs of a scenario built in code keep no scenario file)"
        )
    return sc, data, results


def recorded_setup(run_dir: str | Path, results: dict) -> dict:
    """How the run was set up beyond scenario, seed and device: its block manager (in today's
    names) and its ranks, as run_scenario's keyword arguments."""
    start = next(iter_history(Path(run_dir) / "history.jsonl"), {}) if _has_history(run_dir) else {}
    spec = canonical_spec(results.get("block_manager") or start.get("block_manager"))
    cfg = start.get("config", {})
    return {
        "block_manager_spec": None if spec in (None, *REFERENCES) else spec,
        "tp_mode": results.get("tp_mode") or cfg.get("tp_mode"),
        "world_size": results.get("world_size") or cfg.get("tp_size"),
    }


def _has_history(run_dir: str | Path) -> bool:
    return (Path(run_dir) / "history.jsonl").is_file()


def _stable(event: dict) -> dict:
    return {k: v for k, v in event.items() if k not in UNSTABLE_KEYS}


def _today(events):
    """(line index, event) of the events compared, the run_start's block manager in today's names
    (runs recorded before kvchaos had one import name say engine.*): the same manager is the same
    run. The call log is not compared (runs recorded before it have none; what the manager
    answered shows in the rest)."""
    for i, ev in enumerate(events):
        if ev.get("e") in DIGEST_SKIP:
            continue
        if ev.get("e") == "run_start" and ev.get("block_manager"):
            ev = {**ev, "block_manager": canonical_spec(ev["block_manager"])}
        yield i, ev


def history_digest(path: Path) -> str:
    """The deterministic digest of a stored history, streamed, in today's names."""
    h = hashlib.sha256()
    for _, ev in _today(iter_history(path)):
        h.update(stable_line(ev))
    return h.hexdigest()


def first_difference(recorded: Path, replayed: Path) -> dict | None:
    """The first event whose deterministic part differs (or that one history lacks), else None.
    Both histories are streamed: a long run is never held in memory."""
    missing = object()
    pairs = itertools.zip_longest(
        _today(iter_history(recorded)), _today(iter_history(replayed)), fillvalue=(None, missing)
    )
    answers = 0  # the manager's answers before this event, identical in both
    for (ia, a), (ib, b) in pairs:
        i = ia if ia is not None else ib  # its line in the recorded history (else the replayed)
        if a is missing or b is missing:
            there = b if a is missing else a
            return {
                "index": i,
                "step": there.get("step"),
                "event": there.get("e"),
                "detail": f"only the {'replayed' if a is missing else 'recorded'} history "
                f"has event {i}",
            }
        if stable_line(a) != stable_line(b):
            if _is_answer(a) or _is_answer(b):  # the manager answered otherwise, all else equal
                manager = "first answer" if answers == 0 else "answer"
            else:
                manager = None
            sa, sb = _stable(a), _stable(b)
            keys = sorted(
                k for k in sa.keys() | sb.keys() if sa.get(k, missing) != sb.get(k, missing)
            )
            return {
                "index": i,
                "step": a.get("step"),
                "event": a.get("e"),
                "keys": keys,
                "recorded": {k: sa.get(k) for k in keys},
                "replayed": {k: sb.get(k) for k in keys},
                "manager": manager,
            }
        answers += _is_answer(a)
    return None


def _is_answer(event: dict) -> bool:
    return event.get("e") in MANAGER_ANSWERS or (
        event.get("e") == "engine" and event.get("kind") == "refusal"
    )


def replay(
    run_dir: str | Path,
    device: str | None = None,
    timeout_s: float | None = None,
    overrides: dict | None = None,
    isolated: bool = True,
) -> dict:
    """Re-run RUN_DIR: {"identical", "recorded_digest", "replay_digest", "first_difference", ..}
    isolated: in a fresh worker with the fixed hash seed, as `kvchaos run` records runs."""
    from kvchaos.harness.run.door import (  # (loads torch: not for --help)
        DOOR_SCENARIO,
        door_run,
        validate_isolated,
    )
    from kvchaos.harness.run.isolate import run

    sc, _, results = load_run(run_dir)
    device = device or results["device"]
    setup = {
        **recorded_setup(run_dir, results),
        **{k: v for k, v in (overrides or {}).items() if v},
    }
    door = None  # a run of the check before any run: replayed by checking again
    if setup["block_manager_spec"]:  # bad input (exit 2) before anything runs
        try:
            (validate_isolated if isolated else validate_manager)(setup["block_manager_spec"])
        except SmokeFailure as failed:
            if sc.name != DOOR_SCENARIO:
                raise
            door = failed
    stored = Path(run_dir) / "history.jsonl"
    # the whole stored history is read before the re-run: damage is one line, not a wasted run
    recorded = history_digest(stored) if stored.exists() else results.get("history_digest")
    plots = os.environ.get("KVCHAOS_PLOTS")
    os.environ["KVCHAOS_PLOTS"] = "none"  # the replay's folder is thrown away: no figures for it
    try:
        with tempfile.TemporaryDirectory(prefix="kvchaos-replay-") as tmp:
            r = door_run(door, tmp, index=False) if door else run(
                sc, results["seed"], isolated=isolated, device=device, report_dir=tmp,
                timeout_s=timeout_s, **setup,
            )  # fmt: skip
            new = r.results["history_digest"]
            diff = (
                first_difference(stored, r.run_dir / "history.jsonl") if stored.exists() else None
            )
    finally:
        os.environ.pop("KVCHAOS_PLOTS") if plots is None else os.environ.__setitem__(
            "KVCHAOS_PLOTS", plots
        )
    return {
        "identical": recorded == new and diff is None,
        "recorded_digest": recorded,
        "replay_digest": new,
        "first_difference": diff,
        "history_compared": stored.exists(),
        "seed": results["seed"],
        "device": device,
        "scenario": sc.name,
        "recorded_verdict": results.get("verdict"),
        "replay_verdict": r.verdict,
        "replay_worker": r.results.get("worker"),  # how its worker ended, when it hung or died
        **setup,
    }


def describe(out: dict) -> str:
    head = f"{out['scenario']} seed {out['seed']} on {out['device']}"
    if out["identical"]:
        how = (
            "digest and every event"
            if out["history_compared"]
            else "digest only: no stored history.jsonl"
        )
        return (
            f"identical: {head}: history {out['replay_digest'][:16]} ({how}); "
            f"verdict {out['replay_verdict']}"
        )
    lines = [f"DIFFERENT: {head}"]
    if out["recorded_digest"] is None:
        lines.append(
            "  the recorded run has no history digest "
            f"(it was killed: verdict {out['recorded_verdict']}); "
            f"the replay finished with {out['replay_verdict']}"
        )
    else:
        lines.append(
            f"  history digest: recorded {out['recorded_digest'][:16]}, "
            f"replayed {out['replay_digest'][:16]}"
        )
    lines.append(f"  verdict: recorded {out['recorded_verdict']}, replayed {out['replay_verdict']}")
    d = out["first_difference"]
    if d is not None:
        lines.append(f"  first differing event: #{d['index']} ({d['event']} at step {d['step']})")
        if "detail" in d:
            lines.append(f"    {d['detail']}")
        if d.get("manager") == "first answer":
            lines.append(
                "  the block manager is nondeterministic: its first answer differs with everything "
                "before it identical (its own randomness, the order of a set, the clock, or "
                "state kept from an earlier run in its module)"
            )
        elif d.get("manager"):
            lines.append(
                "  the first difference is an answer of the block manager, everything before it "
                "identical: the block manager is likely nondeterministic"
            )
        for k in d.get("keys", []):
            lines.append(
                f"    {k}: recorded {_short(d['recorded'][k])} "
                f"-> replayed {_short(d['replayed'][k])}"
            )
    elif out["recorded_digest"] is not None and out["history_compared"]:
        lines.append(
            "  every stored event matches the replay: "
            "the recorded digest does not match its own history"
        )
    elif not out["history_compared"]:
        lines.append("  no stored history.jsonl: the first differing event cannot be named")
    return "\n".join(lines)


def _short(v, n: int = 160) -> str:
    s = json.dumps(v, default=str)
    return s if len(s) <= n else s[:n] + "..."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument(
        "run_dir",
        type=options.PATH,
        metavar="RUN_DIR",
        help="a run folder (holds results.json and scenario.toml/.json)",
    )
    options.add(p, "device", default_means="the recorded one", lead="replay there")
    options.add(p, "timeout", default_means=f"{options.DEFAULT_TIMEOUT_S:g}")
    options.add(
        p,
        "block_manager",
        default_means="the recorded one",
        lead="the block manager to replay under",
    )
    p.add_argument(
        "--tp-mode",
        choices=("simulated", "distributed"),
        default=None,
        help="replay with these ranks instead of the recorded ones",
    )
    p.add_argument(
        "--world-size",
        type=inputs.flag(inputs.world_size),
        default=None,
        help="ranks (with --tp-mode)",
    )
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="replay in this process (for a debugger) instead of a fresh worker with the fixed "
        "hash seed `kvchaos run` records runs with",
    )


def main(args) -> int:
    overrides = {
        "block_manager_spec": args.block_manager,
        "tp_mode": args.tp_mode,
        "world_size": args.world_size,
    }
    out = replay(args.run_dir, args.device, args.timeout, overrides, not args.in_process)
    print(json.dumps(out, indent=1, default=str) if args.json else describe(out))
    return 0 if out["identical"] else EXIT_DIFFERENT
