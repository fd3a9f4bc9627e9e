"""The kernels' geometry over the KV pool: how many blocks each rank's pool holds, and the block
size the kernels address it in. Both are the manager's (its num_blocks and block_size): a worker
sizing the pool, or an attention backend asking a block size, apart from them is aligned to the
manager's by the remediated engine (seams.geometry_check), counted in geometry_alignments. Off (a
planted defect), the kernels run as asked: a table entry past the pool (in the kernels' blocks)
addresses past its end, and the raw address runs on: it wraps to the pool's start, as the harness's
record of writes and a -1 entry's write already address it. A mixin of Engine.

block_table.kernel_view() reads a row through such a geometry (the faults' ground truth and the
table_integrity checker)."""

from __future__ import annotations

import torch


class KernelGeometry:
    def _alloc_pools(self, num_blocks: int) -> None:
        """Each rank's KV pool, [layers, K/V, num_blocks, block_size, kv_heads / tp, head_dim],
        zeroed, and the per-layer views the kernels read (in their block size)."""
        mc, bs = self.config.model, self.bm.block_size
        self.pool_blocks = num_blocks
        self.kv_pools = [
            torch.zeros(
                mc.num_layers,
                2,
                num_blocks,
                bs,
                self.kv_heads_per_rank,
                mc.head_dim,
                dtype=mc.torch_dtype,
                device=self.device,
            )
            for _ in range(len(self.kv_pools) if hasattr(self, "kv_pools") else self.config.tp_size)
        ]
        self._views()

    def _views(self) -> None:
        kb, bs = self.kernel_bs, self.bm.block_size
        # apart from the manager's: read once here, not on every step
        self._apart = kb is not None or self.pool_blocks != self.bm.num_blocks
        m = (kb or bs) // bs  # the kernels see whole kernel blocks: a last odd block is past them

        def shape(t: torch.Tensor) -> torch.Tensor:
            return t if kb is None else t[: len(t) - len(t) % m].view(-1, kb, *t.shape[2:])

        self._kv_views = [
            [(shape(pool[layer, 0]), shape(pool[layer, 1])) for layer in range(pool.shape[0])]
            for pool in self.kv_pools
        ]

    def _align(self) -> bool:
        """The remediation: a geometry apart from the manager's is refused, the manager's kept."""
        if self.seams.geometry_check:
            self.geometry_alignments += 1
        return self.seams.geometry_check

    def size_kv_pool(self, num_blocks: int) -> None:
        """A worker sizing each rank's KV pool num_blocks blocks (zeroed), before the first step:
        one other than the manager's num_blocks is aligned to it, unless a defect is planted."""
        if num_blocks != self.bm.num_blocks and self._align():
            num_blocks = self.bm.num_blocks
        self._alloc_pools(num_blocks)

    def launch_block_size(self, block_size: int) -> None:
        """An attention backend asking its kernels be launched with block_size (slot = entry *
        block_size + offset, the pool read in blocks of it): one other than the manager's is
        aligned to it, unless a defect is planted. A multiple of the manager's."""
        bs = self.bm.block_size
        if block_size % bs:
            raise ValueError(f"kernel block size {block_size}: not a multiple of {bs}")
        if block_size != bs and self._align():
            block_size = bs
        self.kernel_bs = None if block_size == bs else block_size
        self._views()

    def kernel_geometry(self) -> dict:
        """What the kernels' geometry is where it is not the manager's (a snapshot's keys):
        kernel_block_size with the manager's block_size, pool_blocks. {}: the manager's."""
        out: dict = {}
        if not self._apart:
            return out
        if self.kernel_bs is not None:
            out.update(kernel_block_size=self.kernel_bs, block_size=self.bm.block_size)
        if self.pool_blocks != self.bm.num_blocks:
            out["pool_blocks"] = self.pool_blocks
        return out

    def _kernel_entries(self, flat: torch.Tensor) -> torch.Tensor:
        """A rank's table as the kernels address the pool: an entry past the pool (in the kernels'
        blocks) wraps to its start. The table itself where the geometry is the manager's."""
        if not self._apart:
            return flat
        bs = self.bm.block_size
        n = self.pool_blocks * bs // (self.kernel_bs or bs)
        return torch.where(flat >= n, flat.remainder(n), flat)
