"""Engine decode benchmarks: batch-1 decode steps with their host share, and the paged engine's
decode step against a contiguous-cache baseline (ContiguousDecoder) on the same Model weights."""

from __future__ import annotations

import random
import statistics

import torch
import torch.nn.functional as F

from kvchaos.engine.config import CacheConfig, EngineConfig
from kvchaos.engine.engine import Engine
from kvchaos.harness.bench.timing import NoGC, perf


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _prefill_until_decode(engine: Engine, batch: int) -> None:
    for _ in range(10_000):
        st = engine.step().stats
        if st.prefill_tokens == 0 and st.decode_tokens == batch:
            return
    raise RuntimeError("the engine never reached steady-state decode")


def bench_engine_b1(device: str, steps: int, warmup: int, prompt: int = 16) -> dict[str, float]:
    """Decode steps of the default engine at batch 1: per-step wall time (median) and host share.
    A default table row holds 512 tokens, so requests follow one another; only pure decode steps
    are timed (each request's prefill and its first decode step are not)."""
    cfg = EngineConfig(device=device)
    engine = Engine(cfg)
    rng = random.Random(0)
    max_new = cfg.cache.max_tokens_per_seq - prompt
    wall, lat, host, prep = [], [], [], []
    k = 0
    while len(wall) < steps:
        engine.add_request(f"b1-{k}", _prompt(rng, prompt, cfg.model.vocab_size), max_new)
        k += 1
        _prefill_until_decode(engine, 1)
        with NoGC():
            while engine.has_unfinished() and len(wall) < steps:
                t = perf()
                st = engine.step().stats
                dt = perf() - t
                assert st.decode_tokens == 1 and st.prefill_tokens == 0
                if warmup > 0:
                    warmup -= 1
                    continue
                wall.append(dt)
                lat.append(st.latency_s)
                host.append(st.host_s)
                prep.append(st.prep_s)
    engine.close()
    return {"step_s": statistics.median(wall), "requests": k, **_host_shares(lat, host, prep)}


def _host_shares(lat: list[float], host: list[float], prep: list[float]) -> dict[str, float]:
    mean_lat = statistics.fmean(lat)
    return {
        "host_share": statistics.fmean(host) / mean_lat,
        "bookkeeping_share": (statistics.fmean(host) - statistics.fmean(prep)) / mean_lat,
    }


class ContiguousDecoder:
    """The baseline: the same Model, per-layer contiguous K/V [B, T, Hkv, D] preallocated; a decode
    step writes the new K/V at position t and runs plain batched SDPA over [:t+1]."""

    def __init__(self, model, batch: int, max_len: int) -> None:
        cfg = model.cfg
        self.model, self.batch = model, batch
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = [
            torch.zeros(shape, dtype=cfg.torch_dtype, device=model.device)
            for _ in range(cfg.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=cfg.torch_dtype, device=model.device)
            for _ in range(cfg.num_layers)
        ]
        self.groups = cfg.num_heads // cfg.num_kv_heads
        self.t = 0
        try:
            q = torch.zeros(1, 2, 1, 4)
            F.scaled_dot_product_attention(q, q[:, :1], q[:, :1], enable_gqa=True)
            self.gqa = True
        except (TypeError, RuntimeError):
            self.gqa = False

    def _sdpa(self, q, k, v, causal: bool):
        if not self.gqa:
            k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.model.scale)
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=causal, scale=self.model.scale, enable_gqa=True
        )

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        b, n = self.batch, len(prompts[0])
        dev = self.model.device
        tokens = torch.tensor([t for p in prompts for t in p], device=dev)
        positions = torch.arange(n, device=dev).repeat(b)

        def attend(layer, q, k, v):
            q, k, v = (x.view(b, n, x.shape[1], x.shape[2]) for x in (q, k, v))
            self.k[layer][:, :n] = k
            self.v[layer][:, :n] = v
            o = self._sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
            return o.transpose(1, 2).reshape(b * n, q.shape[2], q.shape[3])

        hidden = self.model.forward(tokens, positions, attend)
        self.t = n
        return self.model.logits(hidden.view(b, n, -1)[:, -1])

    @torch.inference_mode()
    def step(self, tokens: list[int]) -> tuple[list[int], torch.Tensor]:
        """One decode step for the whole batch at position t: next tokens (greedy) and logits."""
        t, dev = self.t, self.model.device
        tok = torch.tensor(tokens, device=dev)
        positions = torch.full((self.batch,), t, dtype=torch.long, device=dev)

        def attend(layer, q, k, v):
            kc, vc = self.k[layer], self.v[layer]
            kc[:, t] = k
            vc[:, t] = v
            # The paged path's GQA formulation (a KV head's query group as its queries), so the
            # ratio measures paging alone: [B, Hkv, G, D] against [B, Hkv, t+1, D] read in place.
            b, h, d = q.shape
            hkv = kc.shape[2]
            o = F.scaled_dot_product_attention(
                q.view(b, hkv, h // hkv, d),
                kc[:, : t + 1].transpose(1, 2),
                vc[:, : t + 1].transpose(1, 2),
                scale=self.model.scale,
            )
            return o.reshape(b, h, d)

        logits = self.model.logits(self.model.forward(tok, positions, attend))
        self.t = t + 1
        return logits.argmax(-1).tolist(), logits


def bench_paged_vs_contiguous(
    device: str, steps: int, warmup: int, batch: int = 8, context: int = 512
) -> dict[str, float]:
    """Steady-state decode at batch x context: the engine's step and the contiguous baseline's step,
    alternated (who goes first flips every step) on the same inputs; the logits are compared too."""
    total = context + warmup + steps + 2
    cc = CacheConfig(
        num_blocks=max(512, batch * -(-total // 16)),
        max_blocks_per_seq=max(64, -(-total // 16)),
        max_num_seqs=max(16, batch),
    )
    # The whole batch prefills in one step, so every sequence decodes at the same context length.
    cfg = EngineConfig(device=device, cache=cc, max_prefill_tokens=batch * context)
    engine = Engine(cfg)
    rng = random.Random(1)
    prompts = [_prompt(rng, context, cfg.model.vocab_size) for _ in range(batch)]
    ids = [f"b{i}" for i in range(batch)]
    for i, p in zip(ids, prompts):
        engine.add_request(i, p, total - context)
    _prefill_until_decode(engine, batch)  # one prefill step, then the first decode step
    contig = ContiguousDecoder(engine.model, batch, total)
    first = contig.prefill(prompts).argmax(-1).tolist()
    first_agree = first == [engine.seqs[i].tokens[context] for i in ids]
    contig.step(
        [engine.seqs[i].tokens[context] for i in ids]
    )  # catch up with the engine's first decode

    eng_t, con_t, lat, host, prep = [], [], [], [], []
    max_err = 0.0

    def engine_step():
        t = perf()
        out = engine.step()
        return perf() - t, out

    def contig_step(inputs):
        _sync(device)
        t = perf()
        toks, logits = contig.step(inputs)
        return perf() - t, toks, logits

    with NoGC():
        for k in range(warmup + steps):
            inputs = [engine.seqs[i].tokens[-1] for i in ids]
            if k % 2 == 0:
                te, out = engine_step()
                tc, _, logits = contig_step(inputs)
            else:
                tc, _, logits = contig_step(inputs)
                te, out = engine_step()
            st = out.stats
            assert st.decode_tokens == batch and st.prefill_tokens == 0
            got = torch.stack([out.logits[i] for i in ids])
            max_err = max(max_err, float((got - logits.float().cpu()).abs().max()))
            if k >= warmup:
                eng_t.append(te)
                con_t.append(tc)
                lat.append(st.latency_s)
                host.append(st.host_s)
                prep.append(st.prep_s)
    engine.close()
    return {
        "engine_step_s": statistics.median(eng_t),
        "contiguous_step_s": statistics.median(con_t),
        "max_abs_logit_err": max_err,
        "first_token_agrees": first_agree,
        **_host_shares(lat, host, prep),
    }
