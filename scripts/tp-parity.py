#!/usr/bin/env python3
"""Distributed vs simulated ranks: every built-in scenario with more than one rank, run on the same
seeds in both modes through `kvchaos run --format json`; a table of the verdicts that agree and
those that do not. Long (a second or two a run): run by hand, not in CI (CI runs a few seeds:
tests/test_distributed.py).

    .venv/bin/python scripts/tp-parity.py --seeds 50 --report-dir /tmp/tp-parity

Exit status: 0 every verdict agrees, 1 some disagree.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from kvchaos.harness.scenario.spec import builtin_scenarios


def verdicts(name: str, seeds: int, mode: str, world: int, report_dir: Path) -> dict[int, dict]:
    cmd = [sys.executable, "-m", "kvchaos", "run", name, "--seeds", str(seeds), "--tp-mode", mode]
    cmd += ["--world-size", str(world), "--format", "json", "-q", "--report-dir", str(report_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if not out.stdout.strip():
        raise SystemExit(f"{' '.join(cmd)}: no JSON (exit {out.returncode}): {out.stderr[-2000:]}")
    return {r["seed"]: r for r in json.loads(out.stdout)["runs"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=50, help="seeds 0..N-1 (default 50)")
    ap.add_argument("--report-dir", type=Path, default=Path("/tmp/kvchaos-tp-parity"))
    args = ap.parse_args()
    multi = [(sc.name, sc.engine_config().tp_size) for sc in builtin_scenarios()]
    multi = [(n, w) for n, w in multi if w > 1 and "cow-lag" not in n]  # (simulated ranks only)
    head = f"{'scenario':24} {'ranks':>5} {'seeds':>5} {'agree':>5} {'differ':>6} {'summary≠':>8}"
    print(head + "  verdicts (distributed)")
    bad = 0
    for name, world in multi:
        got = {
            m: verdicts(name, args.seeds, m, world, args.report_dir / m)
            for m in ("distributed", "simulated")
        }
        real, sim = got["distributed"], got["simulated"]
        differ = [s for s in sim if real[s]["verdict"] != sim[s]["verdict"]]
        bad += len(differ)
        # the summary carries the evidence: checkers held, faults pulled and remediated, counts
        worded = sum(real[s]["summary"] != sim[s]["summary"] for s in sim)
        counts = Counter(r["verdict"] for r in real.values())
        row = f"{name:24} {world:5} {len(sim):5} {len(sim) - len(differ):5} {len(differ):6}"
        print(f"{row} {worded:8}  " + ", ".join(f"{v} {n}" for v, n in sorted(counts.items())))
        for s in [s for s in sim if real[s]["summary"] != sim[s]["summary"]]:
            print(f"  seed {s}: distributed {real[s]['verdict']} ({real[s]['summary']})")
            print(f"  seed {s}: simulated {sim[s]['verdict']} ({sim[s]['summary']})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
