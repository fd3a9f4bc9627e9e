"""vLLM v1's KVCacheManager (prefix caching on) as a kvchaos block manager: `--block-manager vllm`.

It drives the INSTALLED vllm (0.33.x, checked on import) and copies none of its code: each
protocol v2 call is the calls vLLM's scheduler makes (docs/protocol-v2.md section 7). vLLM keeps
the block table in its worker, so the engine builds the table from block_ids; block 0 is vLLM's
null block (reserved). Install: docs/adapters.md (vllm --no-deps on a CPU torch)."""

from __future__ import annotations

from kvchaos.engine.errors import OutOfBlocks
from kvchaos.engine.protocols import Snapshot
from kvchaos.harness.adapters import require

# vLLM's KVCacheManager API changes between releases
VERSION = require("vllm", "0.33", "vllm==0.33.0", "vLLM")

try:  # after the version check; a broken install is one line too (ImportError, as above)
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1 import kv_cache_interface as kvi
    from vllm.v1.core import kv_cache_utils as kvu
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request, RequestStatus
except Exception as e:
    raise ImportError(f"vllm {VERSION} is installed but fails to import: {e}") from None

HASH = get_hash_fn_by_name("sha256")  # vLLM's default since 0.10.2
kvu.init_none_hash(HASH)  # once a process, as vLLM's engine core does


class VLLMManager:
    """Protocol v2 over one KVCacheManager: one full-attention group (it only counts blocks)."""

    kvchaos_protocol = 2
    capabilities = frozenset({"prefix_cache", "cache_state", "seq_tokens", "end_step"})
    reserved_blocks = (0,)  # vLLM's null block: never handed out

    def __init__(self, num_blocks, block_size, max_num_seqs=None, max_blocks_per_seq=None):
        self.block_size = block_size
        spec = kvi.FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
        )
        group = kvi.KVCacheGroupSpec(["layer"], spec)
        config = kvi.KVCacheConfig(num_blocks, kv_cache_tensors=[], kv_cache_groups=[group])
        self.vllm = KVCacheManager(
            config,
            max_model_len=num_blocks * block_size,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
        )
        self.pool = self.vllm.block_pool
        self.hasher = kvu.get_request_block_hasher(block_size, HASH)
        self.requests: dict[str, Request] = {}  # num_computed_tokens: the slots it has
        self.computed: dict[str, int] = {}  # tokens whose KV a step has written (end_step)
        self.retained: list = []  # copy-on-write endpoints, held until the step has run
        self.noted: dict[str, int] = {}  # leading blocks of a request whose key is in `keyed`
        self.keyed: dict[int, tuple] = {}  # block -> (its hash, cache entry): vLLM keeps no tokens

    num_blocks = property(lambda self: len(self.pool.blocks))  # the null block included
    num_free_blocks = property(lambda self: self.pool.get_num_free_blocks())

    def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
        r = Request(seq_id, list(token_ids), SamplingParams(), None, block_hasher=self.hasher)
        blocks, hit = self.vllm.get_computed_blocks(r, max_computed)[:2]
        n = min(num_new_tokens, len(token_ids) - hit)
        if self.vllm.allocate_slots(r, n, hit, blocks) is None:
            raise OutOfBlocks(f"{seq_id}: vLLM has no room for {n} tokens after a {hit}-token hit")
        r.num_computed_tokens, r.status = hit + n, RequestStatus.RUNNING  # as its scheduler does
        self.requests[seq_id], self.computed[seq_id], self.noted[seq_id] = r, hit, 0
        self._note(seq_id, r)
        return hit

    def append(self, seq_id, token_ids):
        r = self.requests[seq_id]
        new = token_ids[r.num_tokens - r.num_computed_tokens :]  # generated: not in the request yet
        if new:
            r.append_output_token_ids(list(new))  # hashes the blocks they fill
        if self.vllm.allocate_slots(r, len(token_ids)) is None:
            raise OutOfBlocks(f"{seq_id}: vLLM has no room for {len(token_ids)} more tokens")
        r.num_computed_tokens += len(token_ids)
        copies, retained = self.vllm.take_kv_cache_block_copies()
        self.retained += retained
        self._note(seq_id, r)
        return [(c.src_block_id, c.dst_block_id) for c in copies]

    def block_ids(self, seq_id):
        return [b.block_id for b in self.vllm.coordinator.get_blocks(seq_id)[0]]

    def release(self, seq_id, reason):
        r = self.requests.pop(seq_id, None)
        if r is None:
            return False
        done, _ = self.computed.pop(seq_id), self.noted.pop(seq_id)
        # vLLM keys blocks as it allocates them: after a failed step, blocks it never wrote
        unwritten = self.block_ids(seq_id)[done // self.block_size :] if reason == "error" else []
        self.vllm.free(r)  # finished, aborted or preempted alike, as vLLM's scheduler frees
        self.pool.evict_blocks(set(unwritten))
        return True

    def end_step(self, computed):
        self.computed.update((s, n) for s, n in computed.items() if s in self.requests)
        if self.retained:
            self.pool.free_blocks(self.retained)
            self.retained = []
        self.vllm.new_step_starts()

    def _note(self, seq_id, r) -> None:
        """Remember the parent key and tokens of each block r's allocation keyed."""
        i, hashes, bs = self.noted[seq_id], r.block_hashes, self.block_size
        blocks = self.vllm.coordinator.get_blocks(seq_id)[0] if i < len(hashes) else ()
        while i < min(len(blocks), len(hashes)) and blocks[i].block_hash is not None:
            b, parent = blocks[i], hashes[i - 1].hex() if i else None
            toks = list(r.all_token_ids[i * bs : (i + 1) * bs])
            entry = {"block": b.block_id, "key": hashes[i].hex(), "parent": parent, "tokens": toks}
            self.keyed[b.block_id], i = (b.block_hash, entry), i + 1
        self.noted[seq_id] = i

    def _entry(self, b) -> dict:
        hashed, entry = self.keyed.get(b.block_id, (None, None))
        if hashed != b.block_hash:  # keyed by no allocation the adapter saw: tokens unknown
            key = kvu.get_block_hash(b.block_hash).hex()
            return {"block": b.block_id, "key": key, "parent": None, "tokens": None}
        return dict(entry)

    def snapshot(self) -> Snapshot:
        blocks = self.pool.blocks
        return Snapshot(
            len(blocks),
            [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()],
            [b.ref_cnt for b in blocks],
            {s: self.block_ids(s) for s in self.requests},
            seq_tokens={s: r.num_computed_tokens for s, r in self.requests.items()},
            reserved=list(self.reserved_blocks),
            cache=[self._entry(b) for b in blocks if b.block_hash is not None],
        )
