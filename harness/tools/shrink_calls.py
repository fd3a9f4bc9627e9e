"""The call-level reproducer of a shrunk run (kvchaos shrink): the minimal scenario re-run in this
process with every call into the manager logged whole, the calls up to the one the localization
names for the primary finding (the failing call, for an exception), replayed against a fresh
manager and shortened to those that matter, written as minimal/test_<name>_calls.py: the manager
built, the calls made, the assertion that fails (kvchaos.harness.check.repro)."""

from __future__ import annotations

import copy
import sys
import textwrap
from pathlib import Path

from kvchaos.engine.boundary import BadAnswer, check_answer
from kvchaos.engine.errors import OutOfBlocks
from kvchaos.harness.check.localize import describe
from kvchaos.harness.check.repro import (
    MAX_CALLS,
    READS,
    Call,
    Ending,
    call_args,
    holds,
    order,
    released,
    source,
)
from kvchaos.harness.check.verdict import FAIL
from kvchaos.harness.scenario.managers import canonical_spec

MAX_REPLAYS = 3000  # replays the shortening may make (a count: the same run, the same file)


def made(m, c: Call):
    """Make call c on m as it was made; (answer, the exception it raised or None)."""
    pos, kw = call_args(c)
    try:
        return getattr(m, c.name)(*copy.deepcopy(pos), **kw), None
    except Exception as e:  # the manager's, judged by the caller
        return None, e


def as_logged(m, c: Call) -> bool:
    out, err = made(m, c)
    if c.outcome == "refused":
        return isinstance(err, OutOfBlocks)
    return err is None


def goes_as_logged(factory, dims, calls: list[Call], ending: Ending) -> bool:
    """Whether the calls, made on a fresh manager, go as the run logged them and end as `ending`
    says: the last call raising as it did, or the invariant holding before it and failing
    after (refusal_changes: a refused last call changing the snapshot)."""
    try:
        m = factory(*dims)
        *body, last = calls
        if not all(as_logged(m, c) for c in body):
            return False
        if ending.kind == "raises":
            out, err = made(m, last)
            if last.raised_type() != "BadAnswer":
                return err is not None and type(err).__name__ == last.raised_type()
            try:
                check_answer(last.name, out, tuple(call_args(last)[0]), m.num_blocks)
            except BadAnswer:
                return err is None
            return False
        before = m.snapshot()
        held = released(body)
        if ending.kind == "refusal_changes":
            before = before.to_dict()
            return as_logged(m, last) and m.snapshot().to_dict() != before
        if not holds(ending.invariant, before, held) or not as_logged(m, last):
            return False
        return not holds(ending.invariant, m.snapshot(), released(calls))
    except Exception:  # a snapshot that raised, a factory that failed: not this sequence
        return False


def ending_of(factory, dims, calls: list[Call], finding: dict, text: str) -> Ending | None:
    """How the reproducer ends: the last call's failure, else the first invariant (the finding's
    checker's first) that it breaks."""
    last = calls[-1]
    if last.outcome == "raised":
        e = Ending(kind="raises", finding=text)
        return e if goes_as_logged(factory, dims, calls, e) else None
    for name in order(finding["checker"]):
        e = Ending(kind="invariant", invariant=name, finding=text)
        if goes_as_logged(factory, dims, calls, e):
            return e
    e = Ending(kind="refusal_changes", finding=text)
    if last.outcome == "refused" and goes_as_logged(factory, dims, calls, e):
        return e
    return None


def shorten(keeps, calls: list[Call], budget: int = MAX_REPLAYS) -> tuple[list[Call], int]:
    """Drop the calls that do not matter: the reads at once, then chunks, halving, then one at a
    time until none can go (the last call always stays). keeps(calls): still valid and still
    failing. (calls, replays made)."""
    *body, last = calls
    runs = 1
    no_reads = [c for c in body if c.name not in READS]
    if len(no_reads) < len(body) and keeps(no_reads + [last]):
        body = no_reads
    size = max(1, len(body) // 2)
    while body and runs < budget:
        changed, i = False, 0
        while i < len(body) and runs < budget:
            cand = body[:i] + body[i + size :]
            runs += 1
            if keeps(cand + [last]):
                body, changed = cand, True
            else:
                i += size
        if size == 1 and not changed:
            break
        size = max(1, size // 2)
    return body + [last], runs


def logged_calls(events: list[dict], step: int, index: int) -> list[Call] | None:
    """The calls of the run through the index-th call of `step` (None: the log has no such)."""
    out, seen = [], {}
    for e in events:
        if e.get("e") != "calls":
            continue
        for name, args, answer in e["calls"]:
            i = seen.get(e["step"], 0)
            seen[e["step"]] = i + 1
            out.append(Call(step=e["step"], name=name, args=args, answer=answer))
            if (e["step"], i) == (step, index):
                return out
    return None


def primary_finding(results: dict, faults: list[dict]) -> dict | None:
    """The earliest finding of the run's primary fingerprint's checker and kind."""
    from kvchaos.harness.tools.fingerprint import fingerprints

    fps = fingerprints(results, faults)
    if not fps:
        return None
    _, _, checker, kind = fps[0]["fp"]
    found = [
        f
        for c in results.get("checkers", [])
        for f in c.get("findings", [])
        if f["checker"] == checker and (f.get("kind") or "-") == kind
    ]
    return min(found, key=lambda f: f["step"]) if found else None


def manager_folder(module: str) -> str | None:
    """The folder a manager's module is imported from (None: kvchaos's own)."""
    mod = sys.modules.get(module)
    file = getattr(mod, "__file__", None)
    if module.split(".")[0] == "kvchaos" or not file:
        return None
    path = Path(file).resolve()
    up = module.count(".") + (path.name == "__init__.py")
    return str(path.parents[up])


def reproduce(
    data: dict, seed: int, device: str, setup: dict, results: dict, run_dir: Path, minimal: dict
) -> dict:
    """Write the reproducer of the minimal scenario `data` (its run's results) beside its
    scenario test (minimal["test_path"]), as <its name>_calls.py. {"calls_test_path", "calls",
    "calls_logged"}, or {"calls_note": why there is none}."""
    from kvchaos.harness.run.explain import probe_run
    from kvchaos.harness.run.runner import start_event
    from kvchaos.harness.run.user_code import load_object
    from kvchaos.harness.scenario.spec import parse_scenario

    sc, beside = parse_scenario(data, "<shrink>"), Path(minimal["test_path"])

    if results.get("verdict") != FAIL:
        return {"calls_note": f"{results.get('verdict')}: not a bug in the manager"}
    if setup.get("tp_mode") == "distributed":
        return {"calls_note": "a run on real ranks is not replayed call by call"}
    f = primary_finding(results, data.get("faults", []))
    loc = (f or {}).get("call")
    if not loc or loc.get("index") is None:
        what = f"{f['checker']}/{f.get('kind')}" if f else "the primary finding"
        return {"calls_note": f"no call named for {what}"}
    spec = canonical_spec(setup.get("block_manager_spec") or results["block_manager"])
    factory = load_object(spec)
    manager = factory if setup.get("block_manager_spec") else None
    ws = setup.get("world_size")
    tp = {"tp_mode": "simulated", "tp_size": ws} if ws else {}
    events, _ = probe_run(
        sc, seed, device, manager, tp,
        lambda run: start_event(run, sc, seed, device, setup.get("block_manager_spec")),
        set(), loc["step"],
    )  # fmt: skip
    calls = logged_calls(events, loc["step"], loc["index"])
    if calls is None:
        return {"calls_note": f"the re-run logged no call {loc['index']} at step {loc['step']}"}
    cc = sc.engine_config().cache
    dims = (cc.num_blocks, cc.block_size, cc.max_num_seqs, cc.max_blocks_per_seq)
    text = f"{f['checker']}/{f.get('kind')} in the run: {describe(loc)}"
    ending = ending_of(factory, dims, calls, f, text)
    if ending is None:
        return {
            "calls_note": f"replayed on a fresh {spec.rpartition(':')[2]}, the calls through "
            f"{describe(loc)} fail no manager-state invariant: not the manager's state alone"
        }
    kept, _ = shorten(lambda cs: goes_as_logged(factory, dims, cs, ending), calls)
    if len(kept) > MAX_CALLS:
        return {"calls_note": f"{len(kept)} calls still matter, over the cap of {MAX_CALLS}"}
    header = "\n".join(
        textwrap.wrap(
            f"Call-level reproducer from `kvchaos shrink {run_dir}`: the calls the minimal "
            f"scenario beside (scenario.toml, seed {seed}) made into {spec}, {len(kept)} of the "
            f"{len(calls)} through the one its finding names (removing any other changes how "
            "it ends). It fails on the manager as it is and passes once the manager is fixed.",
            96,
        )
    )
    path = beside.with_name(f"{beside.stem}_calls.py")
    mod = spec.partition(":")[0]
    path.write_text(
        source(
            spec=spec, folder=manager_folder(mod), dims=dims, calls=kept, ending=ending,
            test_name=f"{beside.stem}_calls", header=header,
        ),
        encoding="utf-8",
    )  # fmt: skip
    return {"calls_test_path": str(path), "calls": len(kept), "calls_logged": len(calls)}
