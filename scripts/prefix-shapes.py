"""How often runs produce the shapes prefix-cache bugs need (harness/check/shapes.py): per shape,
the runs with at least one and the mean count per run, over N seeds of scenarios or of the soak's
draws that have a prefix cache. --manager runs them under a one-bug manager of tests/bug_managers
and counts the runs it FAILs (the bug caught).

  .venv/bin/python scripts/prefix-shapes.py --seeds 20 prefix-shared-clean prefix-shapes-clean
  .venv/bin/python scripts/prefix-shapes.py --soak 80 [--no-shapes]
  .venv/bin/python scripts/prefix-shapes.py --seeds 20 --manager StaleHashIndex prefix-shapes-clean
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvchaos.harness.check.shapes import prefix_shapes  # noqa: E402
from kvchaos.harness.run.runner import run_scenario  # noqa: E402
from kvchaos.harness.scenario.spec import load_scenario, parse_scenario  # noqa: E402
from kvchaos.harness.tools.soak_space import generate_scenario  # noqa: E402

KEYS = ("stale_index", "prefill_aborts", "refused_hits", "full_hits")


def soak_runs(n: int, shapes: bool):
    """The first n soak seeds whose draw has a prefix cache (without its shapes: --no-shapes)."""
    seed = 0
    while n > 0:
        data = generate_scenario(seed)
        if data["engine"]["cache"].get("prefix_caching"):
            if not shapes:
                data["workload"].pop("shapes", None)
            yield parse_scenario(data, f"<soak seed {seed}>"), seed
            n -= 1
        seed += 1


def seeds_of(sc, n: int):
    return ((sc, s) for s in range(n))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenarios", nargs="*")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--soak", type=int, default=0, help="N soak draws with a prefix cache")
    ap.add_argument("--no-shapes", action="store_true", help="soak draws without their shapes")
    ap.add_argument("--manager", help="a manager class of tests/bug_managers.py")
    a = ap.parse_args()
    manager = None
    if a.manager:
        import tests.bug_managers as bugs

        manager = getattr(bugs, a.manager)
    if a.soak:
        name = "soak draws" + (" (no shapes)" if a.no_shapes else "")
        groups = {name: soak_runs(a.soak, not a.no_shapes)}
    else:
        groups = {name: seeds_of(load_scenario(name), a.seeds) for name in a.scenarios}
    print(f"{'runs':<34} {'n':>3}  " + "  ".join(f"{k:>16}" for k in KEYS) + "  caught")
    for name, runs in groups.items():
        tally, n, caught = {k: [0, 0] for k in KEYS}, 0, 0
        for sc, seed in runs:
            cc = sc.engine_config().cache
            r = run_scenario(sc, seed, report_dir=None, block_manager=manager)
            counts = prefix_shapes(r.events, cc.block_size, cc.num_blocks)
            for k in KEYS:
                tally[k][0] += counts[k] > 0
                tally[k][1] += counts[k]
            n += 1
            caught += r.verdict == "FAIL"
        cells = "  ".join(f"{f'{w}/{n} ({t / max(n, 1):.1f})':>16}" for w, t in tally.values())
        print(f"{name:<34} {n:>3}  {cells}  {f'{caught}/{n}' if manager else '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
