"""The contiguous-cache oracle: the same weights, one causal pass over each request's whole token
sequence with plain SDPA on contiguous K/V (never the paged path), fed the very tokens the engine
produced (teacher forcing). Each engine logit row is compared with the oracle's at that position.
Requests of similar length share a pass, right-padded: under the causal mask a padded tail never
reaches the positions before it."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvchaos.engine.model import Model

# A padded pass costs at most this many times its requests' own tokens; longer ones go in another.
PAD_SLACK = 1.5
# (atol, rtol) by dtype: float32 tight; half precisions as vLLM and FlashInfer test them.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


@dataclass
class OracleResult:
    request: str
    checked: int  # logit rows compared
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

    def check(
        self, request: str, tokens: list[int], prompt_len: int, logits: torch.Tensor
    ) -> OracleResult:
        """tokens: prompt + every generated token; logits[j] produced generated token j."""
        return self.check_many([(request, tokens, prompt_len, logits)])[0]

    @torch.inference_mode()
    def check_many(
        self, items: list[tuple[str, list[int], int, torch.Tensor]]
    ) -> list[OracleResult]:
        """check() for several requests, in padded passes over requests of similar length (the tiny
        reference model's cost is mostly per op, so one pass for many requests is far cheaper)."""
        out = [OracleResult(req, 0, 0.0, 0.0, None) for req, *_ in items]
        # The engine's logits row j came from the prefix tokens[:prompt_len + j]: feed every
        # token but the last.
        todo = sorted(
            (it[2] + it[3].shape[0] - 1, i) for i, it in enumerate(items) if it[3].shape[0]
        )
        group: list[tuple[int, int]] = []
        for n, i in todo:
            if group and n * (len(group) + 1) > PAD_SLACK * (sum(g[0] for g in group) + n):
                self._check_group(items, group, out)
                group = []
            group.append((n, i))
        if group:
            self._check_group(items, group, out)
        return out

    def _check_group(self, items, group: list[tuple[int, int]], out: list[OracleResult]) -> None:
        batch = torch.zeros(
            len(group), group[-1][0], dtype=torch.long
        )  # sorted: the last is the longest
        for row, (n, i) in enumerate(group):
            batch[row, :n] = torch.tensor(items[i][1][:n])
        hidden = self.model.forward_contiguous(batch.to(self.model.device))
        # Logits only where the engine produced some: from each prompt's last token on.
        refs = self.model.logits(
            torch.cat([hidden[row, items[i][2] - 1 : n] for row, (n, i) in enumerate(group)])
        )
        for (n, i), ref in zip(group, refs.cpu().split([items[i][3].shape[0] for _, i in group])):
            out[i] = self._compare(items[i][0], items[i][3].float(), ref)

    def _compare(self, request: str, got: torch.Tensor, ref: torch.Tensor) -> OracleResult:
        err = (got - ref).abs().amax(-1)
        scale = ref.abs().amax(-1)
        tol = self.atol + self.rtol * scale
        bad = torch.nonzero(~(err <= tol)).flatten()  # NaN counts as divergence
        first = int(bad[0]) if bad.numel() else None
        rel = err / scale.clamp(min=1e-12)
        return OracleResult(
            request,
            got.shape[0],
            float(err.max()),
            float(rel.max()),
            first,
            float(err[first]) if first is not None else None,
            float(tol[first]) if first is not None else None,
        )
