"""An incident's timeline: the run's events that matter, in step order, repeats folded."""

from __future__ import annotations

from kvchaos.harness.check.localize import shown
from kvchaos.harness.report.evidence import kv_text
from kvchaos.harness.report.view import RunView

TIMELINE_MAX, REPEATS_SHOWN = 80, 3
# Calls shown around a finding: what changes the manager (reads and estimates are left out)
SHOWN_CALLS = ("admit", "append", "append_decode", "fork", "release", "resize_table")


def focus_steps(results: dict) -> set[int]:
    """The steps around each checker's first finding and each named call: shown whole."""
    steps = set()
    for c in results.get("checkers", []):
        for f in c["findings"][:1] + [f for f in c["findings"] if f.get("call")][:1]:
            for s in (f["step"], (f.get("call") or {}).get("step", f["step"])):
                steps |= {s - 1, s, s + 1}
    return steps


def _answer(out) -> str:
    if isinstance(out, dict) and ("refused" in out or "raised" in out):
        return f"refused: {out['refused']}" if "refused" in out else f"raised {out['raised']}"
    return repr(out) if not isinstance(out, list) or len(out) <= 8 else f"<{len(out)} items>"


def timeline(v: RunView, results: dict) -> list[dict]:
    items = []
    focus = focus_steps(results)
    named = {
        (f["call"]["step"], f["call"].get("index"))
        for c in results.get("checkers", [])
        for f in c["findings"]
        if f.get("call")
    }

    def add(step, order, text, mark="", group=None):
        group = None if step in focus else group  # around a finding, nothing is folded
        items.append({"step": step, "order": order, "text": text, "mark": mark, "group": group})

    for i, e in enumerate(v.events):
        k, s = e.get("e"), e.get("step", 0)
        if k == "calls" and s in focus:
            for j, (name, args, out) in enumerate(e["calls"]):
                if name in SHOWN_CALLS or (isinstance(out, dict) and "raised" in out):
                    mark = "detect" if (s, j) in named else ""
                    add(s, i + j / 1000, f"call {shown(name, args)} -> {_answer(out)}", mark)
        elif k == "step" and s in focus and e.get("preempted"):
            add(s, i, f"preempted: {', '.join(e['preempted'])}")
        elif k == "run_start":
            add(
                s,
                -2,
                f"run started: {e['scenario']} seed {e['seed']} on {e['device']}, "
                f"commit {e['commit']}, "
                f"block manager {v.block_manager}",
            )
        elif k == "fault":
            d = e["detail"]
            text = (
                f"{e['fault']} armed ({'defect planted' if d.get('defect') else 'trigger only'})"
                if e["kind"] == "armed"
                else f"{e['fault']} {e['kind']}: {kv_text(d)}"
            )
            add(s, i, text, "fault", (e["fault"], e["kind"]))
        elif k == "submit" and e.get("origin", "workload") != "workload":
            add(
                s,
                i,
                f"submit {e['req']} (prompt {e['prompt_len']}, "
                f"up to {e['max_new']} new) by {e['origin']}",
                group=("submit", e["origin"]),
            )
        elif k == "cancel":
            add(
                s,
                i,
                f"cancel {e['req']} in phase {e['phase']}"
                f"{' (sharing blocks)' if e.get('shared') else ''} "
                f"holding {len(e.get('blocks', []))} blocks (by {e.get('origin')})",
                group=("cancel",),
            )
        elif k == "reject":
            add(s, i, f"reject {e['req']}: {e['error']}: {e['message']}", group=("reject",))
        elif k == "engine":
            add(
                s,
                i,
                f"engine {e['kind']}: {kv_text(e.get('data', {}))}",
                group=("engine", e["kind"]),
            )
        elif k == "oracle" and e.get("first_divergence") is not None:
            add(
                e["divergence_step"],
                i,
                f"oracle: {e['req']} diverges at token {e['first_divergence']} "
                f"(abs err {e['abs_err_at_divergence']:.3g}; checked at step {s})",
                "detect",
            )
        elif k == "error":
            add(s, i, f"error: {e['error']}: {e['message']}", "error")
        elif k == "run_end":
            add(s, i, f"run ended ({e['reason']})")
    empty = next((st for st in v.steps if st["free_blocks"] == 0), None)
    if empty:
        add(empty["step"], -1, f"free pool empty (0 of {v.num_blocks} blocks free)")
    for c in results.get("checkers", []):
        if c["findings"]:
            f = c["findings"][0]
            more = f" ({len(c['findings'])} findings in all)" if len(c["findings"]) > 1 else ""
            add(f["step"], len(v.events), f"{c['checker']} fires: {f['message']}{more}", "detect")
    items.sort(key=lambda x: (x["step"], x["order"]))
    counts, last = {}, {}
    for it in items:
        if it["group"]:
            counts[it["group"]] = counts.get(it["group"], 0) + 1
            last[it["group"]] = it["step"]
    out, seen = [], {}
    for it in items:
        g = it["group"]
        if g:
            seen[g] = seen.get(g, 0) + 1
        if g and seen[g] > REPEATS_SHOWN:
            n = seen[g]
            if n == counts[g]:
                out.append(
                    {
                        **it,
                        "text": f"... {n - REPEATS_SHOWN} more "
                        f"{' '.join(map(str, g))} events, the last "
                        f"at step {last[g]}",
                    }
                )
            continue
        out.append(it)
    if len(out) > TIMELINE_MAX:
        out = out[: TIMELINE_MAX - 1] + [
            {
                "step": out[-1]["step"],
                "text": f"... {len(out) - TIMELINE_MAX + 1} more entries: see history.jsonl",
                "mark": "",
            }
        ]
    return [
        {
            "step": it["step"],
            "t_ms": round(v.at(it["step"]), 3),
            "event": it["text"],
            "mark": it["mark"],
        }
        for it in out
    ]
