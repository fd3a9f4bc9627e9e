"""An independent reference forward: the model's maths written again, plainly, in float64, sharing
no code with kvchaos.engine.model (only its weights). The oracle shares the model's forward with
the engine, so a bug there (a wrong sign in the rotary embedding, a swapped gate) would pass both;
this cross-checks that shared code on a sample of every run."""

from __future__ import annotations

import math

import torch


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def _turns(t: int, d: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding's cos and sin [T, 1, d/2], rotate-half layout: pair i is (x[i],
    x[i + d/2]), turned by pos * f_i."""
    freqs = torch.tensor([theta ** (-2.0 * i / d) for i in range(d // 2)], dtype=torch.float64)
    angle = torch.arange(t, dtype=torch.float64)[:, None] * freqs[None, :]  # [T, d/2]
    return torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * c - b * s, a * s + b * c], dim=-1)


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits [T, vocab] (float64) after each prefix of `tokens`."""
    cfg = model.cfg
    f64 = lambda t: t.detach().to("cpu", torch.float64)  # noqa: E731
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group = h // hkv
    t = len(tokens)
    c, s = _turns(t, d, cfg.rope_theta)
    x = f64(model.embed)[torch.tensor(tokens)]
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    for layer in model.layers:
        qkv = _norm(x, f64(layer["attn_norm"]), cfg.rms_eps) @ f64(layer["qkv"]).T
        q = qkv[:, : h * d].reshape(t, h, d)
        k = qkv[:, h * d : (h + hkv) * d].reshape(t, hkv, d)
        v = qkv[:, (h + hkv) * d :].reshape(t, hkv, d)
        q, k = _rotate(q, c, s), _rotate(k, c, s)
        kv = torch.arange(h) // group  # query heads share a KV head in consecutive groups
        qh, kh, vh = q.transpose(0, 1), k[:, kv].transpose(0, 1), v[:, kv].transpose(0, 1)
        score = (qh @ kh.transpose(1, 2)) / math.sqrt(d)  # [heads, T, T]
        score = score.masked_fill(~causal, float("-inf"))
        heads = torch.softmax(score, dim=-1) @ vh  # [heads, T, d]
        x = x + heads.transpose(0, 1).reshape(t, h * d) @ f64(layer["o"]).T
        inter = cfg.intermediate_size
        gu = _norm(x, f64(layer["mlp_norm"]), cfg.rms_eps) @ f64(layer["gate_up"]).T
        gate, up = gu[:, :inter], gu[:, inter:]
        x = x + (gate * torch.sigmoid(gate) * up) @ f64(layer["down"]).T
    return _norm(x, f64(model.final_norm), cfg.rms_eps) @ f64(model.lm_head).T


def cross_check(oracle, tokens: list[int], start: int, logits: torch.Tensor) -> dict:
    """The shared forward against the reference on one token sequence: logits [positions, vocab],
    the oracle's after each prefix tokens[: start + 1 + j], taken from its own pass."""
    atol, rtol = oracle.atol, oracle.rtol
    ref = reference_logits(oracle.model, tokens)[start : start + logits.shape[0]]
    err = (logits.to("cpu", torch.float64) - ref).abs().amax(-1)
    tol = atol + rtol * ref.abs().amax(-1)
    bad = torch.nonzero(~(err <= tol)).flatten()
    return {
        "checked": logits.shape[0],
        "max_abs_err": float(err.max()),
        "agrees": not bad.numel(),
        "first_disagreement": start + int(bad[0]) if bad.numel() else None,
    }
