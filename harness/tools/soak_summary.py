"""How a soak shows itself at its end (and, rewritten, as it goes): the soak.json dict built from
the soak, and soak-summary.md / .html rendered from that dict (the HTML self-contained: its plot
is a data: PNG; its links to the kept runs' reports are relative)."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from kvchaos.harness.check.verdict import (
    ERROR,
    EXIT_CODES,
    FAIL,
    INCONCLUSIVE,
    MEANING,
    MISSED,
    PASS,
)
from kvchaos.harness.tools.fingerprint import fp_text
from kvchaos.harness.tools.ledger import size_text

NONDETERMINISM = "NONDETERMINISM"  # the label of a replay whose history digest differed
EXIT_NONDETERMINISM = 14
EXIT_DISK_CAP = 15
TIMELINE = (PASS, INCONCLUSIVE, ERROR, FAIL, MISSED)  # a run's code in the compact timeline
VERDICT_CODE = {v: i for i, v in enumerate(TIMELINE)}
TIMELINE_BINS = 120
KEPT_ROWS = 500  # the summary lists this many kept runs; runs/index.html has them all
WHY = {"finding": "finding", "cited": "first/fastest of an incident", "passing": "passing sample"}
COLOURS = {INCONCLUSIVE: "#b07d00", ERROR: "#7b1fa2", FAIL: "#b3261e", MISSED: "#e8590c"}
FP_LEGEND = (
    "label (verdict, or DETECTED for a planted defect caught as expected) / failure mode / "
    "checker / finding kind"
)
CAUSE_NOTE = "A run with several unfired planted defects counts under each; links: its first runs."
KEPT_NOTE = (
    "Every run with a finding (a verdict other than PASS, the first or fastest run of an "
    "incident, a replay mismatch) and a sample of passing runs; the others were deleted and "
    "live on in the ledger, each with its replay command. All of them:"
)
COLOURS[NONDETERMINISM] = "#1565c0"


def exit_meaning(code: int) -> str:
    if code == 0:
        return "nothing unexpected"
    if code == EXIT_NONDETERMINISM:
        return "nondeterminism: a replayed run's history differed from the original"
    if code == EXIT_DISK_CAP:
        return "stopped at the disk cap (--max-disk) before the budget was spent"
    return next(f"{v}: {MEANING[v]}" for v, c in EXIT_CODES.items() if c == code)


def duration_text(s: float) -> str:
    s = int(s)
    return (
        f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"
        if s >= 3600
        else f"{s // 60}m{s % 60:02d}s"
    )


def inconclusive_causes(summary: str) -> list[str]:
    """Why a run was INCONCLUSIVE, from its verdict summary: each planted fault that never fired,
    else the summary itself with its numbers blurred (so one cause is one row)."""
    for said, cause in (
        ("never fired: ", "never fired"),
        ("never pulled: ", "trigger never pulled"),
    ):
        _, sep, names = summary.partition(said)
        if sep:
            return [f"{n.strip()} {cause}" for n in names.split(";")[0].split(",") if n.strip()]
    return [re.sub(r"\d+(\.\d+)?", "N", summary).strip() or "no reason given"]


# -- the soak.json dict ----------------------------------------------------------------------
def _link(folder: Path, run_dir: str | None) -> str | None:
    """The run's report.html relative to the soak's folder (results.json, with its report_error,
    when the report could not be written); None when the folder is gone."""
    for name in ("report.html", "results.json"):
        if run_dir and (Path(run_dir) / name).is_file():
            return Path(os.path.relpath(Path(run_dir) / name, folder)).as_posix()
    return None


def _growth(a: float, b: float) -> float:
    return round(100 * (b - a) / a, 2)


def _timeline(soak, elapsed: float) -> dict:
    """Cumulative runs, findings per verdict, new fingerprints and replay mismatches, binned."""
    width = max(elapsed, 1e-3) / TIMELINE_BINS

    def cum(times, keep=lambda i: True) -> list[int]:
        counts = [0] * TIMELINE_BINS
        for i, t in enumerate(times):
            if keep(i):
                counts[min(TIMELINE_BINS - 1, int(t / width))] += 1
        out, total = [], 0
        for c in counts:
            total += c
            out.append(total)
        return out

    code = soak.run_v
    findings = {
        v: cum(soak.run_t, lambda i, c=VERDICT_CODE[v]: code[i] == c)
        for v in TIMELINE[1:]
        if VERDICT_CODE[v] in code
    }
    if soak.nondet_t:
        findings[NONDETERMINISM] = cum(soak.nondet_t)
    return {
        "t_s": [round(width * (i + 1), 2) for i in range(TIMELINE_BINS)],
        "runs": cum(soak.run_t),
        "findings": findings,
        "fingerprints": cum(soak.fp_t),
    }


def prefix_cache_summary(runs: list[dict]) -> dict | None:
    """Hit rate over the runs with a prefix cache: pooled (hit tokens over known tokens) and the
    median run's."""
    if not runs:
        return None
    known, hit = sum(r["known_tokens"] for r in runs), sum(r["hit_tokens"] for r in runs)
    rates = sorted(r["hit_rate"] for r in runs)
    return {
        "runs": len(runs),
        "hit_rate_pooled": round(hit / known, 4) if known else 0.0,
        "hit_rate_median": rates[len(rates) // 2],
    }


def summary_of(soak, elapsed: float, code: int) -> dict:
    rss = dict(soak.rss)
    if "baseline_mb" in rss:
        rss["growth_pct"] = _growth(rss["baseline_mb"], rss["end_mb"])
        if rss.get("worker_baseline_mb"):
            rss["worker_growth_pct"] = _growth(rss["worker_baseline_mb"], rss["worker_end_mb"])
    folder, k, a = soak.dir, soak.keeper, soak.args
    incidents = [
        {
            "fingerprint": list(fp),
            **v,
            "first_link": _link(folder, v["first_run"]),
            "fastest_link": _link(folder, v["fastest_run"]),
        }
        for fp, v in sorted(
            soak.incidents.items(), key=lambda kv: (kv[0][0] == "DETECTED", -kv[1]["count"])
        )
    ]
    order = {v: i for i, v in enumerate((MISSED, FAIL, ERROR, INCONCLUSIVE, PASS))}
    kept = sorted(
        (
            {
                **{x: e[x] for x in ("seed", "verdict", "why", "mix", "summary")},
                "run_dir": d,
                "link": _link(folder, d),
            }
            for d, e in k.kept.items()
        ),
        key=lambda e: (e["why"] == "passing", order.get(e["verdict"], 0), e["seed"]),
    )
    causes = [
        {
            "cause": cause,
            "count": c["count"],
            "first_seed": c["first_seed"],
            "links": [x for x in (_link(folder, d) for d in c["runs"]) if x],
        }
        for cause, c in sorted(soak.causes.items(), key=lambda kv: -kv[1]["count"])
    ]
    argv = ["kvchaos", "soak", "--budget", a.budget, "--device", soak.device]
    argv += ["--shard", f"{soak.shard[0]}/{soak.shard[1]}", "--seed-start", str(soak.seed_start)]
    argv += ["--per-run-timeout", f"{a.per_run_timeout:g}", "--report-dir", str(a.report_dir)]
    argv += ["--keep", str(a.keep), "--max-disk", str(a.max_disk)]
    argv += ["--ledger", str(a.ledger)] if a.ledger else []
    argv += ["--block-manager", a.block_manager] if a.block_manager else []
    argv += ["--executor", a.executor] if a.executor != "local" else []
    argv += ["--workers", str(a.workers)] if a.workers else []
    return {
        "soak": soak.id,
        "folder": str(folder),
        "commit": soak.commit,
        "device": soak.device,
        "budget_s": soak.budget,
        "elapsed_s": round(elapsed, 1),
        "shard": list(soak.shard),
        "seed_start": soak.seed_start,
        "first_seed": soak.first_seed,
        "last_seed": soak.last_seed,
        "runs": soak.runs,
        "cut_at_budget_end": soak.cut,
        "steps": soak.steps,
        "steps_per_s": round(soak.steps / elapsed, 1) if elapsed else 0,
        "verdicts": dict(soak.counts),
        "prefix_cache": prefix_cache_summary(soak.hit_rates),
        "performance": [
            {"kind": kind, **p, "first_link": _link(folder, p["first_run"])}
            for kind, p in sorted(soak.performance.items())
        ],
        "determinism": {"replayed": soak.replays, "mismatches": soak.nondet},
        "incidents": incidents,
        "unexpected": [{**u, "link": _link(folder, u["run_dir"])} for u in soak.unexpected],
        "inconclusive": causes,
        "kept": kept,
        "disk": {
            "cap_bytes": k.cap,
            "used_bytes": k.used(),
            "keep": "all" if k.keep is None else k.keep,
            "kept_runs": len(k.kept),
            "kept_passing": len(k.sample),
            "deleted_runs": k.deleted,
            "trimmed_histories": k.trimmed,
            "passing_closed_at_run": k.passing_closed_at,
        },
        "stopped": soak.stopped,
        "timeline": _timeline(soak, elapsed),
        "rss": rss,
        "exit_code": code,
        "exit_meaning": exit_meaning(code),
        "command": shlex.join(argv),
        "ledger": str(soak.ledger_file),
        "injected_hang_every": a.inject_hang_every,
        "block_manager": a.block_manager or "the reference",
        "left_out": soak.fit.left_out() if soak.fit else [],
        "executor": soak.executor_line(),
        "resubmitted": soak.lost,
    }


# -- soak-summary.md --------------------------------------------------------------------------
def rss_line(rss: dict) -> str:
    if "growth_pct" not in rss:
        return "not measured (the soak ended before the baseline sample)"
    return (
        f"soak process {rss['baseline_mb']:.1f} MiB at {rss['baseline_at_s']:g} s -> "
        f"{rss['end_mb']:.1f} MiB at the end ({rss['growth_pct']:+.2f}%), "
        f"peak {rss['peak_mb']:.1f} MiB; worker "
        f"{rss['worker_baseline_mb']:.1f} -> {rss['worker_end_mb']:.1f} MiB "
        f"({rss.get('worker_growth_pct', 0):+.2f}%), peak {rss['worker_peak_mb']:.1f} MiB"
    )


def disk_line(s: dict) -> str:
    d = s["disk"]
    line = (
        f"{size_text(d['used_bytes'])} written of --max-disk {size_text(d['cap_bytes'])}; "
        f"{d['kept_runs']} run folders kept ({d['kept_passing']} of them a sample of passing "
        f"runs, --keep {d['keep']}), {d['deleted_runs']} passing runs deleted (the ledger has "
        "them)"
    )
    if d["trimmed_histories"]:
        line += f", {d['trimmed_histories']} kept without history.jsonl to stay under the cap"
    if d["passing_closed_at_run"]:
        line += f"; from run {d['passing_closed_at_run']} on only findings were kept (80% of cap)"
    return line


def hit_line(pc: dict | None) -> str:
    if not pc:
        return "no run had a prefix cache"
    return (
        f"hit rate {pc['hit_rate_pooled']:.1%} of known tokens over {pc['runs']} runs with a "
        f"cache (median run {pc['hit_rate_median']:.1%})"
    )


def perf_line(perf: list[dict] | None) -> str:
    """The runs with performance warnings (harness/check/performance.py), by kind."""
    if not perf:
        return "none"
    return (
        "; ".join(
            f"{p['kind']} in {p['runs']} run{'s' if p['runs'] > 1 else ''} "
            f"(first seed {p['first_seed']})"
            for p in perf
        )
        + " (warnings: no verdict changed)"
    )


def render_md(s: dict, brief: bool = False) -> str:
    out = [
        f"# kvchaos soak {s['soak']}",
        "",
        *(
            ["- **in progress**: rewritten as the soak goes, this is where it stood"]
            * bool(s.get("in_progress"))
        ),
        f"- result: **exit {s['exit_code']}** ({s['exit_meaning']})",
        f"- {s['runs']} runs in {duration_text(s['elapsed_s'])} of a "
        f"{duration_text(s['budget_s'])} budget on {s['device']}, commit {s['commit']}, "
        f"shard {s['shard'][0]}/{s['shard'][1]}, "
        + (
            f"seeds {s['first_seed']}..{s['last_seed']}"
            if s["first_seed"] is not None
            else "no seed"
        )
        + (
            f" ({s['cut_at_budget_end']} run stopped at the budget's end, not counted)"
            if s["cut_at_budget_end"]
            else ""
        ),
        f"- block manager: {s.get('block_manager', 'the reference')}"
        + (f"; left out of the mix: {'; '.join(s['left_out'])}" if s.get("left_out") else ""),
        f"- runs on: {s.get('executor', 'local')}"
        + (
            f"; {s['resubmitted']} resubmitted once after their worker or node was lost"
            if s.get("resubmitted")
            else ""
        ),
        "- verdicts: "
        + (", ".join(f"{v} {n}" for v, n in sorted(s["verdicts"].items())) or "none"),
        f"- {s['steps']} engine steps, {s['steps_per_s']} steps/s",
        f"- determinism: {s['determinism']['replayed']} runs replayed, "
        f"{len(s['determinism']['mismatches'])} mismatches",
        f"- memory (RSS): {rss_line(s['rss'])}",
        f"- disk: {disk_line(s)}",
        f"- prefix cache: {hit_line(s.get('prefix_cache'))}",
        f"- performance warnings: {perf_line(s.get('performance'))}",
    ]
    out += [f"- **{s['stopped']}**"] if s["stopped"] else []
    out += [f"- rerun this soak: `{s['command']}`; ledger: `{s['ledger']}`"]
    if brief:
        return "\n".join(out)

    def link(text, target) -> str:
        return f"[{text}]({target})" if target else f"{text} (not kept)"

    if s["determinism"]["mismatches"]:
        out += ["", "## Nondeterminism", "", "| seed | verdict | replayed verdict | digest | "]
        out[-1] += "replay digest | run |"
        out += ["|---|---|---|---|---|---|"]
        out += [
            f"| {m['seed']} | {m['verdict']} | {m['replay_verdict']} | "
            f"`{(m['digest'] or '')[:12]}` | `{m['replay_digest'][:12]}` | `{m['run_dir']}` |"
            for m in s["determinism"]["mismatches"]
        ]
    out += ["", "## Incidents by fingerprint", "", f"Fingerprint: {FP_LEGEND}. "]
    out[-1] += "Fastest: the seed where it showed at the earliest step."
    out += ["", "| fingerprint | runs | first seed | fastest seed (step) | reproduce |"]
    out += ["|---|---|---|---|---|"]
    for i in s["incidents"]:
        out.append(
            f"| {fp_text(i['fingerprint'])} | {i['count']} | "
            f"{link(i['first_seed'], i['first_link'])} | "
            f"{link(i['fastest_seed'], i['fastest_link'])} ({i['fastest_step']}) | "
            f"`kvchaos replay {i['fastest_run']}`; `kvchaos shrink {i['fastest_run']}` |"
        )
    if not s["incidents"]:
        out.append("| none | | | | |")
    out += ["", "## INCONCLUSIVE runs by cause", ""]
    if s["inconclusive"]:
        out += [CAUSE_NOTE, "", "| cause | runs | first seed | reports |", "|---|---|---|---|"]
        out += [
            f"| {c['cause']} | {c['count']} | {c['first_seed']} | "
            + (", ".join(f"[{n + 1}]({x})" for n, x in enumerate(c["links"])) or "not kept")
            + " |"
            for c in s["inconclusive"]
        ]
    else:
        out.append("none")
    out += ["", f"## Kept runs ({len(s['kept'])})", "", f"{KEPT_NOTE} runs/index.html", ""]
    out += [
        f"- {link('seed {seed} {verdict}'.format(**k), k['link'])}: {WHY[k['why']]}, {k['mix']}"
        for k in s["kept"][:KEPT_ROWS]
    ]
    out += [f"- ... and {len(s['kept']) - KEPT_ROWS} more"] if len(s["kept"]) > KEPT_ROWS else []
    out += ["", "## Unexpected runs", ""]
    if s["unexpected"]:
        out += ["| verdict | seed | mix | summary | run |", "|---|---|---|---|---|"]
        out += [
            f"| {u['verdict']} | {u['seed']} | {u['mix'].split(': ', 1)[-1]} | "
            f"{u['summary'].replace('|', '/')} | {link('report', u['link'])} `{u['run_dir']}` |"
            for u in s["unexpected"]
        ]
    else:
        out.append("none")
    return "\n".join(out) + "\n"
