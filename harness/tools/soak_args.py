"""`kvchaos soak`'s arguments (the soak itself: soak.py)."""

from __future__ import annotations

import argparse
import os

from kvchaos.harness.scenario import inputs, options


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument(
        "--budget", help="how long to soak: 90s, 5m, 1h30m (wall-clock, for the whole fleet)"
    )
    options.add(p, "device", default="auto")
    options.add(p, "block_manager", default_means="the reference", lead="the block manager to soak")
    options.add(p, "check_timeout", default=options.DEFAULT_CHECK_TIMEOUT_S)
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="runs at once: local, N isolated runs on this machine (default 1); ray, N tasks in "
        "flight (default: the cluster's GPUs, or its CPUs)",
    )
    p.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help="local: runs on this machine; ray: each run a Ray task on a cluster (one GPU per "
        "task on GPU nodes, one CPU otherwise), results streamed back to one ledger and summary "
        "(pip install 'kvchaos[ray]')",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster to join (HOST:6379, or auto; default: $RAY_ADDRESS, else a Ray "
        "instance on this machine)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the ledger's latest soak (its seeds, shard and manager) for --budget "
        "more: no seed run twice, none skipped",
    )
    p.add_argument(
        "--summary",
        type=options.PATH,
        default=None,
        metavar="LEDGER",
        help="run nothing: the summary of every run in LEDGER (a merged fleet ledger: "
        "`kvchaos ledger merge`), written beside it as LEDGER.summary.md",
    )
    p.add_argument(
        "--shard",
        default="1/1",
        metavar="I/N",
        help="take every N-th seed, offset I-1 (default 1/1)",
    )
    options.add(p, "timeout", default=120.0, flag="--per-run-timeout")
    options.add(p, "report_dir", default=options.DEFAULT_REPORT_DIR, lead="the soak's folder")
    p.add_argument(
        "--seed-start",
        type=inputs.flag(inputs.seed),
        default=None,
        metavar="N",
        help="first seed (default: after the highest seed in the ledger)",
    )
    p.add_argument(
        "--ledger",
        type=options.PATH,
        default=None,
        metavar="PATH",
        help="SQLite seed ledger (default: REPORT_DIR/ledger.sqlite)",
    )
    p.add_argument(
        "--keep",
        default="20",
        metavar="N",
        help="passing runs whose folders are kept, a seeded sample over the soak (default 20; "
        "0: none; all: every one, within --max-disk); runs with findings are always kept",
    )
    p.add_argument(
        "--max-disk",
        default="500MB",
        metavar="SIZE",
        help="the most this soak may write, its folder and the ledger's growth: 500MB, 2GB, "
        "750MiB (default 500MB); past 80%% only findings are kept, then the soak stops (exit 15)",
    )
    p.add_argument(
        "--plots",
        choices=("none", "incidents", "all"),
        default=os.environ.get("KVCHAOS_PLOTS", "none"),
        help="plots in each run's report.html (default: none, or $KVCHAOS_PLOTS; "
        "`kvchaos analyze RUN_DIR` draws them later)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no live display, only the summary")
    # tests the hang kill; and bound a soak by its runs, so a busy machine runs the same ones
    p.add_argument("--inject-hang-every", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-runs", type=int, default=None, help=argparse.SUPPRESS)
