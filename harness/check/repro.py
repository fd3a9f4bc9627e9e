"""A call-level reproducer: the calls a run made into its manager, as a plain pytest file that
builds the manager, makes them and ends in the assertion that fails. Pure: calls and snapshots
in, Python source out (kvchaos.harness.tools.shrink_calls replays and shortens the calls).

An invariant is Python source over a snapshot `s` (and RELEASED, the sequences released and not
started again): the very lines the file holds are the ones judged here, so what the file asserts
is what was found to fail."""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

READS = ("block_ids", "blocks_needed")  # calls whose answers no reproducer needs
MAX_CALLS = 200  # a longer reproducer is not written: the scenario test stands
WIDTH = 100


@dataclass(kw_only=True)
class Call:
    """One logged call into the manager: its step in the run, name, arguments and answer."""

    step: int
    name: str
    args: list
    answer: Any

    @property
    def outcome(self) -> Literal["answered", "refused", "raised"]:
        a = self.answer
        if isinstance(a, dict) and len(a) == 1 and next(iter(a)) in ("refused", "raised"):
            return next(iter(a))
        return "answered"

    def raised_type(self) -> str | None:
        return self.answer["raised"].split(":", 1)[0] if self.outcome == "raised" else None


@dataclass(kw_only=True, frozen=True)
class Invariant:
    says: str
    lines: tuple[str, ...]  # statements over `s`, the last an assert


INVARIANTS = {
    "refs_match_holders": Invariant(
        says="every block's ref count is the number of sequences holding it",
        lines=(
            "held = Counter(b for blocks in s.seq_blocks.values() for b in blocks)",
            "wrong = [b for b in range(s.num_blocks) if s.ref_counts[b] != held[b]]",
            "refs = [(b, s.ref_counts[b], held[b]) for b in wrong[:8]]",
            'assert not wrong, f"(block, ref count, holders) that differ: {refs}"',
        ),
    ),
    "conservation": Invariant(
        says="free + referenced == num_blocks (reserved ids apart)",
        lines=(
            "reserved = set(s.reserved or ())",
            "free = len(set(s.free) - reserved)",
            "used = sum(1 for b, r in enumerate(s.ref_counts) if r > 0 and b not in reserved)",
            "usable = s.num_blocks - len(reserved)",
            'assert free + used == usable, f"{free} free + {used} referenced != {usable} blocks"',
        ),
    ),
    "no_free_referenced": Invariant(
        says="no free block is referenced",
        lines=(
            "wrong = [b for b in s.free if s.ref_counts[b] > 0]",
            'assert not wrong, f"free blocks with a ref count: {wrong[:8]}"',
        ),
    ),
    "released_hold_nothing": Invariant(
        says="a released sequence holds nothing",
        lines=(
            "wrong = [q for q in RELEASED if s.seq_blocks.get(q)]",
            'assert not wrong, f"released, yet holding blocks: {wrong[:8]}"',
        ),
    ),
    "table_rows": Invariant(
        says="each table row is its sequence's blocks, then -1 (a free row all -1)",
        lines=(
            "w = s.table_width or 1",
            "row_of = {r: q for q, r in (s.seq_rows or {}).items()}",
            "rows = range(len(s.table or ()) // w)",
            "want = [(s.seq_blocks.get(row_of.get(r), []) + [-1] * w)[:w] for r in rows]",
            "wrong = [r for r in rows if s.table[r * w : (r + 1) * w] != want[r]]",
            'assert not wrong, f"table rows not as their sequences hold: {wrong[:8]}"',
        ),
    ),
}
# The invariants judged first for a finding, by checker (the rest follow, in INVARIANTS' order)
PREFER = {
    "block_accounting": ("refs_match_holders", "conservation", "no_free_referenced"),
    "table_integrity": ("table_rows", "released_hold_nothing"),
}


def holds(name: str, snap, released: list[str]) -> bool:
    """Whether invariant `name` holds on snapshot `snap`: its own lines, run."""
    scope = {"Counter": Counter, "s": snap, "RELEASED": released}  # one scope, as a function's
    try:
        exec("\n".join(INVARIANTS[name].lines), scope)
    except AssertionError:
        return False
    return True


def order(checker: str) -> list[str]:
    first = list(PREFER.get(checker, ()))
    return first + [n for n in INVARIANTS if n not in first]


def released(calls: list[Call]) -> list[str]:
    """The sequences released (and answered) and not started again after."""
    out: dict[str, None] = {}
    for c in calls:
        if c.outcome != "answered" or not c.args:
            continue
        if c.name == "release":
            out[c.args[0]] = None
        elif c.name == "admit":
            out.pop(c.args[0], None)
        elif c.name == "fork" and len(c.args) > 1:
            out.pop(c.args[1], None)
    return list(out)


# -- the source ---------------------------------------------------------------------------------
_KW = re.compile(r"^([a-z_]+)=(-?\d+)$")


def call_args(c: Call) -> tuple[list, dict]:
    """(positional, keyword) arguments as the call was made (the log shows keywords "k=v")."""
    pos, kw = [], {}
    for a in c.args:
        m = _KW.match(a) if isinstance(a, str) and c.name == "resize_table" else None
        if m:
            kw[m[1]] = int(m[2])
        else:
            pos.append(a)
    return pos, kw


def call_source(c: Call, indent: int, assign: str = "") -> list[str]:
    """`m.name(args)` at this indent, wrapped to WIDTH (a long token list over lines)."""
    pos, kw = call_args(c)
    parts = [repr(a) for a in pos] + [f"{k}={v!r}" for k, v in kw.items()]
    head = f"{' ' * indent}{assign}m.{c.name}("
    one = f"{head}{', '.join(parts)})"
    if len(one) <= WIDTH:
        return [one]
    pad = " " * (indent + 4)
    out = [head]
    for p in parts:
        if len(pad) + len(p) + 1 <= WIDTH or not p.startswith("["):
            out.append(f"{pad}{p},")
            continue
        body = textwrap.wrap(p[1:-1], WIDTH - len(pad) - 2, break_on_hyphens=False)
        out += [f"{pad}[{body[0]}"] + [f"{pad} {line}" for line in body[1:]]
        out[-1] += "],"
    return out + [f"{' ' * indent})"]


def manager_import(spec: str, folder: str | None) -> list[str]:
    """The lines that bring the manager in as `Manager` (its folder first on sys.path)."""
    mod, _, attr = spec.partition(":")
    head, *rest = attr.split(".")
    lines = [f"sys.path.insert(0, {folder!r})  # where {mod} was imported from"] if folder else []
    line = f"from {mod} import {head}" + (" as Manager" if not rest else "")
    lines.append(line + ("  # noqa: E402" if folder else ""))
    if rest:
        lines.append(f"Manager = {attr}")
    return lines


@dataclass(kw_only=True)
class Ending:
    """How the reproducer ends: the last call raising (or answering what the protocol does not
    allow: BadAnswer), an invariant failing after it, or a refused last call changing the
    snapshot."""

    kind: Literal["raises", "invariant", "refusal_changes"]
    invariant: str | None = None
    finding: str  # "checker/kind in the run: the call its localization names, and why"


def source(
    *,
    spec: str,
    folder: str | None,
    dims: tuple[int, int, int, int],
    calls: list[Call],
    ending: Ending,
    test_name: str,
    header: str,
) -> str:
    """The pytest file: build the manager, make the calls, end as `ending` says."""
    *body, last = calls
    refusals = any(c.outcome == "refused" for c in calls)
    lines = [f'"""{header}"""', "", "import sys"]
    if ending.kind == "invariant":
        lines.append("from collections import Counter")
    lines.append("")
    if refusals:
        lines += ["import pytest", ""]
    if ending.kind == "raises" and last.raised_type() == "BadAnswer":
        lines.append("from kvchaos.engine.boundary import check_answer")
    if refusals:  # a refusal_changes ending is one too
        lines.append("from kvchaos.engine.errors import OutOfBlocks")
    lines += manager_import(spec, folder)
    lines += ["", "", f"def {test_name}():", f"    m = Manager{dims}"]
    step = None
    for c in body:
        if c.step != step:
            step = c.step
            lines.append(f"    # step {step}")
        lines += _made(c)
    if last.step != step:
        lines.append(f"    # step {last.step}")
    lines += textwrap.wrap(
        ending.finding, WIDTH, initial_indent="    # ", subsequent_indent="    #   "
    )
    if ending.kind == "raises" and last.raised_type() == "BadAnswer":  # it returned: judge it
        pos, _ = call_args(last)
        lines += call_source(last, 4, "got = ")
        lines.append(f"    # in the run: {last.answer['raised'][: WIDTH - 20]}")
        lines.append(f"    check_answer({last.name!r}, got, {tuple(pos)!r}, m.num_blocks)")
        return "\n".join(lines) + "\n"
    if ending.kind == "raises":
        lines.append(f"    # in the run this call raised {last.answer['raised'][: WIDTH - 40]}")
        lines += call_source(last, 4)
        return "\n".join(lines) + "\n"
    if ending.kind == "refusal_changes":
        lines.append("    before = m.snapshot().to_dict()")
        lines += _made(last)
        lines.append(
            '    assert m.snapshot().to_dict() == before, "refused, yet changed the manager"'
        )
        return "\n".join(lines) + "\n"
    lines += _made(last)
    inv = INVARIANTS[ending.invariant]
    lines.append("    s = m.snapshot()")
    if "RELEASED" in "".join(inv.lines):
        lines.append(f"    RELEASED = {released(calls)!r}")
    lines.append(f"    # the invariant: {inv.says}")
    lines += [f"    {line}" for line in inv.lines]
    return "\n".join(lines) + "\n"


def _made(c: Call) -> list[str]:
    if c.outcome != "refused":
        return call_source(c, 4)
    return ["    with pytest.raises(OutOfBlocks):  # refused in the run", *call_source(c, 8)]
