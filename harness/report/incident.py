"""Incidents from a run's own history: impact, trigger, evidence, root cause (known or suspected),
timeline, reproduction. Reads results and events; never runs anything."""

from __future__ import annotations

import statistics
from pathlib import Path

from kvchaos.harness.judge.verdict import ERROR, MEANING
from kvchaos.harness.report.view import RunView

DEFAULT_BLOCK_MANAGER = "kvchaos.engine.block_manager:BlockManager"
STRUCTURAL = (
    "table_integrity",
    "block_accounting",
    "cross_rank",
)  # wrong structure, right outputs: latent
TIMELINE_MAX, REPEATS_SHOWN, EVIDENCE_MAX = 80, 3, 12
HOW = {
    "overlong": "overflowed its block-table row",
    "foreign_block": "its table row holds blocks it does not own",
    "leak": "cancelled, but its blocks were never freed",
    "divergence": "outputs diverged from the oracle",
    "starvation": "starved: produced nothing",
    "unfinished": "never finished",
    "latency_climb": "in the batch while latency climbed",
    "stale_table": "in a batch computed on a stale table",
}


def _fault_knowledge(name: str | None, armed: dict) -> dict:
    if name is None:
        return {}
    if name in armed:
        return armed[name]
    from kvchaos.faults import REGISTRY

    f = REGISTRY.get(name)
    return (
        {
            "name": name,
            "detectors": list(f.detectors),
            "root_cause": f.root_cause,
            "remediation": f.remediation,
        }
        if f
        else {}
    )


def _subjects(results: dict, v: RunView) -> list[tuple[str, str | None, list[str]]]:
    """(kind, fault, checkers) per incident: a planted defect caught or missed, findings that no
    planted defect explains (grouped by the trigger-only fault they point at), or the run's error."""
    checks = results.get("checkers", [])
    fired = [c["checker"] for c in checks if c["valid"] is False]
    if results["verdict"] == ERROR:
        return [("error", None, fired)]
    verify = results.get("fault_verify") or {}
    expected = results.get("expectation", {}).get("checkers", [])
    out, explained = [], set()
    planted = [n for n, d in v.armed.items() if d.get("defect")]
    for name in planted:
        if not verify.get(name, {}).get("fired"):
            continue
        mine = [c for c in fired if c in v.armed[name].get("detectors", []) or c in expected]
        explained.update(mine)
        out.append(
            (
                "detection" if name in results.get("time_to_detect_steps", {}) else "missed",
                name,
                mine,
            )
        )
    groups: dict[str | None, list[str]] = {}
    for c in fired:
        if c not in explained:
            owner = next((n for n, d in v.armed.items() if c in d.get("detectors", [])), None)
            groups.setdefault(owner, []).append(c)
    kind = "unexplained" if planted else "false_alarm"
    out += [(kind, owner, cs) for owner, cs in groups.items()]
    return out


def _findings(results: dict, checkers: list[str]) -> list[dict]:
    fs = [f for c in results.get("checkers", []) if c["checker"] in checkers for f in c["findings"]]
    return sorted(fs, key=lambda f: f["step"])


def _latency_change(v: RunView, start: int | None, signal: str) -> dict | None:
    """Median of `signal` over decode-only steps from `start` on, against the run's own baseline
    (decode-only steps before `start`, or the first dozen when there are too few)."""
    dec = [
        s
        for s in v.steps
        if s.get("prefill_tokens", 0) == 0 and s.get("decode_tokens", 0) > 0 and signal in s
    ]
    if start is None or len(dec) < 4:
        return None
    before = [s[signal] for s in dec if s["step"] < start]
    after = [s[signal] for s in dec if s["step"] >= start]
    if len(before) < 3:
        before = [s[signal] for s in dec[:12]]
    if not after or not before:
        return None
    b, a = statistics.median(before), statistics.median(after)
    return {
        "signal": signal,
        "from_step": start,
        "baseline_ms": b * 1e3,
        "after_ms": a * 1e3,
        "ratio": a / b if b > 0 else None,
        "baseline_steps": len(before),
        "after_steps": len(after),
    }


def _impact(
    v: RunView, results: dict, fault: str | None, findings: list[dict], start: int | None
) -> dict:
    affected: dict[str, set[str]] = {}
    for f in findings:
        ev = f["evidence"]
        reqs = [ev[k] for k in ("req", "owner") if ev.get(k)] + list(ev.get("requests", []))
        if not reqs and f["kind"] in ("latency_climb", "stale_table"):
            reqs = sorted(v.requests_at(ev.get("window") or [f["step"]]))
        for r in reqs:
            affected.setdefault(r, set()).add(HOW.get(f["kind"], f"named by {f['checker']}"))
    for o in v.diverged:
        affected.setdefault(o["req"], set()).add(HOW["divergence"])
    tokens = sum(o["checked"] - o["first_divergence"] for o in v.diverged)

    fv = (results.get("fault_verify") or {}).get(fault, {}) if fault else {}
    leaks = [f for f in findings if f["kind"] == "leak"]
    leak_found = sorted({b for f in leaks for b in f["evidence"].get("blocks", [])})
    never_returned = max(
        (
            f["evidence"]["total"] - f["evidence"]["free"]
            for f in findings
            if f["kind"] == "end_leak" and {"total", "free"} <= set(f["evidence"])
        ),
        default=None,
    )
    verified = (
        sorted({b for x in fv.get("leaks", []) for b in x["blocks"]}) if "leaks" in fv else None
    )
    leaked = {
        "blocks": leak_found,
        "count": len(leak_found),
        "requests": sorted({f["evidence"]["req"] for f in leaks if "req" in f["evidence"]}),
        "never_returned_at_end": never_returned,
        "fault_verify_blocks": verified,
        "fault_verify_skipped_frees": fv.get("skipped_frees"),
        "matches_fault_verify": None if verified is None else set(verified) == set(leak_found),
    }

    lat_f = next((f for f in findings if f["checker"] == "latency"), None)
    signal = lat_f["evidence"].get("signal", "host_s") if lat_f else "host_s"
    latency = _latency_change(v, start, signal)
    wall = _latency_change(v, start, "latency_s") if signal != "latency_s" else None

    if not v.oracle:
        manifest, note = (
            "unknown",
            "no request reached the oracle: whether outputs were right is unknown",
        )
    elif v.diverged:
        manifest = "manifest"
        note = (
            f"outputs diverged from the contiguous-cache oracle: {len(v.diverged)} of {len(v.oracle)} checked "
            f"requests, {tokens} tokens from the first divergent one on"
        )
    elif any(f["checker"] in STRUCTURAL for f in findings):
        manifest = "latent"
        note = (
            f"the structure was wrong but all {len(v.oracle)} checked requests matched the oracle: latent, "
            f"nothing wrong was served yet"
        )
    else:
        manifest = "none"
        note = f"outputs stayed correct: all {len(v.oracle)} checked requests matched the oracle"
    return {
        "requests_affected": [{"req": r, "how": sorted(h)} for r, h in sorted(affected.items())],
        "requests_checked": len(v.oracle),
        "requests_diverged": [o["req"] for o in v.diverged],
        "tokens_diverged": tokens,
        "blocks_leaked": leaked,
        "latency": latency,
        "latency_wall": wall,
        "manifest": manifest,
        "manifest_note": note,
    }


def _plan_line(a: dict) -> str:
    what = f"{a['op']} {a['req']}"
    if a["op"] in ("submit", "fork"):
        what += f" (prompt {a['prompt_len']} tokens, up to {a['max_new']} new)"
    if a.get("parent"):
        what += f" from {a['parent']}"
    if a.get("when"):
        what += f" when it is in phase {a['when']}"
    return f"{what} at step {a['step']}"


def _kv(d: dict) -> str:
    return ", ".join(
        f"{k}={v}" for k, v in d.items() if not isinstance(v, (list, dict)) or len(str(v)) < 60
    )


def _trigger(v: RunView, fault: str | None, fv: dict) -> dict:
    cfg = v.start.get("config", {})
    cc = cfg.get("cache", {})
    engine = (
        (
            f"{cc.get('num_blocks')} blocks of {cc.get('block_size')} tokens; table {cc.get('max_num_seqs')} rows x "
            f"{cc.get('max_blocks_per_seq')} blocks ({(cc.get('max_blocks_per_seq') or 0) * (cc.get('block_size') or 0)} "
            f"tokens per sequence); tp_size {cfg.get('tp_size')}; block manager "
            f"{v.start.get('block_manager', DEFAULT_BLOCK_MANAGER)}"
        )
        if cc
        else "unknown (no run_start event)"
    )
    plan = v.start.get("plan", [])
    if fault is None:
        ops = {}
        for a in plan:
            ops[a["op"]] = ops.get(a["op"], 0) + 1
        return {
            "fault": None,
            "engine": engine,
            "actions": [],
            "events": [],
            "events_total": 0,
            "description": "no fault armed for this: the workload alone ("
            + (", ".join(f"{n} {op}s" for op, n in ops.items()) or "no actions")
            + ")",
        }
    d = v.armed.get(fault, {})
    acts = [_plan_line(a) for a in plan if a.get("origin") == fault]
    evs = [
        e
        for e in v.by.get("fault", [])
        if e["fault"] == fault and e["kind"] in ("trigger", "fired")
    ]
    trig = [e for e in evs if e["kind"] == "trigger"]
    desc = f"{fault} armed ({'defect planted' if d.get('defect') else 'trigger only'}) with {_kv(d.get('params', {}))}"
    if acts:
        desc += f"; it added {len(acts)} workload actions, first: {acts[0]}"
    if trig:
        desc += f"; trigger pulled {len(trig)} times, first at step {trig[0]['step']} ({_kv(trig[0]['detail'])})"
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
            {"step": e["step"], "kind": e["kind"], "detail": _kv(e["detail"])}
            for e in evs[:EVIDENCE_MAX]
        ],
        "events_total": len(evs),
        "description": desc,
    }


def _evidence(v: RunView, f: dict, fv: dict) -> dict:
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
            "text": f"request {ev['req']}: logit error {ev['abs_err_at_divergence']:.3g} at generated token "
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
            "text": f"victim row {ev['row']} ({owner}) at step {s}: intruding blocks {ev['intruders']} at entries "
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
            "text": f"request {ev['req']} in row {ev['row']} holds {ev['blocks']} blocks, {ev['width']} fit: blocks "
            f"{spill} were written past the row's end, into row {ev['row'] + 1}",
        }
    if k == "leak":
        c = ev.get("cancel") or {}
        in_verify = (
            any(x["req"] == ev["req"] for x in fv.get("leaks", [])) if "leaks" in fv else None
        )
        how = (
            (
                f"cancel at step {c['step']} in phase {c['phase']}{' while sharing blocks' if c.get('shared') else ''} "
                f"(by {c.get('origin')})"
            )
            if c
            else "no cancel recorded"
        )
        return {
            "type": "leak",
            "step": s,
            "req": ev["req"],
            "blocks": ev["blocks"],
            "cancel": c,
            "in_fault_verify": in_verify,
            "text": f"request {ev['req']} leaked blocks {ev['blocks']}: the {how} did not free them",
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
            "text": f"{sig}: baseline {ev['baseline_ms']:.2f} ms, rolling median {ev['rolling_median_ms']:.2f} ms "
            f"(x{ev['ratio']:.1f}) over steps {ev['window'][0]}-{ev['window'][-1]}, climb began at step "
            f"{ev['climb_started_step']}, plateau {ev['plateau_ms']:.2f} ms",
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


def _detection(
    v: RunView, results: dict, kind: str, fault: str | None, findings: list[dict], start: int | None
) -> dict:
    exp = results.get("expectation", {})
    fv = (results.get("fault_verify") or {}).get(fault, {}) if fault else {}
    caught = [f for f in findings if start is None or f["step"] >= start]
    first = next(
        (f for f in caught if f["checker"] in exp.get("checkers", [])),
        caught[0] if caught else None,
    )
    ttd = results.get("time_to_detect_steps", {}).get(fault) if fault else None
    if ttd is None and first is not None and start is not None:
        ttd = first["step"] - start
    ttd_ms = (
        v.at(first["step"]) - v.at(start - 1) if first is not None and start is not None else None
    )
    limits = {"leak": EVIDENCE_MAX, "divergence": 5, "foreign_block": 3, "stale_table": 3}
    evidence, per = [], {}
    for f in caught or findings:
        per[f["kind"]] = per.get(f["kind"], 0) + 1
        if per[f["kind"]] <= limits.get(f["kind"], 1) and len(evidence) < EVIDENCE_MAX:
            evidence.append(_evidence(v, f, fv))
    err = _error(v, results)
    if kind == "error" and err:
        status = f"{err['error']} at step {err.get('step', '?')}: {err['message']}"
    elif kind == "missed":
        status = (
            f"not caught: {exp.get('checkers')} had to fire within {exp.get('within_steps')} steps of step {start}"
            + (f"; the first finding came {ttd} steps after it" if first else "; nothing fired")
        )
    elif first:
        status = f"{first['checker']} fired at step {first['step']}: {first['message']}"
    else:
        status = "no checker fired"
    return {
        "status": status,
        "checkers": sorted({f["checker"] for f in findings}),
        "expected": exp.get("checkers", []),
        "within_steps": exp.get("within_steps"),
        "first_step": first["step"] if first else None,
        "fault_first_step": start,
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


def _error(v: RunView, results: dict) -> dict | None:
    return next(iter(v.by.get("error", [])), None) or results.get(
        "error"
    )  # the history's has the traceback


def _where(err: dict | None) -> str | None:
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


def _root_cause(
    v: RunView, kind: str, fault: str | None, checkers: list[str], results: dict
) -> tuple[dict, str]:
    bm = v.start.get("block_manager", DEFAULT_BLOCK_MANAGER)
    own = bm != DEFAULT_BLOCK_MANAGER
    if kind == "error":
        err = _error(v, results)
        unknown = [c for c in results.get("checkers", []) if c["valid"] is None]
        if err:
            where = f" (raised at {_where(err)})" if _where(err) else ""
            text = f"the run broke with {err['error']}: {err['message']}{where}"
            fix = "fix the exception above (the traceback is in history.jsonl), then replay the run to confirm"
        else:
            text = "checker(s) could not decide: " + "; ".join(
                f"{c['checker']}: {(c.get('error') or 'no traceback').strip().splitlines()[-1]}"
                for c in unknown
            )
            fix = "fix the checker (its traceback is in results.json), then `kvchaos analyze` this run again"
        return {"status": "suspected", "text": text, "source": "the run's error"}, fix
    k = _fault_knowledge(fault, v.armed)
    if kind in ("detection", "missed"):
        text = k.get("root_cause", "")
        if own:
            text = (
                f"the run used your block manager {bm}; the planted {fault} defect explains the findings "
                f"if your code behaves like the reference: {text}"
            )
        if kind == "missed":
            text += (
                f" The harness then failed: none of {results.get('expectation', {}).get('checkers')} caught it in "
                f"time."
            )
        fix = k.get("remediation", "")
        if kind == "missed":
            fix += " Harness: make the expected checker see this failure mode sooner (the evidence above shows what it saw)."
        return {
            "status": "suspected" if own else "known",
            "text": text,
            "source": f"the planted {fault} defect" + (f" under {bm}" if own else ""),
        }, fix
    if (
        fault is not None
    ):  # a trigger-only fault whose detectors fired: the remediation did not hold
        return {
            "status": "suspected",
            "source": f"the {fault} trigger (no defect planted)",
            "text": f"the engine's remediation for {fault} did not hold under its trigger"
            f"{' in your block manager ' + bm if own else ''}; what that failure looks like: "
            f"{k.get('root_cause', '')} Or the checker is wrong: a harness false positive.",
        }, k.get("remediation", "")
    from kvchaos.faults import REGISTRY

    cands = [f for f in REGISTRY.values() if checkers and checkers[0] in f.detectors]
    text = (
        f"nothing was planted, so the harness cannot know. {', '.join(checkers)} "
        f"{'is' if len(checkers) == 1 else 'are'} built to catch: "
        + " / ".join(f"{f.name}: {f.root_cause}" for f in cands)
        if cands
        else f"nothing was planted and no known failure mode is caught by {', '.join(checkers)}"
    )
    text += " Or the checker is wrong: a harness false positive (check the evidence)."
    return {
        "status": "suspected",
        "text": text,
        "source": "the checkers' findings only",
    }, " / ".join(
        f"if {f.name}: {f.remediation}" for f in cands
    ) or "investigate the evidence above"


def _timeline(v: RunView, results: dict) -> list[dict]:
    items = []

    def add(step, order, text, mark="", group=None):
        items.append({"step": step, "order": order, "text": text, "mark": mark, "group": group})

    for i, e in enumerate(v.events):
        k, s = e.get("e"), e.get("step", 0)
        if k == "run_start":
            add(
                s,
                -2,
                f"run started: {e['scenario']} seed {e['seed']} on {e['device']}, commit {e['commit']}, "
                f"block manager {e.get('block_manager', DEFAULT_BLOCK_MANAGER)}",
            )
        elif k == "fault":
            d = e["detail"]
            text = (
                f"{e['fault']} armed ({'defect planted' if d.get('defect') else 'trigger only'})"
                if e["kind"] == "armed"
                else f"{e['fault']} {e['kind']}: {_kv(d)}"
            )
            add(s, i, text, "fault", (e["fault"], e["kind"]))
        elif k == "submit" and e.get("origin", "workload") != "workload":
            add(
                s,
                i,
                f"submit {e['req']} (prompt {e['prompt_len']}, up to {e['max_new']} new) by {e['origin']}",
                group=("submit", e["origin"]),
            )
        elif k == "cancel":
            add(
                s,
                i,
                f"cancel {e['req']} in phase {e['phase']}{' (sharing blocks)' if e.get('shared') else ''} "
                f"holding {len(e.get('blocks', []))} blocks (by {e.get('origin')})",
                group=("cancel",),
            )
        elif k == "reject":
            add(s, i, f"reject {e['req']}: {e['error']}: {e['message']}", group=("reject",))
        elif k == "engine":
            add(s, i, f"engine {e['kind']}: {_kv(e.get('data', {}))}", group=("engine", e["kind"]))
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
                        "text": f"... {n - REPEATS_SHOWN} more {' '.join(map(str, g))} events, the last "
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


def _severity(kind: str, impact: dict, checkers: list[str]) -> tuple[str, str]:
    if impact["tokens_diverged"]:
        return (
            "SEV1",
            f"wrong outputs served: {impact['tokens_diverged']} tokens diverged from the oracle",
        )
    if kind == "missed":
        return "SEV1", "a defect fired and the harness did not catch it in time"
    if kind == "error":
        return "SEV2", "the run itself broke"
    if any(c in STRUCTURAL + ("liveness",) for c in checkers):
        return "SEV2", "latent corruption or lost capacity: outputs still correct"
    return "SEV3", "performance only: outputs correct"


def _summary(kind, fault, det, impact, fv) -> str:
    lat = impact["latency"]
    bits = [
        f"requests affected: {len(impact['requests_affected'])}",
        f"tokens diverged: {impact['tokens_diverged']}",
        f"blocks leaked: {impact['blocks_leaked']['count']}",
    ]
    if lat and lat["ratio"]:
        bits.append(f"{lat['signal']} x{lat['ratio']:.1f} against the run's baseline")
    bits.append(
        {
            "manifest": "wrong outputs served (manifest)",
            "latent": "latent: outputs still matched the oracle",
            "none": "outputs correct",
            "unknown": "outputs not checked",
        }[impact["manifest"]]
    )
    if kind == "detection":
        lead = (
            f"The planted {fault} defect fired first at step {fv.get('first_step')} ({fv.get('times')} times) and "
            f"{', '.join(det['checkers'])} caught it {det['time_to_detect_steps']} steps later."
        )
    elif kind == "missed":
        lead = f"The planted {fault} defect fired first at step {fv.get('first_step')} and was {det['status']}."
    elif kind == "error":
        lead = f"The run broke: {det['status']}."
    else:
        why = (
            "with nothing planted"
            if kind == "false_alarm"
            else "and the planted defect does not explain it"
        )
        lead = f"{', '.join(det['checkers'])} fired {why} (first at step {det['first_step']})."
    return f"{lead} Impact: " + "; ".join(bits) + "."


def _title(kind, fault, det, results) -> str:
    where = f"{results['scenario']} seed {results['seed']}"
    if kind == "detection":
        return (
            f"{fault} caught by {', '.join(det['checkers'])} at step {det['first_step']} ({where})"
        )
    if kind == "missed":
        return f"{fault} fired at step {det['fault_first_step']} and was missed ({where})"
    if kind == "error":
        err = results.get("error") or {}
        return f"run error: {err.get('error', 'checker could not decide')}: {str(err.get('message', ''))[:80]} ({where})"
    label = "false alarm" if kind == "false_alarm" else "unexplained finding"
    return f"{label}: {', '.join(det['checkers'])} fired at step {det['first_step']} ({where})"


def build_incidents(results: dict, events: list[dict], run_dir: Path | None = None) -> list[dict]:
    """The incidents of one run as plain data (what results.json holds and the templates render)."""
    v = RunView(events)
    timeline = None
    out = []
    for kind, fault, checkers in _subjects(results, v):
        fv = (results.get("fault_verify") or {}).get(fault, {}) if fault else {}
        findings = _findings(results, checkers)
        start = (
            fv.get("first_step") if fv.get("fired") else (findings[0]["step"] if findings else None)
        )
        impact = _impact(v, results, fault, findings, start)
        det = _detection(v, results, kind, fault, findings, start)
        root, fix = _root_cause(v, kind, fault, checkers, results)
        sev, why = _severity(kind, impact, checkers)
        timeline = timeline or _timeline(v, results)
        n = len(out) + 1
        replay = results.get("replay", "")
        bm = v.start.get("block_manager", DEFAULT_BLOCK_MANAGER)
        if bm != DEFAULT_BLOCK_MANAGER and "--block-manager" not in replay:
            replay += f" --block-manager {bm}"
        first = det["findings"][0] if det["findings"] else {}
        err = _error(v, results) if kind == "error" else None
        fingerprint = (
            {"failure_mode": "error", "checker": err["error"], "site": _where(err)}
            if err
            else {
                "failure_mode": fault or "none",
                "checker": first.get("checker"),
                "site": first.get("kind"),
            }
        )
        out.append(
            {
                "id": f"incident-{n:03d}",
                "file": f"incident-{n:03d}.md",
                "kind": kind,
                "title": _title(kind, fault, det, results),
                "severity": sev,
                "severity_reason": why,
                "fingerprint": fingerprint,
                "verdict": {
                    "run": results["verdict"],
                    "meaning": MEANING.get(results["verdict"], ""),
                    "summary": results.get("summary", ""),
                    "expectation": results.get("expectation", {}),
                },
                "summary": _summary(kind, fault, det, impact, fv),
                "impact": impact,
                "trigger": _trigger(v, fault, fv),
                "detection": det,
                "root_cause": root,
                "remediation": fix,
                "timeline": timeline,
                "reproduction": {
                    "command": replay,
                    "seed": results.get("seed"),
                    "commit": results.get("commit"),
                    "config_hash": results.get("config_hash"),
                    "device": results.get("device"),
                    "block_manager": bm,
                    "analyze": f"kvchaos analyze {run_dir}" if run_dir else None,
                },
                "minimal_reproducer": results.get("minimal_reproducer")
                or {"status": f"not shrunk yet: run `kvchaos shrink {run_dir or 'RUN_DIR'}`"},
                "what_held": [
                    {"checker": c["checker"], "checked": c["checked"]}
                    for c in results.get("checkers", [])
                    if c["valid"] is True
                ],
            }
        )
    return out
