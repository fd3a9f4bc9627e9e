"""The contiguous-cache oracle: the same weights, one causal pass over each request's whole token
sequence with plain SDPA on contiguous K/V (never the paged path), fed the very tokens the engine
produced (teacher forcing). Each engine logit row is compared with the oracle's at that position."""
from __future__ import annotations

from dataclasses import dataclass, asdict

import torch

from engine.model import Model

# (atol, rtol) by dtype: float32 tight; half precisions as vLLM and FlashInfer test them.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (5e-2, 5e-2)}


@dataclass
class OracleResult:
    request: str
    checked: int            # logit rows compared
    max_abs_err: float
    max_rel_err: float
    first_divergence: int | None  # index of the first generated token whose logits diverged
    abs_err_at_divergence: float | None = None
    tolerance: float | None = None

    @property
    def diverged(self) -> bool:
        return self.first_divergence is not None

    def to_dict(self) -> dict:
        return asdict(self)


class Oracle:
    def __init__(self, model: Model) -> None:
        self.model = model
        self.atol, self.rtol = TOLERANCES[model.cfg.torch_dtype]

    @torch.inference_mode()
    def check(self, request: str, tokens: list[int], prompt_len: int, logits: torch.Tensor) -> OracleResult:
        """tokens: prompt + every generated token; logits[j] produced generated token j."""
        m = logits.shape[0]
        if m == 0:
            return OracleResult(request, 0, 0.0, 0.0, None)
        seq = torch.tensor(tokens[:prompt_len + m - 1], device=self.model.device)
        ref = self.model.forward_contiguous(seq)[prompt_len - 1:].cpu()
        got = logits.float()
        err = (got - ref).abs().amax(-1)
        scale = ref.abs().amax(-1)
        tol = self.atol + self.rtol * scale
        bad = torch.nonzero(~(err <= tol)).flatten()  # NaN counts as divergence
        first = int(bad[0]) if bad.numel() else None
        rel = (err / scale.clamp(min=1e-12))
        return OracleResult(request, m, float(err.max()), float(rel.max()), first,
                            float(err[first]) if first is not None else None,
                            float(tol[first]) if first is not None else None)
