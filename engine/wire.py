"""The wire between tensor-parallel ranks: the step's collectives (Wire) and the step's inputs as
one broadcast of ints (Batch), the same on every rank.

One step on the wire, from rank 0:
  broadcast   header: op, step, table version, sync; batch: token ids, positions, decode rows,
              prefill chunks, copy-on-write copies, which ranks get a table update (and its size)
  isend/recv  the table updates due this step whose table changed (int32)
  all_gather  [version, crc] of the table each rank is about to compute with: the acknowledgement
              (with sync on, any rank on another version makes every rank refuse the step) and
              the cross-rank checker's input, recorded by rank 0 in the step stats
  all_gather  per layer, each rank's attention output for its heads
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvchaos.engine.config import EngineConfig

STEP, END = 1, 2
# op, step, version, sync; then the counts of tokens, decode rows, prefill chunks, copies, updates,
# scrambled ranks
HEAD = 10
TIMERS = ("bcast", "table", "ack", "gather", "compute")


def step_capacity(cfg: EngineConfig, world: int) -> int:
    """Ints in a step's one broadcast: room for a full batch (a longer one sends the rest after)."""
    seqs = cfg.cache.max_num_seqs
    return HEAD + 2 * (cfg.max_prefill_tokens + seqs) + 6 * seqs + 3 * world


class Wire:
    """The step's collectives, timed by kind and counted on every rank in the same order: the count
    is a rank's progress, which names the rank that hangs. (On NCCL the times are launch times.)"""

    def __init__(self, device: torch.device, world: int) -> None:
        self.dev, self.world = device, world
        self.ops = 0
        self.busy = False  # between a step's broadcast and its last collective
        self.sends: list = []
        self.t = dict.fromkeys(TIMERS, 0.0)

    def _op(self, kind: str, fn, *args):
        self.ops += kind != "table"  # point-to-point traffic differs by rank: not progress
        t0 = time.perf_counter()
        out = fn(*args)
        self.t[kind] += time.perf_counter() - t0
        return out

    def broadcast_step(self, msg: list[int] | None, cap: int) -> torch.Tensor:
        """Rank 0's header and batch (msg), in one broadcast of `cap` ints if it fits."""
        x = (
            torch.tensor(msg + [0] * (cap - len(msg)), dtype=torch.int64, device=self.dev)
            if msg is not None
            else torch.empty(cap, dtype=torch.int64, device=self.dev)
        )
        self._op("bcast", dist.broadcast, x[:cap], 0)
        n = HEAD + Batch.body_len(x[:HEAD].tolist())
        if n > cap:
            if msg is None:
                x = torch.cat([x, torch.empty(n - cap, dtype=torch.int64, device=self.dev)])
            self._op("bcast", dist.broadcast, x[cap:n], 0)
        return x[:n]

    def gather(self, x: torch.Tensor, kind: str) -> list[torch.Tensor]:
        out = [torch.empty_like(x) for _ in range(self.world)]
        self._op(kind, dist.all_gather, out, x)
        return out

    def send_table(self, dst: int, table: torch.Tensor) -> None:
        msg = table.to(self.dev)
        # msg is kept alive until sent
        self.sends.append((self._op("table", dist.isend, msg, dst), msg))

    def settle(self) -> None:
        for work, _ in self.sends:
            self._op("table", work.wait)
        self.sends = []

    def recv_table(self, numel: int) -> torch.Tensor:
        msg = torch.empty(numel, dtype=torch.int32, device=self.dev)
        self._op("table", dist.recv, msg, 0)
        return msg


@dataclass
class Batch:
    """One step's inputs, the same on every rank. Table entries travel as indices (entry (row, j)
    of the flat table is row * width + j), so every rank resolves them through its own copy."""

    op: int
    step: int
    version: int
    sync: bool
    tokens: torch.Tensor
    positions: torch.Tensor
    bases: list[int]  # each decode row's entry 0
    max_len: int  # longest decode context
    min_len: int  # shortest decode context
    prefill: list[tuple[int, int, int]]  # (row's entry 0, start, n)
    copies: list[tuple[int, int]]  # copy-on-write (src block, dst block)
    # table updates, in order: (rank, version, numel); numel 0: the rank's previous table under a
    # new version, else the table is sent after this broadcast
    updates: list[tuple[int, int, int]]
    # ranks whose tokens reach them out of order this step and write each block reversed
    scrambled: list[int]

    @staticmethod
    def pack(
        step, version, sync, tok, pos, bases, prefill, copies, updates, scrambled
    ) -> list[int]:
        head = [
            STEP,
            step,
            version,
            int(sync),
            len(tok),
            len(bases),
            len(prefill),
            len(copies),
            len(updates),
            len(scrambled),
        ]
        body = [x for t in (*prefill, *copies, *updates) for x in t]
        return head + tok + pos + bases + body + list(scrambled)

    @staticmethod
    def body_len(head: list[int]) -> int:
        return 2 * head[4] + head[5] + 3 * head[6] + 2 * head[7] + 3 * head[8] + head[9]

    @staticmethod
    def unpack(msg: torch.Tensor, device: torch.device) -> "Batch":
        op, step, version, sync, nt, nd, npre, ncp, nup, _ = msg[:HEAD].tolist()
        t = msg[HEAD : HEAD + 2 * nt].to(device)
        rest = msg[HEAD + 2 * nt :].tolist()
        pre, cps, ups = (
            rest[nd : nd + 3 * npre],
            rest[nd + 3 * npre : nd + 3 * npre + 2 * ncp],
            rest[nd + 3 * npre + 2 * ncp : nd + 3 * npre + 2 * ncp + 3 * nup],
        )
        scr = rest[nd + 3 * npre + 2 * ncp + 3 * nup :]
        dec_pos = msg[HEAD + nt : HEAD + nt + nd].tolist()
        return Batch(
            op,
            step,
            version,
            bool(sync),
            t[:nt],
            t[nt:],
            rest[:nd],
            max(dec_pos) + 1 if nd else 0,
            min(dec_pos) + 1 if nd else 0,
            [tuple(pre[i : i + 3]) for i in range(0, len(pre), 3)],
            [tuple(cps[i : i + 2]) for i in range(0, len(cps), 2)],
            [tuple(ups[i : i + 3]) for i in range(0, len(ups), 3)],
            scr,
        )
