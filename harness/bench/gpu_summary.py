"""The GPU check's summaries: gpu-check.json and gpu-check.md, the Markdown rendered from the
report."""

from __future__ import annotations

import json
from pathlib import Path

from kvchaos.harness.bench.gpu_stages import OK, PACKAGES


def write_summaries(report: dict, out: Path) -> None:
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu-check.md").write_text(markdown(report))


def markdown(r: dict) -> str:
    st = r["stages"]
    env = st.get("env", {}).get("details", {})
    lines = [
        f"# kvchaos gpu-check: {r.get('result', 'RUNNING')}",
        "",
        f"{env.get('gpu', r['device'])}, torch {env.get('torch', '?')}, "
        f"triton {env.get('triton', '?')}, "
        f"driver {env.get('driver', '?')}; commit {r['commit']}; started {r['started']}; "
        f"budget {r['budget_s']} s, took {r.get('wall_s', '-')} s",
        "",
        "| stage | status | s | summary |",
        "|---|---|---|---|",
    ]
    for n, s in st.items():
        summary = str(s.get("summary", "")).replace("|", "/")
        lines.append(f"| {n} | {s['status']} | {s.get('wall_s', '-')} | {summary} |")
    b = st.get("bench_kernel", {}).get("details")
    if b and "timings" in b:
        lines += _kernel(b)
    runs = st.get("scenarios", {}).get("details", {}).get("runs")
    if runs:
        lines += _scenarios(runs)
    sg = st.get("staging", {}).get("details", {})
    if sg.get("applicable"):
        lines += _staging(sg)
    gt = st.get("gpu_tests", {}).get("details", {})
    if gt.get("failed") or gt.get("collection_errors"):
        lines += (
            ["", "## GPU test failures", ""]
            + [f"- `{f['test']}`: {f['message']}" for f in gt["failed"]]
            + [
                f"- could not collect `{f['test']}`: {f['message']}"
                for f in gt["collection_errors"]
            ]
        )
    soak = st.get("soak", {}).get("details", {})
    if soak.get("summary_md"):
        lines += ["", "## Soak", "", soak["summary_md"]]
    missing = {
        p: need for p, need in PACKAGES.items() if env.get("packages", {}).get(p, "?") is None
    }
    if missing:
        lines += ["", "## Missing packages", ""] + [
            f"- {p}: needed by {need}" for p, need in missing.items()
        ]
    not_ok = [n for n, s in st.items() if s["status"] != OK]
    if not_ok:
        lines += ["", "## Not measured in this run", ""] + [
            f"- {n}: {st[n]['status']}: {st[n].get('summary', '')}" for n in not_ok
        ]
    return "\n".join(lines) + "\n"


def _kernel(b: dict) -> list[str]:
    """The kernel benchmark: timings against the copy bandwidth, targets, correctness."""
    sh = b["shape"]
    lines = [
        "",
        f"## Kernel benchmark ({b['device']}, {b['mode']})",
        "",
        f"batch {sh['batch']} x {sh['ctx']} tokens, "
        f"{sh['num_heads']} heads over {sh['num_kv_heads']} KV "
        f"heads, head_dim {sh['head_dim']}, block {sh['block_size']}, {sh['dtype']}; "
        f"KV {b['kv_bytes'] / 2**20:.0f} MiB; "
        f"median of {b['runs']} runs, "
        f"L2 flushed ({b['l2_flush_bytes'] / 2**20:.0f} MiB) before each",
        "",
        "| variant | median ms | GB/s | of copy bandwidth |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {k} | {v['median_ms']:.4g} | {v['gbps']} | {v['gbps'] / b['copy']['gbps']:.0%} |"
        for k, v in b["timings"].items()
    ]
    c = b["copy"]
    lines += [
        f"| device-to-device copy (read + write) | {c['median_ms']:.4g} | {c['gbps']} | 100% |",
        "",
        "| target | measured | wanted | met |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {t['name']} | {t['measured']} | {t['target']} | "
        f"{'-' if t['met'] is None else 'yes' if t['met'] else '**no**'}"
        f"{' (' + t['note'] + ')' if t['note'] else ''} |"
        for t in b["targets"]
    ]
    c = b["correctness"]
    lines += [
        "",
        f"Output vs SDPA: max abs err {c['paged_vs_sdpa_max_abs_err']:.3g} (paged), "
        f"{c['identity_vs_sdpa_max_abs_err']:.3g} (identity), tolerance {c['tol']}. "
        f"num_splits auto {b['num_splits_auto']}; "
        f"sweep (median ms by num_splits): {b['splits_sweep_median_ms']}",
    ]
    return lines


def _scenarios(runs: list[dict]) -> list[str]:
    """Scenario verdicts by dtype, with the oracle's max error, and the telemetry they carried."""
    dts = list(dict.fromkeys(x["dtype"] for x in runs))
    lines = [
        "",
        "## Scenarios vs the oracle",
        "",
        "| scenario | " + " | ".join(dts) + " |",
        "|---" * (len(dts) + 1) + "|",
    ]
    by = {}
    for x in runs:
        err = x.get("oracle_max_abs_err")
        cell = x["verdict"] + (f" (err {err:.2g})" if err is not None else "")
        by.setdefault(x["scenario"], {})[x["dtype"]] = cell
    lines += [f"| {s} | " + " | ".join(v.get(d, "-") for d in dts) + " |" for s, v in by.items()]
    tel = [x for x in runs if x.get("telemetry_samples")]
    if tel:
        samples = sum(x["telemetry_samples"] for x in tel)
        lines += [
            "",
            f"Telemetry: {samples} samples in {len(tel)} runs; "
            f"GPU fields present: {all(x['telemetry_gpu'] for x in tel)}; peak GPU memory used "
            f"{max((x['peak_gpu_mem_mb'] or 0) for x in tel):.0f} MiB",
        ]
    return lines


def _staging(sg: dict) -> list[str]:
    """Per-step latency with pinned vs pageable table staging, per table size."""
    lines = [
        "",
        "## Table staging: pinned vs pageable (per-step engine latency, median)",
        "",
        "| table | pinned us | pageable us | difference "
        "| bare upload host-blocked (pinned / pageable) us |",
        "|---|---|---|---|---|",
    ]
    for k, t in sg["tables"].items():
        up = t["upload"]
        lines.append(
            f"| {k} ({t['table_bytes'] / 1024:.0f} KiB) | {t['pinned']['median_us']} | "
            f"{t['pageable']['median_us']} | "
            f"{t['pageable_minus_pinned_us']:+} us (x{t['pageable_over_pinned']}) | "
            f"{up['pinned']['host_blocked_us']} / {up['pageable']['host_blocked_us']} |"
        )
    return lines
