"""How often call localization names the method that holds the bug: each one-bug manager of
tests/bug_managers.py (and, with --canaries, selftest's canaries) on clean built-in scenarios.

  .venv/bin/python scripts/localization-rate.py [--seeds 3] [--canaries]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvchaos.engine.prefix_manager import PrefixCachingManager  # noqa: E402
from kvchaos.harness.check.story import root_first  # noqa: E402
from kvchaos.harness.run.runner import run_scenario  # noqa: E402
from kvchaos.harness.scenario.spec import load_scenario  # noqa: E402
from tests.bug_managers import BUGGY  # noqa: E402

SCENARIOS = {
    False: ("baseline-clean", "fork-heavy-clean", "mixed-clean"),
    True: ("prefix-shared-clean", "prefix-multiturn-clean"),
}
CANARY_CALLS = {
    "allocate": ("admit", "append", "append_decode"),
    "append": ("append", "admit"),
    "copy-on-write": ("append", "append_decode"),
    "fork": ("fork",),
    "free": ("release",),
    "cancel": ("release",),
    "preempt": ("release",),
    "resize": ("resize_table",),
    "table upload": ("append_decode",),
    "row reuse": ("admit",),
    "admission": ("blocks_needed",),
    "snapshot": ("snapshot",),
    "prefix cache": ("admit",),
}


def first_named(results: dict):
    """The call named for the story's first root that has one (what the incident leads with)."""
    fs = root_first([f for c in results["checkers"] for f in c["findings"]])
    return next((f["call"] for f in fs if f.get("call")), None)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--canaries", action="store_true")
    args = p.parse_args()
    cases = [(m.__name__, m, calls) for m, calls in BUGGY.items()]
    if args.canaries:
        from kvchaos.harness.tools.canaries import CANARIES

        cases += [(c.name, c.manager, CANARY_CALLS[c.family]) for c in CANARIES]
    total_found = total_named = 0
    for name, manager, calls in cases:
        prefix = issubclass(manager, PrefixCachingManager)
        found = named = 0
        misses = []
        t = time.perf_counter()
        for sc_name in SCENARIOS[prefix]:
            sc = load_scenario(sc_name)
            for seed in range(args.seeds):
                r = run_scenario(sc, seed, "cpu", None, block_manager=manager)
                if r.verdict != "FAIL":
                    continue
                found += 1
                call = first_named(r.results)
                if call and call["call"] in calls:
                    named += 1
                else:
                    loc = (r.results.get("localization") or {}).get("lines", [])
                    misses.append(f"{sc_name}/{seed}: {call and call['call']} {loc[:1]}")
        total_found, total_named = total_found + found, total_named + named
        rate = f"{named}/{found}" if found else "-"
        print(
            f"{name:28} named the buggy call in {rate:6} runs that found it "
            f"({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
        for m in misses[:3]:
            print(f"    miss {m}")
    print(f"overall: {total_named}/{total_found} = {total_named / max(1, total_found):.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
