"""The run's figure: latency, free blocks and the faults' windows over engine steps (matplotlib)."""

from __future__ import annotations

import base64
import io

from kvchaos.harness.report.view import RunView


def _windows(v: RunView, verify: dict) -> list[tuple[str, int, int]]:
    """Steps where each fault was triggered or fired, merged into spans; a fault whose verify()
    counts more firings than it logged kept firing silently: its last span runs to the end."""
    out = []
    for name in v.armed:
        steps = sorted(
            {
                e["step"]
                for e in v.by.get("fault", [])
                if e["fault"] == name and e["kind"] != "armed"
            }
        )
        if not steps:
            continue
        spans = [[steps[0], steps[0]]]
        for s in steps[1:]:
            if s <= spans[-1][1] + 1:
                spans[-1][1] = s
            else:
                spans.append([s, s])
        logged = sum(
            1 for e in v.by.get("fault", []) if e["fault"] == name and e["kind"] == "fired"
        )
        if verify.get(name, {}).get("times", 0) > logged:
            spans[-1][1] = v.last_step
        out += [(name, a, b) for a, b in spans]
    return out


def plot_run(v: RunView, verify: dict) -> str:
    """One figure, three panels (latency, free blocks, divergence per request): a PNG data URI."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 9), dpi=72)
    FigureCanvasAgg(fig)
    ax_lat, ax_free, ax_div = fig.subplots(
        3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2, 3]}
    )
    xs = [s["step"] for s in v.steps]
    ax_lat.plot(xs, [s["latency_s"] * 1e3 for s in v.steps], lw=1, label="latency_s (whole step)")
    ax_lat.plot(xs, [s["host_s"] * 1e3 for s in v.steps], lw=1, label="host_s (host side)")
    ax_lat.set_ylabel("ms per step")
    ax_lat.set_title(f"{v.start.get('scenario', '?')} seed {v.start.get('seed', '?')}", loc="left")
    ax_free.step(
        xs,
        [s["free_blocks"] for s in v.steps],
        where="mid",
        lw=1,
        color="tab:green",
        label="free blocks",
    )
    if v.num_blocks:
        ax_free.axhline(v.num_blocks, ls=":", color="grey", label=f"pool ({v.num_blocks})")
    ax_free.set_ylabel("free blocks")
    colours = ["tab:red", "tab:purple", "tab:orange", "tab:brown"]
    windows = _windows(v, verify)
    for i, name in enumerate(v.armed):
        spans = [(a - 0.5, b - a + 1) for n, a, b in windows if n == name]
        if not spans:
            continue
        for ax in (
            ax_lat,
            ax_free,
            ax_div,
        ):  # one collection per fault and panel: an axvspan per window is slow
            ax.broken_barh(
                spans,
                (0, 1),
                transform=ax.get_xaxis_transform(),
                color=colours[i % len(colours)],
                alpha=0.15,
                lw=0,
                label=name,
            )
    reqs = sorted(v.token_steps, key=lambda r: (v.token_steps[r][0], r))
    div = {o["req"]: o for o in v.diverged}
    for y, r in enumerate(reqs):
        ss = v.token_steps[r]
        ax_div.hlines(y, ss[0], ss[-1], color="tab:blue", lw=2)
        if r in div and div[r]["divergence_step"] is not None:
            d = div[r]["divergence_step"]
            ax_div.hlines(y, d, ss[-1], color="tab:red", lw=3)
            ax_div.plot([d], [y], "x", color="black")
            ax_div.annotate(
                f"{div[r]['abs_err_at_divergence']:.2g}",
                (d, y),
                xytext=(3, 3),
                textcoords="offset points",
                fontsize=7,
            )
    if len(reqs) <= 24:  # tick labels are most of the drawing time: name requests only when few
        ax_div.set_yticks(range(len(reqs)), reqs, fontsize=7)
    ax_div.set_ylabel("request")
    ax_div.set_xlabel("engine step")
    ax_div.set_title(
        f"tokens per request (red: diverged from the oracle, label = logit error); "
        f"{len(v.diverged)} of {len(v.oracle)} diverged",
        loc="left",
        fontsize=9,
    )
    ax_lat.legend(fontsize=8, loc="upper left")
    ax_free.legend(fontsize=8, loc="lower left")
    fig.subplots_adjust(
        left=0.07, right=0.99, top=0.96, bottom=0.06, hspace=0.12
    )  # tight_layout would draw twice
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
