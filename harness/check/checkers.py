"""Checkers: pure functions over a history (a list of events, see harness/history.py) that return a
tri-state result. Each finding names its step, so time to detect is measured per step, and says
whether the corruption was manifest (outputs diverged) or latent (only structure was wrong).
A checker that raises gives valid=None (unknown), never a pass."""

from __future__ import annotations

import operator
import traceback
from typing import Callable

from kvchaos.engine.block_table import kernel_view
from kvchaos.harness.check.accounting import check_block_accounting
from kvchaos.harness.check.cache_checks import check_kv_reads, check_prefix_cache
from kvchaos.harness.check.findings import CheckResult, Finding, judged_result, of_kind
from kvchaos.harness.check.latency import check_latency
from kvchaos.harness.check.manager_checks import check_admission, check_manager_calls
from kvchaos.harness.check.offload_checks import check_offload


def check_oracle_divergence(events: list[dict]) -> CheckResult:
    """Each request's logits against the contiguous oracle, fed its planned prompt; the engine's
    stored prompt against the plan; and the model code both share against an independent float64
    reference (its "reference" event)."""
    found = []
    results = of_kind(events, "oracle")
    for ref in of_kind(events, "reference"):
        if not ref["agrees"]:
            found.append(
                Finding(
                    checker="oracle_divergence",
                    step=ref["step"],
                    message=f"the model code the engine and the oracle share disagrees with an "
                    f"independent float64 reference on request {ref['req']} from token "
                    f"{ref['first_disagreement']} (max abs error {ref['max_abs_err']:.3g})",
                    evidence={
                        k: ref[k] for k in ("req", "first_disagreement", "max_abs_err", "checked")
                    },
                    manifest=True,
                    kind="shared_code",
                )
            )
    for o in results:
        if o.get("prompt_mismatch_at") is not None:
            found.append(
                Finding(
                    checker="oracle_divergence",
                    step=o["step"],
                    message=f"request {o['req']}: the engine stored a prompt that differs from "
                    f"the one "
                    f"submitted, from token {o['prompt_mismatch_at']}",
                    evidence={"req": o["req"], "prompt_mismatch_at": o["prompt_mismatch_at"]},
                    manifest=True,
                    kind="prompt",
                )
            )
        if o["first_divergence"] is not None:
            found.append(
                Finding(
                    checker="oracle_divergence",
                    step=o["divergence_step"],
                    message=f"request {o['req']}: logits diverge from the contiguous oracle at "
                    f"generated "
                    f"token {o['first_divergence']} "
                    f"(max abs error {o['abs_err_at_divergence']:.3g} "
                    f"> tolerance {o['tolerance']:.3g})",
                    evidence={
                        k: o[k]
                        for k in (
                            "req",
                            "first_divergence",
                            "abs_err_at_divergence",
                            "tolerance",
                            "max_abs_err",
                            "checked",
                        )
                    },
                    manifest=True,
                    kind="divergence",
                    known_at=o["step"],  # known when the request was checked, not when it diverged
                )
            )
    return judged_result("oracle_divergence", found, len(results))


# a snapshot's kernel geometry, where it is not the manager's (engine kernel_stride, geometry.py)
KERNEL_KEYS = ("kernel_stride", "kernel_block_size", "pool_blocks")


def check_table_integrity(events: list[dict]) -> CheckResult:
    """Every row holds exactly its sequence's blocks, then -1; rows nobody owns are all -1. A
    snapshot whose kernels index the table at another row stride (kernel_stride) is judged as
    they read it too (_kernel_rows)."""
    found, snaps = [], 0
    reported: set[tuple] = set()
    last: tuple = ()
    for e in of_kind(events, "snapshot"):
        snaps += 1
        table, w, s = e["table"], e["table_width"], e["step"]
        geometry = tuple(e.get(k) for k in KERNEL_KEYS)
        now = (table, e["seq_rows"], e["seq_blocks"], w, geometry)
        if last and now[3:] == last[3:] and all(map(operator.is_, now[:3], last[:3])):
            continue  # the very objects judged before (shared in memory): told already
        last = now
        if any(g is not None for g in geometry):
            found += _kernel_rows(e, reported)
        owner: dict[int, str] = {}
        for req, row in e["seq_rows"].items():
            if row in owner and ("shared_row", row, owner[row], req) not in reported:
                reported.add(("shared_row", row, owner[row], req))
                found.append(
                    Finding(
                        checker="table_integrity",
                        step=s,
                        message=f"requests {owner[row]} and {req} are both mapped to row {row}",
                        evidence={"row": row, "owner": owner[row], "req": req},
                        manifest=False,
                        kind="shared_row",
                    )
                )
            owner[row] = req
        for row in range(len(table) // w):
            got = table[row * w : (row + 1) * w]
            req = owner.get(row)
            blocks = e["seq_blocks"].get(req, []) if req is not None else []
            if len(blocks) > w and ("overlong", req) not in reported:
                reported.add(("overlong", req))
                found.append(
                    Finding(
                        checker="table_integrity",
                        step=s,
                        message=f"request {req} holds {len(blocks)} blocks but its row "
                        f"is {w} wide: entries past the row spill into row {row + 1}",
                        evidence={"req": req, "row": row, "blocks": len(blocks), "width": w},
                        manifest=False,
                        kind="overlong",
                    )
                )
            want = (blocks + [-1] * w)[:w]
            if got != want:
                bad = [i for i in range(w) if got[i] != want[i]]
                key = ("row", row, tuple(got))
                if key in reported:
                    continue
                reported.add(key)
                intruders = sorted({got[i] for i in bad if got[i] != -1} - set(blocks))
                who = f"request {req}" if req is not None else "no sequence"
                found.append(
                    Finding(
                        checker="table_integrity",
                        step=s,
                        message=f"row {row} ({who}) holds blocks it does not own "
                        f"{intruders[:8]} at entries {bad[:8]}",
                        evidence={
                            "row": row,
                            "owner": req,
                            "entries": bad,
                            "row_now": got,
                            "row_expected": want,
                            "intruders": intruders,
                        },
                        manifest=False,
                        kind="foreign_block",
                    )
                )
    found += _foreign_writes(events) + _unslotted_writes(events)
    return judged_result("table_integrity", found, snaps)


def _kernel_rows(e: dict, reported: set) -> list[Finding]:
    """The blocks the kernels read for each live sequence, through the snapshot's kernel geometry
    (block_table.kernel_view): row r from r * kernel_stride, in kernel blocks of
    kernel_block_size, an entry past a pool of pool_blocks wrapped to its start: exactly its
    blocks (the host table may be right while the kernels read other blocks)."""
    found, table, w = [], e["table"], e["table_width"]
    stride = e.get("kernel_stride") or w
    kbs, bs = e.get("kernel_block_size"), e.get("block_size")
    ratio = kbs // bs if kbs and bs else 1
    pool = e.get("pool_blocks", e.get("num_blocks"))
    pool_k = pool // ratio if pool is not None and (ratio > 1 or "pool_blocks" in e) else None
    how = f"at stride {stride}, the table's width being {w}"
    if ratio > 1:
        how = f"in blocks of {kbs} tokens, the manager's being {bs}"
    elif "pool_blocks" in e:
        how = f"over a pool of {e['pool_blocks']} blocks, the manager's being {e['num_blocks']}"
    for req, row in e["seq_rows"].items():
        blocks = e["seq_blocks"].get(req, [])
        got = kernel_view(table, row, stride, len(blocks), ratio, pool_k)
        if got == blocks or ("kernel", req, tuple(got)) in reported:
            continue
        reported.add(("kernel", req, tuple(got)))
        bad = [i for i in range(len(blocks)) if i >= len(got) or got[i] != blocks[i]]
        intruders = sorted(set(got) - set(blocks) - {-1})
        found.append(
            Finding(
                checker="table_integrity",
                step=e["step"],
                message=f"the kernels read row {row} (request {req}) {how}: entries {bad[:8]} "
                f"name blocks {intruders[:8]} it does not own",
                evidence={
                    "row": row,
                    "owner": req,
                    "entries": bad,
                    "row_now": got,
                    "row_expected": blocks,
                    "intruders": intruders,
                    "view": "kernel",
                    "stride": stride,
                },
                manifest=False,
                kind="foreign_block",
            )
        )
    return found


def _foreign_writes(events: list[dict]) -> list[Finding]:
    """Writes the engine's slot mapping sent into blocks the snapshot does not list for the
    sequence (or lists as free): the table the kernel read disagrees with the manager's word."""
    return [
        Finding(
            checker="table_integrity",
            step=e["step"],
            message=f"request {e['req']} wrote its KV into blocks {e['blocks'][:8]} it does not "
            f"hold"
            + (f" (rank {', '.join(map(str, e['ranks']))})" if e.get("ranks", [0]) != [0] else ""),
            evidence={
                "req": e["req"],
                "blocks": e["blocks"],
                "owned": e["owned"][:32],
                "ranks": e.get("ranks", [0]),
            },
            manifest=False,
            kind="foreign_write",
        )
        for e in of_kind(events, "foreign_write")
    ]


def _unslotted_writes(events: list[dict]) -> list[Finding]:
    """Positions written with no slot reserved for them (the engine's slot mapping against the
    blocks the sequence holds): their KV went to a block someone else may hold."""
    out = []
    for e in of_kind(events, "unslotted_write"):
        pos, n, ranks = e["positions"][0], len(e["positions"]), e["ranks"]
        more = f" (+{n - 1} more positions)" if n > 1 else ""
        how = (
            f"it holds slots for {e['slots_held']} tokens (written through entry {e['entry']} "
            "of its row)"
            if e["via"] == "past_blocks"
            else f"entry {e['entry']} of its row is unused (-1), so its KV landed in the pool's "
            "last block"
        )
        out.append(
            Finding(
                checker="table_integrity",
                step=e["step"],
                message=f"request {e['req']} wrote position {pos}{more} with no slot reserved: "
                f"{how} (rank {', '.join(map(str, ranks))})",
                evidence={
                    **{k: e[k] for k in ("req", "positions", "ranks", "via", "slots_held")},
                    **({"blocks": e["blocks"]} if "blocks" in e else {}),
                },
                manifest=False,
                kind="unslotted_write",
            )
        )
    return out


def check_cross_rank(events: list[dict]) -> CheckResult:
    """Every rank's copy of the block table hashes the same as the scheduler's, every step."""
    found, n = [], 0
    for e in of_kind(events, "step"):
        crcs = e.get("rank_crcs") or []
        if not crcs:
            continue
        n += 1
        bad = [r for r, c in enumerate(crcs) if c != e["table_crc"]]
        if bad:
            found.append(
                Finding(
                    checker="cross_rank",
                    step=e["step"],
                    message=f"ranks {bad} computed step {e['step']} on a block table "
                    f"that differs from the scheduler's (version {e['table_version']})",
                    evidence={
                        "ranks": bad,
                        "rank_crcs": crcs,
                        "table_crc": e["table_crc"],
                        "stale_ranks": e.get("stale_ranks", []),
                    },
                    manifest=None,
                    kind="stale_table",
                )
            )
    return judged_result("cross_rank", found, n)


def check_liveness(
    events: list[dict], bound_steps: int = 200, stall_steps: int = 16
) -> CheckResult:
    """Every request finishes, is rejected or is cancelled; none waits longer than bound_steps
    while the engine stalls (no token for anyone in the last stall_steps): a request queued behind
    long ones that are still producing is waiting its turn, not starved.
    Each finding carries `blocked_need`: the most blocks (plus the watermark) that any request
    ahead of or equal to the starved one, first come first served, needs to complete. Oldest first,
    with preemption of the newest, the queue moves whenever each request fits the pool on its own:
    a leak explains starvation only while it shrinks the usable pool below that need. Its
    `num_blocks` is that usable pool: the ids the latest snapshot reserves are left out."""
    submitted, ended, first_token, total = {}, set(), {}, {}
    reserved = 0  # ids the manager never hands out (vLLM's null block, SGLang's padding page)
    found = []
    last_step, last_token, waiting = 0, 0, {}  # waiting: request -> when it started to wait
    cache = next(iter(of_kind(events, "run_start")), {}).get("config", {}).get("cache", {})
    bs, num_blocks = cache.get("block_size", 16), cache.get("num_blocks", 0)
    watermark = int(cache.get("watermark", 0) * num_blocks)

    def need(r: str) -> dict:
        order = [q for q in submitted if q not in ended]
        ahead = order[: order.index(r) + 1] if r in order else [r]
        blocking = max(ahead, key=lambda q: total.get(q, 1))  # the one the queue waits on
        most = -(-total.get(blocking, 1) // bs)
        usable = num_blocks - reserved
        return {"blocked_need": most + watermark, "num_blocks": usable, "blocking": blocking}

    for e in events:
        k = e.get("e")
        if k == "snapshot":
            reserved = len(e.get("reserved") or ())
        elif k == "submit":
            submitted[e["req"]] = e["step"]
            total[e["req"]] = e.get("prompt_len", 1) + e.get("max_new", 0)
        elif k in ("reject", "cancel"):
            ended.add(e["req"])
        elif k == "step":
            last_step = e["step"]
            ended.update(e.get("finished", []))
            ended.update(e.get("failed", ()))
            if e.get("tokens"):
                last_token = e["step"]
            for r in e.get("tokens", {}):
                first_token.setdefault(r, e["step"])
            stalled = e["step"] - last_token >= stall_steps
            for r, s in submitted.items():
                if r in ended or r in first_token or r in waiting:
                    continue
                if e["step"] - s >= bound_steps and stalled:
                    waiting[r] = s
                    found.append(
                        Finding(
                            checker="liveness",
                            step=e["step"],
                            message=f"request {r} submitted at step {s} has produced "
                            f"nothing in {bound_steps} steps: starved",
                            evidence={"req": r, "submitted": s, **need(r)},
                            manifest=None,
                            kind="starvation",
                        )
                    )
    end = of_kind(events, "run_end")
    # a run cut at max_steps while still producing ran out of steps: that is no bug
    stalled = last_step - last_token >= stall_steps
    if end and (end[-1]["reason"] == "done" or end[-1]["reason"] == "max_steps" and stalled):
        stuck = sorted(r for r in submitted if r not in ended)
        if stuck:
            found.append(
                Finding(
                    checker="liveness",
                    step=last_step,
                    message=f"{len(stuck)} requests never finished by the end of the run "
                    f"({end[-1]['reason']}): {stuck[:8]}",
                    evidence={"requests": stuck, **need(stuck[-1])},
                    manifest=None,
                    kind="unfinished",
                )
            )
    return judged_result("liveness", found, len(submitted))


# one function per name in faults.base.CHECKER_NAMES, in its order (tests/test_scenario.py)
CHECKERS: dict[str, Callable[..., CheckResult]] = {
    "oracle_divergence": check_oracle_divergence,
    "block_accounting": check_block_accounting,
    "table_integrity": check_table_integrity,
    "latency": check_latency,
    "cross_rank": check_cross_rank,
    "liveness": check_liveness,
    "manager_calls": check_manager_calls,
    "admission": check_admission,
    "kv_reads": check_kv_reads,
    "prefix_cache": check_prefix_cache,
    "offload": check_offload,
}


def run_checkers(events: list[dict], options: dict | None = None, disabled=()) -> list[CheckResult]:
    """Run every checker but the disabled ones; options maps a checker name to keyword arguments."""
    options = options or {}
    out = []
    for name, fn in CHECKERS.items():
        if name in disabled:
            continue
        try:
            out.append(fn(events, **options.get(name, {})))
        except Exception:
            out.append(
                CheckResult(checker=name, valid=None, findings=[], error=traceback.format_exc())
            )
    return out
