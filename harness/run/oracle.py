"""The contiguous-cache oracle: the same weights, one causal pass over each request's whole token
sequence with plain SDPA on contiguous K/V (never the paged path), fed the very tokens the engine
produced (teacher forcing). Each engine logit row is compared with the oracle's at that position.
Requests of similar length share a pass, right-padded: under the causal mask a padded tail never
reaches the positions before it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvchaos.engine.model import Model

# A padded pass costs at most this many times its requests' own tokens; longer ones go in another.
PAD_SLACK = 1.5
PAD_FREE = 64  # ... unless the padding is this few tokens: a pass costs more than they do
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
        return dict(self.__dict__)  # flat: dataclasses.asdict's deep copy costs more than a check


@dataclass
class _Past:
    """A live request's contiguous cache: the K/V of the tokens fed so far, per layer, and what
    its checks found so far (a live request is checked again as it grows: only its new tokens
    are fed then, attending to this cache)."""

    fed: list[int]
    kv: torch.Tensor  # [layers, 2 (K after rotation, V), Hkv, len(fed), D]
    checked: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0


# Token prefixes whose K/V the oracle keeps for other requests that start with them (system
# prompts, templates, earlier turns): one every SHARE_EVERY tokens fed, SHARE_MAX at most.
SHARE_EVERY = 8
SHARE_MAX = 4096


class Oracle:
    def __init__(self, model: Model) -> None:
        self.model = model
        self.atol, self.rtol = TOLERANCES[model.cfg.torch_dtype]
        self.past: dict[str, _Past] = {}
        # exact token prefix -> K/V holding at least its positions: the oracle's own computation
        # for those very tokens, so a request starting with them does not compute them again
        self.shared: dict[tuple[int, ...], torch.Tensor] = {}
        self.captured: tuple[int, torch.Tensor] | None = None  # see check_many's capture

    def _shared_past(self, fed: list[int], prompt_len: int) -> _Past | None:
        """The longest kept prefix of fed that ends before the first position whose logits are
        compared (they are computed, never taken)."""
        top = min(prompt_len - 1, len(fed) - 1)
        for n in range(top - top % SHARE_EVERY, 0, -SHARE_EVERY):
            kv = self.shared.get(tuple(fed[:n]))
            if kv is not None:
                return _Past(fed[:n], kv[:, :, :, :n])
        return None

    def _share(self, fed: list[int], start: int, kv) -> None:
        """Keep the prefixes of fed that end in (start, len(fed)]: kv() builds its K/V."""
        ends = range(start - start % SHARE_EVERY + SHARE_EVERY, len(fed) + 1, SHARE_EVERY)
        if not ends or len(self.shared) >= SHARE_MAX:
            return
        full = kv()
        for n in ends:
            self.shared.setdefault(tuple(fed[:n]), full)

    def check(
        self, request: str, tokens: list[int], prompt_len: int, logits: torch.Tensor
    ) -> OracleResult:
        """tokens: prompt + every generated token; logits[j] produced generated token j."""
        return self.check_many([(request, tokens, prompt_len, logits)])[0]

    @torch.inference_mode()
    def check_many(
        self,
        items: list[tuple[str, list[int], int, torch.Tensor]],
        keep: set[str] = frozenset(),
        capture: str | None = None,
    ) -> list[OracleResult]:
        """check() for several requests, in padded passes over requests of similar length (the tiny
        reference model's cost is mostly per op, so one pass for many requests is far cheaper).
        keep: live requests, checked again later on more rows: their cache is kept, so the next
        check feeds only the tokens since (a check without keep is the request's last).
        capture: a request whose logits at every position fed here are kept in self.captured, as
        (first position, logits [positions, vocab]): what the shared model code is cross-checked
        on (from its pass: no pass of its own)."""
        self.captured = None
        out = [OracleResult(req, 0, 0.0, 0.0, None) for req, *_ in items]
        feeds = []  # (new tokens to feed, item index, past or None)
        for i, (req, tokens, prompt_len, rows) in enumerate(items):
            past = self.past.pop(req, None)
            # The engine's logits row j came from the prefix tokens[:prompt_len + j]: feed every
            # token but the last.
            fed = tokens[: prompt_len + rows.shape[0] - 1]
            if past is not None and fed[: len(past.fed)] != past.fed:
                past = None  # not a prefix of what it fed before: start over
            if past is None and self.shared:
                past = self._shared_past(fed, prompt_len)
            if past is not None and len(fed) == len(past.fed):  # nothing new since: no pass
                out[i] = OracleResult(req, past.checked, past.max_abs, past.max_rel, None)
                if req in keep:
                    self.past[req] = past
            elif rows.shape[0]:
                feeds.append((len(fed) - (len(past.fed) if past else 0), i, past))
        group: list = []
        for m, i, past in sorted(feeds, key=lambda f: (f[0], f[1])):
            padded, own = m * (len(group) + 1), sum(g[0] for g in group) + m
            if group and padded > PAD_SLACK * own and padded - own > PAD_FREE:
                self._check_group(items, group, out, keep, capture)
                group = []
            group.append((m, i, past))
        if group:
            self._check_group(items, group, out, keep, capture)
        return out

    def _forward(self, batch: torch.Tensor, lens: list[int], pasts: list):
        """batch [R, M] new tokens of requests whose caches hold lens[r] tokens (pasts[r], or
        None) -> hidden [R, M, hidden] and the new tokens' K/V ([layers, 2, R, Hkv, M, D])."""
        model, cfg = self.model, self.model.cfg
        r, m = batch.shape
        p_max, dev = max(lens), model.device
        lens_t, new = torch.tensor(lens), torch.arange(m)
        positions = (lens_t[:, None] + new[None, :]).clamp(max=cfg.max_position - 1)
        # a query sees the cached keys of its own request and the new keys up to itself
        key = torch.arange(p_max + m)[None, None, :]
        mask = (key < lens_t[:, None, None]) | (
            (key >= p_max) & (key <= p_max + new[None, :, None])
        )  # [R, M, P+M]
        groups = cfg.num_heads // cfg.num_kv_heads
        # the query heads sharing a K/V head share its attention call: [R, Hkv, G*M, ...]
        mask = mask[:, None].repeat(1, 1, groups, 1).to(dev)
        # every layer's K/V, the caches padded to P then the new tokens': written once, read as
        # they are (no per-layer concatenation); the new tokens' part is what this returns
        shape = (cfg.num_layers, 2, r, cfg.num_kv_heads, p_max + m, cfg.head_dim)
        kv = torch.zeros(shape, dtype=cfg.torch_dtype, device=dev)
        for row, past in enumerate(pasts):
            if past:
                kv[:, :, row, :, : lens[row]] = past.kv
        wide = cfg.torch_dtype != torch.float32  # attention runs in float32

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv[layer, 0, :, :, p_max:] = k.view(r, m, k.shape[1], k.shape[2]).transpose(1, 2)
            kv[layer, 1, :, :, p_max:] = v.view(r, m, v.shape[1], v.shape[2]).transpose(1, 2)
            h, d = q.shape[1], q.shape[2]
            q = q.view(r, m, h, d).transpose(1, 2).reshape(r, h // groups, groups * m, d)
            keys, values = kv[layer, 0], kv[layer, 1]
            if wide:
                q, keys, values = q.float(), keys.float(), values.float()
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=model.scale)
            o = o.view(r, h, m, d).transpose(1, 2).reshape(r * m, h, d)  # [R*M, H, D]
            return o.to(cfg.torch_dtype) if wide else o

        hidden = model.forward(batch.reshape(-1).to(dev), positions.reshape(-1).to(dev), attend)
        return hidden.view(r, m, -1), kv[:, :, :, :, p_max:]  # [layers, 2, R, Hkv, M, D]

    def _check_group(self, items, group: list, out: list[OracleResult], keep, capture) -> None:
        model = self.model
        r, m = len(group), max(1, group[-1][0])  # sorted: the last feeds the most
        lens = [len(p.fed) if p else 0 for _, _, p in group]
        flat, fed_all = [], []  # the new tokens, right-padded with 0: one tensor for the pass
        for row, (n, i, past) in enumerate(group):
            req, tokens, prompt_len, rows = items[i]
            fed = tokens[: prompt_len + rows.shape[0] - 1]
            fed_all.append(fed)
            flat += fed[lens[row] :]
            flat += [0] * (m - n)
        batch = torch.tensor(flat, dtype=torch.long).view(r, m)
        hidden, new_kv = self._forward(batch, lens, [p for _, _, p in group])
        # Logits only where the engine produced some and not yet checked: from each prompt's
        # last token on, past what an earlier check of it compared.
        spans = []
        for row, (n, i, _) in enumerate(group):
            prompt_len = items[i][2]
            lo = max(prompt_len - 1, lens[row])  # first position whose row is new
            spans.append((lo - lens[row], lo - lens[row] + max(0, lens[row] + n - lo)))
        refs = model.logits(torch.cat([hidden[row, a:b] for row, (a, b) in enumerate(spans)]))
        for row, (n, i, _) in enumerate(group):
            if items[i][0] == capture:  # every position it fed, prompt included
                self.captured = (lens[row], model.logits(hidden[row, :n]))
        # rows before first_row were compared by an earlier check of the request
        first_rows = [max(0, lens[row] - items[i][2] + 1) for row, (_, i, _) in enumerate(group)]
        got = [items[i][3][f:].float() for (_, i, _), f in zip(group, first_rows)]
        compared = self._compare(torch.cat(got), refs.cpu(), [g.shape[0] for g in got])
        for row, ((n, i, past), first_row, res) in enumerate(zip(group, first_rows, compared)):
            req = items[i][0]
            res.request = req
            res.first_divergence = (
                None if res.first_divergence is None else res.first_divergence + first_row
            )
            if past is not None:
                res.checked += past.checked
                res.max_abs_err = max(res.max_abs_err, past.max_abs)
                res.max_rel_err = max(res.max_rel_err, past.max_rel)
            out[i] = res
            whole: list = []  # the request's K/V, built once for what needs it

            def kv(row=row, n=n, past=past, whole=whole):
                if not whole:
                    new = new_kv[:, :, row, :, :n]
                    whole.append(torch.cat([past.kv, new], dim=3) if past else new.clone())
                return whole[0]

            self._share(fed_all[row], lens[row], kv)
            if req in keep and not res.diverged:
                self.past[req] = _Past(
                    fed_all[row], kv(), res.checked, res.max_abs_err, res.max_rel_err
                )

    def _compare(self, got: torch.Tensor, ref: torch.Tensor, sizes: list[int]) -> list:
        """Logit rows against the oracle's, for several requests at once (sizes: rows each):
        one set of tensor ops for the group, then each request's share on the host."""
        err = (got - ref).abs().amax(-1)
        scale = ref.abs().amax(-1)
        tol = self.atol + self.rtol * scale
        bad = (~(err <= tol)).tolist()  # NaN counts as divergence
        err_, rel, tol_ = err.tolist(), (err / scale.clamp(min=1e-12)).tolist(), tol.tolist()
        out, at = [], 0
        for n in sizes:
            span = range(at, at + n)
            first = next((j - at for j in span if bad[j]), None)
            out.append(
                OracleResult(
                    "",
                    n,
                    _max(err_[at : at + n]),
                    _max(rel[at : at + n]),
                    first,
                    err_[at + first] if first is not None else None,
                    tol_[at + first] if first is not None else None,
                )
            )
            at += n
        return out


def _max(xs: list[float]) -> float:
    """max() that, like torch's, is NaN when any is (and 0.0 over nothing)."""
    return float("nan") if any(x != x for x in xs) else max(xs, default=0.0)
