"""Advise a KV block size from the traffic's request lengths, for a real model's shape.

  kvchaos advise --lengths day.csv --model-config config.json
  kvchaos advise --lengths day.csv --compare night.csv --layers 32 --kv-heads 8 --head-dim 128
  kvchaos advise --from-run reports/latest --model-config config.json --measure --html a.html

Per candidate block size: the fill (tokens stored per allocated slot), the mean fill of the last
block, blocks a request, the internal fragmentation (bytes at --concurrency, and the share of the
pool the requests hold), the block table's bytes at --concurrency, and the attention step time as
a ratio to the best (the cost model's, or --measure's on this machine); the article's rule of
thumb as a reference line; a recommendation with its reason in one line. --compare: a second
traffic window (day vs night), and whether and why the recommendation changes.

--lengths: CSV or JSON lines, one length a line, or prompt,output, or a histogram length,count
(a header names the columns). --from-run: the lengths a run served (a run folder, its
history.jsonl, or a soak ledger's kept runs): each request that produced a token, at the context
it reached. The cost model and its constants: kvchaos.harness.tools.advise_model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvchaos.harness.scenario import inputs, options
from kvchaos.harness.tools import advise_model as am


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{text!r}: expected a whole number >= 1") from None
    if n < 1:
        raise ValueError(f"{text!r}: expected a whole number >= 1")
    return n


def _sizes(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(","):
        n = _positive(part.strip())
        if n & (n - 1) or n > 4096:
            raise ValueError(f"{part.strip()!r}: block sizes are powers of two, 1 .. 4096")
        out.append(n)
    return tuple(sorted(set(out)))


def _share(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise ValueError(f"{text!r}: expected a share 0 .. 1") from None
    if not 0 <= s <= 1:
        raise ValueError(f"{text!r}: expected a share 0 .. 1")
    return s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--lengths", type=options.PATH, metavar="FILE", help="request lengths: CSV or JSON lines"
    )
    src.add_argument(
        "--from-run",
        type=options.PATH,
        metavar="RUN",
        help="the lengths a run served: a run folder, its history.jsonl, or a soak ledger",
    )
    p.add_argument(
        "--compare",
        type=options.PATH,
        metavar="FILE2",
        help="a second traffic window (a lengths file or a run): does the advice change?",
    )
    p.add_argument(
        "--model-config",
        type=options.PATH,
        metavar="FILE",
        help="a Hugging Face config.json (num_hidden_layers, num_key_value_heads, head_dim or "
        "hidden_size / num_attention_heads, torch_dtype); flags given override it",
    )
    size = inputs.flag(_positive)
    p.add_argument("--layers", type=size, metavar="N", help="transformer layers")
    p.add_argument("--kv-heads", type=size, metavar="N", help="KV heads (GQA: fewer than heads)")
    p.add_argument("--head-dim", type=size, metavar="N", help="a head's dimension")
    p.add_argument(
        "--heads",
        type=size,
        metavar="N",
        help="query heads, for --measure (default: the config's, else the KV heads)",
    )
    p.add_argument(
        "--dtype",
        type=inputs.flag(am.dtype_name),
        help=f"the KV cache's dtype: {', '.join(am.DTYPE_BYTES)} (default: the config's, else "
        "float16)",
    )
    p.add_argument(
        "--concurrency",
        type=size,
        default=am.DEFAULT_CONCURRENCY,
        metavar="N",
        help="concurrent requests the fragmentation and the table are counted at (default: "
        f"{am.DEFAULT_CONCURRENCY})",
    )
    p.add_argument(
        "--block-sizes",
        type=inputs.flag(_sizes),
        default=am.CANDIDATES,
        metavar="LIST",
        help="candidate block sizes (default: 8,16,32,64,128)",
    )
    p.add_argument(
        "--attention-share",
        type=inputs.flag(_share),
        default=am.ATTENTION_SHARE,
        metavar="S",
        help="the share of a decode step's time paged attention takes at a full pool: 0 values "
        f"fill only, 1 step time only (default: {am.ATTENTION_SHARE:g})",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="measure the paged attention step time at each block size on this machine (the "
        "Triton kernel on a GPU, the torch path on the CPU) instead of the cost model",
    )
    options.add(p, "device", default="auto", lead="where --measure runs")
    p.add_argument("--html", type=options.PATH, metavar="FILE", help="write the report there")
    p.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="text: the tables and the lines; json: one JSON document on stdout",
    )


def _traffic(path: str, is_run: bool) -> am.Traffic:
    from kvchaos.harness.tools.advise_inputs import read_lengths, read_run

    return read_run(path) if is_run else read_lengths(path)


def _looks_like_run(path: str) -> bool:
    p = Path(path)
    if p.is_dir() or p.name == "history.jsonl":
        return True
    try:
        with p.open("rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


def _advise(t: am.Traffic, shape: am.Shape, args) -> am.Advice:
    measured, note = None, ""
    if args.measure:
        from kvchaos.harness.run.device import resolve_device
        from kvchaos.harness.tools.advise_measure import measure

        measured, note = measure(t, shape, args.block_sizes, resolve_device(args.device))
    return am.advise(
        t,
        shape,
        concurrency=args.concurrency,
        attention_share=args.attention_share,
        sizes=args.block_sizes,
        measured=measured,
        cost_note=note,
    )


HEADER = [
    "block",
    "slot fill",
    "last block",
    "blocks/req",
    "padding/req",
    "fragmentation",
    "pool share",
    "table",
    "step",
]


def rows(a: am.Advice) -> list[list[str]]:
    from kvchaos.harness.tools.ledger import size_text

    return [
        [
            str(c.block_size),
            f"{c.slot_fill:.1%}",
            f"{c.fill:.1%}",
            f"{c.blocks_per_request:.2f}",
            f"{c.padding_tokens:.1f}",
            size_text(c.fragmentation_bytes),
            f"{c.fragmentation_share:.1%}",
            size_text(c.table_bytes),
            f"{c.step_time_ratio:.3f}x",
        ]
        for c in a.candidates
    ]


def lines(a: am.Advice) -> list[str]:
    from kvchaos.harness.tools.ledger import size_text

    t, s = a.traffic, a.shape
    return [
        f"traffic: {t.source}: {t.requests} requests, mean {t.mean:.1f}, median {t.median}, "
        f"p90 {t.quantile(0.9)}, max {t.max} tokens",
        f"shape: {s.layers} layers x {s.kv_heads} KV heads x head_dim {s.head_dim}, {s.dtype} "
        f"({s.source}): {size_text(s.token_bytes)} of KV a token; fragmentation and table at "
        f"{a.concurrency} concurrent requests",
        f"step time: {a.cost_note}",
        f"reference: {a.rule_of_thumb.text}",
        f"recommended: {a.reason}",
    ]


def table_text(a: am.Advice) -> str:
    header = HEADER[:-1] + [f"step ({'measured' if a.cost == 'measured' else 'model'})"]
    cells = [header] + rows(a)
    width = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, width, strict=True)) for r in cells)


def main(args) -> int:
    from kvchaos.harness.tools.advise_inputs import model_shape

    shape = model_shape(
        args.model_config,
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        heads=args.heads,
        dtype=args.dtype,
    )
    traffics = [_traffic(args.lengths or args.from_run, args.from_run is not None)]
    if args.compare:
        traffics.append(_traffic(args.compare, _looks_like_run(args.compare)))
    advices = [_advise(t, shape, args) for t in traffics]
    changed = am.compare(*advices) if len(advices) == 2 else None
    compare_line = None
    if changed is not None:
        compare_line = f"changes: {changed[1]}" if changed[0] else changed[1]
    if args.format == "json":
        doc = am.advice_doc(advices[0])
        if changed is not None:
            doc["compare"] = {
                "changes": changed[0],
                "reason": changed[1],
                "advice": am.advice_doc(advices[1]),
            }
        print(json.dumps(doc, indent=1), flush=True)
    else:
        for a in advices:
            head, *rest = lines(a)
            print("\n".join([head, *rest[:2], table_text(a), *rest[2:]]) + "\n")
        if compare_line:
            print(f"compare: {compare_line}")
    if args.html:
        from kvchaos.harness.report.advise_html import Section, render_advice_html

        sections = [
            Section(doc=am.advice_doc(a), header=HEADER, rows=rows(a), lines=lines(a))
            for a in advices
        ]
        Path(args.html).write_text(render_advice_html(sections, compare_line), encoding="utf-8")
        print(f"report: {args.html}", file=sys.stderr if args.format == "json" else sys.stdout)
    return 0
