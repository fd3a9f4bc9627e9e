"""Building a step's batch: token ids, positions and, per rank, the slot mapping and attention
tables read through that rank's copy of the flat block table; and the attention the model calls
per layer over the paged KV pool. A mixin of the Engine (DistEngine overrides both halves)."""

from __future__ import annotations

from itertools import groupby

import torch

from kvchaos.engine.attention import (
    DecodePlan,
    decode_blocks,
    decode_mask,
    paged_decode_torch,
    paged_prefill_torch,
    reversed_in_blocks,
    write_kv,
)
from kvchaos.engine.sequence import Sequence


class BatchBuilder:
    def _batch_inputs(self, decode: list[Sequence], prefill: list[tuple[Sequence, int]]):
        """Each sequence's table row, and the step's token ids and positions (decode first)."""
        rows = self.table.rows
        tok, pos = [], []
        for s in decode:
            tok.append(s.tokens[-1])
            pos.append(s.num_computed)
        for s, n in prefill:
            tok += s.tokens[s.num_computed : s.num_computed + n]
            pos += range(s.num_computed, s.num_computed + n)
        return rows, tok, pos

    def _build_batch(self, decode: list[Sequence], prefill: list[tuple[Sequence, int]]):
        """Token ids, positions and, per rank, the slot mapping and attention tables, all read
        through that rank's own copy of the flat table."""
        # the stride the kernels index rows with: the table's width unless a seam pins another;
        # the block size they address the pool in: the manager's unless launched with another
        bs = self.kernel_bs or self.bm.block_size
        width = self.seams.kernel_stride or self.table.table.width
        rows, tok, pos = self._batch_inputs(decode, prefill)
        dev = self.device
        nt, nd = len(tok), len(decode)
        dec_pos = pos[:nd]
        # Decode metadata in one host -> device copy. Entry (row, j) of the flat table is
        # row * width + j: base is each decode row's entry 0, ent the entry holding the token's
        # block, off the token's offset in that block.
        bases = [rows[s.id] * width for s in decode]
        ent = [b + p // bs for b, p in zip(bases, dec_pos)]
        meta = torch.tensor(
            tok + pos + [p + 1 for p in dec_pos] + bases + ent + [p % bs for p in dec_pos],
            device=dev,
        )
        tokens, positions = meta[:nt], meta[nt : 2 * nt]
        max_len = max(dec_pos) + 1 if nd else 0
        if nd:
            dec_lens, dec_base, dec_ent, dec_off = meta[2 * nt :].view(4, nd).unbind()
            torch_path = self.decode_attention is paged_decode_torch
            if (
                torch_path
            ):  # the mask every rank and layer shares (None when all rows are max_len long)
                mask = decode_mask(dec_lens, max_len, min(dec_pos) + 1)
            else:  # the kernel's dtype, converted once per step rather than per layer
                dec_lens = dec_lens.to(torch.int32)
            nblk_dec = -(-max_len // bs)
            dec_idx = torch.add(dec_base.unsqueeze(1), self._arange(nblk_dec)).view(
                -1
            )  # [nd * nblk_dec] entries
            hi = max(bases) + nblk_dec - 1  # the largest entry read (every ent is <= it)
        metas, scrambled = [], self._scramble()
        for rank in self.ranks.ranks:
            flat = self._kernel_entries(rank.table)  # the table itself, unless apart (geometry.py)
            last = flat.numel() - 1
            slots, dec_tables, plan, chunks = [], None, None, []
            if nd:  # flat addressing: an overlong row reads on into the next one, as a kernel would
                di, de = (
                    (dec_idx, dec_ent)
                    if hi <= last
                    else (dec_idx.clamp(max=last), dec_ent.clamp(max=last))
                )
                dec_tables = flat.index_select(0, di).view(nd, nblk_dec)
                slots.append(
                    torch.add(dec_off, flat.index_select(0, de), alpha=bs)
                )  # block * bs + offset, int64
                if torch_path:
                    plan = DecodePlan(decode_blocks(dec_tables, bs, max_len), max_len, mask)
            off = nd
            for s, n in prefill:
                start = s.num_computed
                nblk = -(-(start + n) // bs)
                trow = flat[(rows[s.id] * width + torch.arange(nblk, device=dev)).clamp_(max=last)]
                p = positions[off : off + n]
                slots.append(trow[p // bs].long() * bs + p % bs)
                chunks.append((off, n, start, trow))
                off += n
            slots = torch.cat(slots) if len(slots) > 1 else slots[0]
            if rank.index in scrambled:
                slots = reversed_in_blocks(slots, positions, bs)
            metas.append((slots, dec_tables, plan, chunks))
        if self.record_writes:
            self._record_writes(decode, prefill, [m[0] for m in metas])
        if self.seams.on_batch is not None:
            self._report_batch(
                decode, prefill, tok, pos, lambda r: (metas[r][0], metas[r][1], metas[r][3])
            )
        self._dec_lens, self._dec_max_len = (dec_lens if nd else None), max_len
        return tokens, positions, metas

    def _scramble(self) -> list[int]:
        """The ranks whose tokens reach them out of order this step and that write them so (the
        remediation, slots_by_position, writes every token at its position's offset)."""
        seams, step = self.seams, self.step_count
        late = [r for r in range(len(self.ranks.ranks)) if seams.tokens_out_of_order(r, step)]
        if seams.slots_by_position:
            self.order_fixes += len(late)
            late = []
        self.scrambled_ranks = late
        return late

    def _report_batch(self, decode, prefill, tok: list, pos: list, meta_of) -> None:
        """Tell the on_batch seam what each rank writes and reads this step, from that rank's own
        metadata (meta_of(rank): its slots, decode tables and prefill chunks). Reads are the row
        entries the kernel reads for positions [0, n_ctx): a decode token's [0, pos], a chunk's
        [0, start + n) (its own positions, written first, too); an unused entry (-1) reads block
        0. A rank whose table equals rank 0's computes as rank 0 does: not reported."""
        bs, report, ranks = self.bm.block_size, self.seams.on_batch, self.ranks.ranks
        seqs = [s.id for s in decode] + [s.id for s, n in prefill for _ in range(n)]
        ctx = [(s.id, p + 1) for s, p in zip(decode, pos)]
        ctx += [(s.id, s.num_computed + n) for s, n in prefill]
        for r in range(len(ranks)):
            if r and torch.equal(ranks[r].content(), ranks[0].content()):
                if r not in self.scrambled_ranks:
                    continue
            slots, dec_tables, chunks = meta_of(r)
            rows = dec_tables.clamp(min=0).tolist() if decode else []
            rows += [c[3].clamp(min=0).tolist() for c in chunks]
            if self.kernel_bs:  # a kernel block is kernel_bs // bs of the manager's, in order
                m = self.kernel_bs // bs
                rows = [[e * m + t for e in row for t in range(m)] for row in rows]
            reads = [(seq, n, row[: -(-n // bs)]) for (seq, n), row in zip(ctx, rows)]
            report(r, reads, list(zip(seqs, pos, tok, slots.tolist())))

    def _record_writes(self, decode, prefill, slots_by_rank: list[torch.Tensor]) -> None:
        """The blocks each rank's writes land in, by sequence, the positions each sequence wrote
        (first, end), and each write through an unused entry: (sequence, position, rank). The
        harness's record."""
        nb, bs = self.kv_pools[0].shape[2:4]  # the pool as sized (no call into the manager)
        ids = [s.id for s in decode] + [s.id for s, n in prefill for _ in range(n)]
        spans = {s.id: (s.num_computed, s.num_computed + 1) for s in decode}
        spans.update((s.id, (s.num_computed, s.num_computed + n)) for s, n in prefill)
        written, self.write_spans, self.unslotted = {}, spans, []
        self.written = written
        for rank, slots in enumerate(slots_by_rank):
            blocks = (slots // bs).tolist()
            # a chunk's tokens run in one block at a time: one entry per run
            for (seq_id, block), _ in groupby(zip(ids, blocks)):
                # an unused entry (-1) lands in the last block
                written.setdefault(seq_id, {}).setdefault(block % nb, set()).add(rank)
            if blocks and min(blocks) < 0:
                pos = [s.num_computed for s in decode]
                pos += [p for s, n in prefill for p in range(s.num_computed, s.num_computed + n)]
                self.unslotted += [(q, p, rank) for q, p, b in zip(ids, pos, blocks) if b < 0]

    def _arange(self, n: int) -> torch.Tensor:
        """torch.arange(n) on the engine's device, cached (a view of a longer one)."""
        ar = getattr(self, "_arange_cache", None)
        if ar is None or ar.numel() < n:
            ar = self._arange_cache = torch.arange(max(2 * n, 64), device=self.device)
        return ar[:n]

    def _attend(self, nd: int, metas):
        scale, decode_attention = self.model.scale, self.decode_attention
        hkv_r = self.kv_heads_per_rank
        h_r = hkv_r * (self.config.model.num_heads // self.config.model.num_kv_heads)
        kv_views, dec_lens = self._kv_views, self._dec_lens
        max_len = self._dec_max_len  # int(dec_lens.max()), known on the host
        tp = len(metas)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outs = []
            for r, (slots, dec_tables, plan, chunks) in enumerate(metas):
                kc, vc = kv_views[r][layer]
                qr, kr, vr = (
                    (q, k, v)
                    if tp == 1
                    else (
                        q[:, r * h_r : (r + 1) * h_r],
                        k[:, r * hkv_r : (r + 1) * hkv_r],
                        v[:, r * hkv_r : (r + 1) * hkv_r],
                    )
                )
                write_kv(kc, vc, slots, kr, vr)
                parts = []
                if nd:
                    parts.append(
                        decode_attention(
                            qr[:nd] if chunks else qr,
                            kc,
                            vc,
                            dec_tables,
                            dec_lens,
                            scale,
                            max_len,
                            plan=plan,
                        )
                    )
                for off, n, start, trow in chunks:
                    parts.append(paged_prefill_torch(qr[off : off + n], kc, vc, trow, start, scale))
                outs.append(parts[0] if len(parts) == 1 else torch.cat(parts))
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

        return attend
