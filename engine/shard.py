"""What every tensor-parallel rank holds and does, rank 0 included: its own copy of the flat block
table, the pool of its num_kv_heads / world KV heads, and attention for those heads. The outputs
are all-gathered per layer, so every rank ends the layer with the whole attention output."""

from __future__ import annotations

import torch

from kvchaos.engine.attention import (
    paged_decode_torch,
    paged_prefill_torch,
    plan_decode,
    reversed_in_blocks,
    write_kv,
)
from kvchaos.engine.config import EngineConfig
from kvchaos.engine.engine import decode_backend
from kvchaos.engine.errors import KVChaosError
from kvchaos.engine.ranks import VirtualRank
from kvchaos.engine.wire import Batch, Wire


class StaleTable(KVChaosError):
    """A rank was about to compute on a table version other than the step's: refused."""


class Shard:
    """What every rank holds and does: its copy of the block table, the pool of its KV heads, its
    share of attention."""

    def __init__(
        self,
        cfg: EngineConfig,
        rank: int,
        world: int,
        device: torch.device,
        table: VirtualRank,
        scale: float,
        pool: torch.Tensor | None = None,
    ) -> None:
        mc, cc = cfg.model, cfg.cache
        self.rank, self.world, self.device, self.table, self.scale = (
            rank,
            world,
            device,
            table,
            scale,
        )
        self.hkv = mc.num_kv_heads // world
        self.h = self.hkv * (mc.num_heads // mc.num_kv_heads)
        self.bs, self.layers = cc.block_size, mc.num_layers
        self.pool = (
            pool
            if pool is not None
            else torch.zeros(
                mc.num_layers,
                2,
                cc.num_blocks,
                cc.block_size,
                self.hkv,
                mc.head_dim,
                dtype=mc.torch_dtype,
                device=device,
            )
        )
        self.decode_attention = decode_backend(cfg.resolved_backend())

    def receive(self, wire: Wire, b: Batch) -> None:
        """Apply, in order, the table updates rank 0 sends this rank this step."""
        for r, version, numel in b.updates:
            if r == self.rank and numel:
                self.table.apply(version, wire.recv_table(numel))
            elif r == self.rank:
                self.table.version = version

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([c[0] for c in copies], device=self.device)
            dst = torch.tensor([c[1] for c in copies], device=self.device)
            self.pool[:, :, dst] = self.pool[:, :, src]

    def acknowledge(self, wire: Wire, b: Batch) -> tuple[list[int], list[int]]:
        """Every rank reports [version, crc] of the table it is about to compute with."""
        mine = torch.tensor(
            [self.table.version, self.table.crc()], dtype=torch.int64, device=wire.dev
        )
        got = torch.stack(wire.gather(mine, "ack")).tolist()
        versions, crcs = [g[0] for g in got], [g[1] for g in got]
        stale = [r for r, v in enumerate(versions) if v != b.version]
        if b.sync and stale:
            raise StaleTable(
                f"step {b.step}: ranks {stale} hold table versions {[versions[r] for r in stale]}, "
                f"the step's is {b.version}: refusing to compute on a stale table"
            )
        return versions, crcs

    def slots(self, b: Batch, flat: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Where rank `rank`'s (this rank's) K/V of the step go through the flat table `flat`:
        each token's entry (its row's entry 0 + position // block size, read on past the table's
        end as the last entry) and its offset in that block (reversed where the rank's tokens
        reach it out of order, b.scrambled)."""
        bs, p = self.bs, b.positions
        nd = len(b.bases)
        ent = [torch.tensor(b.bases, device=self.device) + p[:nd] // bs] if nd else []
        off = nd
        for base, _, n in b.prefill:
            ent.append(base + p[off : off + n] // bs)
            off += n
        ent = torch.cat(ent).clamp_(max=flat.numel() - 1)
        slots = flat[ent].long() * bs + p % bs
        if (self.rank if rank is None else rank) in b.scrambled:
            slots = reversed_in_blocks(slots, p, bs)
        return slots

    def resolve(self, b: Batch, flat: torch.Tensor | None = None, rank: int | None = None):
        """Slot mapping and attention tables through this rank's own table (or flat: rank
        `rank`'s, as rank 0 knows it). Flat addressing: an overlong row reads on into the next one,
        as a kernel would (as Engine._build_batch)."""
        flat = self.table.table if flat is None else flat
        bs, dev = self.bs, self.device
        last = flat.numel() - 1
        dec, chunks = None, []
        nd = len(b.bases)
        if nd:
            nblk = -(-b.max_len // bs)
            base = torch.tensor(b.bases, device=dev)
            idx = (base[:, None] + torch.arange(nblk, device=dev)[None, :]).view(-1)
            if max(b.bases) + nblk - 1 > last:
                idx = idx.clamp(max=last)
            tables = flat.index_select(0, idx).view(nd, nblk)
            lens = (b.positions[:nd] + 1).to(torch.int32)
            plan = (
                plan_decode(tables, lens, bs, b.max_len, b.min_len)
                if self.decode_attention is paged_decode_torch
                else None
            )
            dec = (tables, lens, plan)
        off = nd
        for base, start, n in b.prefill:
            nblk = -(-(start + n) // bs)
            trow = flat[(base + torch.arange(nblk, device=dev)).clamp_(max=last)]
            chunks.append((off, n, start, trow))
            off += n
        return self.slots(b, flat, rank), dec, chunks

    def attend(self, wire: Wire, b: Batch, meta):
        slots, dec, chunks = meta
        r, h, hkv, nd, pool, scale = (
            self.rank,
            self.h,
            self.hkv,
            len(b.bases),
            self.pool,
            self.scale,
        )

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc, vc = pool[layer, 0], pool[layer, 1]
            qr = q[:, r * h : (r + 1) * h]
            write_kv(kc, vc, slots, k[:, r * hkv : (r + 1) * hkv], v[:, r * hkv : (r + 1) * hkv])
            parts = (
                [
                    self.decode_attention(
                        qr[:nd], kc, vc, dec[0], dec[1], scale, b.max_len, plan=dec[2]
                    )
                ]
                if nd
                else []
            )
            for off, n, start, trow in chunks:
                parts.append(paged_prefill_torch(qr[off : off + n], kc, vc, trow, start, scale))
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
            if self.world > 1:
                out = torch.cat(wire.gather(out.contiguous(), "gather"), dim=1)
            wire.busy = layer < self.layers - 1
            return out

        return attend
