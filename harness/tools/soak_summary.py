"""How a soak shows itself: the live display while it runs, and soak-summary.md / .html (from the
soak.json dict) at the end."""

from __future__ import annotations

import html

from kvchaos.harness.judge.verdict import EXIT_CODES, INCONCLUSIVE, MEANING, PASS
from kvchaos.harness.tools.fingerprint import fp_text

NONDETERMINISM = "NONDETERMINISM"  # the label of a replay whose history digest differed
EXIT_NONDETERMINISM = 14


def exit_meaning(code: int) -> str:
    if code == 0:
        return "nothing unexpected"
    if code == EXIT_NONDETERMINISM:
        return "nondeterminism: a replayed run's history differed from the original"
    return next(f"{v}: {MEANING[v]}" for v, c in EXIT_CODES.items() if c == code)


def duration_text(s: float) -> str:
    s = int(s)
    return (
        f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"
        if s >= 3600
        else f"{s // 60}m{s % 60:02d}s"
    )


# -- the live display ------------------------------------------------------------------------
def live_panel(soak, t: float):
    """The live display's table: where the soak stands t s in."""
    from rich.table import Table

    tab = Table.grid(padding=(0, 2))
    tab.add_column(style="bold")
    tab.add_column()
    colour = {PASS: "green", INCONCLUSIVE: "yellow"}
    tab.add_row(
        "elapsed",
        f"{duration_text(t)} / {duration_text(soak.budget)}  "
        f"({min(100, 100 * t / soak.budget):.0f}%)",
    )
    tab.add_row(
        "runs",
        f"{soak.runs}  (determinism replays {soak.replays}, mismatches {len(soak.nondet)})",
    )
    tab.add_row(
        "verdicts",
        "  ".join(f"[{colour.get(v, 'red')}]{v} {n}[/]" for v, n in sorted(soak.counts.items()))
        or "-",
    )
    unexpected = sum(1 for fp in soak.incidents if fp[0] != "DETECTED")
    tab.add_row("incidents", f"{len(soak.incidents)} fingerprints ({unexpected} unexpected)")
    tab.add_row("steps/s", f"{soak.steps / t:.0f}" if t > 0 else "-")
    tab.add_row(
        "RSS",
        f"soak {soak.rss.get('end_mb', 0):.0f} MiB, "
        f"worker {soak.rss.get('worker_end_mb', 0):.0f} MiB",
    )
    return tab


# -- the summary -----------------------------------------------------------------------------
def _rss_line(rss: dict) -> str:
    if "growth_pct" not in rss:
        return "not measured (the soak ended before the baseline sample)"
    return (
        f"soak process {rss['baseline_mb']:.1f} MiB at {rss['baseline_at_s']:g} s -> "
        f"{rss['end_mb']:.1f} MiB at the end ({rss['growth_pct']:+.2f}%), "
        f"peak {rss['peak_mb']:.1f} MiB; worker "
        f"{rss['worker_baseline_mb']:.1f} -> {rss['worker_end_mb']:.1f} MiB "
        f"({rss.get('worker_growth_pct', 0):+.2f}%), peak {rss['worker_peak_mb']:.1f} MiB"
    )


def render_md(s: dict, brief: bool = False) -> str:
    out = [
        f"# kvchaos soak {s['soak']}",
        "",
        f"- result: **exit {s['exit_code']}** ({s['exit_meaning']})",
        f"- {s['runs']} runs in {duration_text(s['elapsed_s'])} of a "
        f"{duration_text(s['budget_s'])} budget on {s['device']}, commit {s['commit']}, "
        f"shard {s['shard'][0]}/{s['shard'][1]}, seeds {s['first_seed']}..{s['last_seed']}"
        + (
            f" ({s['cut_at_budget_end']} run stopped at the budget's end, not counted)"
            if s["cut_at_budget_end"]
            else ""
        ),
        "- verdicts: "
        + (", ".join(f"{v} {n}" for v, n in sorted(s["verdicts"].items())) or "none"),
        f"- {s['steps']} engine steps, {s['steps_per_s']} steps/s",
        f"- determinism: {s['determinism']['replayed']} runs replayed, "
        f"{len(s['determinism']['mismatches'])} mismatches",
        f"- memory (RSS): {_rss_line(s['rss'])}",
        f"- rerun this soak: `{s['command']}`; ledger: `{s['ledger']}`",
    ]
    if brief:
        return "\n".join(out)
    if s["determinism"]["mismatches"]:
        out += [
            "",
            "## Nondeterminism",
            "",
            "| seed | verdict | replayed verdict | digest | replay digest | run |",
            "|---|---|---|---|---|---|",
        ]
        out += [
            f"| {m['seed']} | {m['verdict']} | {m['replay_verdict']} | "
            f"`{(m['digest'] or '')[:12]}` | `{m['replay_digest'][:12]}` | `{m['run_dir']}` |"
            for m in s["determinism"]["mismatches"]
        ]
    out += [
        "",
        "## Incidents by fingerprint",
        "",
        "Fingerprint: label (verdict, or DETECTED for a planted defect caught as expected) / "
        "failure mode / checker / finding kind. "
        "Fastest: the seed where it showed at the earliest step.",
        "",
        "| fingerprint | runs | first seed | fastest seed (step) | reproduce |",
        "|---|---|---|---|---|",
    ]
    for inc in s["incidents"]:
        out.append(
            f"| {fp_text(inc['fingerprint'])} | {inc['count']} | {inc['first_seed']} | "
            f"{inc['fastest_seed']} ({inc['fastest_step']}) | "
            f"`kvchaos replay {inc['fastest_run']}`; `kvchaos shrink {inc['fastest_run']}` |"
        )
    if not s["incidents"]:
        out.append("| none | | | | |")
    out += ["", "## Unexpected runs", ""]
    if s["unexpected"]:
        out += ["| verdict | seed | mix | summary | run |", "|---|---|---|---|---|"]
        out += [
            f"| {u['verdict']} | {u['seed']} | {u['mix'].split(': ', 1)[-1]} | "
            f"{u['summary'].replace('|', '/')} | `{u['run_dir']}` |"
            for u in s["unexpected"]
        ]
    else:
        out.append("none")
    return "\n".join(out) + "\n"


def _table(headers: tuple, rows: str) -> str:
    if not rows:
        return "<p>none</p>"
    return "<table><tr>" + "".join(f"<th>{h}</th>" for h in headers) + f"</tr>{rows}</table>"


_STYLE = (
    "<style>body{font:14px system-ui,sans-serif;margin:2em;max-width:80em}"
    "table{border-collapse:collapse;margin:1em 0}\n"
    "td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left;vertical-align:top}"
    "th{background:#f3f3f3}\n"
    ".bad{color:#b00020}.ok{color:#1b7f3b}code{font-size:90%}</style>"
)
_FP_LEGEND = (
    "label (verdict, or DETECTED for a planted defect caught as expected) / failure mode / "
    "checker / finding kind"
)


def render_html(s: dict) -> str:
    e = html.escape
    bad = s["exit_code"] != 0
    rows = "".join(
        f"<tr><td>{e(fp_text(i['fingerprint']))}</td><td>{i['count']}</td>"
        f"<td>{i['first_seed']}</td>"
        f"<td>{i['fastest_seed']} (step {i['fastest_step']})</td><td><code>kvchaos replay "
        f"{e(i['fastest_run'])}</code></td></tr>"
        for i in s["incidents"]
    )
    unexp = "".join(
        f"<tr><td>{e(u['verdict'])}</td><td>{u['seed']}</td><td>{e(u['mix'])}</td>"
        f"<td>{e(u['summary'])}</td><td><code>{e(u['run_dir'])}</code></td></tr>"
        for u in s["unexpected"]
    )
    nondet = "".join(
        f"<tr><td>{m['seed']}</td><td>{e(m['verdict'])}</td><td>{e(m['replay_verdict'])}</td>"
        f"<td><code>{e(str(m['digest'])[:12])}</code></td>"
        f"<td><code>{e(m['replay_digest'][:12])}</code></td><td><code>{e(m['run_dir'])}</code></td></tr>"
        for m in s["determinism"]["mismatches"]
    )
    verdicts = "".join(f"<li>{e(v)}: {n}</li>" for v, n in sorted(s["verdicts"].items()))
    nondet = _table(("seed", "verdict", "replayed", "digest", "replay digest", "run"), nondet)
    title = f"kvchaos soak {e(s['soak'])}"
    ran = (
        f"{s['runs']} runs in {duration_text(s['elapsed_s'])} of a {duration_text(s['budget_s'])} "
        f"budget on {e(s['device'])}, commit\n{e(s['commit'])}, "
        f"shard {s['shard'][0]}/{s['shard'][1]}, seeds {s['first_seed']}..{s['last_seed']};\n"
        f"{s['steps']} engine steps "
        f"({s['steps_per_s']} steps/s); {s['determinism']['replayed']} determinism replays,\n"
        f"{len(s['determinism']['mismatches'])} mismatches."
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
{_STYLE}</head><body>
<h1>{title}</h1>
<p class="{"bad" if bad else "ok"}"><b>exit {s["exit_code"]}</b>: {e(s["exit_meaning"])}</p>
<p>{ran}</p>
<ul>{verdicts}</ul>
<p>Memory (RSS): {e(_rss_line(s["rss"]))}</p>
<p>Rerun: <code>{e(s["command"])}</code>; ledger: <code>{e(s["ledger"])}</code></p>
<h2>Nondeterminism</h2>{nondet}
<h2>Incidents by fingerprint</h2>
<p>{_FP_LEGEND}</p>
{_table(("fingerprint", "runs", "first seed", "fastest seed", "reproduce"), rows)}
<h2>Unexpected runs</h2>{_table(("verdict", "seed", "mix", "summary", "run"), unexp)}
</body></html>
"""
