"""Each checker on small hand-made histories: it fires where it must (at the right step, with the
right kind of finding) and stays silent where it must not. A checker that raises gives an
unknown result (valid=None) through run_checkers, never a pass."""

from __future__ import annotations

import random

import pytest

from kvchaos.harness.check.checkers import (
    CHECKERS,
    check_block_accounting,
    check_cross_rank,
    check_latency,
    check_liveness,
    check_oracle_divergence,
    check_table_integrity,
    run_checkers,
)


# -- tiny constructors for history events (schema: harness/history.py) ---------------------------
def submit(req, step=1, prompt_len=4, max_new=4, parent=None):
    return {
        "e": "submit",
        "step": step,
        "req": req,
        "prompt_len": prompt_len,
        "max_new": max_new,
        "parent": parent,
    }


def reject(req, step=1):
    return {
        "e": "reject",
        "step": step,
        "req": req,
        "error": "RequestRejected",
        "message": "too long",
    }


def cancel(req, step, phase="decode", blocks=(), shared=False):
    return {
        "e": "cancel",
        "step": step,
        "req": req,
        "phase": phase,
        "shared": shared,
        "blocks": list(blocks),
    }


def step(
    n,
    tokens=None,
    finished=(),
    host_s=1e-3,
    latency_s=None,
    prefill=0,
    decode=1,
    rank_crcs=(),
    table_crc=0,
    stale_ranks=(),
):
    return {
        "e": "step",
        "step": n,
        "latency_s": host_s * 2 if latency_s is None else latency_s,
        "host_s": host_s,
        "free_blocks": 0,
        "running": 1,
        "waiting": 0,
        "prefill_tokens": prefill,
        "decode_tokens": decode,
        "preempted": [],
        "tokens": dict(tokens or {}),
        "finished": list(finished),
        "table_version": n,
        "stale_ranks": list(stale_ranks),
        "rank_crcs": list(rank_crcs),
        "table_crc": table_crc,
    }


def snapshot(
    n,
    seq_blocks,
    num_blocks=8,
    width=4,
    rows=3,
    seq_rows=None,
    free=None,
    ref_counts=None,
    table=None,
    live=None,
):
    """A consistent block-manager snapshot unless a field is overridden: ref counts from the
    holders, every unreferenced block free, each sequence's row = its blocks padded with -1."""
    seq_rows = dict(seq_rows if seq_rows is not None else {s: i for i, s in enumerate(seq_blocks)})
    refs = [0] * num_blocks
    for blocks in seq_blocks.values():
        for b in blocks:
            refs[b] += 1
    if table is None:
        table = [-1] * (rows * width)
        for s, r in seq_rows.items():
            for i, b in enumerate(seq_blocks.get(s, [])[:width]):
                table[r * width + i] = b
    return {
        "e": "snapshot",
        "step": n,
        "num_blocks": num_blocks,
        "free": list(free) if free is not None else [b for b in range(num_blocks) if refs[b] == 0],
        "ref_counts": list(ref_counts) if ref_counts is not None else refs,
        "seq_blocks": {s: list(b) for s, b in seq_blocks.items()},
        "seq_rows": seq_rows,
        "table": list(table),
        "table_width": width,
        "live": list(seq_blocks) if live is None else live,
    }


def oracle(req, n, first_divergence=None, divergence_step=None, checked=6):
    div = first_divergence is not None
    return {
        "e": "oracle",
        "step": n,
        "req": req,
        "checked": checked,
        "max_abs_err": 0.5 if div else 1e-6,
        "max_rel_err": 0.1 if div else 1e-6,
        "first_divergence": first_divergence,
        "abs_err_at_divergence": 0.5 if div else None,
        "tolerance": 1e-4 if div else None,
        "divergence_step": divergence_step,
    }


def run_end(n, reason="done"):
    return {"e": "run_end", "step": n, "reason": reason, "counters": {}, "fault_verify": {}}


def kinds(result):
    return [(f.step, f.kind) for f in result.findings]


# -- oracle divergence -------------------------------------------------------------------------
def test_oracle_divergence_fires_at_the_engine_step_of_the_first_divergent_token():
    h = [
        submit("r0"),
        submit("r1"),
        oracle("r0", 9),
        oracle("r1", 12, first_divergence=3, divergence_step=7),
    ]
    r = check_oracle_divergence(h)
    assert r.valid is False and r.checked == 2
    (f,) = r.findings
    assert (f.step, f.kind, f.manifest) == (7, "divergence", True)
    assert f.evidence["req"] == "r1" and f.evidence["first_divergence"] == 3
    assert "r1" in f.message and "token 3" in f.message


def test_oracle_divergence_silent_when_every_request_matches():
    r = check_oracle_divergence([oracle("r0", 9), oracle("r1", 12), oracle("r2", 3, checked=0)])
    assert r.valid is True and r.findings == [] and r.checked == 3


# -- block accounting --------------------------------------------------------------------------
def test_block_accounting_silent_on_a_clean_run_with_sharing_cancel_and_finish():
    h = [
        submit("r0"),
        submit("r1", parent=None),
        snapshot(1, {"r0": [0, 1], "r1": [2]}),
        submit("f0", step=2, parent="r0"),
        snapshot(2, {"r0": [0, 1], "r1": [2], "f0": [0, 1]}),  # ref 2 on 0, 1
        cancel("r1", 3, blocks=[2]),
        step(3, finished=["f0"]),
        snapshot(3, {"r0": [0, 1, 3]}),
        step(4, finished=["r0"]),
        snapshot(4, {}),
        run_end(4),
    ]
    r = check_block_accounting(h)
    assert r.valid is True and r.findings == [] and r.checked == 4


def test_block_accounting_conservation_missing_block():
    s = snapshot(5, {"r0": [0, 1]})
    s["free"].remove(7)  # block 7: neither free nor referenced
    r = check_block_accounting([submit("r0"), s])
    assert kinds(r) == [(5, "conservation")]
    assert r.findings[0].evidence == {"free": 5, "referenced": 2, "total": 8}
    assert r.findings[0].manifest is False


def test_block_accounting_conservation_duplicate_free_entry():
    s = snapshot(2, {"r0": [0]})
    s["free"].remove(7)
    s["free"].append(3)  # 3 twice: the counts add up but the free list is corrupt
    r = check_block_accounting([s])
    assert kinds(r) == [(2, "conservation")]


def test_block_accounting_refcount_mismatch():
    refs = [1, 2, 0, 0, 0, 0, 0, 0]  # block 1 counted twice, held once
    r = check_block_accounting([snapshot(4, {"r0": [0, 1]}, ref_counts=refs)])
    assert kinds(r) == [(4, "refcount")]
    assert r.findings[0].evidence == {"blocks": [1], "orphans": []}


def test_block_accounting_orphan_block():
    s = snapshot(
        6, {"r0": [0]}, free=[2, 3, 4, 5, 6, 7], ref_counts=[1, 1, 0, 0, 0, 0, 0, 0]
    )  # 1: nobody holds it
    r = check_block_accounting([s])
    assert kinds(r) == [(6, "refcount")]  # conservation holds: 1 is referenced, just by no one
    assert r.findings[0].evidence["orphans"] == [1]
    assert "1 orphaned" in r.findings[0].message


def test_block_accounting_free_but_referenced():
    s = snapshot(3, {"r0": [0, 1]})
    s["free"].append(1)  # handed out again while r0 still holds it
    r = check_block_accounting([s])
    assert (3, "free_referenced") in kinds(r)
    f = next(f for f in r.findings if f.kind == "free_referenced")
    assert f.evidence["blocks"] == [1]


def test_block_accounting_leak_blamed_on_the_cancel_at_the_cancel_step():
    c = cancel("r1", 5, phase="prefill", blocks=[2, 3])
    h = [
        submit("r0"),
        submit("r1"),
        snapshot(4, {"r0": [0, 1], "r1": [2, 3]}),
        c,
        step(5),
        snapshot(5, {"r0": [0, 1], "r1": [2, 3]}),  # r1 cancelled, still holds its blocks
        step(6),
        snapshot(6, {"r0": [0, 1], "r1": [2, 3]}),
        run_end(6, "max_steps"),
    ]
    r = check_block_accounting(h)
    assert kinds(r) == [
        (5, "leak")
    ]  # once, at the cancel's own step (time to detect 0), not every snapshot
    f = r.findings[0]
    assert (
        f.evidence["req"] == "r1" and f.evidence["blocks"] == [2, 3] and f.evidence["cancel"] == c
    )
    assert "cancelled at step 5 in phase prefill" in f.message


def test_block_accounting_leak_of_a_finished_request():
    h = [submit("r0"), step(3, finished=["r0"]), snapshot(3, {"r0": [4]}), run_end(3, "max_steps")]
    r = check_block_accounting(h)
    assert kinds(r) == [(3, "leak")]
    assert "ended at step 3" in r.findings[0].message and r.findings[0].evidence["cancel"] is None


def test_block_accounting_end_of_run_leak():
    # r0 never ended, so no per-step leak; but the run says it is done, nothing is running, and
    # the pool is not whole
    h = [
        submit("r0"),
        step(1),
        snapshot(1, {"r0": [0, 1]}),
        step(2),
        snapshot(2, {"r0": [0, 1]}, live=[]),
        run_end(2),
    ]
    r = check_block_accounting(h)
    assert kinds(r) == [(2, "end_leak")]
    assert r.findings[0].evidence == {"free": 6, "total": 8, "live": 0}


@pytest.mark.parametrize("reason", ["max_steps", "interrupted", "error"])
def test_block_accounting_no_end_leak_when_the_run_did_not_finish(reason):
    h = [submit("r0"), step(1), snapshot(1, {"r0": [0, 1]}), run_end(1, reason)]
    assert check_block_accounting(h).valid is True


# -- table integrity ---------------------------------------------------------------------------
def test_table_integrity_silent_on_a_correct_table():
    h = [
        snapshot(1, {"r0": [0, 1], "r1": [2]}, seq_rows={"r0": 0, "r1": 2}),
        snapshot(2, {"r0": [0, 1, 3, 4]}, seq_rows={"r0": 0}),
    ]  # a full row is fine
    r = check_table_integrity(h)
    assert r.valid is True and r.checked == 2


def test_table_integrity_foreign_block_in_a_row():
    t = [0, 1, -1, -1, -1, -1, -1, -1, 2, 0, -1, -1]  # row 2 (r1) also maps r0's block 0
    r = check_table_integrity(
        [snapshot(4, {"r0": [0, 1], "r1": [2]}, seq_rows={"r0": 0, "r1": 2}, table=t)]
    )
    assert kinds(r) == [(4, "foreign_block")]
    ev = r.findings[0].evidence
    assert (
        ev["row"] == 2 and ev["owner"] == "r1" and ev["entries"] == [1] and ev["intruders"] == [0]
    )
    assert ev["row_expected"] == [2, -1, -1, -1]
    assert r.findings[0].manifest is False


def test_table_integrity_stale_entry_past_the_sequence_blocks():
    t = [0, 6, -1, -1] + [-1] * 8  # block 6 was freed but its entry never cleared
    r = check_table_integrity([snapshot(3, {"r0": [0]}, table=t)])
    assert kinds(r) == [(3, "foreign_block")]
    assert r.findings[0].evidence["intruders"] == [6] and r.findings[0].evidence["entries"] == [1]


def test_table_integrity_unowned_row_not_empty():
    t = [0, -1, -1, -1, 5, -1, -1, -1] + [-1] * 4
    r = check_table_integrity([snapshot(2, {"r0": [0]}, table=t)])
    assert kinds(r) == [(2, "foreign_block")]
    ev = r.findings[0].evidence
    assert ev["row"] == 1 and ev["owner"] is None and ev["intruders"] == [5]
    assert "no sequence" in r.findings[0].message


def test_table_integrity_overlong_sequence_spills_into_the_next_row():
    # width 2: r0 holds 3 blocks; its third entry lands at row 1, entry 0, which is r1's
    t = [0, 1, 2, -1, -1, -1]
    s = snapshot(7, {"r0": [0, 1, 2], "r1": [3]}, width=2, rows=3, table=t)
    r = check_table_integrity([s])
    assert sorted(kinds(r)) == [(7, "foreign_block"), (7, "overlong")]
    over = next(f for f in r.findings if f.kind == "overlong")
    assert over.evidence == {"req": "r0", "row": 0, "blocks": 3, "width": 2}
    victim = next(f for f in r.findings if f.kind == "foreign_block")
    assert victim.evidence["owner"] == "r1" and victim.evidence["intruders"] == [2]


def test_table_integrity_reports_a_standing_corruption_once():
    t = [0, -1, -1, -1, 5, -1, -1, -1] + [-1] * 4
    r = check_table_integrity([snapshot(n, {"r0": [0]}, table=t) for n in (2, 3, 4)])
    assert kinds(r) == [(2, "foreign_block")] and r.checked == 3


# -- latency -----------------------------------------------------------------------------------
def _series(values, start=1):
    return [step(start + i, host_s=v) for i, v in enumerate(values)]


def test_latency_climb_then_plateau_fires_within_the_expected_steps():
    base, climb_from, ramp, top = 1e-3, 31, 10, 6e-3
    values = (
        [base] * (climb_from - 1)
        + [base + (top - base) * (i + 1) / ramp for i in range(ramp)]
        + [top] * 50
    )
    r = check_latency(_series(values))
    assert r.valid is False
    (f,) = r.findings
    assert f.kind == "latency_climb" and f.manifest is None
    assert climb_from < f.step <= climb_from + 20  # within 20 steps of the climb starting
    assert climb_from <= f.evidence["climb_started_step"] <= climb_from + ramp
    assert f.evidence["baseline_ms"] == pytest.approx(1.0)
    assert f.evidence["plateau_ms"] == pytest.approx(6.0)
    assert f.evidence["ratio"] >= 2.0


def test_latency_step_change_detected_in_a_few_steps():
    values = [2e-3] * 20 + [8e-3] * 20
    (f,) = check_latency(_series(values)).findings
    assert 21 <= f.step <= 21 + 8 + 4  # a window of 8 slow steps, then 4 sustained, at most


def _noisy_flat(
    seed: int, n: int = 200, spike_p: float = 0.1, burst_p: float = 0.03
) -> list[float]:
    """1 ms steps with 25% jitter; single-step spikes (x5-x30), and bursts of contention (8 steps of
    which about 70% are slow), as a shared two-core box under another job's load produces."""
    rng = random.Random(seed)
    values, burst = [], 0
    for _ in range(n):
        v = 1e-3 * max(0.3, rng.gauss(1.0, 0.25))
        if burst == 0 and rng.random() < burst_p:
            burst = 8
        slow = rng.random() < (0.7 if burst else spike_p)
        burst = max(0, burst - 1)
        values.append(v * rng.uniform(5, 30) if slow else v)
    return values


@pytest.mark.parametrize("seed", range(25))
def test_latency_noisy_but_flat_with_random_spikes_stays_silent(seed):
    r = check_latency(_series(_noisy_flat(seed)))
    assert r.valid is True and r.checked == 200, r.findings


def test_latency_climb_is_found_through_the_noise():
    noise = _noisy_flat(7, n=120, burst_p=0.0)
    values = [
        v + (4e-3 if i >= 60 else 0.0) for i, v in enumerate(noise)
    ]  # every step pays 4 ms more from 61
    (f,) = check_latency(_series(values)).findings
    assert 61 < f.step <= 61 + 20


def test_latency_below_the_slo_ratio_stays_silent():
    assert check_latency(_series([1e-3] * 20 + [1.6e-3] * 60)).valid is True


def test_latency_absolute_floor_ignores_tiny_ratios_on_tiny_steps():
    # x10, but 90 microseconds above a 10 microsecond baseline: under the 0.5 ms floor
    assert check_latency(_series([1e-5] * 20 + [1e-4] * 40)).valid is True
    assert check_latency(_series([1e-5] * 20 + [1e-4] * 40), floor_s=1e-5).valid is False


def test_latency_ignores_prefill_steps_and_judges_the_chosen_signal():
    h = _series([1e-3] * 40)
    for e in h[20:]:
        e["latency_s"] = 9e-3  # the whole step got slow, the host side did not
    h += [
        step(41 + i, host_s=20e-3, prefill=16, decode=0) for i in range(10)
    ]  # slow prefill steps: not judged
    assert check_latency(h).valid is True
    assert check_latency(h).checked == 40
    (f,) = check_latency(h, signal="latency_s").findings
    assert f.evidence["signal"] == "latency_s" and 21 <= f.step <= 21 + 8 + 4


def test_latency_too_short_to_judge_is_not_a_finding():
    r = check_latency(_series([1e-3] * 5 + [50e-3] * 10))
    assert r.valid is None and r.error is None and r.checked == 15  # not judged, never "held"
    assert r.status == "not judged"


# -- cross-rank --------------------------------------------------------------------------------
def test_cross_rank_fires_on_the_step_a_rank_differs():
    h = [
        step(1),
        step(2, rank_crcs=[7, 7], table_crc=7),
        step(3, rank_crcs=[9, 8], table_crc=9, stale_ranks=[1]),
        step(4, rank_crcs=[5, 5], table_crc=5),
    ]
    r = check_cross_rank(h)
    assert (
        kinds(r) == [(3, "stale_table")] and r.checked == 3
    )  # step 1 had one rank: nothing to compare
    ev = r.findings[0].evidence
    assert ev["ranks"] == [1] and ev["stale_ranks"] == [1] and ev["table_crc"] == 9


def test_cross_rank_silent_when_every_rank_agrees_or_there_is_one_rank():
    h = [
        step(1),
        step(2, rank_crcs=[3, 3, 3, 3], table_crc=3),
        step(3, rank_crcs=[4, 4], table_crc=4),
    ]
    assert check_cross_rank(h).valid is True
    assert check_cross_rank([step(1), step(2)]).checked == 0


# -- liveness ----------------------------------------------------------------------------------
def test_liveness_silent_when_every_request_ends_somehow():
    h = [
        submit("r0"),
        submit("r1"),
        submit("r2"),
        reject("r1"),
        step(1, tokens={"r0": 5}),
        cancel("r2", 2),
        step(2, tokens={"r0": 6}, finished=["r0"]),
        run_end(2),
    ]
    r = check_liveness(h)
    assert r.valid is True and r.checked == 3


@pytest.mark.parametrize("reason", ["done", "max_steps"])
def test_liveness_unfinished_requests_at_the_end(reason):
    h = [
        submit("r0"),
        submit("r1"),
        step(1, tokens={"r0": 1, "r1": 2}),
        step(2, tokens={"r1": 3}, finished=["r1"]),
        step(3, tokens={"r0": 4}),
    ]
    h += [step(n) for n in range(4, 8)] + [run_end(7, reason)]  # stalled at the end
    r = check_liveness(h, stall_steps=3)
    assert kinds(r) == [(7, "unfinished")]
    assert r.findings[0].evidence["requests"] == ["r0"]


def test_a_run_cut_at_max_steps_while_producing_ran_out_of_steps():
    h = [
        submit("r0"),
        step(1, tokens={"r0": 1}),
        step(2, tokens={"r0": 2}),
        run_end(2, "max_steps"),
    ]
    assert check_liveness(h, stall_steps=3).findings == []


@pytest.mark.parametrize("reason", ["interrupted", "error"])
def test_liveness_no_unfinished_verdict_on_a_broken_run(reason):
    h = [submit("r0"), step(1), run_end(1, reason)]
    assert check_liveness(h).valid is True


def test_liveness_starvation_at_the_bound():
    h = [submit("r0", step=1), submit("r1", step=1)]
    h += [step(n, tokens={"r1": n} if n <= 2 else {}) for n in range(1, 10)]  # then a stall
    r = check_liveness(h, bound_steps=5, stall_steps=3)
    assert kinds(r) == [(6, "starvation")]
    assert {k: r.findings[0].evidence[k] for k in ("req", "submitted")} == {
        "req": "r0",
        "submitted": 1,
    }


def test_waiting_behind_requests_that_still_produce_is_no_starvation():
    """r0 queues behind a long r1 that produces every step: its turn comes; nothing stalled."""
    h = [submit("r0", step=1), submit("r1", step=1)]
    h += [step(n, tokens={"r1": n}) for n in range(1, 40)]
    assert check_liveness(h, bound_steps=5, stall_steps=3).findings == []


def test_liveness_says_what_the_queue_needed_to_move():
    """blocked_need: the most blocks any request ahead of (or equal to) the starved one needs to
    complete, plus the watermark; a leak explains starvation only below that."""
    start = {
        "e": "run_start",
        "step": 0,
        "config": {"cache": {"block_size": 4, "num_blocks": 48, "watermark": 0.0}},
    }
    h = [start, submit("r0", 1, 20, 20), submit("r1", 1, 4, 4)]
    h += [step(n) for n in range(1, 5)]
    r = check_liveness(h, bound_steps=3, stall_steps=2)
    assert [(f.evidence["req"], f.evidence["blocked_need"]) for f in r.findings] == [
        ("r0", 10),
        ("r1", 10),
    ]
    assert r.findings[0].evidence["num_blocks"] == 48


def test_a_leak_explains_starvation_against_the_usable_pool_reserved_ids_left_out():
    # SGLang refcount-leak-detect seed 7: 29 blocks leaked of 48, one reserved; the queue needs 19
    from kvchaos.faults.refcount_leak import RefcountLeak

    start = {"e": "run_start", "step": 0, "config": {"cache": {"block_size": 4, "num_blocks": 48}}}
    snap = {"e": "snapshot", "step": 1, "reserved": [0]}
    h = [start, snap, submit("r0", 1, 40, 36)] + [step(n) for n in range(1, 5)]
    (f,) = check_liveness(h, bound_steps=3, stall_steps=2).findings
    assert (f.evidence["num_blocks"], f.evidence["blocked_need"]) == (47, 19)
    leaks = {"leaks": [{"req": "x", "blocks": list(range(1, 30)), "step": 0}]}
    assert RefcountLeak.explains(f.__dict__, leaks) == "consequence"  # 47 - 29 < 19
    leaks["leaks"][0]["blocks"] = list(range(1, 29))  # 28 leaked: 19 usable remain, it fits
    assert RefcountLeak.explains(f.__dict__, leaks) is None


def test_liveness_no_starvation_when_the_request_makes_progress_in_time():
    h = [submit("r0", step=1), submit("r1", step=1)]
    h += [step(n, tokens={"r1": n, **({"r0": 0} if n >= 4 else {})}) for n in range(1, 10)]
    assert check_liveness(h, bound_steps=5).valid is True


# -- composition, unknown results, manifest / latent ------------------------------------------
def test_run_checkers_runs_every_checker_and_passes_options():
    h = [submit("r0", step=1)] + [step(n) for n in range(1, 5)]
    out = run_checkers(h, {"liveness": {"bound_steps": 3, "stall_steps": 2}})
    assert [c.checker for c in out] == list(CHECKERS)
    live = next(c for c in out if c.checker == "liveness")
    assert kinds(live) == [(4, "starvation")]
    # nothing for the others to look at: not judged (never "held")
    assert {c.checker: c.status for c in out if c.checker != "liveness"} == {
        "oracle_divergence": "not judged",
        "block_accounting": "not judged",
        "table_integrity": "not judged",
        "latency": "not judged",
        "cross_rank": "not judged",
        "manager_calls": "held",
        "admission": "not judged",
        "kv_reads": "not judged",
        "prefix_cache": "not judged",
        "offload": "not judged",
    }


@pytest.mark.parametrize(
    "bad, broken",
    [
        (
            {"e": "snapshot", "step": 1, "num_blocks": 4},
            {"block_accounting", "table_integrity"},
        ),  # fields missing
        ({"e": "oracle", "step": 2, "req": "r0"}, {"oracle_divergence"}),
        ({"e": "step", "step": 3, "rank_crcs": [1, 2]}, {"cross_rank"}),  # no table_crc
        ({"e": "cancel", "step": 1}, {"block_accounting", "liveness"}),  # no req
    ],
)
def test_a_checker_that_raises_is_unknown_never_a_pass(bad, broken):
    out = {c.checker: c for c in run_checkers([submit("r0"), bad])}
    for name in broken:
        assert out[name].valid is None, name
        assert out[name].findings == [] and "Error" in out[name].error
    for name in set(CHECKERS) - broken:  # the others still ran: decided, or had nothing to judge
        assert out[name].error is None, name


def test_manifest_and_latent_flags():
    """Outputs diverging is manifest; structure-only findings (tables, ref counts) are latent;
    timing, rank hashes and liveness say nothing about outputs."""
    corrupt_table = [0, 1, -1, -1, 6, -1, -1, -1] + [-1] * 4
    s = snapshot(3, {"r0": [0, 1]}, table=corrupt_table, free=[2, 3, 4, 5, 6])  # 7 missing too
    h = (
        [
            submit("r0", step=1),
            oracle("r0", 4, first_divergence=1, divergence_step=3),
            s,
            step(3, rank_crcs=[1, 2], table_crc=1),
        ]
        + [step(n) for n in range(4, 10)]
        + [run_end(9)]
    )
    by = {c.checker: c for c in run_checkers(h, {"liveness": {"bound_steps": 4}})}
    assert [f.manifest for f in by["oracle_divergence"].findings] == [True]
    assert {f.manifest for f in by["table_integrity"].findings} == {False}
    assert {f.manifest for f in by["block_accounting"].findings} == {False}
    assert [f.manifest for f in by["cross_rank"].findings] == [None]
    assert by["liveness"].findings and {f.manifest for f in by["liveness"].findings} == {None}
    lat = check_latency(_series([1e-3] * 20 + [9e-3] * 20))
    assert [f.manifest for f in lat.findings] == [None]
