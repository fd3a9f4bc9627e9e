"""Which call into the manager made a finding true. Pure: the run's history (its call log) and,
where the history alone cannot tell, probes of a deterministic replay (the manager's snapshot
after each call of the steps around the finding: kvchaos.harness.run.explain).

Rules, by what the finding is:
- a call's own failure (an exception, a bad answer, a refusal that changed state): that call;
- a leak (blocks referenced with no holder, or held by a request that ended): the first release
  after which blocks the released sequence held stayed referenced with no other holder;
- any other wrong state (conservation, ref counts, a reserved block, a row): the first call after
  which the finding's checker, run on the probe, reports its kind where it did not before;
- a read of wrong KV: the hit that served it, or the call that handed its block to the writer
  while the reader held it, or the growth that should have copied a shared block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

from kvchaos.engine.boundary import TOKEN_ARG
from kvchaos.harness.check.checkers import CHECKERS

GROWTH = ("admit", "append", "append_decode", "fork")


@dataclass(kw_only=True)
class Probe:
    """The manager right after one call: the call as logged and its snapshot, as an event."""

    step: int
    index: int  # the call's place among its step's calls
    call: str
    args: list
    answer: Any
    snapshot: dict  # a full snapshot event (no cache delta)
    context: int  # how many history events came before the call
    before: dict | None = None  # the snapshot just before the call (releases only)


class Located(TypedDict):
    call: str
    args: list
    step: int
    index: int | None
    why: str


def shown(call: str, args: list) -> str:
    """A call as a maintainer would write it: release('r4', 'preempted'); a long list by its
    length (a token list as the call log shows it)."""
    at = TOKEN_ARG.get(call)
    parts = [
        repr(a)
        if not isinstance(a, list) or len(a) <= 8
        else f"<{len(a)} {'tokens' if i == at else 'items'}>"
        for i, a in enumerate(args)
    ]
    return f"{call}({', '.join(parts)})"


def describe(loc: Located) -> str:
    return f"{shown(loc['call'], loc['args'])} at step {loc['step']} {loc['why']}"


def _names(call: str, args: list, seq: str) -> bool:
    """Whether a logged call is about seq (append_decode's first argument lists its sequences)."""
    if not args:
        return False
    first = args[0]
    return (
        first == seq
        or (isinstance(first, list) and seq in first)
        or (call == "fork" and len(args) > 1 and args[1] == seq)
    )


def calls_of(events: list[dict], step: int) -> list[list]:
    return [c for e in events if e.get("e") == "calls" and e["step"] == step for c in e["calls"]]


def _last_call(events, step, seq, names) -> Located | None:
    calls = calls_of(events, step)
    for i in range(len(calls) - 1, -1, -1):
        name, args, _ = calls[i]
        if name in names and _names(name, args, seq):
            return Located(call=name, args=args, step=step, index=i, why="")
    return None


def direct(f: dict, events: list[dict]) -> Located | str | None:
    """A finding that names its call (or is no call's doing); None: it needs the probes."""
    checker, kind, ev, step = f["checker"], f.get("kind"), f.get("evidence") or {}, f["step"]
    if checker in ("latency", "liveness", "cross_rank", "admission"):
        return {
            "latency": "measured time, not a call's answer",
            "liveness": "the scheduling of requests, not one call",
            "cross_rank": "the ranks' tables, not a call into the manager",
            "admission": "the engine's own admission decision, no call into the manager",
        }[checker]
    if checker == "manager_calls":
        calls = calls_of(events, step)
        if kind == "bad_snapshot":
            return Located(call="snapshot", args=[], step=step, index=None, why=ev.get("problem"))
        if kind == "refusal_changed_state":
            for i in range(len(calls) - 1, -1, -1):
                name, args, out = calls[i]
                if name == ev.get("call") and _names(name, args, ev.get("seq")):
                    why = f"refused, yet changed the manager: {ev.get('changed')}"
                    return Located(call=name, args=args, step=step, index=i, why=why)
        name = str(ev.get("call", "")).split("(", 1)[0]
        for i in range(len(calls) - 1, -1, -1):  # the failing call is its step's last of its name
            if calls[i][0] == name:
                why = (
                    f"raised {ev.get('error')}: {ev.get('message')}"
                    if kind == "exception"
                    else (str(ev.get("message", kind)))
                )
                return Located(call=name, args=calls[i][1], step=step, index=i, why=why)
        return f"the call log has no {name or 'such'} call at step {step}"
    if checker == "block_accounting" and kind == "shared_write":
        loc = _last_call(events, step, ev.get("req"), ("append", "append_decode", "admit"))
        if loc:
            loc["why"] = (
                f"answered no copy of block {ev.get('block')}, shared by {ev.get('refs')} "
                f"sequences, before {ev.get('req')} wrote into it (a missed copy-on-write)"
            )
        return loc or f"no growth call of {ev.get('req')} at step {step}"
    if checker == "table_integrity" and kind in ("foreign_write", "unslotted_write"):
        loc = _last_call(events, step, ev.get("req"), GROWTH)
        if loc:
            loc["why"] = (
                f"left {ev.get('req')}'s slots pointing at blocks {ev.get('blocks', [])[:8]} it "
                "does not hold"
                if kind == "foreign_write"
                else f"reserved no slot for {ev.get('req')}'s position {ev['positions'][0]} "
                f"(it holds slots for {ev.get('slots_held')} tokens)"
            )
        return loc or f"no growth call of {ev.get('req')} at step {step}"
    if checker == "prefix_cache" and kind == "hit_blocks":
        loc = _last_call(events, step, ev.get("req"), ("admit",))
        if loc:
            loc["why"] = f"served block {ev.get('block')} as a hit: {f['message']}"
        return loc
    if checker in ("kv_reads", "oracle_divergence"):
        return _read(f, events)
    return None


def _read(f: dict, events: list[dict]) -> Located | str | None:
    """A wrong read: the request that read it, through a hit (its admit) or not (the probes)."""
    ev = f.get("evidence") or {}
    if f["checker"] == "oracle_divergence":
        read = _read_by(events, ev.get("req"))
        if read is None:
            return "no read of another request's KV recorded for it: see the structural findings"
        ev = {**read, "hit_step": _hit_step(events, read)}
    if ev.get("via_hit") and ev.get("hit_step") is not None:
        loc = _last_call(events, ev["hit_step"], ev["req"], ("admit",))
        if loc:
            by = f"written by {ev['writer']}" if ev.get("writer") else "never written"
            loc["why"] = f"served block {ev.get('block')} to {ev['req']} as a hit, its KV {by}"
            return loc
    return None  # the probes: who was handed the block


def _read_by(events: list[dict], req) -> dict | None:
    """The first read of KV not written for req's tokens (the writer record's event)."""
    return next((e for e in events if e.get("e") == "kv_read" and e["req"] == req), None)


def _hit_step(events: list[dict], read: dict) -> int | None:
    steps = [
        e["step"]
        for e in events
        if e.get("e") == "engine"
        and e.get("kind") == "hit"
        and e["data"]["req"] == read["req"]
        and e["step"] <= read["step"]
    ]
    return steps[-1] if steps else None


def leaked_blocks(f: dict, events: list[dict]) -> list[int] | None:
    """The blocks a leak finding is about (None: not a leak)."""
    ev, kind = f.get("evidence") or {}, f.get("kind")
    if kind == "refcount" and ev.get("orphans"):
        return ev["orphans"]
    if kind == "leak":
        return ev.get("blocks")
    if kind == "end_leak":
        last = [e for e in events if e.get("e") == "snapshot"]
        if not last:
            return None
        s = last[-1]
        live = set(s.get("live", []))
        held = {b for r, bs in s["seq_blocks"].items() if r in live for b in bs}
        return [b for b, r in enumerate(s["ref_counts"]) if r > 0 and b not in held]
    return None


def by_release(blocks: list[int], probes: list[Probe]) -> Located | None:
    """The first release after which blocks the released sequence held stay referenced with no
    holder (or still listed for it)."""
    want = set(blocks)
    for p in probes:
        if p.call != "release" or p.before is None:
            continue
        seq = p.args[0] if p.args else None
        had = set(p.before["seq_blocks"].get(seq, ())) & want
        if not had:
            continue
        after = p.snapshot
        holders = {b for r, bs in after["seq_blocks"].items() if r != seq for b in bs}
        left = sorted(b for b in had if after["ref_counts"][b] > 0 and b not in holders)
        if left:
            still = seq in after["seq_blocks"]
            refs = sorted({after["ref_counts"][b] for b in left})
            why = f"left blocks {left[:8]} with ref count {', '.join(map(str, refs))} and " + (
                f"still listed for {seq}" if still else "no holder"
            )
            return Located(call=p.call, args=p.args, step=p.step, index=p.index, why=why)
    return None


def _context(events: list[dict], n: int) -> list[dict]:
    skip = ("snapshot", "foreign_write", "snapshot_invalid")
    return [e for e in events[:n] if e.get("e") not in skip]


def _holds(f: dict, p: Probe, events: list[dict]) -> bool:
    res = CHECKERS[f["checker"]](_context(events, p.context) + [p.snapshot])
    return any(g.kind == f.get("kind") for g in res.findings)


def by_state(f: dict, probes: list[Probe], events: list[dict]) -> Located | str:
    """The first probe in the finding's window after which its kind holds, where it did not."""
    window = [p for p in probes if f["step"] - 1 <= p.step <= f["step"]]
    if not window:
        return f"no snapshot after a call at steps {f['step'] - 1}-{f['step']}"
    earlier = [p for p in probes if p.step < f["step"] - 1]
    was = _holds(f, earlier[-1], events) if earlier else False
    for p in window:
        now = _holds(f, p, events)
        if now and not was:
            return Located(
                call=p.call, args=p.args, step=p.step, index=p.index, why=f"left: {f['message']}"
            )
        was = now
    return f"it held already before step {f['step'] - 1}" if was else "it never held after a call"


def by_holder(f: dict, probes: list[Probe], events: list[dict]) -> Located | str:
    """A read of KV another request wrote: the call that put its block in the writer's list
    while the reader held it, else the writer's growth that should have copied it."""
    ev = f.get("evidence") or {}
    if f["checker"] == "oracle_divergence":
        ev = _read_by(events, ev.get("req")) or ev
    b, reader, writer, ws = ev.get("block"), ev.get("req"), ev.get("writer"), ev.get("writer_step")
    if b is None or writer is None or ws is None:
        return "the read names no writer: its block was never written"
    seen = [p for p in probes if p.step <= ws]
    for p in reversed(seen):
        held = p.snapshot["seq_blocks"]
        if b in held.get(writer, ()) and b in held.get(reader, ()):
            prev = seen[seen.index(p) - 1] if seen.index(p) else None
            fresh = prev is None or b not in prev.snapshot["seq_blocks"].get(writer, ())
            if fresh and p.snapshot["ref_counts"][b] < 2:
                why = f"handed block {b}, held by {reader}, to {writer} (ref count 1)"
                return Located(call=p.call, args=p.args, step=p.step, index=p.index, why=why)
            break
    loc = _last_call(events, ws, writer, ("append", "append_decode", "admit"))
    if loc is None:
        return f"no growth call of {writer} at step {ws}"
    loc["why"] = f"let {writer} write into block {b}, which {reader} reads, without a copy"
    return loc


def localize(f: dict, events: list[dict], probes: list[Probe] | None) -> Located | str:
    """The call that made finding f true, or why none is named. probes None: not replayed."""
    got = direct(f, events)
    if got is not None and (not isinstance(got, str) or f["checker"] != "oracle_divergence"):
        return got
    if probes is None:
        return "not replayed"
    leaked = leaked_blocks(f, events)
    if leaked:
        return by_release(leaked, probes) or (
            f"no release left blocks {leaked[:8]} referenced: the engine never released them"
        )
    if f["checker"] in ("kv_reads", "oracle_divergence"):
        return by_holder(f, probes, events)
    if f["checker"] in CHECKERS:
        return by_state(f, probes, events)
    return f"no rule for {f['checker']}"


def carry_calls(old: list[dict], new: list[dict]) -> None:
    """Re-checked findings (kvchaos analyze) keep the calls a replay named for the same ones."""
    named = {
        (c["checker"], f.get("kind"), f["step"], f["message"]): f["call"]
        for c in old
        for f in c.get("findings", [])
        if f.get("call")
    }
    for c in new:
        for f in c["findings"]:
            call = named.get((c["checker"], f.get("kind"), f["step"], f["message"]))
            if call:
                f["call"] = call
