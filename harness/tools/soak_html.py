"""The soak's summary page (soak-summary.html): the timeline plot and the tables."""

from __future__ import annotations

import base64
import html
import io

from kvchaos.harness.tools.fingerprint import fp_text
from kvchaos.harness.tools.soak_summary import (
    CAUSE_NOTE,
    COLOURS,
    FP_LEGEND,
    KEPT_NOTE,
    KEPT_ROWS,
    WHY,
    disk_line,
    duration_text,
    hit_line,
    rss_line,
)


# -- the plot ---------------------------------------------------------------------------------
def plot_timeline(tl: dict) -> str | None:
    """Runs and findings over time, as a PNG data URI (None without matplotlib or runs)."""
    if not tl["runs"] or not tl["runs"][-1]:
        return None
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    hours = tl["t_s"][-1] > 2 * 3600
    xs = [t / (3600 if hours else 60) for t in tl["t_s"]]
    fig = Figure(figsize=(14, 5.6), dpi=72)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 3]})
    top.plot(xs, tl["runs"], color="#2a7d2a", lw=1.5, label="runs")
    top.set_ylabel("runs (total)")
    top.legend(loc="upper left", frameon=False)
    for v, ys in tl["findings"].items():
        bottom.step(xs, ys, where="post", lw=1.5, color=COLOURS.get(v), label=v)
    bottom.step(
        xs, tl["fingerprints"], where="post", lw=1, ls="--", color="#555", label="new fingerprints"
    )
    bottom.set_ylabel("findings (total)")
    bottom.set_xlabel("hours into the soak" if hours else "minutes into the soak")
    bottom.legend(loc="upper left", frameon=False, fontsize=9)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.set_xlim(0, xs[-1])
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


# -- soak-summary.html ------------------------------------------------------------------------
_STYLE = (
    "<style>body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:76em;color:#222;"
    "padding:0 1em}h2{font-size:1.2em;border-bottom:1px solid #ddd;margin-top:1.6em}\n"
    "table{border-collapse:collapse;margin:.6em 0}"
    "td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}"
    "th{background:#f4f4f4}.nw{white-space:nowrap}\n"
    ".bad{color:#b3261e}.ok{color:#1b7f3b}.muted{color:#666}"
    "code{font-size:90%;background:#f6f6f6}img.plot{max-width:100%;border:1px solid #eee}\n"
    ".v{display:inline-block;padding:0 .5em;border-radius:4px;color:#fff;font-weight:600}"
    ".PASS{background:#2a7d2a}.INCONCLUSIVE{background:#b07d00}.ERROR{background:#7b1fa2}"
    ".FAIL,.MISSED{background:#b3261e}.stop{background:#fff4e5;border:1px solid #e8590c;"
    "padding:.5em 1em;border-radius:6px}</style>"
)


def _table(headers: tuple, rows: str) -> str:
    if not rows:
        return "<p>none</p>"
    return "<table><tr>" + "".join(f"<th>{h}</th>" for h in headers) + f"</tr>{rows}</table>"


def _a(text, href) -> str:
    e = html.escape
    return f'<a href="{e(href)}">{e(str(text))}</a>' if href else f"{e(str(text))} (not kept)"


def _badge(v: str) -> str:
    return f'<span class="v {html.escape(v)}">{html.escape(v)}</span>'


def perf_html(perf: list[dict] | None) -> str:
    """perf_line, each kind's first run linked."""
    if not perf:
        return "none"
    e = html.escape
    return (
        "; ".join(
            f"<span class='bad'>{e(p['kind'])}</span> in {p['runs']} runs (first: "
            f"{_a('seed ' + str(p['first_seed']), p.get('first_link'))})"
            for p in perf
        )
        + " (warnings: no verdict changed)"
    )


def render_html(s: dict) -> str:
    e = html.escape
    bad = s["exit_code"] != 0
    rows = "".join(
        f"<tr><td>{e(fp_text(i['fingerprint']))}</td><td>{i['count']}</td>"
        f"<td>{_a(i['first_seed'], i['first_link'])}</td><td class='nw'>"
        f"{_a(i['fastest_seed'], i['fastest_link'])} (step {i['fastest_step']})</td>"
        f"<td><code>kvchaos replay {e(i['fastest_run'])}</code></td></tr>"
        for i in s["incidents"]
    )
    unexp = "".join(
        f"<tr><td>{_badge(u['verdict'])}</td><td>{u['seed']}</td>"
        f"<td>{e(u['mix'].split(': ', 1)[-1])}</td>"
        f"<td>{e(u['summary'])}</td><td>{_a('report', u['link'])}</td></tr>"
        for u in s["unexpected"]
    )
    nondet = "".join(
        f"<tr><td>{m['seed']}</td><td>{e(m['verdict'])}</td><td>{e(m['replay_verdict'])}</td>"
        f"<td><code>{e(str(m['digest'])[:12])}</code></td>"
        f"<td><code>{e(m['replay_digest'][:12])}</code></td><td><code>{e(m['run_dir'])}</code>"
        "</td></tr>"
        for m in s["determinism"]["mismatches"]
    )
    causes = "".join(
        f"<tr><td>{e(c['cause'])}</td><td>{c['count']}</td><td>{c['first_seed']}</td><td>"
        + (" ".join(_a(n + 1, x) for n, x in enumerate(c["links"])) or "not kept")
        + "</td></tr>"
        for c in s["inconclusive"]
    )
    kept = "".join(
        f"<tr><td>{_a(k['seed'], k['link'])}</td><td>{_badge(k['verdict'])}</td>"
        f"<td>{WHY[k['why']]}</td><td>{e(k['mix'])}</td><td>{e(k['summary'])}</td></tr>"
        for k in s["kept"][:KEPT_ROWS]
    )
    if len(s["kept"]) > KEPT_ROWS:
        kept += f"<tr><td colspan=5>... and {len(s['kept']) - KEPT_ROWS} more</td></tr>"
    verdicts = " ".join(f"{_badge(v)} {n}" for v, n in sorted(s["verdicts"].items()))
    nondet = _table(("seed", "verdict", "replayed", "digest", "replay digest", "run"), nondet)
    plot = plot_timeline(s["timeline"])
    plot = (
        f'<img class="plot" alt="runs and findings over time" src="{plot}">'
        if plot
        else "<p class='muted'>no plot (no runs, or matplotlib is not installed)</p>"
    )
    title = f"kvchaos soak {e(s['soak'])}"
    ran = (
        f"{s['runs']} runs in {duration_text(s['elapsed_s'])} of a {duration_text(s['budget_s'])} "
        f"budget on {e(s['device'])}, commit\n{e(s['commit'])}, "
        f"shard {s['shard'][0]}/{s['shard'][1]}, seeds {s['first_seed']}..{s['last_seed']};\n"
        f"{s['steps']} engine steps "
        f"({s['steps_per_s']} steps/s); {s['determinism']['replayed']} determinism replays,\n"
        f"{len(s['determinism']['mismatches'])} mismatches."
    )
    stop = f'<p class="stop"><b>{e(s["stopped"])}</b></p>' if s["stopped"] else ""
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
{_STYLE}</head><body>
<h1>{title}</h1>
<p class="{"bad" if bad else "ok"}"><b>exit {s["exit_code"]}</b>: {e(s["exit_meaning"])}</p>
{stop}<p>{ran}</p>
<p>{verdicts}</p>
<p>Disk: {e(disk_line(s))}.</p>
<p>Prefix cache: {e(hit_line(s.get("prefix_cache")))}.</p>
<p>Performance warnings: {perf_html(s.get("performance"))}.</p>
<p>Memory (RSS): {e(rss_line(s["rss"]))}</p>
<p>Rerun: <code>{e(s["command"])}</code><br>ledger: <code>{e(s["ledger"])}</code></p>
<h2>Runs and findings over time</h2>{plot}
<h2>Nondeterminism</h2>{nondet}
<h2>Incidents by fingerprint</h2>
<p class="muted">{FP_LEGEND}; seeds link to the run's report</p>
{_table(("fingerprint", "runs", "first seed", "fastest seed", "reproduce"), rows)}
<h2>INCONCLUSIVE runs by cause</h2><p class="muted">{CAUSE_NOTE}</p>
{_table(("cause", "runs", "first seed", "reports"), causes)}
<h2>Unexpected runs</h2>{_table(("verdict", "seed", "mix", "summary", "run"), unexp)}
<h2>Kept runs ({len(s["kept"])})</h2>
<p class="muted">{e(KEPT_NOTE)} <a href="runs/index.html">runs/index.html</a></p>
{_table(("seed (report)", "verdict", "kept as", "mix", "summary"), kept)}
</body></html>
"""
