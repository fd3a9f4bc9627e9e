"""How often a run produced the shapes prefix-cache bugs need and the paths leak variants break,
read from the history alone (scripts/prefix-shapes.py counts them over many seeds).

Prefix shapes (a run with a prefix cache: its submits carry prompt ids):
  stale_index     a whole block's tokens after one prefix, then after another, then after the
                  first again, with at least a pool's worth of tokens submitted between the first
                  and the last (the free queue cycled): nano-vllm 44a51af's stale hash index
  prefill_aborts  cancels that landed inside a prefill (between chunks)
  refused_hits    refused admissions of a request that hits the cache: refused with the blocks
                  the estimate counted free (a revived hit took more), a hit at its admission, or
                  its first block repeating an earlier prompt's
  full_hits       hits on a prompt of whole blocks, every block but the last served (the cap)
"""

from __future__ import annotations


def prefix_shapes(events: list[dict], bs: int, num_blocks: int) -> dict[str, int]:
    subs = [e for e in events if e.get("e") == "submit" and e.get("prompt_ids") is not None]
    hits = [e["data"] for e in events if e.get("e") == "engine" and e.get("kind") == "hit"]
    refusals = [
        e["data"]
        for e in events
        if e.get("e") == "engine" and e.get("kind") == "refusal" and e["data"]["call"] == "admit"
    ]
    hit_reqs = {h["req"] for h in hits if h.get("answered")}
    first: set[tuple] = set()
    repeats: set[str] = set()  # requests whose first block an earlier prompt began with
    for s in subs:
        b0 = tuple(s["prompt_ids"][:bs])
        if len(b0) == bs:
            if b0 in first:
                repeats.add(s["req"])
            first.add(b0)
    return {
        "stale_index": _stale_index(subs, bs, num_blocks * bs),
        "prefill_aborts": sum(
            1 for e in events if e.get("e") == "cancel" and e.get("phase") == "prefill"
        ),
        # free >= needed: the manager took more than the estimate, which counts no revive
        "refused_hits": sum(
            1 for r in refusals if r["free"] >= r["needed"] or r["seq"] in hit_reqs | repeats
        ),
        "full_hits": sum(
            1
            for h in hits
            if h["known"] % bs == 0 and h["known"] > bs and h["answered"] >= h["known"] - bs
        ),
    }


def _stale_index(subs: list[dict], bs: int, pool_tokens: int) -> int:
    """Triples (i, j, k) of submits, in order, whose block holds the same tokens after prefix X
    (i), another prefix (j), X again (k), with a pool's worth of tokens submitted from i to k;
    counted once per k and block."""
    seen: dict[tuple, list[tuple[int, int]]] = {}  # block tokens -> (submit index, its prefix)
    spent = [0]  # tokens submitted before each submit
    for s in subs:
        spent.append(spent[-1] + len(s["prompt_ids"]) + s.get("max_new", 0))
    found = 0
    for k, s in enumerate(subs):
        ids = s["prompt_ids"]
        for pos in range(bs, len(ids) - bs + 1, bs):  # a block after some prefix
            toks, pre = tuple(ids[pos : pos + bs]), hash(tuple(ids[:pos]))
            earlier = seen.setdefault(toks, [])
            hit = False
            for i, p in earlier:
                if p != pre or spent[k] - spent[i] < pool_tokens:
                    continue
                if any(i < j and q != pre for j, q in earlier):
                    hit = True
                    break
            found += hit
            earlier.append((k, pre))
    return found
