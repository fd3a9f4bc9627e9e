"""The block-size advisor's page: a small plot (fill and step-time ratio per block size, one line a
traffic) and each traffic's table, from the advisor's JSON documents and its text rows."""

from __future__ import annotations

import base64
import html
import io
from typing import TypedDict

COLOURS = ("tab:blue", "tab:orange")


class Section(TypedDict):
    doc: dict  # advice_doc's document
    header: list[str]
    rows: list[list[str]]
    lines: list[str]  # the shape, the cost, the rule of thumb, the recommendation


def plot_advice(docs: list[dict]) -> str | None:
    """Slot fill, last-block fill and step-time ratio per block size, as a PNG data URI (None
    without matplotlib)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(9, 5.2), dpi=72)
    FigureCanvasAgg(fig)
    fill, step = fig.subplots(2, 1, sharex=True)
    for doc, colour in zip(docs, COLOURS, strict=False):
        xs = [c["block_size"] for c in doc["candidates"]]
        name = doc["traffic"]["source"].split(" (")[0].rsplit("/", 1)[-1]
        label = f"{name} (mean {doc['traffic']['mean']:.0f})"
        fill.plot(xs, [c["slot_fill"] for c in doc["candidates"]], "o-", color=colour, label=label)
        fill.plot(xs, [c["fill"] for c in doc["candidates"]], "s--", color=colour, alpha=0.6)
        step.plot(xs, [c["step_time_ratio"] for c in doc["candidates"]], "o-", color=colour)
        for ax in (fill, step):
            ax.axvline(doc["recommended"], color=colour, lw=1, ls=":")
    fill.set_ylabel("fill (solid: slots,\ndashed: last block)")
    fill.set_ylim(0, 1.02)
    fill.legend(loc="lower left", frameon=False, fontsize=9)
    kind = "measured" if docs[0]["cost"] == "measured" else "modelled"
    step.set_ylabel(f"{kind} step time\n/ the best")
    step.set_xlabel("block size (tokens); dotted: recommended")
    step.set_xscale("log", base=2)
    step.set_xticks(xs, [str(x) for x in xs])
    for ax in (fill, step):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


_STYLE = (
    "<style>body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:76em;color:#222;"
    "padding:0 1em}h2{font-size:1.2em;border-bottom:1px solid #ddd;margin-top:1.6em}"
    "table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ddd;padding:.25em .6em;"
    "text-align:right}th{background:#f4f4f4}tr.best{background:#eef6ff;font-weight:600}"
    ".muted{color:#666}img.plot{max-width:100%;border:1px solid #eee}</style>"
)


def _section(s: Section) -> str:
    e = html.escape
    best = str(s["doc"]["recommended"])
    head = "".join(f"<th>{e(h)}</th>" for h in s["header"])
    rows = "".join(
        f"<tr{' class=best' if r[0] == best else ''}>"
        + "".join(f"<td>{e(c)}</td>" for c in r)
        + "</tr>"
        for r in s["rows"]
    )
    lines = "".join(f"<p>{e(line)}</p>" for line in s["lines"])
    return f"<h2>{e(s['doc']['traffic']['source'])}</h2><table><tr>{head}</tr>{rows}</table>{lines}"


def render_advice_html(sections: list[Section], compare_line: str | None = None) -> str:
    plot = plot_advice([s["doc"] for s in sections])
    img = (
        f'<img class="plot" alt="fill and step time per block size" src="{plot}">'
        if plot
        else "<p class='muted'>no plot (matplotlib is not installed)</p>"
    )
    cmp = f"<p><b>{html.escape(compare_line)}</b></p>" if compare_line else ""
    body = "".join(_section(s) for s in sections)
    return f"""<!doctype html><html><head><meta charset="utf-8">
<title>kvchaos advise: block size</title>{_STYLE}</head><body>
<h1>kvchaos advise: block size from the traffic's lengths</h1>{cmp}
{img}{body}</body></html>
"""
