"""Block accounting, judged over a history's snapshots: conservation, ref counts against the
sequences holding each block, no referenced free block, reserved ids never handed out, no blocks
held by a request that ended (a leak), and no new tokens written into a shared block."""

from __future__ import annotations

import operator

from kvchaos.harness.check.findings import CheckResult, Finding, judged_result, of_kind
from kvchaos.harness.history.cache import apply_cache


def check_block_accounting(events: list[dict]) -> CheckResult:
    """Conservation (free + referenced == total), refcounts == references, no referenced free block,
    no blocks held by a request that has ended (a leak, blamed on the cancel that ended it), and,
    where snapshots carry per-sequence token counts, no new tokens written into a shared block."""
    found, ended, cancels = [], {}, {}
    failed: set[str] = set()  # ended in error by the engine (its own failure in a step)
    snaps = 0
    seen_leaks: set[str] = set()
    seen_reserved: set[int] = set()
    start = next(iter(of_kind(events, "run_start")), {})
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
            for r in (*e.get("finished", ()), *e.get("failed", ())):
                ended[r] = e["step"]
            failed.update(e.get("failed", ()))
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
                _ended_holding(e, ended, cancels, seen_leaks, found, failed)
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
                        checker="block_accounting",
                        step=s,
                        message=f"conservation broken: {in_free} free + {held} "
                        f"referenced != {usable} usable blocks",
                        evidence={"free": in_free, "referenced": held, "total": usable},
                        manifest=False,
                        kind="conservation",
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
                        checker="block_accounting",
                        step=s,
                        message=f"{len(wrong)} blocks whose ref count differs from the "
                        f"sequences holding them ({len(orphans)} orphaned)",
                        evidence={"blocks": wrong[:32], "orphans": orphans[:32]},
                        manifest=False,
                        kind="refcount",
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
                        checker="block_accounting",
                        step=s,
                        message=f"free blocks with a non-zero ref count: {busy[:8]}",
                        evidence={"blocks": busy[:32]},
                        manifest=False,
                        kind="free_referenced",
                    )
                )
            last_pool, pool_clean = pool, n0 == n1 and n2 == len(found)
            _ended_holding(e, ended, cancels, seen_leaks, found, failed)
    end = of_kind(events, "run_end")
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
                    checker="block_accounting",
                    step=s["step"],
                    message=f"end of run ({end[-1]['reason']}): {missing} blocks never returned "
                    f"to the "
                    f"pool nor held by a live request",
                    evidence={
                        "free": len(free),
                        "total": s["num_blocks"] - len(reserved) - len(held),
                        "live": len(live),
                    },
                    manifest=False,
                    kind="end_leak",
                    known_at=end[-1]["step"],
                )
            )
    return judged_result("block_accounting", found, snaps)


def _ended_holding(
    snap: dict, ended: dict, cancels: dict, seen: set, found: list, failed: set
) -> None:
    """Requests that ended but still hold blocks: leaked (blamed on how they ended: a cancel, the
    engine's abort of a failed request, or a finish), once each."""
    for req, blocks in snap["seq_blocks"].items():
        if req in ended and req not in seen:
            seen.add(req)
            c = cancels.get(req)
            how = (
                f"cancelled at step {c['step']} in phase {c['phase']}"
                if c
                else f"ended in error at step {ended[req]} (the engine's abort)"
                if req in failed
                else f"ended at step {ended[req]}"
            )
            ev = {"req": req, "blocks": blocks, "cancel": c}
            found.append(
                Finding(
                    checker="block_accounting",
                    step=snap["step"],
                    message=f"request {req} {how} but still holds {len(blocks)} blocks: leaked",
                    evidence={**ev, "failed": True} if req in failed else ev,
                    manifest=False,
                    kind="leak",
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
            checker="block_accounting",
            step=snap["step"],
            message=f"reserved block {b} handed out: {how} (the manager reserves "
            f"{sorted(reserved)[:8]})",
            evidence={"blocks": bad[:32], "req": held.get(b), "reserved": sorted(reserved)[:32]},
            manifest=False,
            kind="reserved_block",
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
                        checker="block_accounting",
                        step=snap["step"],
                        message=f"request {req} writes tokens {was}..{now - 1} into block "
                        f"{blocks[i]}, "
                        f"which {ref[blocks[i]] - 1} other sequence(s) still share: a missed "
                        "copy-on-write",
                        evidence={
                            "req": req,
                            "block": blocks[i],
                            "index": i,
                            "refs": ref[blocks[i]],
                        },
                        manifest=False,
                        kind="shared_write",
                    )
                )
    return out
