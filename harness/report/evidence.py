"""What an incident shows of its cause: the trigger (the plan's actions, the engine's config) and
each finding's evidence, read from the run's own events and snapshots."""

from __future__ import annotations

from pathlib import Path

from kvchaos.harness.report.view import RunView

EVIDENCE_MAX = 12  # evidence entries shown per incident


def plan_line(a: dict) -> str:
    what = f"{a['op']} {a['req']}"
    if a["op"] == "turn":  # its prompt: the previous turn's prompt and output, then these
        what += f" ({a['prompt_len']} tokens after {a['parent']}'s, up to {a['max_new']} new)"
    elif a["op"] in ("submit", "fork"):
        what += f" (prompt {a['prompt_len']} tokens, up to {a['max_new']} new)"
    if a.get("parent") and a["op"] != "turn":
        what += f" from {a['parent']}"
    target = a.get("after") or a.get("parent") or "it"
    if a.get("when") == "finished":
        what += f" once {target} has finished"
    elif a.get("when"):
        what += f" when {target} is in phase {a['when']}"
    return f"{what} at step {a['step']}"


def kv_text(d: dict) -> str:
    return ", ".join(
        f"{k}={v}" for k, v in d.items() if not isinstance(v, (list, dict)) or len(str(v)) < 60
    )


def done_counts(v: RunView, origin: str | None = None) -> dict[str, int]:
    """What the history says was done, by plan op: requests submitted, forked (a submit with a
    parent), next turns (a submit with turn_of) and cancelled, each an event of its own (the run's
    metrics count the same events)."""
    mine = [e for k in ("submit", "cancel") for e in v.by.get(k, [])]
    out = {"submit": 0, "fork": 0, "turn": 0, "cancel": 0}
    for e in mine:
        if origin is None or e.get("origin") == origin:
            op = "cancel" if e["e"] == "cancel" else "fork" if e.get("parent") else "submit"
            out["turn" if e.get("turn_of") else op] += 1
    return out


DONE_WORDS = {"submit": "submitted", "fork": "forked", "turn": "next turns", "cancel": "cancelled"}


def planned_and_done(v: RunView, actions: list[dict]) -> str:
    """'16 submits, 2 forks, 7 cancels planned; done: 16 submitted, 0 forked, 4 cancelled': the
    plan's actions by op, then what the history shows done of each (a cancel waits for its request's
    phase, a fork for its parent's: one whose moment never came is planned, never done)."""
    ops: dict[str, int] = {}
    for a in actions:
        ops[a["op"]] = ops.get(a["op"], 0) + 1
    if not ops:
        return "no actions"
    origins = {a.get("origin") for a in actions}
    done = done_counts(v, origins.pop() if len(origins) == 1 else None)
    planned = ", ".join(f"{n} {op}s" for op, n in ops.items())
    did = ", ".join(f"{done[op]} {DONE_WORDS[op]}" for op in ops if op in done)
    return f"{planned} planned; done: {did}" if did else planned


def trigger_section(v: RunView, fault: str | None, fv: dict) -> dict:
    cfg = v.start.get("config", {})
    cc = cfg.get("cache", {})
    engine = (
        (
            f"{cc.get('num_blocks')} blocks of {cc.get('block_size')} tokens; "
            f"table {cc.get('max_num_seqs')} rows x "
            f"{cc.get('max_blocks_per_seq')} blocks "
            f"({(cc.get('max_blocks_per_seq') or 0) * (cc.get('block_size') or 0)} "
            f"tokens per sequence); tp_size {cfg.get('tp_size')}; block manager "
            f"{v.block_manager}"
        )
        if cc
        else "unknown (no run_start event)"
    )
    plan = v.start.get("plan", [])
    if fault is None:
        return {
            "fault": None,
            "engine": engine,
            "actions": [],
            "events": [],
            "events_total": 0,
            "description": "no fault armed for this: the workload alone ("
            + planned_and_done(v, plan)
            + ")",
        }
    d = v.armed.get(fault, {})
    mine = [a for a in plan if a.get("origin") == fault]
    acts = [plan_line(a) for a in mine]
    evs = [
        e
        for e in v.by.get("fault", [])
        if e["fault"] == fault and e["kind"] in ("trigger", "fired")
    ]
    trig = [e for e in evs if e["kind"] == "trigger"]
    desc = (
        f"{fault} armed ({'defect planted' if d.get('defect') else 'trigger only'}) "
        f"with {kv_text(d.get('params', {}))}"
    )
    if acts:
        desc += f"; it added workload actions ({planned_and_done(v, mine)}), first: {acts[0]}"
    if trig:
        desc += (
            f"; trigger pulled {len(trig)} times, first at step {trig[0]['step']} "
            f"({kv_text(trig[0]['detail'])})"
        )
    if fv.get("fired"):
        desc += (
            f"; the defect fired first at step {fv['first_step']}, {fv.get('times')} times in all"
        )
    return {
        "fault": fault,
        "defect": d.get("defect"),
        "params": d.get("params", {}),
        "engine": engine,
        "actions": acts,
        "events": [
            {"step": e["step"], "kind": e["kind"], "detail": kv_text(e["detail"])}
            for e in evs[:EVIDENCE_MAX]
        ],
        "events_total": len(evs),
        "description": desc,
    }


def evidence_entry(v: RunView, f: dict, fv: dict) -> dict:
    try:
        return _evidence_of(v, f, fv)
    except (
        KeyError,
        IndexError,
        TypeError,
        ValueError,
    ):  # a checker changed its evidence: show it raw
        return {
            "type": f["checker"],
            "step": f["step"],
            "text": f["message"],
            "data": f["evidence"],
        }


def _evidence_of(v: RunView, f: dict, fv: dict) -> dict:
    ev, k, s = f["evidence"], f["kind"], f["step"]
    if k == "divergence":
        o = next((o for o in v.diverged if o["req"] == ev["req"]), {})
        return {
            "type": "logit_error",
            "step": s,
            "req": ev["req"],
            "token": ev["first_divergence"],
            "abs_err": ev["abs_err_at_divergence"],
            "tolerance": ev["tolerance"],
            "max_abs_err": ev["max_abs_err"],
            "checked": ev["checked"],
            "checked_at_step": o.get("step"),
            "text": f"request {ev['req']}: logit error {ev['abs_err_at_divergence']:.3g} "
            f"at generated token "
            f"{ev['first_divergence']} (step {s}) against a tolerance of {ev['tolerance']:.3g}; "
            f"max {ev['max_abs_err']:.3g} over {ev['checked']} tokens",
        }
    if k == "foreign_block":
        prev = v.snapshot_before(s)
        now = v.snapshot_at(s)
        w = now["table_width"] if now else len(ev["row_now"])
        before = prev["table"][ev["row"] * w : (ev["row"] + 1) * w] if prev else None
        holders = {}
        for b in ev["intruders"]:
            holders[b] = sorted(r for r, bl in (now or {}).get("seq_blocks", {}).items() if b in bl)
        owner = ev["owner"] or "no sequence"
        return {
            "type": "table_rows",
            "step": s,
            "row": ev["row"],
            "owner": ev["owner"],
            "entries": ev["entries"],
            "intruders": ev["intruders"],
            "intruder_holders": {str(b): h for b, h in holders.items()},
            "before_step": prev["step"] if prev else None,
            "before": before,
            "after": ev["row_now"],
            "expected": ev["row_expected"],
            "text": f"victim row {ev['row']} ({owner}) at step {s}: "
            f"intruding blocks {ev['intruders']} at entries "
            f"{ev['entries']}"
            + "".join(f"; block {b} belongs to {', '.join(h)}" for b, h in holders.items() if h),
        }
    if k == "overlong":
        snap = v.snapshot_at(s)
        spill = snap["seq_blocks"].get(ev["req"], [])[ev["width"] :] if snap else []
        return {
            "type": "overlong",
            "step": s,
            "req": ev["req"],
            "row": ev["row"],
            "blocks": ev["blocks"],
            "width": ev["width"],
            "spill": spill,
            "victim_row": ev["row"] + 1,
            "text": f"request {ev['req']} in row {ev['row']} holds {ev['blocks']} blocks, "
            f"{ev['width']} fit: blocks "
            f"{spill} were written past the row's end, into row {ev['row'] + 1}",
        }
    if k == "leak":
        c = ev.get("cancel") or {}
        # only a planted defect's verify() lists leaks: a trigger-only fault's says nothing
        in_verify = (
            any(x["req"] == ev["req"] for x in fv.get("leaks", []))
            if "leaks" in fv and fv.get("planted", True)
            else None
        )
        if c:
            how = (
                f"the cancel at step {c['step']} in phase {c['phase']}"
                f"{' while sharing blocks' if c.get('shared') else ''} "
                f"(by {c.get('origin')}) did not free them"
            )
        elif ev["req"] in v.finished:
            how = f"it finished at step {v.finished[ev['req']]} and they were never freed"
        else:
            how = "it ended and they were never freed"
        return {
            "type": "leak",
            "step": s,
            "req": ev["req"],
            "blocks": ev["blocks"],
            "cancel": c,
            "finished_step": v.finished.get(ev["req"]),
            "in_fault_verify": in_verify,
            "text": f"request {ev['req']} leaked blocks {ev['blocks']}: {how}",
        }
    if k == "latency_climb":
        sig = ev["signal"]
        per = {st["step"]: st[sig] for st in v.steps if st["step"] in set(ev["window"])}
        return {
            "type": "latency_window",
            "step": s,
            "signal": sig,
            "baseline_ms": ev["baseline_ms"],
            "rolling_median_ms": ev["rolling_median_ms"],
            "ratio": ev["ratio"],
            "plateau_ms": ev["plateau_ms"],
            "climb_started_step": ev["climb_started_step"],
            "window": [
                {"step": st, "ms": round(per[st] * 1e3, 3)} for st in ev["window"] if st in per
            ],
            "text": f"{sig}: baseline {ev['baseline_ms']:.2f} ms, "
            f"rolling median {ev['rolling_median_ms']:.2f} ms "
            f"(x{ev['ratio']:.1f}) over steps {ev['window'][0]}-{ev['window'][-1]}, "
            f"climb began at step "
            f"{ev['climb_started_step']}, plateau {ev['plateau_ms']:.2f} ms",
        }
    if k == "staging_slow":  # each upload's staging copy beside its calibration
        per = {st["step"]: st for st in v.steps if st["step"] in set(ev["steps"])}
        return {
            "type": "staging_window",
            "step": s,
            "signal": "stage_s",
            "ratio": ev["ratio"],
            "window": [
                {
                    "step": st,
                    "ms": round(per[st]["stage_s"] * 1e3, 3),
                    "probe_ms": round(per[st]["probe_s"] * 1e3, 3),
                }
                for st in ev["steps"]
                if st in per
            ],
            "text": f"staging copy {ev['stage_ms']:.3f} ms vs its calibration "
            f"{ev['probe_ms']:.3f} ms (x{ev['ratio']:.1f}) over steps {ev['steps'][0]}-"
            f"{ev['steps'][-1]}; {ev['stalled_steps']} of {ev['judged_steps']} judged uploads "
            f"stalled, in {ev['bursts']} bursts",
        }
    if k == "stale_table":
        seen_at = {
            st["table_crc"]: st["step"] for st in v.steps if st["step"] < s
        }  # the latest step per table hash
        lag = {r: seen_at.get(ev["rank_crcs"][r]) for r in ev["ranks"]}
        how = "; ".join(
            f"rank {r} computed on "
            + (
                f"the scheduler's table of step {p} ({s - p} step(s) stale)"
                if p is not None
                else "a table the scheduler never had"
            )
            for r, p in lag.items()
        )
        return {
            "type": "stale_table",
            "step": s,
            "ranks": ev["ranks"],
            "rank_crcs": ev["rank_crcs"],
            "table_crc": ev["table_crc"],
            "stale_since": {str(r): p for r, p in lag.items()},
            "text": f"step {s}: {how}",
        }
    return {"type": f["checker"], "step": s, "text": f["message"], "data": ev}


def detection(
    v: RunView, results: dict, kind: str, fault: str | None, findings: list[dict], start: int | None
) -> dict:
    exp = results.get("expectation", {})
    fv = (results.get("fault_verify") or {}).get(fault, {}) if fault else {}
    caught = [f for f in findings if start is None or f["step"] >= start]
    first = next(
        (f for f in caught if f["checker"] in exp.get("checkers", [])),
        caught[0] if caught else None,
    )
    # time to detect counts from a firing: with nothing fired there is nothing to time
    fired = fv.get("first_step") if fv.get("fired") else None
    ttd = results.get("time_to_detect_steps", {}).get(fault) if fault else None
    if ttd is None and first is not None and fired is not None:
        ttd = first["step"] - fired
    ttd_ms = (
        v.at(first["step"]) - v.at(fired - 1) if first is not None and fired is not None else None
    )
    limits = {"leak": EVIDENCE_MAX, "divergence": 5, "foreign_block": 3, "stale_table": 3}
    evidence, per = [], {}
    for f in caught or findings:
        per[f["kind"]] = per.get(f["kind"], 0) + 1
        if per[f["kind"]] <= limits.get(f["kind"], 1) and len(evidence) < EVIDENCE_MAX:
            evidence.append(evidence_entry(v, f, fv))
    err = run_error(v, results)
    if kind == "error" and err:
        status = f"{err['error']} at step {err.get('step', '?')}: {err['message']}"
    elif kind == "error":
        unknown = [c["checker"] for c in results.get("checkers", []) if c["valid"] is None]
        status = f"checker(s) could not decide: {', '.join(unknown) or '?'}"
    elif kind == "missed":
        status = (
            f"not caught: {exp.get('checkers')} had to fire "
            f"within {exp.get('within_steps')} steps of step {start}"
            + (f"; the first finding came {ttd} steps after it" if first else "; nothing fired")
        )
    elif first:
        status = f"{first['checker']} fired at step {first['step']}: {first['message']}"
    else:
        status = "no checker fired"
    return {
        "status": status,
        "checkers": sorted({f["checker"] for f in findings}),
        # the ones that fired at the detection step: what caught it (the others came later)
        "caught_by": sorted({f["checker"] for f in caught if first and f["step"] == first["step"]})
        or sorted({f["checker"] for f in findings}),
        "expected": exp.get("checkers", []),
        "within_steps": exp.get("within_steps"),
        "first_step": first["step"] if first else None,
        "fault_first_step": fired,
        "time_to_detect_steps": ttd,
        "time_to_detect_ms": round(ttd_ms, 3) if ttd_ms is not None else None,
        "findings_total": len(findings),
        "stale_ranks": sorted(
            {
                r
                for f in findings
                if f["kind"] == "stale_table"
                for r in f["evidence"].get("ranks", [])
            }
        ),
        "findings": [
            {k: f[k] for k in ("checker", "step", "kind", "message")}
            for f in findings[:EVIDENCE_MAX]
        ],
        "evidence": evidence,
    }


def run_error(v: RunView, results: dict) -> dict | None:
    return next(iter(v.by.get("error", [])), None) or results.get(
        "error"
    )  # the history's has the traceback


def error_site(err: dict | None) -> str | None:
    """file:line of the innermost frame of an error's traceback."""
    frames = [
        ln.strip()
        for ln in ((err or {}).get("traceback") or "").splitlines()
        if ln.strip().startswith("File ")
    ]
    if not frames:
        return None
    parts = frames[-1].split('"')
    line = frames[-1].split("line ")[-1].split(",")[0]
    return f"{Path(parts[1]).name}:{line}" if len(parts) > 2 else frames[-1]
