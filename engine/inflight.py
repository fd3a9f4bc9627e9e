"""Asynchronous scheduling (`[engine] async_scheduling`), as vLLM's async scheduler: step N+1 is
scheduled (admit / append / release go to the manager) while step N still executes, so its KV
writes have not landed when the manager answers for N+1.

On the CPU the lag is deterministic, driven by the step count alone (no thread): a step's KV is
written as the model computes it (its own attention reads it at once, as one stream orders a
kernel's write before its read) and the step *completes* (its writes land, as far as any other
request can tell) after the next step has been scheduled and computed. A sequence released
while the step in flight wrote its blocks is the hazard window:

- remediated (the default seam): the engine completes that step first, a fence, then frees;
- freed at once (seam `free_in_flight` says so): its in-flight writes land when the step
  completes, into blocks the manager has taken back and may have handed to another request.

Only those writes are re-applied at completion (the others land on the values already there).

The table upload is asynchronous too: step N's copy still reads its staged table when step N+1
is staged. Double-buffered (the default), each copy reads its own buffer; restaging the one
buffer (seam `reuse_staging`) lets N's copy land over N+1's rows past the first, so the table
step N+1 computes with mixes two steps.

The events of the history (engine events, built by keyword here): `async_step`, `async_fence`,
`async_freed`, `async_landed`, `async_mixed`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from typing_extensions import TypedDict

if TYPE_CHECKING:  # the harness's events import this module: a command starts without torch
    import torch


class AsyncStep(TypedDict):
    """Each computed step: what went in flight, what completed."""

    inflight: int  # the step whose writes are now in flight
    seqs: list[str]  # the sequences it wrote
    completed: int | None  # the step whose writes landed in this one (None: none in flight)


class AsyncFence(TypedDict):
    """A release waited for the step in flight (the remediation)."""

    req: str
    why: str  # finish | cancel | preempt | error
    waited: int  # the step it waited for


class AsyncFreed(TypedDict):
    """A release went to the manager while the step in flight still writes the blocks."""

    req: str
    why: str
    inflight: int
    slots: list[int]  # rank 0's slots of its in-flight writes


class AsyncMixed(TypedDict):
    """The table a step computes with mixes two steps: rows past the first still hold the step
    before's, which its in-flight copy wrote after this step's table was staged."""

    rows: list[int]
    seqs: list[str]  # the sequences those rows now belong to
    # the blocks of those rows, this step's and the step before's: the ones the step wrote over
    # and the ones it should have written (a prefix cache may key them, never written)
    blocks: list[int]


class AsyncLanded(TypedDict):
    """In-flight writes of a released sequence landed (their step completed)."""

    req: str
    written: int  # the step that wrote them
    blocks: list[int]
    slots: list[int]  # rank 0's
    holders: dict[str, list[int]]  # block -> the sequences whose table rows name it now
    writes: list[list[int]]  # [rank, pos, token, slot]


@dataclass(kw_only=True)
class Early:
    """A sequence freed while in flight: its writes, and the KV they wrote, kept to land."""

    req: str
    writes: list[tuple[int, int, int, int]]  # (rank, pos, token, slot)
    kv: list[torch.Tensor]  # per write: [layers, 2, kv_heads, head_dim]


@dataclass(kw_only=True)
class InFlight:
    step: int | None = None  # the step whose writes have not landed
    writes: dict[str, list[tuple[int, int, int, int]]] = field(default_factory=dict)
    early: list[Early] = field(default_factory=list)
    landed: list[AsyncLanded] = field(default_factory=list)  # since the harness last looked
    log: list[AsyncLanded] = field(default_factory=list)  # every landing of the run
    staged: torch.Tensor | None = None  # the table the step in flight's copy reads
    mixed: list[AsyncMixed] = field(default_factory=list)  # every mixed table of the run
    counters: dict[str, int]  # the engine's: async_fences, async_freed, async_landed

    def begin(self, step: int, ids: list[str], pos: list[int], tok: list[int], slots) -> None:
        """Step `step` goes in flight: its writes by sequence (slots: per rank, a tensor)."""
        by: dict[str, list[tuple[int, int, int, int]]] = {}
        for rank, sl in enumerate(slots):
            for q, p, t, s in zip(ids, pos, tok, sl.tolist()):
                by.setdefault(q, []).append((rank, p, t, s))
        self.step, self.writes = step, by

    def wrote(self, req: str) -> bool:
        return self.step is not None and req in self.writes

    def keep(self, req: str, pools: list[torch.Tensor]) -> AsyncFreed:
        """req is freed while in flight: keep its writes' KV (as they stand now) to land."""
        writes = self.writes.pop(req)
        kv = []
        for rank, _, _, slot in writes:
            pool = pools[rank]
            nb, bs = pool.shape[2], pool.shape[3]
            s = slot % (nb * bs)
            kv.append(pool[:, :, s // bs, s % bs].clone())
        self.early.append(Early(req=req, writes=writes, kv=kv))
        self.counters["async_freed"] += 1
        return AsyncFreed(
            req=req, why="", inflight=self.step or 0, slots=[w[3] for w in writes if w[0] == 0]
        )

    def complete(self, pools: list[torch.Tensor], table) -> list[AsyncLanded]:
        """The step in flight completes: the kept writes land. Returns what landed."""
        out = []
        for e in self.early:
            for (rank, _, _, slot), kv in zip(e.writes, e.kv):
                pool = pools[rank]
                nb, bs = pool.shape[2], pool.shape[3]
                s = slot % (nb * bs)
                pool[:, :, s // bs, s % bs] = kv
            bs = pools[0].shape[3]
            nb = pools[0].shape[2]
            slots = [w[3] for w in e.writes if w[0] == 0]
            blocks = sorted({(s % (nb * bs)) // bs for s in slots})
            out.append(
                AsyncLanded(
                    req=e.req,
                    written=self.step or 0,
                    blocks=blocks,
                    slots=slots,
                    holders={str(b): holders(table, b) for b in blocks},
                    writes=[list(w) for w in e.writes],
                )
            )
        self.counters["async_landed"] += len(out)
        self.landed += out
        self.log += out
        self.step, self.writes, self.early = None, {}, []
        return out


def holders(table, block: int) -> list[str]:
    """The sequences whose table rows name block (the engine's own table, no manager call)."""
    t = table.table
    host, width = t.host, t.width
    return sorted(
        q for q, r in table.rows.items() if block in host[r * width : (r + 1) * width].tolist()
    )


class AsyncSteps:
    """The Engine's half of asynchronous scheduling (a mixin: self is the Engine)."""

    def _release_in_flight(self, seq, why: str) -> None:
        """seq is released while the step in flight still writes its blocks: wait for that step
        (the remediation), or (seam free_in_flight) free now and let its writes land later."""
        f = self.inflight
        if self.seams.free_in_flight(seq, why):
            freed = f.keep(seq.id, self.kv_pools)
            freed["why"] = why
            self.seams.on_event("async_freed", dict(freed))
            return
        waited = f.step or 0
        self._complete()
        f.counters["async_fences"] += 1
        self.seams.on_event("async_fence", dict(AsyncFence(req=seq.id, why=why, waited=waited)))

    def _staged_in_flight(self, staged) -> None:
        """The step in flight's table copy reads its staged table still (its first row copied):
        with one buffer restaged for this step (seam reuse_staging), its other rows land over
        this step's on every rank; double-buffered, each copy reads its own."""
        f, width = self.inflight, self.table.table.width
        prev, f.staged = f.staged, staged.clone()
        if prev is None or prev.shape != staged.shape:
            return
        differ = (prev != staged).view(-1, width).any(1).nonzero().flatten().tolist()
        differ = [r for r in differ if r > 0]
        of_row = {r: q for q, r in self.table.rows.items()}
        seqs = sorted({of_row[r] for r in differ if r in of_row})
        if not self.seams.reuse_staging(seqs) or not seqs:  # asked each upload, [] too
            return
        for rank in self.ranks.ranks:
            if rank.table.shape == prev.shape:
                rank.table[width:] = prev[width:].to(rank.table.device)
        self.counters["async_mixed"] += 1
        ids = [*staged.view(-1, width)[differ].flatten().tolist()]
        ids += prev.view(-1, width)[differ].flatten().tolist()
        mixed = AsyncMixed(rows=differ, seqs=seqs, blocks=sorted({b for b in ids if b >= 0}))
        f.mixed.append(mixed)
        self.seams.on_event("async_mixed", dict(mixed))

    def _complete(self) -> None:
        """The step in flight completes: writes kept for sequences freed early land now."""
        f = self.inflight
        if f is None or f.step is None:
            return
        for landed in f.complete(self.kv_pools, self.table):
            self.seams.on_event("async_landed", dict(landed))

    def _went_in_flight(self, decode: list, prefill: list, metas) -> None:
        """This step's writes go in flight; the one before completes."""
        f = self.inflight
        done = f.step
        self._complete()
        ids = [s.id for s in decode] + [s.id for s, n in prefill for _ in range(n)]
        pos = [s.num_computed for s in decode]
        pos += [p for s, n in prefill for p in range(s.num_computed, s.num_computed + n)]
        tok = [s.tokens[-1] for s in decode]
        tok += [t for s, n in prefill for t in s.tokens[s.num_computed : s.num_computed + n]]
        f.begin(self.step_count, ids, pos, tok, [m[0] for m in metas])
        seqs = sorted(f.writes)
        ev = AsyncStep(inflight=self.step_count, seqs=seqs, completed=done)
        self.seams.on_event("async_step", dict(ev))
