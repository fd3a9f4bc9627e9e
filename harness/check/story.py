"""One story from a run's findings, reader first: the root findings (explained by no other), each
with the findings it explains listed under it. A request that read KV it does not own outranks the
holder of that block (a bystander); a divergence is explained by the wrong read or write of its
own request; a leak at the end by the leak that started it; findings the same call made true by
the first of them. Pure, over Finding records or their dicts (results.json's)."""

from __future__ import annotations

# Within one step, what a reader needs first: the request that read wrong KV, then the call that
# failed, then the wrong write, then wrong state, then what the outputs showed
RANK = {
    "kv_reads": 0,
    "prefix_cache": 1,
    "manager_calls": 2,
    "table_integrity": 3,
    "block_accounting": 4,
    "oracle_divergence": 5,
}
LEAKS = ("refcount", "leak", "conservation", "free_referenced")


def _get(f, key: str, default=None):
    return f.get(key, default) if isinstance(f, dict) else getattr(f, key, default)


def _ev(f) -> dict:
    return _get(f, "evidence") or {}


# Within a checker, the finding that says most: a position written with no slot names the
# position; the foreign write it also is names only the block it landed in
FIRST_KINDS = ("unslotted_write",)


def order_key(f) -> tuple:
    checker = _get(f, "checker")
    return (_get(f, "step"), RANK.get(checker, 6), checker, _get(f, "kind") not in FIRST_KINDS)


def _reader(f) -> str | None:
    """The request a finding says read or wrote wrong KV."""
    c, k = _get(f, "checker"), _get(f, "kind")
    if c in ("kv_reads", "prefix_cache") or (c, k) in (
        ("table_integrity", "foreign_write"),
        ("table_integrity", "unslotted_write"),
        ("block_accounting", "shared_write"),
    ):
        return _ev(f).get("req")
    return None


def _same_call(a, b) -> bool:
    ca, cb = _get(a, "call"), _get(b, "call")
    return bool(ca and cb) and (ca["call"], ca["step"], ca.get("index")) == (
        cb["call"],
        cb["step"],
        cb.get("index"),
    )


def explains(root, f) -> bool:
    """Whether finding root explains finding f (root comes first in the story)."""
    if root is f:
        return False
    rc, fc, fk = _get(root, "checker"), _get(f, "checker"), _get(f, "kind")
    rs, fs = _get(root, "step"), _get(f, "step")
    if fc == "oracle_divergence" and rs <= fs:
        return _reader(root) is not None and _reader(root) == _ev(f).get("req")
    if fk == "shared_write" and rc in ("kv_reads", "prefix_cache"):
        # the block's holder wrote into a block another request got wrongly: a bystander
        ev, block = _ev(root), _ev(f).get("block")
        got = block is not None and (
            ev.get("block") == block or block in (ev.get("hit_blocks") or ())
        )
        return got and abs(rs - fs) <= 1 and ev.get("req") != _ev(f).get("req")
    if fk == "end_leak" and _get(root, "kind") in LEAKS and rs <= fs:
        return True
    return _same_call(root, f) and order_key(root) <= order_key(f)


def story(findings: list) -> list[tuple]:
    """[(root, [findings it explains])], roots in order (step, then RANK); each finding once."""
    ordered = sorted(findings, key=order_key)
    # readers and wrong writes first: they may explain findings that come before them in time
    chosen = sorted(ordered, key=lambda f: (_reader(f) is None, order_key(f)))
    placed: dict[int, list] = {}
    under: set[int] = set()
    for f in ordered:
        root = next(
            (r for r in chosen if id(r) not in under and id(r) != id(f) and explains(r, f)), None
        )
        if root is not None:
            under.add(id(f))
            placed.setdefault(id(root), []).append(f)
    return [(f, placed.get(id(f), [])) for f in ordered if id(f) not in under]


def root_first(findings: list) -> list:
    """The findings in the story's order: each root, then what it explains."""
    return [x for root, kids in story(findings) for x in (root, *kids)]
