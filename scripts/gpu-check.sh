#!/usr/bin/env bash
# The prepared GPU check, run from anywhere in a kvchaos checkout on a CUDA machine, with only the
# preinstalled torch, triton, pytest and nvidia-ml-py: no network, no pip install.
#
#   OUT=/path/for/summaries scripts/gpu-check.sh [gpu-check flags, e.g. --budget-s 450 --quick]
#
# Leaves gpu-check.json, gpu-check.md, gpu-check.log, gpu-tests.xml and bench-kernel.json in $OUT
# (run folders go to $WORK, default /tmp/kvchaos-gpu-check, so $OUT stays small).
# It is `kvchaos gpu-check`, run as `python3 -m kvchaos.harness.bench.gpu_check`: the kvchaos CLI
# imports every tool module, so one tool's missing dependency would stop the check before it starts.
#
# What each stage needs beyond torch + triton:
#   env, bench_kernel, staging   nothing
#   gpu_tests                    pytest (the staging-stall gpu tests also need pydantic; they skip without it)
#   scenarios                    pydantic; without it the stage says "not available" and the rest runs
#   soak                         pydantic, rich, psutil (else "not available"); jinja2 + matplotlib for its HTML reports
#   telemetry                    nvidia-ml-py for GPU fields, psutil for RSS/CPU (else /proc)
#   tables                       rich (plain text without it)
# Missing pydantic: on a machine with network, `pip install --target .deps --python-version 3.12
# --platform manylinux2014_x86_64 --only-binary=:all: pydantic`, then carry .deps: it goes on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# kvchaos need not be installed: a folder holding a link named kvchaos to this checkout is enough
PKGROOT="$(mktemp -d)"
ln -s "$PWD" "$PKGROOT/kvchaos"
export PYTHONPATH="$PKGROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .deps ]; then PYTHONPATH="$PYTHONPATH:$PWD/.deps"; fi
export PYTHONUNBUFFERED=1
exec "$PY" -m kvchaos.harness.bench.gpu_check --out "${OUT:-reports/gpu-check}" --work-dir "${WORK:-/tmp/kvchaos-gpu-check}" "$@"
