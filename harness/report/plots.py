"""The run's figure: latency, free blocks and requests over engine steps (matplotlib), with the
faults' windows, when each fault fired, when it was detected, and what the incidents name."""

from __future__ import annotations

import base64
import io

from kvchaos.harness.report.view import RunView

FAULT_COLOURS = ["tab:red", "tab:purple", "tab:olive", "tab:brown"]
AFFECTED = "tab:orange"  # requests an incident names; tab:blue the others, tab:red diverged


def _windows(v: RunView, verify: dict) -> list[tuple[str, int, int]]:
    """Steps where each fault was triggered or fired, or where the workload actions it added ran,
    merged into spans; a fault whose verify() counts more firings than it logged kept firing
    silently: its last span runs to the end."""
    out = []
    acts = [e for k in ("submit", "cancel") for e in v.by.get(k, [])]
    for name in v.armed:
        steps = sorted(
            {
                e["step"]
                for e in v.by.get("fault", [])
                if e["fault"] == name and e["kind"] != "armed"
            }
            | {e["step"] for e in acts if e.get("origin") == name}
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


def _marks(incidents) -> dict:
    """What the incidents say, for the figure: fault -> first firing, step -> detecting checkers,
    the error's step, the requests named, where leaks were found and how many blocks leaked."""
    m = {"fired": {}, "detected": {}, "error": None, "affected": set(), "leaks": [], "leaked": 0}
    for inc in incidents:
        d, fault = inc["detection"], inc["trigger"].get("fault")
        if fault and d.get("fault_first_step") is not None:
            m["fired"][fault] = d["fault_first_step"]
        if d.get("first_step") is not None and d["checkers"]:
            m["detected"].setdefault(d["first_step"], set()).update(
                d.get("caught_by") or d["checkers"]
            )
        if inc.get("error"):
            m["error"] = inc["error"].get("step")
        m["affected"].update(a["req"] for a in inc["impact"]["requests_affected"])
        m["leaks"] += [(e["step"], e["req"]) for e in d["evidence"] if e["type"] == "leak"]
        m["leaked"] = max(m["leaked"], inc["impact"]["blocks_leaked"]["count"])
    return m


def _vlines(axes, m: dict, colour_of: dict) -> None:
    """The fault's first firing (solid, its colour), detections (dashed black), the error (red)."""
    for i, ax in enumerate(axes):
        first = i == 0  # legend entries on the top panel only
        for fault, s in m["fired"].items():
            ax.axvline(
                s,
                color=colour_of.get(fault, "tab:red"),
                lw=1.5,
                label=f"{fault} fired (step {s})" if first else None,
            )
        for s, cs in sorted(m["detected"].items()):
            ax.axvline(
                s,
                color="black",
                ls="--",
                lw=1.2,
                label=f"detected by {', '.join(sorted(cs))} (step {s})" if first else None,
            )
        if m["error"] is not None:
            s = m["error"]
            ax.axvline(
                s, color="tab:red", ls=":", lw=2, label=f"error (step {s})" if first else None
            )


ZOOM_BELOW = 0.6  # zoom when what happens spans less than this share of the run's steps


def focus(v: RunView, m: dict, windows) -> dict | None:
    """The x axis's span when the run's activity fills only part of it: the steps that computed
    (a prefill or a decode), the plan's actions, the faults' windows and firings, the leaks
    found, the error; None when that is most of the run. {"lo", "hi": the axis's limits, "busy":
    the last such step, "later": detections past the span (a starvation found 200 steps on),
    drawn outside it and named at the panel's edge}."""
    busy = {s["step"] for s in v.steps if s.get("prefill_tokens") or s.get("decode_tokens")}
    busy |= {e["step"] for k in ("submit", "cancel") for e in v.by.get(k, [])}
    busy |= {x for _, a, b in windows for x in (a, b)} | set(m["fired"].values())
    busy |= {s for s, _ in m["leaks"]} | ({m["error"]} if m["error"] is not None else set())
    if not busy or v.last_step <= 0:
        return None
    first, last = min(busy), max(busy)
    if last - first >= ZOOM_BELOW * v.last_step:
        return None
    pad = max(2.0, 0.05 * (last - first))
    later = sorted(s for s in m["detected"] if s > last + pad)
    return {"lo": max(first - pad, -0.5), "hi": last + pad, "busy": last, "later": later}


def _zoom(axes, v: RunView, m: dict, windows) -> None:
    span = focus(v, m, windows)
    if span is None:
        return
    for ax in axes:
        ax.set_xlim(span["lo"], span["hi"])
    axes[-1].set_xlabel(
        f"engine step (steps {max(0, round(span['lo']))}-{int(span['hi'])} of 0-{v.last_step} "
        f"shown: no request computed and nothing was planned after step {span['busy']})"
    )
    if span["later"]:
        text = "; ".join(
            f"detected by {', '.join(sorted(m['detected'][s]))} at step {s}" for s in span["later"]
        )
        axes[0].annotate(
            f"{text} \u2192", (1, 0.96), xycoords="axes fraction", ha="right", va="top", fontsize=8
        )


def plot_run(v: RunView, verify: dict, incidents=()) -> str:
    """The run's figure as a PNG data URI (report.html embeds it: no file beside it to lose)."""
    buf = io.BytesIO()
    draw(v, verify, incidents).savefig(buf, format="png")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def draw(v: RunView, verify: dict, incidents=()):
    """One figure, three panels (latency, free blocks, tokens per request)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    m = _marks(incidents)
    fig = Figure(figsize=(13, 10), dpi=80)
    FigureCanvasAgg(fig)
    ax_lat, ax_free, ax_div = fig.subplots(
        3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2, 3]}
    )
    xs = [s["step"] for s in v.steps]
    # the events record seconds; the axis is milliseconds, and the legend says so
    ax_lat.plot(xs, [s["latency_s"] * 1e3 for s in v.steps], lw=1, label="whole step (ms)")
    ax_lat.plot(
        xs, [s["host_s"] * 1e3 for s in v.steps], lw=1, color="tab:gray", label="host side (ms)"
    )
    ax_lat.set_ylabel("latency, ms per step")
    ax_lat.set_title(
        f"{v.start.get('scenario', '?')} seed {v.start.get('seed', '?')}: "
        f"{len(incidents)} incident(s)",
        loc="left",
    )
    ax_free.step(
        xs,
        [s["free_blocks"] for s in v.steps],
        where="mid",
        lw=1,
        color="tab:green",
        label="free blocks",
    )
    if v.num_blocks:
        ax_free.axhline(v.num_blocks, ls=":", color="grey", label=f"pool ({v.num_blocks} blocks)")
        if m["leaked"] and m["leaks"]:
            ax_free.hlines(
                v.num_blocks - m["leaked"],
                min(s for s, _ in m["leaks"]),
                v.last_step,
                ls="--",
                color="tab:brown",
                label=f"pool less the {m['leaked']} leaked blocks",
            )
    ax_free.set_ylabel("free blocks")
    tier = [e for e in v.by.get("engine", []) if e["kind"] == "offload_tier"]
    if tier:  # a host tier: its occupancy and traffic beside the device pool's
        _tier(ax_free, tier)
    colour_of = {n: FAULT_COLOURS[i % len(FAULT_COLOURS)] for i, n in enumerate(v.armed)}
    windows = _windows(v, verify)
    for name in v.armed:
        spans = [(a - 0.5, b - a + 1) for n, a, b in windows if n == name]
        if not spans:
            continue
        for ax in (ax_lat, ax_free, ax_div):  # one collection per fault and panel: axvspan is slow
            ax.broken_barh(
                spans,
                (0, 1),
                transform=ax.get_xaxis_transform(),
                color=colour_of[name],
                alpha=0.12,
                lw=0,
                label=f"{name} window (triggered or fired)" if ax is ax_lat else None,
            )
    _vlines((ax_lat, ax_free, ax_div), m, colour_of)
    _requests(ax_div, v, m)
    _zoom((ax_lat, ax_free, ax_div), v, m, windows)
    for ax in (ax_lat, ax_free):  # above the panel, never over the curves
        ax.legend(fontsize=8, loc="lower right", bbox_to_anchor=(1, 1), ncol=3, frameon=False)
    right = 0.93 if tier else 0.99  # room for the host tier's axis
    fig.subplots_adjust(left=0.06, right=right, top=0.93, bottom=0.06, hspace=0.3)
    return fig


def _tier(ax, tier: list[dict]) -> None:
    """The host tier on a second axis: slots in use, and blocks stored out and restored."""
    tx = ax.twinx()
    xs = [e["step"] for e in tier]
    tx.step(xs, [e["data"]["host_used"] for e in tier], where="mid", lw=1, color="tab:purple")
    tx.bar(xs, [e["data"]["stored"] for e in tier], width=0.8, color="tab:orange", alpha=0.5)
    tx.bar(xs, [-e["data"]["restored"] for e in tier], width=0.8, color="tab:cyan", alpha=0.5)
    tx.set_ylabel("host tier: slots in use (line),\nblocks stored (+) / restored (-)", fontsize=8)


def _requests(ax, v: RunView, m: dict) -> None:
    """One line per request over the steps it produced tokens in: blue, orange when an incident
    names it, red from its first divergence on; a square where a leak of its blocks was found."""
    # a named request that produced no token (cancelled waiting, starved) is a dot at its submit
    submitted = {e["req"]: e["step"] for e in v.by.get("submit", [])}
    spans = {r: (ss[0], ss[-1]) for r, ss in v.token_steps.items()}
    for r in m["affected"] - set(spans):
        s = submitted.get(r, 0)
        spans[r] = (s, s)
    reqs = sorted(spans, key=lambda r: (spans[r][0], r))
    div = {o["req"]: o for o in v.diverged}
    row = {r: y for y, r in enumerate(reqs)}
    for r in reqs:
        y, (a, b) = row[r], spans[r]
        hit = r in m["affected"]
        colour = AFFECTED if hit else "tab:blue"
        if r in v.token_steps:
            ax.hlines(y, a, b, color=colour, lw=3 if hit else 2)
        else:
            ax.plot([a], [y], "o", color=colour, ms=4)
        if r in div and div[r]["divergence_step"] is not None:
            d = div[r]["divergence_step"]
            ax.hlines(y, d, b, color="tab:red", lw=3)
            ax.plot([d], [y], "x", color="black")
            ax.annotate(
                f"{div[r]['abs_err_at_divergence']:.2g}",
                (d, y),
                xytext=(3, 3),
                textcoords="offset points",
                fontsize=7,
            )
    leaks = [(s, row[r]) for s, r in m["leaks"] if r in row]
    if leaks:
        ax.plot(*zip(*leaks), "s", color="tab:brown", ms=5, label="leak found")
    if len(reqs) <= 30:  # tick labels are most of the drawing time: name requests only when few
        ax.set_yticks(range(len(reqs)), reqs, fontsize=7)
        for t, r in zip(ax.get_yticklabels(), reqs):
            if r in m["affected"]:
                t.set_color(AFFECTED)
                t.set_fontweight("bold")
    ax.set_ylabel("request")
    ax.set_xlabel("engine step")
    ax.set_title(
        f"tokens per request: orange = named by an incident ({len(m['affected'])}), "
        f"red = diverged from the oracle (label: logit error; {len(v.diverged)} of "
        f"{len(v.oracle)} checked)",
        loc="left",
        fontsize=9,
    )
    if leaks:
        ax.legend(fontsize=8, loc="lower right", bbox_to_anchor=(1, 1), frameon=False)
