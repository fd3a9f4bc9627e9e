#!/usr/bin/env bash
# The latency checker beside a CPU hog (one busy process, as another job on a shared machine):
# staging-stall-detect on DETECT seeds must be caught every time, staging-stall-clean on CLEAN seeds
# must hold every time. Long: run by hand, not in CI (CI judges hand-made histories of such runs:
# tests/test_latency.py; and runs the scenarios quietly, in .ci/run's timing step).
#
#   scripts/latency-under-load.sh [kvchaos run flags, e.g. --tp-mode distributed --world-size 2]
#
# DETECT (default 20) and CLEAN (default 50) set the seed counts, OUT (default
# /tmp/kvchaos-latency-under-load) the report folder. Exit status: 0 when every run is PASS.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT="${OUT:-/tmp/kvchaos-latency-under-load}"
mkdir -p "$OUT"
"$PY" -c "while True: pass" &
HOG=$!
trap 'kill "$HOG" 2>/dev/null || true' EXIT
status=0
for pair in "staging-stall-detect:${DETECT:-20}" "staging-stall-clean:${CLEAN:-50}"; do
  name="${pair%%:*}" seeds="${pair##*:}"
  "$PY" -m kvchaos run "$name" --seeds "$seeds" "$@" --report-dir "$OUT" --format json -q \
    >"$OUT/$name.json" || status=1
  "$PY" - "$OUT/$name.json" <<'EOF'
import collections, json, re, sys
d = json.load(open(sys.argv[1]))
runs = d["runs"]
counts = collections.Counter(r["verdict"] for r in runs)
ttd = [int(m.group(1)) for r in runs if (m := re.search(r"staging_stall (\d+) steps", r["summary"]))]
name = runs[0]["scenario"]
others = ", ".join(f"{v} {n}" for v, n in counts.items() if v != "PASS")
line = f"{name}: PASS {counts['PASS']}/{len(runs)}" + (f" ({others})" if others else "")
if ttd:
    line += f"; time to detect (steps) min {min(ttd)} max {max(ttd)}"
print(line)
for r in runs:
    if r["verdict"] != "PASS":
        print(f"  seed {r['seed']}: {r['verdict']}: {r['summary']}  ({r['run_dir']})")
EOF
done
exit $status
