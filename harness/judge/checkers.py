"""Checkers: pure functions over a history (a list of events, see harness/history.py) that return a
tri-state result. Each finding names its step, so time to detect is measured per step, and says
whether the corruption was manifest (outputs diverged) or latent (only structure was wrong).
A checker that raises gives valid=None (unknown), never a pass."""

from __future__ import annotations

import operator
import traceback
from typing import Callable

from kvchaos.harness.judge.cache_checks import check_kv_reads, check_prefix_cache
from kvchaos.harness.judge.findings import CheckResult, Finding, _of, _result
from kvchaos.harness.judge.latency import check_latency
from kvchaos.harness.judge.manager_checks import check_admission, check_manager_calls
from kvchaos.harness.judge.snapshots import apply_cache


def check_oracle_divergence(events: list[dict]) -> CheckResult:
    """Each request's logits against the contiguous oracle, fed its planned prompt; the engine's
    stored prompt against the plan; and the model code both share against an independent float64
    reference (its "reference" event)."""
    found = []
    results = _of(events, "oracle")
    for ref in _of(events, "reference"):
        if not ref["agrees"]:
            found.append(
                Finding(
                    "oracle_divergence",
                    ref["step"],
                    f"the model code the engine and the oracle share disagrees with an "
                    f"independent float64 reference on request {ref['req']} from token "
                    f"{ref['first_disagreement']} (max abs error {ref['max_abs_err']:.3g})",
                    {k: ref[k] for k in ("req", "first_disagreement", "max_abs_err", "checked")},
                    True,
                    "shared_code",
                )
            )
    for o in results:
        if o.get("prompt_mismatch_at") is not None:
            found.append(
                Finding(
                    "oracle_divergence",
                    o["step"],
                    f"request {o['req']}: the engine stored a prompt that differs from the one "
                    f"submitted, from token {o['prompt_mismatch_at']}",
                    {"req": o["req"], "prompt_mismatch_at": o["prompt_mismatch_at"]},
                    True,
                    "prompt",
                )
            )
        if o["first_divergence"] is not None:
            found.append(
                Finding(
                    "oracle_divergence",
                    o["divergence_step"],
                    f"request {o['req']}: logits diverge from the contiguous oracle at generated "
                    f"token {o['first_divergence']} "
                    f"(max abs error {o['abs_err_at_divergence']:.3g} "
                    f"> tolerance {o['tolerance']:.3g})",
                    {
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
                    True,
                    "divergence",
                    o["step"],  # known when the request was checked, not when it diverged
                )
            )
    return _result("oracle_divergence", found, len(results))


def check_block_accounting(events: list[dict]) -> CheckResult:
    """Conservation (free + referenced == total), refcounts == references, no referenced free block,
    no blocks held by a request that has ended (a leak, blamed on the cancel that ended it), and,
    where snapshots carry per-sequence token counts, no new tokens written into a shared block."""
    found, ended, cancels = [], {}, {}
    snaps = 0
    seen_leaks: set[str] = set()
    seen_reserved: set[int] = set()
    start = next(iter(_of(events, "run_start")), {})
    bs = start.get("config", {}).get("cache", {}).get("block_size")
    tokens: dict[str, int] = {}
    cache: dict = {}  # the prefix cache as of the latest snapshot
    last_pool: tuple = ()  # the latest snapshot's pool fields, and whether they were sound
    pool_clean = False
    for e in events:
        kind = e.get("e")
        if kind == "cancel":
            ended[e["req"]] = e["step"]
            cancels[e["req"]] = e
        elif kind == "step":
            for r in e.get("finished", []):
                ended[r] = e["step"]
        elif kind == "snapshot":
            snaps += 1
            s = e["step"]
            cache = apply_cache(cache, e)
            ref, free, total = e["ref_counts"], e["free"], e["num_blocks"]
            pool = (ref, free, e["seq_blocks"], e.get("reserved"))
            if pool_clean and all(map(operator.is_, pool, last_pool)):
                # the very objects the snapshot before found nothing wrong with (a history in
                # memory shares unchanged fields): nothing again
                if bs and e.get("seq_tokens") is not None:
                    found += _shared_writes(e, tokens, bs, cache)
                    tokens = e["seq_tokens"]
                _ended_holding(e, ended, cancels, seen_leaks, found)
                continue
            n0 = len(found)
            reserved = set(e.get("reserved") or ())  # never handed out (vLLM's null block)
            held = (
                sum(1 for b, r in enumerate(ref) if r > 0 and b not in reserved)
                if reserved
                else total - ref.count(0)
            )
            usable = total - len(reserved)
            in_free = len(set(free) - reserved)
            if in_free + held != usable or len(set(free)) != len(free):
                found.append(
                    Finding(
                        "block_accounting",
                        s,
                        f"conservation broken: {in_free} free + {held} "
                        f"referenced != {usable} usable blocks",
                        {"free": in_free, "referenced": held, "total": usable},
                        False,
                        "conservation",
                    )
                )
            if reserved:
                found += _reserved_handed_out(e, reserved, seen_reserved)
            refs = [0] * total
            for blocks in e["seq_blocks"].values():
                for b in blocks:
                    refs[b] += 1
            wrong = [b for b in range(total) if refs[b] != ref[b]] if refs != ref else []
            if wrong:
                orphans = [b for b in wrong if refs[b] == 0]
                found.append(
                    Finding(
                        "block_accounting",
                        s,
                        f"{len(wrong)} blocks whose ref count differs from the "
                        f"sequences holding them ({len(orphans)} orphaned)",
                        {"blocks": wrong[:32], "orphans": orphans[:32]},
                        False,
                        "refcount",
                    )
                )
            n1 = len(found)
            if bs and e.get("seq_tokens") is not None:
                found += _shared_writes(e, tokens, bs, cache)
                tokens = e["seq_tokens"]
            n2 = len(found)
            busy = [b for b in free if ref[b] != 0]
            if busy:
                found.append(
                    Finding(
                        "block_accounting",
                        s,
                        f"free blocks with a non-zero ref count: {busy[:8]}",
                        {"blocks": busy[:32]},
                        False,
                        "free_referenced",
                    )
                )
            last_pool, pool_clean = pool, n0 == n1 and n2 == len(found)
            _ended_holding(e, ended, cancels, seen_leaks, found)
    end = _of(events, "run_end")
    last = [e for e in events if e.get("e") == "snapshot"]
    if end and last and end[-1].get("reason") in ("done", "max_steps"):
        # the final snapshot: every block is free or held by a request still live, or by a holder
        # that is no request at all (the manager's own: preallocated or pinned blocks)
        s = last[-1]
        live = set(s.get("live", []))
        submitted = {e["req"] for e in events if e.get("e") == "submit"}
        held = {
            b for r, bs in s["seq_blocks"].items() if r in live or r not in submitted for b in bs
        }
        reserved = set(s.get("reserved") or ())
        free = set(s["free"]) - reserved
        missing = s["num_blocks"] - len(reserved) - len(free) - len(held - free - reserved)
        if missing > 0:
            found.append(
                Finding(
                    "block_accounting",
                    s["step"],
                    f"end of run ({end[-1]['reason']}): {missing} blocks never returned to the "
                    f"pool nor held by a live request",
                    {
                        "free": len(free),
                        "total": s["num_blocks"] - len(reserved) - len(held),
                        "live": len(live),
                    },
                    False,
                    "end_leak",
                    end[-1]["step"],
                )
            )
    return _result("block_accounting", found, snaps)


def _ended_holding(snap: dict, ended: dict, cancels: dict, seen: set, found: list) -> None:
    """Requests that ended but still hold blocks: leaked (blamed on how they ended), once each."""
    for req, blocks in snap["seq_blocks"].items():
        if req in ended and req not in seen:
            seen.add(req)
            c = cancels.get(req)
            how = (
                f"cancelled at step {c['step']} in phase {c['phase']}"
                if c
                else f"ended at step {ended[req]}"
            )
            found.append(
                Finding(
                    "block_accounting",
                    snap["step"],
                    f"request {req} {how} but still holds {len(blocks)} blocks: leaked",
                    {"req": req, "blocks": blocks, "cancel": c},
                    False,
                    "leak",
                )
            )


def _reserved_handed_out(snap: dict, reserved: set[int], seen: set[int]) -> list[Finding]:
    """A reserved id (the manager's own word: never handed out) held, free or referenced; once a
    block."""
    held = {b: r for r, bs in snap["seq_blocks"].items() for b in bs if b in reserved}
    free = reserved & set(snap["free"])
    refs = {b for b in reserved if 0 <= b < len(snap["ref_counts"]) and snap["ref_counts"][b]}
    bad = sorted((set(held) | free | refs) - seen)
    if not bad:
        return []
    seen.update(bad)
    b = bad[0]
    how = f"held by request {held[b]}" if b in held else "free" if b in free else "referenced"
    return [
        Finding(
            "block_accounting",
            snap["step"],
            f"reserved block {b} handed out: {how} (the manager reserves {sorted(reserved)[:8]})",
            {"blocks": bad[:32], "req": held.get(b), "reserved": sorted(reserved)[:32]},
            False,
            "reserved_block",
        )
    ]


def _shared_writes(snap: dict, before: dict[str, int], bs: int, cache: dict) -> list[Finding]:
    """Blocks that receive a sequence's new tokens while another sequence holds them too."""
    out = []
    ref = snap["ref_counts"]
    # A keyed block is shared by its key (a prefix-cache hit, over the same tokens): vLLM keys a
    # block as it allocates it, so a hit in the same step shares it before the pass writes its
    # last slots, legally. What such a block holds is judged by kv_reads, not here.
    keyed = {b for b, _ in cache}
    for req, now in snap["seq_tokens"].items():
        was = before.get(req, now)  # a new (or forked) sequence: no write judged yet
        blocks = snap["seq_blocks"].get(req, [])
        for i in range(was // bs, -(-now // bs)) if now > was else ():
            if i < len(blocks) and ref[blocks[i]] > 1 and blocks[i] not in keyed:
                out.append(
                    Finding(
                        "block_accounting",
                        snap["step"],
                        f"request {req} writes tokens {was}..{now - 1} into block {blocks[i]}, "
                        f"which {ref[blocks[i]] - 1} other sequence(s) still share: a missed "
                        "copy-on-write",
                        {"req": req, "block": blocks[i], "index": i, "refs": ref[blocks[i]]},
                        False,
                        "shared_write",
                    )
                )
    return out


def check_table_integrity(events: list[dict]) -> CheckResult:
    """Every row holds exactly its sequence's blocks, then -1; rows nobody owns are all -1."""
    found, snaps = [], 0
    reported: set[tuple] = set()
    last: tuple = ()
    for e in _of(events, "snapshot"):
        snaps += 1
        table, w, s = e["table"], e["table_width"], e["step"]
        now = (table, e["seq_rows"], e["seq_blocks"], w)
        if last and w == last[3] and all(map(operator.is_, now[:3], last[:3])):
            continue  # the very objects judged before (shared in memory): told already
        last = now
        owner: dict[int, str] = {}
        for req, row in e["seq_rows"].items():
            if row in owner and ("shared_row", row, owner[row], req) not in reported:
                reported.add(("shared_row", row, owner[row], req))
                found.append(
                    Finding(
                        "table_integrity",
                        s,
                        f"requests {owner[row]} and {req} are both mapped to row {row}",
                        {"row": row, "owner": owner[row], "req": req},
                        False,
                        "shared_row",
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
                        "table_integrity",
                        s,
                        f"request {req} holds {len(blocks)} blocks but its row "
                        f"is {w} wide: entries past the row spill into row {row + 1}",
                        {"req": req, "row": row, "blocks": len(blocks), "width": w},
                        False,
                        "overlong",
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
                        "table_integrity",
                        s,
                        f"row {row} ({who}) holds blocks it does not own "
                        f"{intruders[:8]} at entries {bad[:8]}",
                        {
                            "row": row,
                            "owner": req,
                            "entries": bad,
                            "row_now": got,
                            "row_expected": want,
                            "intruders": intruders,
                        },
                        False,
                        "foreign_block",
                    )
                )
    return _result("table_integrity", found + _foreign_writes(events), snaps)


def _foreign_writes(events: list[dict]) -> list[Finding]:
    """Writes the engine's slot mapping sent into blocks the snapshot does not list for the
    sequence (or lists as free): the table the kernel read disagrees with the manager's word."""
    return [
        Finding(
            "table_integrity",
            e["step"],
            f"request {e['req']} wrote its KV into blocks {e['blocks'][:8]} it does not hold"
            + (f" (rank {', '.join(map(str, e['ranks']))})" if e.get("ranks", [0]) != [0] else ""),
            {
                "req": e["req"],
                "blocks": e["blocks"],
                "owned": e["owned"][:32],
                "ranks": e.get("ranks", [0]),
            },
            False,
            "foreign_write",
        )
        for e in _of(events, "foreign_write")
    ]


def check_cross_rank(events: list[dict]) -> CheckResult:
    """Every rank's copy of the block table hashes the same as the scheduler's, every step."""
    found, n = [], 0
    for e in _of(events, "step"):
        crcs = e.get("rank_crcs") or []
        if not crcs:
            continue
        n += 1
        bad = [r for r, c in enumerate(crcs) if c != e["table_crc"]]
        if bad:
            found.append(
                Finding(
                    "cross_rank",
                    e["step"],
                    f"ranks {bad} computed step {e['step']} on a block table "
                    f"that differs from the scheduler's (version {e['table_version']})",
                    {
                        "ranks": bad,
                        "rank_crcs": crcs,
                        "table_crc": e["table_crc"],
                        "stale_ranks": e.get("stale_ranks", []),
                    },
                    None,
                    "stale_table",
                )
            )
    return _result("cross_rank", found, n)


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
    cache = next(iter(_of(events, "run_start")), {}).get("config", {}).get("cache", {})
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
                            "liveness",
                            e["step"],
                            f"request {r} submitted at step {s} has produced "
                            f"nothing in {bound_steps} steps: starved",
                            {"req": r, "submitted": s, **need(r)},
                            None,
                            "starvation",
                        )
                    )
    end = _of(events, "run_end")
    # a run cut at max_steps while still producing ran out of steps: that is no bug
    stalled = last_step - last_token >= stall_steps
    if end and (end[-1]["reason"] == "done" or end[-1]["reason"] == "max_steps" and stalled):
        stuck = sorted(r for r in submitted if r not in ended)
        if stuck:
            found.append(
                Finding(
                    "liveness",
                    last_step,
                    f"{len(stuck)} requests never finished by the end of the run "
                    f"({end[-1]['reason']}): {stuck[:8]}",
                    {"requests": stuck, **need(stuck[-1])},
                    None,
                    "unfinished",
                )
            )
    return _result("liveness", found, len(submitted))


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
            out.append(CheckResult(name, None, [], traceback.format_exc()))
    return out
