"""The reach table: for every variant of every fault, its clean scenarios run on a block manager,
and whether the trigger reached the manager path the variant breaks (results.json["exercised"],
the paths of harness/check/reach.py), with the run's verdict. A variant planted on a reference
manager's own seam says not applicable (its fault_verify's not_applicable) under another one.
Prints Markdown; nothing here is judged by time (a timing scenario's verdict is shown as it fell).

  .venv/bin/python scripts/reach-table.py [--seeds 1] [--block-manager vllm] [--out docs/x.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from kvchaos.faults import REGISTRY  # noqa: E402
from kvchaos.harness.check.reach import REACH, count, reached  # noqa: E402
from kvchaos.harness.scenario.managers import canonical_spec  # noqa: E402
from kvchaos.harness.scenario.spec import builtin_scenarios  # noqa: E402

HEADER = (
    "| variant | clean scenario | manager path (exercised) | reached | trigger pulled | verdict |",
    "|---|---|---|---|---|---|",
)


def variants() -> list[tuple[str, str]]:
    """(fault, variant) for every fault of the registry, in its own order."""
    out = []
    for name, cls in REGISTRY.items():
        out += [(name, v) for v in cls.variant_names() or ("-",)]
    return out


def clean_scenarios() -> dict[tuple[str, str], list]:
    """(fault, variant) -> the built-in clean scenarios that plant its trigger alone."""
    out: dict[tuple[str, str], list] = {}
    for sc in builtin_scenarios():
        if sc.expect.outcome != "clean" or len(sc.faults) != 1 or sc.faults[0].defect:
            continue
        f = sc.faults[0]
        cls = REGISTRY[f.name]
        v = f.params.get("variant", cls.defaults.get("variant", "-"))
        out.setdefault((f.name, v), []).append(sc)
    return out


def row(fault: str, variant: str, scenario: str, runs: list[dict]) -> str:
    """One table row from the runs' results.json (one per seed)."""
    label = f"{fault}/{variant}"
    paths = REACH.get(fault, {}).get(variant)
    verdicts = [r["verdict"] for r in runs]
    truth = [r.get("fault_verify", {}).get(fault, {}) for r in runs]
    na = next((t["not_applicable"] for t in truth if t.get("not_applicable")), None)
    pulled = "/".join(str(t.get("triggered", 0)) for t in truth)
    if paths is None:
        where, hit = "no reach declared", "?"
    elif not paths:
        where, hit = "none: an engine seam (the table upload's staging)", "n/a"
    else:
        counts = [[count(r.get("exercised", {}), p) for r in runs] for p in paths]
        where = ", ".join(
            f"{p} = {'/'.join('-' if c is None else str(c) for c in cs)}"
            for p, cs in zip(paths, counts)
        )
        ok = [reached(r.get("exercised", {}), paths) for r in runs]
        hit = f"{sum(ok)}/{len(ok)}" if len(ok) > 1 else ("yes" if ok[0] else "no")
        hit = hit if all(ok) else f"**{hit}**"
    if na:
        hit = "not applicable"
    verdict = _verdicts(verdicts)
    summary = next((r["summary"] for r in runs if r["verdict"] != "PASS"), "")
    if na:
        verdict += f": not applicable ({na})"
    elif summary:
        verdict += f": {summary}"
    cells = (label, scenario, where, hit, pulled, verdict)
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _verdicts(vs: list[str]) -> str:
    if len(vs) == 1:
        return vs[0]
    return ", ".join(f"{v} {vs.count(v)}/{len(vs)}" for v in sorted(set(vs)))


def table(rows: list[str]) -> str:
    return "\n".join((*HEADER, *rows)) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 of each (default 1)")
    ap.add_argument("--block-manager", help="MODULE:ATTR, or vllm / sglang (default: reference)")
    ap.add_argument("--out", help="also write the table to this file")
    ap.add_argument("--only", help="fault or fault/variant to run alone")
    a = ap.parse_args()
    from kvchaos.harness.run.runner import run_scenario

    spec = canonical_spec(a.block_manager)
    by_variant, rows = clean_scenarios(), []
    for fault, variant in variants():
        if a.only and a.only not in (fault, f"{fault}/{variant}"):
            continue
        scs = by_variant.get((fault, variant))
        if not scs:
            rows.append(f"| {fault}/{variant} | none | - | - | - | no clean scenario |")
            continue
        for sc in scs:
            runs = [
                run_scenario(sc, s, "cpu", None, block_manager_spec=spec).results
                for s in range(a.seeds)
            ]
            rows.append(row(fault, variant, sc.name, runs))
            print(rows[-1], file=sys.stderr, flush=True)
    text = table(rows)
    print(text, end="")
    if a.out:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
