"""The refcount_leak fault's variants: each a leak class real engines shipped, its report, and the
trigger that puts the fault's own requests into the phase the variant breaks.

  any        the article's case: a cancel path skips the whole free (params paths, fraction)
  prefill    a cancel landing between two prefill chunks skips the free (sglang#1674, the abort
             path between match and allocation in sglang#12693)
  decode     a cancel of a decoding request skips the free (sglang#1674)
  shared     a cancel in the shared phase of a fork skips the free: every shared block stays
             referenced after the parent ends (the article's fork / beam case)
  preempted  a preemption's release drops the mapping but not the blocks' refs; the request's
             later abort while preempted finds nothing to free (the recompute-preemption class
             of tests/bug_managers.py PreemptLeak: no public report found)
  retry      a refused admission touches its cache hit before the room check and never untouches
             it; every retry of the waiting request leaks the hit's refs and its cancel frees
             nothing (vllm#11562, fixed by vllm#11565 in v0.6.6's V1 allocate_slots)
  partial    an abort drops the private blocks' refs but not the shared (copy-on-write or
             cache-hit) ones (xllm#828: a ref-count test that assumed one holder)
  rate       the article's rate: about one cancel in 20 skips the free (its "1200 blocks in 3
             hours"), so the pool drains slowly; exact accounting still names the first leak
  waiting    a cancel of a request still in the waiting queue that already holds blocks (admitted,
             its KV landing from a disaggregated prefill: the engine's seams.kv_load_steps) skips
             the free, the abort path assuming a waiting request owns nothing (sglang#8587, the
             decode engine's waiting queue; vLLM's WAITING_FOR_REMOTE_KVS abort, vllm#46283)
  engine_abort  an engine-initiated abort: one request's own error inside a step (a sampling
             error raised, RequestFailed, at a token the fault's seeded schedule picks) ends it
             on an error path that forgets the release (sglang#38352: a request finished ahead
             of the result processors "leaks its KV and never answers")

Engine-path variants (any, prefill, decode, shared, rate, waiting, engine_abort) plant on the
engine's free_on_exit seam (waiting's trigger on kv_load_steps, engine_abort's on on_sample) and
so in any manager; preempted and partial plant in the reference managers' release_skips, retry in
the reference prefix pool (PoolSeams.check_before_touch)."""

from __future__ import annotations

from kvchaos.faults.base import Variant
from kvchaos.faults.plan import Action

# planted on the reference managers' own seams: not applicable under another manager
REFERENCE_ONLY = ("preempted", "retry", "partial")
# its requests hold blocks whose KV lands later: a prefix-caching manager that keys blocks as it
# allocates them (vLLM's, unless its scheduler passes delay_cache_blocks, which protocol v2
# cannot say) caches them unwritten: left out of vLLM's adapter lane, and of the soak's mix under
# any other prefix-caching manager (it cannot tell which key at allocation; SGLang's holds).
DELAYED_KV = ("waiting",)
# free_on_exit: any manager
ENGINE_PATH = ("any", "prefill", "decode", "shared", "rate", "waiting", "engine_abort")
RATE_STRIDE = 20  # rate: one cancel in RATE_STRIDE leaks (about 5%)
LOAD_STEPS = 3  # waiting: the steps an admitted request's KV takes to land

RAII = (
    "Hold a request's blocks through a handle released on every exit path (a context manager / "
    "try-finally around the request's life, the article's RAII), and make release idempotent."
)
VARIANTS = {  # as an incident quotes them (any: the fault's own text)
    "any": Variant(),
    "prefill": Variant(
        "A cancel that arrived between two prefill chunks returned before the free: the blocks "
        "reserved for the chunks already computed stayed referenced with no owner "
        "(sgl-project/sglang#1674; the abort window of sgl-project/sglang#12693).",
        RAII,
    ),
    "decode": Variant(
        "The cancel path of a decoding request returned before releasing its blocks: their "
        "reference counts never dropped (sgl-project/sglang#1674).",
        RAII,
    ),
    "shared": Variant(
        "A fork cancelled while it still shared its parent's blocks skipped the free: the shared "
        "blocks kept the child's reference after the parent released them.",
        RAII,
    ),
    "preempted": Variant(
        "The preemption (recompute) path dropped the request's block list but not the blocks' "
        "reference counts; an abort while the request was preempted found nothing of its own to "
        "free, and the blocks stayed referenced by no one.",
        "Release through the same call on every exit (finish, abort, preempt, error): the block "
        "list and the references go together, and release is idempotent.",
    ),
    "retry": Variant(
        "An admission touched (ref-counted) its prefix-cache hit before checking for room; the "
        "refusal returned without untouching it, so each retry of the waiting request leaked the "
        "hit's references, and its cancel, holding nothing, freed none (vllm-project/vllm#11562, "
        "fixed by vllm-project/vllm#11565).",
        "Check room first and touch the hit only once the admission can no longer fail: a "
        "refusal changes nothing.",
    ),
    "partial": Variant(
        "The abort path dropped the references of the request's private blocks but not of the "
        "blocks it shared (copy-on-write or cache hits): a ref-count test that assumed one holder "
        "(xLLM-AI/xllm#828) left them referenced after every other holder ended.",
        "Drop exactly one reference per block the request held, shared or not, through one "
        "handle released on every exit path (the article's RAII).",
    ),
    "rate": Variant(
        "One cancel path in about twenty skipped the free (a rarely taken exception branch): the "
        "pool lost a few blocks per hundred cancels, the article's 1200 blocks in 3 hours.",
        RAII,
    ),
    "waiting": Variant(
        "The abort path of a request still in the waiting queue assumed it owned nothing, true "
        "of a request never admitted but not of one admitted and waiting for its KV to land "
        "(a disaggregated decode engine's preallocated blocks): it was removed without "
        "releasing them (sgl-project/sglang#8587; the WAITING_FOR_REMOTE_KVS abort of "
        "vllm-project/vllm#46283).",
        "Release by what the request holds, not by the queue it is in: every exit path, from the "
        "waiting queue too, goes through the one release (the article's RAII).",
    ),
    "engine_abort": Variant(
        "A request whose own work failed inside a step (a sampling error) was ended by the "
        "engine on an error branch that never released its blocks: it finished ahead of the "
        "path that frees, so it leaked its KV (sgl-project/sglang#38352; the article's "
        "exception branches).",
        RAII,
    ),
}


def shape(variant: str, n: int, plan, cfg, rng) -> dict[str, int]:
    """Add the variant's trigger to the plan: n rounds of the fault's own requests, each put into
    the phase the variant breaks (ids lk<i>...). Returns, for engine_abort, the token (1 = the
    first sampled) at which each of its requests fails; for waiting, its requests whose KV lands
    from elsewhere (value: the steps it takes)."""
    bs, mpt = cfg.cache.block_size, cfg.max_prefill_tokens
    cap = cfg.cache.max_tokens_per_seq

    def add(step, op, req, prompt=(), out=0, **kw) -> None:
        plan.add(Action(step, op, req, list(prompt), out, origin="refcount_leak", **kw))

    schedule: dict[str, int] = {}
    for i in range(n):
        r, t = f"lk{i}", 1 + 3 * i
        if variant == "waiting":  # one cancelled while its KV lands, one that lands and runs
            p = min(cap // 2, 2 * bs + 2, mpt)
            add(t, "submit", r, plan.prompt(p, rng), 4)
            add(t, "cancel", r, when="loading")
            add(t + 1, "submit", f"{r}l", plan.prompt(p, rng), 4)
            schedule[r] = schedule[f"{r}l"] = LOAD_STEPS
        elif variant == "engine_abort":  # decoding; its own sampling error at a seeded token
            p = min(cap // 4, bs + 1)
            out = max(2, min(cap - p, 12))
            add(t, "submit", r, plan.prompt(p, rng), out)
            schedule[r] = rng.randint(1, out - 1)
        elif variant == "prefill":  # chunked: the cancel lands after its first chunk
            add(t, "submit", r, plan.prompt(min(cap - 4, 2 * mpt + bs), rng), 4)
            add(t, "cancel", r, when="prefill")
        elif variant == "decode":
            p = min(cap // 4, bs + 1)
            add(t, "submit", r, plan.prompt(p, rng), min(cap - p, 24))
            add(t + 2, "cancel", r, when="decode")
        elif variant in ("shared", "partial"):
            # the parent: two whole blocks and a partial one; the child forks it as it decodes
            p = 2 * bs + 2
            out = max(2, min(16, (cap - p) // 2))
            add(t, "submit", f"{r}p", plan.prompt(p, rng), out)
            if variant == "partial":  # first: it waits a step, the child copies its last block
                add(t, "cancel", f"{r}c", when="shared")
            add(t, "fork", f"{r}c", (), out, parent=f"{r}p", when="decode")
            if variant == "shared":
                add(t, "cancel", f"{r}c", when="shared")
        elif variant == "preempted":  # growth past the pool: the newest is preempted
            _pressure(i, plan, cfg, add, rng)
        elif variant == "retry":  # and decode past the pool: preempted requests come back to
            _retry(i, plan, cfg, add, rng)  # hits they must revive, refused while it is full
            _pressure(i, plan, cfg, add, rng)
        elif variant == "rate":  # short requests, each cancelled while it decodes
            for j in range(RATE_STRIDE):
                q, p = f"{r}r{j}", min(cap // 4, bs + 1)
                add(t + j, "submit", q, plan.prompt(p, rng), min(cap - p, 12))
                add(t + j + 1, "cancel", q, when="decode")
    return schedule


def _pressure(i: int, plan, cfg, add, rng) -> None:
    """Requests whose decode outgrows the pool together: the scheduler preempts the newest; a
    cancel waits for each in its preempted phase."""
    cc = cfg.cache
    k = max(2, min(cc.max_num_seqs, 4))
    p = min(cc.max_tokens_per_seq // 4, cc.block_size + 1)
    out = min(cc.max_tokens_per_seq - p, -(-3 * cc.num_blocks * cc.block_size // (2 * k)))
    step = 1 + 40 * i
    for j in range(k):
        q = f"lk{i}g{j}"
        add(step, "submit", q, plan.prompt(p, rng), out)
        if j == k - 1:
            add(step, "cancel", q, when="preempted")


def retry_need(cfg) -> int:
    """Blocks the retry trigger's reader asks at admission: its 3-block hit, revived from the
    free queue, and its first chunk."""
    return 3 + -(-cfg.max_prefill_tokens // cfg.cache.block_size)


def _retry(i: int, plan, cfg, add, rng) -> None:
    """A source finishes (its 3 whole blocks cached, free); fillers then hold all but need - 1
    blocks; a reader repeating the source's blocks is refused (its hit revives blocks the
    scheduler's estimate does not count) and is cancelled while it waits to retry."""
    cc = cfg.cache
    bs, need = cc.block_size, retry_need(cfg)
    src = plan.prompt(3 * bs, rng)
    a, b = f"lk{i}a", f"lk{i}b"
    prev = f"lk{i - 1}b" if i else None
    if prev is None:
        add(1, "submit", a, src, 2)
    else:
        add(1, "submit", a, src, 2, after=prev, when="finished")
    hold = cc.num_blocks - need + 1  # blocks the fillers hold: need - 1 stay free
    k = max(1, cc.max_num_seqs - 2)  # rows: the fillers', the reader's
    k = max(k, -(-hold // (cc.max_tokens_per_seq // bs)))
    fills = [hold // k + (j < hold % k) for j in range(k)]
    for j, size in enumerate(fills):  # each within its blocks to the end: no growth
        out = min(16, size * bs - 1)
        prompt = plan.prompt(size * bs - out, rng)
        add(1, "submit", f"lk{i}f{j}", prompt, out, after=a, when="finished")
    add(1, "cancel", b, when="waiting")  # before the submit: it lands once b was tried
    reader = src + plan.prompt(cc.max_tokens_per_seq - 3 * bs - 4, rng)
    add(1, "submit", b, reader, 2, after=f"lk{i}f{len(fills) - 1}", when="decode")
