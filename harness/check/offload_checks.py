"""The host tier's checker (`offload`), pure over a history: the engine's copy records
(engine/offload.py: offload_store, offload_restore, offload_landed, with a CRC of each block as
read and as written) and the manager's snapshots (host_blocks, host_free beside seq_blocks).
Judged block by block: a copy's blocks land in order, each its own offload_landed (with a
bandwidth, over several steps); the copy completed once every block it issued landed.

- tier_map: every block of a sequence on exactly one tier, or in flight (a copy issued and not
  completed): a host slot held twice, or held and free; a sequence stored out that still holds
  device blocks, or one restored that still holds host slots.
- store_content: a store's host copy of a block equals what the device block held when that
  block's copy completed (the block is still held, unwritten, until then): else it was read early.
  Its evidence says since when each block's copy was taken as current: the store's issue, or the
  restore it kept (a copy equal to what that restore wrote), so a write into the block since can
  be named.
- restore_content: a restore reads what the store copied (the host slot unchanged while held),
  and the device block it wrote holds that.
- read_in_flight: a block read by the kernels while its restore was in flight (not landed).
- reuse_before_store: a device block being stored out held by another sequence before its copy
  landed.
- landed_after_free: a load (restore) landed after its request was released, into blocks the
  manager took back.
A history without a host tier is not judged."""

from __future__ import annotations

from kvchaos.harness.check.findings import CheckResult, Finding, judged_result
from kvchaos.harness.history.cache import apply_cache

KINDS = ("offload_store", "offload_restore", "offload_landed", "offload_late")


def _finding(step: int, kind: str, message: str, **evidence) -> Finding:
    return Finding(
        checker="offload", step=step, message=message, evidence=evidence, manifest=False, kind=kind
    )


def check_offload(events: list[dict]) -> CheckResult:
    found: list[Finding] = []
    checked = 0
    stored: dict[str, dict] = {}  # req -> its last completed store (slot -> crc)
    slots: dict = {}  # host slot -> crc of the last store completed into it (a hit reads it)
    flight: dict[str, dict] = {}  # req -> the copy in flight (its event data, step)
    where: dict[str, str] = {}  # req -> host (stored out) | device (restored)
    # the last snapshot's holders and prefix cache: a block shared before its store, or cached
    # (served by a hit), is not a block handed on before the store completed
    held: dict[str, list[int]] = {}
    cache: dict = {}
    restored: dict[str, dict] = {}  # req -> device block -> (crc, step) its last restore wrote
    for e in events:
        kind = e.get("e")
        if kind == "engine" and e["kind"] in KINDS:
            checked += 1
            d, step = e["data"], e["step"]
            if e["kind"] == "offload_store":
                mine = _blocks(d, 0)
                before = {(q, b) for q, bs in held.items() if q != d["req"] for b in mine & set(bs)}
                flight[d["req"]] = {**d, "kind": "store", "step": step, "shared": before}
                flight[d["req"]]["left"] = mine  # its blocks not landed yet
            elif e["kind"] == "offload_late":
                flight.pop(d["req"], None)
                found.append(_late(step, d))
            elif e["kind"] == "offload_restore":
                flight[d["req"]] = {**d, "kind": "restore", "step": step, "left": _blocks(d, 1)}
                was = slots if d.get("hit") else stored.get(d["req"], {})  # a hit: the cache's
                found += _restore_reads(step, d, was)
            else:
                issued = flight.get(d["req"])
                found += _landed(step, d, issued, stored, restored)
                if issued is not None and d["kind"] == "store":
                    slots.update(stored[d["req"]])
                if issued is None or not issued["left"]:  # its last block landed
                    flight.pop(d["req"], None)
                    where[d["req"]] = "host" if d["kind"] == "store" else "device"
        elif kind == "tier_read":
            c = flight.get(e["req"])
            # by the landings: the blocks read that had not landed (the engine's word, without
            # a record of the copy)
            left = c["left"] if c is not None and c["kind"] == "restore" else None
            blocks = [b for b in e["blocks"] if left is None or b in left]
            if blocks:
                found.append(_read(e, blocks, c is not None))
        elif kind == "snapshot" and "host_blocks" in e:
            checked += 1
            cache = apply_cache(cache, e)
            found += _tiers(e, flight, where, {b for b, _ in cache})
            held = e["seq_blocks"]
    return judged_result("offload", _first_each(found), checked)


def _blocks(d: dict, at: int) -> set[int]:
    """A copy's device blocks: pairs[at] (a store's pairs are (block, slot), a restore's (slot,
    block))."""
    return {p[at] for p in d["pairs"]}


def _read(e: dict, blocks: list[int], restoring: bool) -> Finding:
    return _finding(
        e["step"],
        "read_in_flight",
        f"request {e['req']} computed on its restored blocks {blocks[:8]} at step {e['step']}, "
        f"before their copy from the host tier (issued at step {e['issued']}) landed",
        req=e["req"],
        blocks=blocks,
        issued=e["issued"],
        restoring=restoring,
    )


def _late(step: int, d: dict) -> Finding:
    held = {b: h for b, h in d["holders"].items() if h}
    now = f", held now by {sorted({q for h in held.values() for q in h})}" if held else ""
    return _finding(
        step,
        "landed_after_free",
        f"request {d['req']}'s load from the host tier (issued at step {d['issued']}) landed in "
        f"blocks {d['blocks'][:8]} after the request was released{now}",
        req=d["req"],
        blocks=d["blocks"],
        holders=held,
    )


def _restore_reads(step: int, d: dict, stored: dict) -> list[Finding]:
    """The host slots a restore reads hold what the store copied into them."""
    bad = [(s, b) for (s, b), c in zip(d["pairs"], d["crcs"]) if s in stored and stored[s] != c]
    if not bad:
        return []
    return [
        _finding(
            step,
            "restore_content",
            f"request {d['req']} is restored from host slots {[s for s, _ in bad][:8]} whose "
            "contents are not what its store copied into them (the host copy changed while held)",
            req=d["req"],
            slots=[s for s, _ in bad],
            blocks=[b for _, b in bad],
        )
    ]


def _landed(step: int, d: dict, issued: dict | None, stored: dict, restored: dict) -> list[Finding]:
    """Blocks of a copy landed: each against what its issue read (its pair's CRC there)."""
    req, out = d["req"], []
    if issued is None:
        return []
    at = {tuple(p): c for p, c in zip(issued["pairs"], issued["crcs"])}
    mine = [(tuple(p), c) for p, c in zip(d["pairs"], d["crcs"]) if tuple(p) in at]
    issued["left"] -= {p[0] if d["kind"] == "store" else p[1] for p, _ in mine}
    if d["kind"] == "store":
        if not issued.get("began"):  # its first blocks landed: the host copy is this store's
            issued["began"], stored[req] = True, {}
        stored[req].update({s: at[(b, s)] for (b, s), _ in mine})
        bad = [b for (b, s), c in mine if c != at[(b, s)]]
        kept = restored.get(req, {})
        copied = {b: at[(b, s)] for (b, s), _ in mine}
        # per bad block: a copy equal to what the last restore wrote in it was kept since then
        since = [
            kept[b][1] if b in kept and kept[b][0] == copied[b] else issued["step"] for b in bad
        ]
        if not issued["left"]:
            restored.pop(req, None)
        if bad:
            out.append(
                _finding(
                    step,
                    "store_content",
                    f"request {req}: the host copy of its blocks {bad[:8]} differs from what "
                    f"the device blocks held when their copy completed (issued at step "
                    f"{issued['step']}): read before the compute writing them completed, or a "
                    "stale host copy taken as current",
                    req=req,
                    blocks=bad,
                    issued=issued["step"],
                    since=since,
                )
            )
    else:
        if not issued.get("began"):  # its first blocks landed: what this restore wrote
            issued["began"], restored[req] = True, {}
        restored[req].update({b: (c, step) for (_, b), c in mine})
        bad = [b for (s, b), c in mine if c != at[(s, b)]]
        if bad:
            out.append(
                _finding(
                    step,
                    "restore_content",
                    f"request {req}: its restored blocks {bad[:8]} do not hold what was copied "
                    "from the host tier once the restore completed",
                    req=req,
                    blocks=bad,
                )
            )
    return out


def _tiers(e: dict, flight: dict, where: dict, cached: set) -> list[Finding]:
    """One snapshot's tiers: each host slot held once (or, where the host tier shares slots,
    by as many as its ref count says) and not free, a stored sequence on the host alone, a
    restored one on the device alone, a block being stored handed to none else."""
    step, host, devices = e["step"], e["host_blocks"], e["seq_blocks"]
    out = []
    owner: dict[int, str] = {}
    free = set(e.get("host_free", ()))
    refs = e.get("host_ref_counts")
    holders: dict[int, int] = {}
    for req, slots in sorted(host.items()):
        for s in slots:
            other = owner.setdefault(s, req)
            holders[s] = holders.get(s, 0) + 1
            shared = refs is not None and 0 <= s < len(refs) and holders[s] <= refs[s]
            if other != req and not shared or s in free:
                why = f"held by {other} too" if other != req else "held and free"
                out.append(
                    _finding(
                        step,
                        "tier_map",
                        f"host slot {s} of request {req} is {why}",
                        req=req,
                        slots=[s],
                    )
                )
    for req, tier in where.items():
        if req in flight:
            continue
        if tier == "host" and devices.get(req):
            out.append(
                _finding(
                    step,
                    "tier_map",
                    f"request {req} is stored out but still holds device blocks {devices[req][:8]}",
                    req=req,
                    blocks=devices[req],
                )
            )
        elif tier == "device" and host.get(req):
            out.append(
                _finding(
                    step,
                    "tier_map",
                    f"request {req} is restored but still holds host slots {host[req][:8]}",
                    req=req,
                    slots=host[req],
                )
            )
    for req, c in flight.items():
        if c["kind"] != "store":
            continue
        mine, shared = c["left"] - cached, c.get("shared", ())  # (its blocks not landed yet)
        for other, blocks in devices.items():
            taken = [b for b in sorted(mine & set(blocks)) if (other, b) not in shared]
            taken = taken if other != req else []
            if taken:
                out.append(
                    _finding(
                        step,
                        "reuse_before_store",
                        f"request {other} holds device blocks {taken[:8]} that request {req}'s "
                        f"store (issued at step {c['step']}) has not finished copying out",
                        req=req,
                        holder=other,
                        blocks=taken,
                    )
                )
    return out


def _first_each(found: list[Finding]) -> list[Finding]:
    """One finding per (kind, request): a wrong tier map is told where it starts."""
    seen, out = set(), []
    for f in found:
        key = (f.kind, f.evidence.get("req"))
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out
