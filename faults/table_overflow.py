"""Failure mode 1: block-table overflow. A request needs more blocks than a table row holds; with
no bound check the write lands in the next row of the flat table and silently corrupts a
neighbour. Variants (`params.variant`), each a bug class a real engine shipped:

  unchecked        the default: no admission check and no bound check on the table index
  article          the source article's reproduction: a request of width x block_size + 2 tokens
                   (2050 on its 128 x 16 rows), admitted unchecked, its last block spills
  off_by_one       admission is on but counts one block short (the last block's index compared
                   with > instead of >=): a request one block over the row is admitted and spills
                   (the allocation past max_num_blocks_per_req of vllm#10730; vllm#23316)
  floor_width      admission checks a max_model_len, the row was sized floor(max_model_len /
                   block_size): a request of max_model_len tokens spills its last block (vllm#10730
                   sized rows max_model_len // block_size; vllm#39324 an unusual max_model_len)
  stride_mismatch  read side: after a resize the kernels keep the old row stride, so every row but
                   the first reads entries of another while the host table is right
                   (local-inference-lab/b12x#85, vllm-ascend#10112)
  last_row         the over-long request holds the table's last row: its spill runs past the end
                   of the buffer (vllm#45462: an index past the whole block table)
  chunked_growth   admission counts the first prefill chunk only: a later chunk crosses the row's
                   end mid-chunk (vllm#56469, kekzl/imp#134)
  slot_past_pool   the worker sized the KV pool one block short of the manager's num_blocks (a
                   block reserved twice, as a null block: kvcached#398): the block the manager
                   hands out last is past the pool, and the write kernel, with no upper bound on
                   its slot (flashinfer#3740, flashinfer#3647), addresses past the pool's end: it
                   wraps into block 0, another request's
  kernel_block_size read side: the attention backend's kernels run with a block size other than the
                   manager's (twice it): slot = entry x kernel block size + offset reads and
                   writes other blocks while the host table is right (vllm#42872, closing
                   vllm#42846: a kernel block size apart from the KV manager's)

The remediation is the engine's: admission counts every token's blocks and rejects (429-style) or
resizes by policy, the table refuses a write past a row's width, the kernels read the table at its
own stride, a row is sized cdiv(max_model_len, block_size), and the kernels' geometry (the pool's
blocks, their block size) is checked against the manager's and aligned to it
(engine/geometry.py). The default variant keeps the
plain name and its params as before it had variants (histories recorded then compare)."""

from __future__ import annotations

from typing_extensions import NotRequired, TypedDict

from kvchaos.engine.block_table import kernel_view
from kvchaos.faults import base
from kvchaos.faults import table_overflow_shapes as shapes
from kvchaos.faults.base import BOOL, COUNT, STEP, Fault, Num, ParamError, Variant
from kvchaos.faults.plan import Action

REMEDIES = ("overlong_rejected", "table_resizes")  # the engine's answers to an over-long request
GEOMETRY = ("slot_past_pool", "kernel_block_size")  # the kernels' geometry apart from the manager's
READ_SIDE = ("stride_mismatch", *GEOMETRY)  # judged from the table as the kernels read it
DEFAULT = "unchecked"
VARIANTS = {  # as an incident quotes them (unchecked, the default: the class's text)
    "unchecked": Variant(),
    "article": Variant(
        "The article's case: with no length check at admission and no bound check on the table "
        "index, a request of width x block_size + 2 tokens (2050 on rows of 128 blocks of 16) "
        "was admitted and its block at index width was written at row * width + width, entry 0 "
        "of the next row, which the neighbouring sequence (and the kernel) then read.",
        "Check the length at admission: reject a request that can never fit with a 429-style "
        "error, or resize the table in sync (the kernels read the new width); refuse any table "
        "write past a row's width.",
    ),
    "off_by_one": Variant(
        "Admission checked the row's width one block short (the last block's index compared with "
        "> instead of >=): a request needing width + 1 blocks was admitted and, with no bound "
        "check on the table index, its last block spilled into the next row (the allocation past "
        "max_num_blocks_per_req fixed in vllm#10730; vllm#23316).",
        "Admission counts ceil(tokens / block_size) blocks and rejects more than the width; the "
        "table refuses a write past a row's width.",
    ),
    "floor_width": Variant(
        "The row was sized floor(max_model_len / block_size) while admission let in up to "
        "max_model_len tokens: a request of max_model_len tokens (not a multiple of block_size) "
        "needed one block more than a row holds and spilled it into the next row (vllm#10730's "
        "rows of max_model_len // block_size; vllm#39324).",
        "Size a row cdiv(max_model_len, block_size) blocks, so every admitted request fits.",
    ),
    "stride_mismatch": Variant(
        "After the table was resized wider, the kernels kept indexing it with the old row stride "
        "(a stride cached at the first launch): row 0 stayed right, every later row read and "
        "wrote through entries of another row while the host table was correct "
        "(local-inference-lab/b12x#85; vllm-ascend#10112).",
        "Pass the table's current row stride to every launch (resize in sync): the kernels read "
        "row r at r * width.",
    ),
    "last_row": Variant(
        "With no bound check, the over-long request held the table's last row: its spilled "
        "entry fell past the end of the whole buffer, and the kernel read whatever lies there "
        "(vllm#45462: an index past the block table's end).",
        "Check the length at admission (429-style, or resize by policy); refuse any table write "
        "past a row's width, the last row's too.",
    ),
    "chunked_growth": Variant(
        "Admission counted the blocks of the request's first prefill chunk, not of the whole "
        "request: a prompt longer than a row was admitted, and a later chunk's growth crossed "
        "the row's end mid-chunk, its tail blocks written past the row (vllm#56469; "
        "kekzl/imp#134).",
        "Admission counts every token of the request; the growth of each chunk is checked "
        "against the row's width before anything is written.",
    ),
    "slot_past_pool": Variant(
        "The worker sized the KV pool one block short of the num_blocks the manager hands out (a "
        "block reserved twice, as a null block: kvcached#398): the block the manager handed out "
        "last was past the pool, and the write kernel, with no upper bound on slot = block x "
        "block_size + offset (flashinfer#3740, flashinfer#3647), wrote and read past the pool's "
        "end, wrapping into block 0, another request's.",
        "Size the pool from the manager's num_blocks and check it at start (the engine aligns a "
        "pool sized apart from it); bound every slot by num_blocks x block_size in the kernel.",
    ),
    "kernel_block_size": Variant(
        "The attention backend's kernels were launched with a block size other than the KV "
        "manager's (twice it): each table entry was read as a kernel block, slot = entry x "
        "kernel block size + offset, so every sequence read and wrote other blocks while the "
        "host table was right (vllm#42872, closing vllm#42846).",
        "Check the kernels' block size against the manager's declared one at launch (the engine "
        "refuses another and aligns it), or translate the table into kernel blocks.",
    ),
}


class Stray(TypedDict):
    step: int
    blocks: list[int]  # written where the manager mapped other blocks for those positions


class Truth(base.Truth):
    overlong: NotRequired[list[str]]  # the requests only the missing bound check let in
    variant: NotRequired[str]  # absent: the default
    # kernel_block_size with a host tier: per step, the blocks the misread rows' writes landed in
    strays: NotRequired[list[Stray]]


class TableOverflow(Fault):
    name = "table_overflow"
    detectors = ("table_integrity", "oracle_divergence")
    truth = Truth
    root_cause = (
        "No bound check on the block-table index: a sequence longer than max_blocks_per_seq x "
        "block_size wrote its next block id at row * width + index with index >= width, i.e. "
        "into the next row of the flat table, which the neighbouring sequence (and the kernel) "
        "then read."
    )
    remediation = (
        "Check the length at admission: reject a request that can never fit with a 429-style "
        "error, or resize the table by policy; refuse any table write past a row's width."
    )
    defaults = {
        "at_step": 3,
        "long_requests": 1,
        "overshoot": 1.5,
        "boundary": True,
        "neighbours": 3,
        "variant": DEFAULT,
    }
    # overshoot: the long request's length in rows; at most one row, it fits and is no trigger
    domains = {
        "at_step": STEP,
        "long_requests": COUNT,
        "overshoot": Num(float, gt=1),
        "boundary": BOOL,
        "neighbours": COUNT,
    }
    variants, bare_default = VARIANTS, True
    # the other variants read at_step and neighbours; article and stride_mismatch long_requests,
    # stride_mismatch overshoot too (table_overflow_shapes.py)

    def __init__(self, defect: bool, params: dict, seed: int) -> None:
        super().__init__(defect, params, seed)
        self.variant = self.p["variant"]

    def describe(self) -> dict:
        d = super().describe()
        if self.variant == DEFAULT:  # as recorded before there were variants
            d["params"] = {k: v for k, v in self.p.items() if k != "variant"}
        return d

    @classmethod
    def check_engine(cls, p: dict, cfg) -> None:
        v, cc, mpt = p["variant"], cfg.cache, cfg.max_prefill_tokens
        problem = None
        if v == "floor_width" and cc.block_size < 3:
            problem = (
                "floor_width needs a max_model_len two tokens or more past a block boundary and "
                f"inside the next block: [engine.cache] block_size >= 3, got {cc.block_size}"
            )
        elif v == "stride_mismatch" and cc.overflow_policy != "resize":
            problem = (
                "stride_mismatch reads a resized table: set [engine.cache] overflow_policy = "
                f'"resize", got {cc.overflow_policy!r}'
            )
        elif v in READ_SIDE and cfg.tp_mode != "simulated":
            problem = (
                f"{v} plants in the simulated ranks' kernels: set [engine] tp_mode = "
                f'"simulated", got {cfg.tp_mode!r}'
            )
        elif v == "chunked_growth" and (
            mpt >= cc.max_tokens_per_seq or cc.max_tokens_per_seq % mpt == 0
        ):
            problem = (
                f"chunked_growth needs a prefill chunk that crosses a row's end mid-chunk: "
                f"[engine] max_prefill_tokens {mpt} must be below a row's "
                f"{cc.max_tokens_per_seq} tokens and not divide them"
            )
        if problem:
            raise ParamError(cls.name, "variant", problem)

    def shape(self, plan, cfg) -> None:
        if self.variant != DEFAULT:
            self.overlong, self.front = [], 0
            shapes.SHAPES[self.variant](self, plan, cfg)
            return
        self.overlong = []  # the requests it made longer than a row: only the defect admits them
        cap = cfg.cache.max_tokens_per_seq
        step = self.p["at_step"]
        # neighbours first: they take the rows after the long request's, so an overflow has a victim
        for i in range(self.p["long_requests"]):
            total = int(cap * self.p["overshoot"])
            prompt = max(1, cap // 4)
            plan.add(
                Action(
                    step,
                    "submit",
                    f"long{i}",
                    plan.prompt(prompt),
                    total - prompt,
                    origin=self.name,
                )
            )
            self.overlong.append(f"long{i}")
        for i in range(self.p["neighbours"]):
            plan.add(
                Action(step, "submit", f"nb{i}", plan.prompt(8), cap - 8, origin=self.name)
            )  # outlive the overflow
        if self.p["boundary"]:  # right at the edge: exactly a full row (fits), and one token over
            plan.add(
                Action(
                    step + 1,
                    "submit",
                    "edge_fit",
                    plan.prompt(cap // 2),
                    cap - cap // 2,
                    origin=self.name,
                )
            )
            plan.add(
                Action(
                    step + 1,
                    "submit",
                    "edge_over",
                    plan.prompt(cap // 2),
                    # the last generated token's KV is never stored: one more makes it spill
                    cap - cap // 2 + 2,
                    origin=self.name,
                )
            )
            self.overlong.append("edge_over")

    def arm(self, engine, emit) -> None:
        super().arm(engine, emit)
        v = self.variant
        if self.defect and v == DEFAULT:
            engine.seams.admission_check = False
            engine.table.table.bound_check = False
        elif self.defect:
            shapes.plant(self, engine)
        elif v == "floor_width":  # the remediation: a row of cdiv(max_model_len, block_size)
            limit = shapes.max_model_len(engine.config.cache)
            engine.table.resize(width=-(-limit // engine.bm.block_size))
        if v in GEOMETRY:  # the worker's / backend's ask: aligned unless the defect is planted
            before = engine.geometry_alignments
            shapes.ask_geometry(self, engine)
            self.remediated += engine.geometry_alignments - before
        self.misread: set[str] = set()  # read side: requests the kernels read wrong
        self.reached: set[str] = set()  # geometry: requests the asked geometry would misread
        self._arrived = False  # floor_width: its request reached admission
        self._seen = self._looked = engine.table.table.overflow_writes
        # only a host tier's copies are judged by where the writes landed (store_content): without
        # one the truth stays as recorded before
        self._tiered = self.defect and v == "kernel_block_size" and engine.tier is not None
        self.strays: list[Stray] = []
        self._views: tuple[int, int, dict] = (-1, 0, {})  # step, pool, req -> (mapped, kernel's)
        self.overflowing: dict[str, int] = {}  # request -> its row, for requests that overflowed
        self._counts = {k: engine.counters[k] for k in ("overlong_requests", *REMEDIES)}
        upload = engine.seams.on_upload

        def look() -> None:  # mid-step, after the appends: every row still has its owner
            if v in READ_SIDE:
                self._misreads(engine)
            else:
                self._who(engine)
            upload()

        engine.seams.on_upload = look

    def _who(self, engine) -> None:
        """What the unchecked writes touched: the rows written into, the blocks they name, and
        every request that has held one of those rows or blocks since (a spilled entry stays in
        the row for its next owner, and sends that owner's writes into the named block, whoever
        holds it by then)."""
        table = engine.table.table
        n = table.overflow_writes
        new = table.overflow_log[self._looked : n]
        self._looked = n
        rows = {r for r, _, _ in new} | {r + i // table.width for r, i, _ in new}
        self.touch(rows=rows, blocks={b for _, _, b in new})
        if not self.touched["rows"]:
            return
        snap, w = engine.snapshot(), table.width
        owner = {row: req for req, row in snap.seq_rows.items()}
        self.overflowing.update({owner[r]: r for r, _, _ in new if r in owner})
        for req, row in self.overflowing.items():  # the entries it addresses past its row, today
            if snap.seq_rows.get(req) == row:
                spill = snap.table[row * w + w : row * w + len(snap.seq_blocks[req])]
                # an unused entry (-1) addresses the pool's last block, as a raw kernel would
                self.touch(blocks={b % snap.num_blocks for b in spill})
        rows, blocks = self.touched["rows"], self.touched["blocks"]
        self.touch(requests={req for req, row in snap.seq_rows.items() if row in rows})
        self.touch(requests={req for req, bs in snap.seq_blocks.items() if blocks & set(bs)})

    def before_step(self, engine, step) -> None:
        if self.variant == "chunked_growth":  # where each running request's chunk starts
            self._starts = {s.id: s.num_computed for s in engine.scheduler.running}

    def after_step(self, engine, step, output) -> None:
        c, v = engine.counters, self.variant
        if v != "floor_width":
            for _ in range(c["overlong_requests"] - self._counts["overlong_requests"]):
                self.trigger(step)  # a request longer than a row reached admission
        elif not self._arrived and "fw_edge" in engine.seqs:  # max_model_len tokens, admitted
            self._arrived = True
            self.trigger(step)
            self.remediated += not self.defect  # its row holds cdiv(max_model_len, block_size)
        if v not in READ_SIDE:
            self.remediated += sum(c[k] - self._counts[k] for k in REMEDIES)
        elif not self.defect:  # the kernels follow the resize
            self.remediated += c["table_resizes"] - self._counts["table_resizes"]
        self._counts = {k: c[k] for k in self._counts}
        if self._tiered:
            self._stray_writes(engine)
        table = engine.table.table
        n = table.overflow_writes
        if n > self._seen:
            self._who(engine)  # a step that uploaded nothing
            detail = {"overflow_writes": n - self._seen, "table_width": table.width}
            if v != DEFAULT:
                detail.update(self._spill_detail(engine, table.overflow_log[self._seen : n]))
            self.fired(step, detail)
            self._seen = n

    def _stray_writes(self, engine) -> None:
        """The step's writes through a misread row: the blocks the engine's record of writes
        (engine.written, at the positions each sequence wrote) has them land in where the kernels'
        view of the row names another block than the manager's for those positions."""
        at, nb, views = self._views
        if at != engine.step_count:  # the step wrote nothing (its table was not uploaded)
            return
        bs, out = engine.bm.block_size, set()
        for req, (a, b) in engine.write_spans.items():
            if req not in views:
                continue
            mapped, got = views[req]
            idx = range(a // bs, min(-(-b // bs), len(got), len(mapped)))
            wrong = {got[i] % nb for i in idx if got[i] != mapped[i]}
            out |= wrong & set(engine.written.get(req, ()))
        if out:
            self.strays.append(Stray(step=at, blocks=sorted(out)))

    def _spill_detail(self, engine, new: list) -> dict:
        """What the writes did, by variant: past the buffer's end (last_row), the chunk that
        crossed the row's end (chunked_growth: [first, end) positions of the request's chunk)."""
        table, out = engine.table.table, {}
        out["past_end"] = sum(r * table.width + i >= len(table.host) for r, i, _ in new)
        if self.variant == "chunked_growth":
            rows = {r for r, _, _ in new}
            starts = getattr(self, "_starts", {})
            out["chunks"] = {
                s: [starts.get(s, 0), engine.seqs[s].num_computed]
                for s, r in engine.table.rows.items()
                if r in rows and s in engine.seqs
            }
        return out

    def _misreads(self, engine) -> None:
        """Read side, as the step's table is uploaded: each live request whose row the kernels
        read through their geometry (their stride, block size, pool: block_table.kernel_view)
        names other blocks than it holds. Those requests, their rows, the blocks named (an unused
        entry addresses the pool's last block) and every request holding one of them are touched;
        a request misread for the first time fires it. The geometry variants' trigger too."""
        stride, geometry = engine.kernel_stride(), engine.kernel_geometry()
        if stride is None and not geometry and self.variant not in GEOMETRY:
            return
        snap = engine.snapshot()
        if self.variant in GEOMETRY:
            self._reached(snap, engine.step_count)
        if stride is None and not geometry:
            return
        w = snap.table_width
        stride, ratio, pool = shapes.kernel_reading(snap, stride or w, geometry)
        wrong: dict[str, int] = {}
        views: dict = {}
        self._views = (engine.step_count, snap.num_blocks, views)
        for req, row in snap.seq_rows.items():
            blocks = snap.seq_blocks.get(req, [])
            got = kernel_view(snap.table, row, stride, len(blocks), ratio, pool)
            if got != blocks:
                wrong[req] = row
                views[req] = (blocks, got)
                # the blocks named instead, and its own blocks the kernels miss (unwritten)
                self.touch(blocks={b % snap.num_blocks for b in got if b not in blocks})
                self.touch(blocks=set(blocks) - set(got))
        if not wrong:
            return
        named = self.touched["blocks"]
        self.touch(requests=wrong, rows=wrong.values())
        self.touch(requests={r for r, bs in snap.seq_blocks.items() if named & set(bs)})
        new = sorted(set(wrong) - self.misread)
        if new:
            self.misread.update(new)
            step = engine.step_count
            detail = {"kernel_stride": stride, "table_width": w} if not geometry else geometry
            self.fired(step, {**detail, "misread": {r: wrong[r] for r in new}})

    def _reached(self, snap, step: int) -> None:
        """The geometry variants' trigger, with or without the defect: a sequence the asked
        geometry would misread (shapes.would_misread) for the first time."""
        new = sorted(shapes.would_misread(self, snap) - self.reached)
        if new:
            self.reached.update(new)
            self.trigger(step, {"reached": new})

    def verify(self) -> dict:
        out = {
            **super().verify(),
            "overflow_writes": self._seen,
            "overlong": getattr(self, "overlong", []),
        }
        if self.variant != DEFAULT:  # (the default's record as before there were variants)
            out["variant"] = self.variant
        if getattr(self, "strays", None):
            out["strays"] = self.strays
        return out

    @classmethod
    def explains(cls, finding: dict, truth: dict) -> str | None:
        if truth.get("first_step") is None or finding["step"] < truth["first_step"]:
            return None
        reqs, rows = set(truth["touched"]["requests"]), set(truth["touched"]["rows"])
        ev = finding.get("evidence", {})
        if finding["checker"] == "table_integrity" and ev.get("view") == "kernel":
            # a row as the kernels read it: only a fault pinning their stride makes the two differ
            return "cause" if truth.get("variant") in READ_SIDE else None
        if finding["checker"] == "table_integrity" and (
            ev.get("req") in reqs or ev.get("owner") in reqs or ev.get("row") in rows
        ):
            return "cause"
        if finding["checker"] == "oracle_divergence" and ev.get("req") in reqs:
            return "cause"
        if finding["checker"] == "kv_reads" and (
            ev.get("req") in reqs or ev.get("block") in set(truth["touched"]["blocks"])
        ):  # read through a spilled entry, or KV a spilled write left
            return "consequence" if finding.get("kind") == "poisoned_read" else "cause"
        touched = set(truth["touched"]["blocks"])
        if finding["checker"] == "prefix_cache" and (
            set(ev.get("writers") or ()) & reqs
            or ev.get("block") in touched
            or ev.get("parent_block") in touched
        ):  # a spilled write landed in a cached block, or in the block it continues
            return "cause"
        if finding.get("kind") in ("starvation", "unfinished") and ev.get("blocking") in set(
            truth.get("overlong", [])
        ):
            return "consequence"  # the queue waits on a request only the defect let in
        if finding["checker"] == "offload" and truth.get("strays"):
            # the misread rows' writes changed every differing block while its copy was current
            stored = finding.get("kind") == "store_content"
            return "consequence" if stored and _strayed_into(finding, truth["strays"]) else None
        if finding["checker"] == "offload" and truth.get("variant") == "slot_past_pool":
            # a block past a pool sized short is the one it wraps to: that one's holder writing
            # it changes a host copy of it in flight (or a restore's into it)
            named = set(ev.get("blocks") or ())
            copies = finding.get("kind") in ("store_content", "restore_content")
            return "consequence" if copies and named and named <= touched else None
        return None


def _strayed_into(finding: dict, strays: list) -> bool:
    """Each block a store's host copy differs in was written by a misread row from the step its
    copy was taken as current (evidence "since": the store's issue, or a restore it kept) to the
    step the copy completed, not its writes (a step's landings come before its batch)."""
    ev, step = finding.get("evidence") or {}, finding["step"]
    blocks = ev.get("blocks") or []
    since = ev.get("since") or [ev.get("issued", step)] * len(blocks)
    return bool(blocks) and all(
        any(lo <= x["step"] < step and b in x["blocks"] for x in strays)
        for b, lo in zip(blocks, since)
    )
