"""The advisor's inputs, checked: a traffic's lengths (a file, a run's history, a soak ledger) and
a model's KV shape (flags or a Hugging Face config.json). Anything wrong is a ValueError of one
line naming the file and the line: the command exits 2.

A lengths file is CSV or JSON lines ('#' lines and blank lines skipped), in one of three forms:
  one length a line (request lengths, prompt + output tokens)
  prompt,output                 a header naming the columns; each line a request
  length,count                  a histogram: a length and how many requests had it
A header is needed for more than one column; other columns are ignored. JSON lines: a number, or
an object with the same names ({"prompt": 40, "output": 47}, {"length": 87, "count": 12})."""

from __future__ import annotations

import csv
import json
import sqlite3
from collections import Counter
from pathlib import Path

from kvchaos.harness.history.log import check_history, iter_history
from kvchaos.harness.tools.advise_model import Shape, Traffic, dtype_name, traffic_of

COLUMNS = {
    "length": {"length", "len", "tokens", "total", "total_tokens", "seq_len", "request_len"},
    "prompt": {"prompt", "prompt_len", "prompt_tokens", "input", "input_len", "input_tokens"},
    "output": {"output", "output_len", "output_tokens", "completion", "completion_tokens"},
    "count": {"count", "n", "requests", "freq", "frequency"},
}
NAMES = "length, prompt + output, and count"


def _column(name: str) -> str | None:
    key = name.strip().lower()
    return next((col for col, names in COLUMNS.items() if key in names), None)


def _whole(value, where: str, what: str, least: int) -> int:
    """A token count or a request count: a whole number >= least."""
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"{where}: {what} {text!r} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: {what} {value!r} is not a number")
    if value != value or value in (float("inf"), float("-inf")) or value != int(value):
        raise ValueError(f"{where}: {what} {value!r}: expected a whole number")
    if value < least:
        raise ValueError(f"{where}: {what} {int(value)}: expected a whole number >= {least}")
    return int(value)


def _record(fields: dict, where: str) -> tuple[int, int]:
    """(length, count) of one line's named fields."""
    count = _whole(fields["count"], where, "count", 0) if "count" in fields else 1
    if "length" in fields:
        return _whole(fields["length"], where, "length", 1), count
    prompt = _whole(fields["prompt"], where, "prompt", 1)
    return prompt + _whole(fields["output"], where, "output", 0), count


def _header(fields: list[str], where: str) -> dict[str, int] | None:
    """column -> index when the line is a header (no field is a number), else None."""
    if any(_is_number(f) for f in fields):
        return None
    cols = {}
    for i, f in enumerate(fields):
        col = _column(f)
        if col and col not in cols:
            cols[col] = i
    if not cols:
        raise ValueError(
            f"{where}: {','.join(fields)!r} is neither a length nor a header naming the "
            f"columns (length; prompt,output; length,count)"
        )
    if "length" not in cols and not {"prompt", "output"} <= cols.keys():
        raise ValueError(
            f"{where}: header {','.join(fields)!r} names no length column (names: "
            f"length, or prompt and output, and count for a histogram)"
        )
    return cols


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _csv(path: str, lines: list[tuple[int, str]]) -> list[tuple[int, int]]:
    out, cols = [], None
    for n, line in lines:
        where = f"{path}:{n}"
        fields = [f.strip() for f in next(csv.reader([line]))]
        if cols is None and not out:
            cols = _header(fields, where)
            if cols is not None:
                continue
        if cols is None:
            if len(fields) > 1:
                raise ValueError(
                    f"{where}: {len(fields)} columns and no header: name them "
                    f"(length,count or prompt,output)"
                )
            out.append((_whole(fields[0], where, "length", 1), 1))
            continue
        if len(fields) <= max(cols.values()):
            raise ValueError(f"{where}: {len(fields)} fields, the header names more")
        out.append(_record({c: fields[i] for c, i in cols.items()}, where))
    return out


def _json_lines(path: str, lines: list[tuple[int, str]]) -> list[tuple[int, int]]:
    out = []
    for n, line in lines:
        where = f"{path}:{n}"
        try:
            value = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{where}: not a JSON line: {e.msg}") from None
        if isinstance(value, dict):
            fields = {c: value[k] for k in value if (c := _column(k)) is not None}
            if "length" not in fields and not {"prompt", "output"} <= fields.keys():
                raise ValueError(f"{where}: an object naming no length ({NAMES})")
            out.append(_record(fields, where))
        else:
            out.append((_whole(value, where, "length", 1), 1))
    return out


def read_lengths(path: str) -> Traffic:
    """A lengths file as a histogram."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{path}: a folder, not a lengths file (--from-run reads a run folder)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (CSV or JSON lines)") from None
    lines = [
        (n, s)
        for n, raw in enumerate(text.splitlines(), 1)
        if (s := raw.strip()) and not s.startswith("#")
    ]
    if not lines:
        raise ValueError(f"{path}: no lengths in it (empty, or only comments)")
    rows = (_json_lines if lines[0][1].startswith("{") else _csv)(path, lines)
    if not rows:
        raise ValueError(f"{path}: no lengths in it (only a header)")
    counts = Counter()
    for length, count in rows:
        counts[length] += count
    if not sum(counts.values()):
        raise ValueError(f"{path}: a histogram with no counts (every count is 0)")
    return traffic_of(path, counts)


def history_lengths(history: Path) -> Counter:
    """The lengths a run served: each request that produced a token, at the context it reached
    (its prompt and the tokens it produced)."""
    check_history(history)
    prompts, produced = {}, Counter()
    for e in iter_history(history):
        if e.get("e") == "submit":
            prompts[e["req"]] = int(e["prompt_len"])
        elif e.get("e") == "step":
            produced.update(e.get("tokens", {}).keys())  # req -> its token: one each
    return Counter(prompts[r] + k for r, k in produced.items() if r in prompts and k)


def _ledger_runs(path: Path) -> tuple[list[Path], int]:
    """The kept run folders a soak ledger names (a relative one: from the ledger's folder too),
    and how many rows it has."""
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        rows = db.execute("SELECT run_dir FROM runs ORDER BY id").fetchall()
        db.close()
    except sqlite3.DatabaseError as e:
        raise ValueError(f"{path}: not a soak ledger: {e}") from None
    found = []
    for (run_dir,) in rows:
        if not run_dir:
            continue
        d = Path(run_dir)
        for cand in (d, path.parent / d, path.parent / d.name):
            if (cand / "history.jsonl").is_file():
                found.append(cand)
                break
    return found, len(rows)


def _is_sqlite(p: Path) -> bool:
    with p.open("rb") as f:
        return f.read(16) == b"SQLite format 3\x00"


def read_run(path: str) -> Traffic:
    """The lengths a run served (a run folder or its history.jsonl), or all the kept runs of a soak
    ledger (ledger.sqlite)."""
    p = Path(path)
    if p.is_dir():
        if not (p / "history.jsonl").is_file():
            raise ValueError(f"{path}: no history.jsonl: not a kvchaos run folder")
        counts, what = history_lengths(p / "history.jsonl"), "its history"
    elif not p.exists():
        raise ValueError(f"{path}: no such run folder, history or ledger")
    elif _is_sqlite(p):
        runs, rows = _ledger_runs(p)
        if not runs:
            raise ValueError(f"{path}: none of its {rows} runs' folders is on disk: no lengths")
        counts = Counter()
        for d in runs:
            counts.update(history_lengths(d / "history.jsonl"))
        what = f"{len(runs)} kept runs of {rows}"
    else:
        counts, what = history_lengths(p), "a history"
    if not counts:
        raise ValueError(f"{path}: no request in it produced a token: no lengths to advise on")
    return traffic_of(f"{path} ({what})", counts)


def _config_int(cfg: dict, key: str, where: str) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {key} = {value!r}: expected a whole number >= 1")
    return value


def read_config(path: str) -> dict:
    """The KV shape a Hugging Face config.json names: layers, kv_heads, head_dim, heads, dtype
    (each None when it names none)."""
    p = Path(path)
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a JSON config (not text)") from None
    except ValueError as e:
        raise ValueError(f"{path}:{e.lineno}: not a JSON config: {e.msg}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a config (a JSON object)")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]  # a multimodal model's language part
    heads = _config_int(cfg, "num_attention_heads", path)
    head_dim = _config_int(cfg, "head_dim", path)
    hidden = _config_int(cfg, "hidden_size", path)
    if head_dim is None and hidden and heads:
        if hidden % heads:
            raise ValueError(f"{path}: hidden_size {hidden} is not a multiple of {heads} heads")
        head_dim = hidden // heads
    dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    if dtype is not None:
        if not isinstance(dtype, str):
            raise ValueError(f"{path}: torch_dtype {dtype!r}: expected a dtype name")
        try:
            dtype = dtype_name(dtype)
        except ValueError as e:
            raise ValueError(f"{path}: torch_dtype {e}") from None
    return {
        "layers": _config_int(cfg, "num_hidden_layers", path),
        "kv_heads": _config_int(cfg, "num_key_value_heads", path) or heads,
        "head_dim": head_dim,
        "heads": heads,
        "dtype": dtype,
    }


FLAG = {"layers": "--layers", "kv_heads": "--kv-heads", "head_dim": "--head-dim"}


def model_shape(
    config: str | None = None,
    *,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    heads: int | None = None,
    dtype: str | None = None,
) -> Shape:
    """The shape from the flags, a config's values where a flag is not given."""
    got = read_config(config) if config else {}
    flags = {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "heads": heads}
    flags["dtype"] = dtype
    v = {k: flags[k] if flags[k] is not None else got.get(k) for k in flags}
    missing = [FLAG[k] for k in FLAG if v[k] is None]
    if missing:
        where = f"{config} names no {', '.join(m[2:] for m in missing)}; " if config else ""
        raise ValueError(
            f"{where}the advice needs a real model's shape: --model-config config.json, or "
            f"--layers, --kv-heads and --head-dim (missing: {', '.join(missing)})"
        )
    heads_ = v["heads"] or v["kv_heads"]
    if heads_ % v["kv_heads"]:
        raise ValueError(f"{heads_} query heads are not a multiple of {v['kv_heads']} KV heads")
    return Shape(
        layers=v["layers"],
        kv_heads=v["kv_heads"],
        head_dim=v["head_dim"],
        dtype=v["dtype"] or "float16",
        heads=heads_,
        source=config or "flags",
    )
