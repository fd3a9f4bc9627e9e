"""A small Llama-style decoder (RMSNorm, rotary embeddings, GQA, SwiGLU) with weights drawn from
the seed. It does not know about paging: attention is a callback, so the engine runs it over the
paged pool and the oracle over a contiguous cache."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kvchaos.engine.config import ModelConfig

# attend(layer, q [N, H, D], k [N, Hkv, D], v [N, Hkv, D]) -> [N, H, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class Model:
    def __init__(self, cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        g = torch.Generator().manual_seed(seed)
        hd, h, hkv, hid, inter = (
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.hidden_size,
            cfg.intermediate_size,
        )

        def w(
            out: int, fan_in: int
        ) -> torch.Tensor:  # drawn on the CPU: the same weights on every device
            return (torch.randn(out, fan_in, generator=g) / fan_in**0.5).to(
                self.device, cfg.torch_dtype
            )

        def norm() -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(hid, generator=g)).to(self.device, cfg.torch_dtype)

        self.embed = torch.randn(cfg.vocab_size, hid, generator=g).to(self.device, cfg.torch_dtype)
        self.layers = [
            dict(
                attn_norm=norm(),
                qkv=w((h + 2 * hkv) * hd, hid),
                o=w(hid, h * hd),
                mlp_norm=norm(),
                gate_up=w(2 * inter, hid),
                down=w(hid, inter),
            )
            for _ in range(cfg.num_layers)
        ]
        self.final_norm = norm()
        self.lm_head = w(cfg.vocab_size, hid)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.arange(cfg.max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.cos = angles.cos().to(self.device, torch.float32)
        self.sin = angles.sin().to(self.device, torch.float32)
        self.scale = hd**-0.5

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """tokens, positions: [N] -> hidden states [N, hidden] (before the final norm)."""
        cfg = self.cfg
        h, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        x = self.embed[tokens]
        for i, L in enumerate(self.layers):
            qkv = F.linear(_rms_norm(x, L["attn_norm"], cfg.rms_eps), L["qkv"])
            q, k, v = qkv.split([h * hd, hkv * hd, hkv * hd], dim=-1)
            q = self._rope(q.view(-1, h, hd), cos, sin)
            k = self._rope(k.view(-1, hkv, hd), cos, sin)  # K is cached after rotation
            o = attend(i, q, k, v.view(-1, hkv, hd))
            x = x + F.linear(o.reshape(-1, h * hd), L["o"])
            gate, up = F.linear(_rms_norm(x, L["mlp_norm"], cfg.rms_eps), L["gate_up"]).chunk(
                2, dim=-1
            )
            x = x + F.linear(F.silu(gate) * up, L["down"])
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(_rms_norm(hidden, self.final_norm, self.cfg.rms_eps), self.lm_head).float()
