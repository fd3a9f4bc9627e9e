"""kvchaos advise: the fill arithmetic on hand-computed histograms, the article's day (mean 87)
and night (mean 23) traffic recommending a smaller block at night, the JSON document, --compare,
--from-run on a real run's history (and a soak ledger naming it), --measure on this CPU, the HTML
report, and every bad input refused with exit 2 and one line naming the file and the line."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvchaos.harness.cli import main
from kvchaos.harness.history.log import read_history
from kvchaos.harness.tools import advise_model as am
from kvchaos.harness.tools.advise_inputs import model_shape, read_lengths, read_run
from kvchaos.harness.tools.ledger import Ledger

REPO = Path(__file__).resolve().parents[1]
DAY, NIGHT = REPO / "docs/advise/day.csv", REPO / "docs/advise/night.csv"
LLAMA2_7B = ["--layers", 32, "--kv-heads", 32, "--head-dim", 128, "--dtype", "float16"]
SHAPE = am.Shape(layers=2, kv_heads=4, head_dim=64, dtype="bfloat16", heads=8, source="test")


def cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def advise_json(capsys, *argv) -> dict:
    rc, out, err = cli(capsys, "advise", *argv, "--format", "json")
    assert rc == 0, err
    return json.loads(out)


# -- the arithmetic ---------------------------------------------------------------------------
def test_fill_on_a_hand_computed_histogram():
    t = am.traffic_of("hand", {5: 1, 16: 1, 17: 2})  # 55 tokens, 4 requests
    slot_fill, last, per_req, pad = am.geometry(t, 8)
    # blocks: 5 -> 1, 16 -> 2, 17 -> 3 (twice): 9 blocks, 72 slots
    assert slot_fill == pytest.approx(55 / 72)
    assert last == pytest.approx((5 / 8 + 8 / 8 + 1 / 8 + 1 / 8) / 4)
    assert per_req == pytest.approx(9 / 4) and pad == pytest.approx(17 / 4)
    a = am.advise(t, SHAPE, concurrency=10, sizes=(8, 16))
    c8, c16 = a.at(8), a.at(16)
    token = 2 * 4 * 64 * 2 * 2  # layers x kv heads x head_dim x K,V x bf16
    assert SHAPE.token_bytes == token
    assert c8.fragmentation_bytes == round(17 / 4 * token * 10)
    assert c8.fragmentation_share == pytest.approx(17 / 72)
    assert c8.table_bytes == 10 * 3 * 4 and c16.table_bytes == 10 * 2 * 4  # rows for 17 tokens
    # at 16: 5 -> 1, 16 -> 1, 17 -> 2 (twice): 6 blocks, 96 slots; last blocks 5, 16, 1, 1
    assert c16.slot_fill == pytest.approx(55 / 96)
    assert c16.fill == pytest.approx((5 + 16 + 1 + 1) / 16 / 4)
    # the cost model: per KV-head program, 2 x 64 x 2 bytes a token and BLOCK_OVERHEAD a block
    t8 = 55 * 256 + 9 * am.BLOCK_OVERHEAD_BYTES
    t16 = 55 * 256 + 6 * am.BLOCK_OVERHEAD_BYTES
    assert c8.step_time == t8 and c16.step_time == t16
    assert c16.step_time_ratio == 1.0 and c8.step_time_ratio == pytest.approx(t8 / t16)
    stored = 55 / 4 * token
    assert c8.memory_factor == pytest.approx((stored + 17 / 4 * token + 3 * 4) / stored)
    s = am.ATTENTION_SHARE
    assert c8.score == pytest.approx(c8.memory_factor * ((1 - s) + s * t8 / t16))
    assert a.recommended == min((c8, c16), key=lambda c: c.score).block_size


def test_lengths_that_fill_their_blocks_fill_them_whole():
    t = am.traffic_of("full", {32: 3, 64: 1})
    for b in (8, 16, 32):
        assert am.geometry(t, b)[:2] == (1.0, 1.0)
    assert am.geometry(t, 64)[0] == pytest.approx(160 / 256)


def test_the_rule_of_thumb_is_the_articles_formula():
    t = am.traffic_of("x", {10: 1, 500: 2})
    shape = am.Shape(layers=1, kv_heads=32, head_dim=128, dtype="float16", heads=32, source="x")
    r = am.rule_of_thumb(t, shape)
    assert r.median == 500 and r.value == pytest.approx((500 * 128 * 32 * 2 * 2) ** 0.5)
    assert "the article's rule of thumb" in r.text and "not the answer" in r.text


# -- the article's example: day (mean 87) vs night (mean 23) -----------------------------------
def test_the_shipped_traffic_is_what_its_generator_writes():
    spec = importlib.util.spec_from_file_location(
        "make_traffic", REPO / "docs/advise/make_traffic.py"
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    files = gen.files()
    assert DAY.read_text(encoding="utf-8") == files["day.csv"]
    assert NIGHT.read_text(encoding="utf-8") == files["night.csv"]
    assert read_lengths(str(DAY)).mean == pytest.approx(87, abs=0.05)
    assert read_lengths(str(NIGHT)).mean == pytest.approx(23, abs=0.05)


@pytest.mark.parametrize(
    "shape",
    [LLAMA2_7B, ["--layers", 32, "--kv-heads", 8, "--head-dim", 128, "--dtype", "bf16"]],
    ids=["llama2-7b", "llama3-8b"],
)
def test_the_night_traffic_gets_a_smaller_block(capsys, shape):
    day, night = (advise_json(capsys, "--lengths", f, *shape) for f in (DAY, NIGHT))
    assert night["recommended"] < day["recommended"]
    for doc in (day, night):  # a smaller block always fills better: fill alone decides nothing
        fills = [c["slot_fill"] for c in doc["candidates"]]
        assert fills == sorted(fills, reverse=True)
        assert doc["reason"].startswith(f"{doc['recommended']}: ") and "\n" not in doc["reason"]
        assert doc["cost"] == "model"
    # with fill alone (attention share 0) the smallest block wins both
    zero = advise_json(capsys, "--lengths", DAY, *shape, "--attention-share", 0)
    assert zero["recommended"] == 8


def test_compare_says_whether_and_why_it_changes(capsys):
    rc, out, _ = cli(capsys, "advise", "--lengths", DAY, "--compare", NIGHT, *LLAMA2_7B)
    assert rc == 0
    line = next(ln for ln in out.splitlines() if ln.startswith("compare: "))
    doc = advise_json(capsys, "--lengths", DAY, "--compare", NIGHT, *LLAMA2_7B)
    day, night = doc["recommended"], doc["compare"]["advice"]["recommended"]
    assert doc["compare"]["changes"] is (day != night) is True
    assert line.startswith(f"compare: changes: {day} -> {night}: ") and "shorter" in line
    assert "mean 23.0 vs 87.0" in doc["compare"]["reason"]
    same = advise_json(capsys, "--lengths", DAY, "--compare", DAY, *LLAMA2_7B)
    assert same["compare"]["changes"] is False
    assert same["compare"]["reason"].startswith(f"unchanged at {day}: ")
    rc, out, _ = cli(capsys, "advise", "--lengths", DAY, "--compare", DAY, *LLAMA2_7B)
    assert out.rstrip().splitlines()[-1].startswith(f"compare: unchanged at {day}: ")


def test_the_json_document(capsys):
    doc = advise_json(capsys, "--lengths", NIGHT, *LLAMA2_7B, "--block-sizes", "8,32,16")
    assert [c["block_size"] for c in doc["candidates"]] == [8, 16, 32]
    named = {"block_size", "fill", "fragmentation_bytes", "table_bytes", "step_time_ratio"}
    for c in doc["candidates"]:
        assert named <= c.keys()
        assert 0 < c["fill"] <= 1 and 0 < c["slot_fill"] <= 1
        assert isinstance(c["fragmentation_bytes"], int) and isinstance(c["table_bytes"], int)
        assert c["step_time_ratio"] >= 1
    assert min(c["step_time_ratio"] for c in doc["candidates"]) == 1
    assert doc["recommended"] in (8, 16, 32)
    assert doc["traffic"]["requests"] == 1000 and doc["shape"]["token_bytes"] == 32 * 32 * 128 * 4
    assert doc["rule_of_thumb"]["median"] == doc["traffic"]["median"]


def test_the_text_table_and_the_html_report(capsys, tmp_path):
    page = tmp_path / "advice.html"
    rc, out, _ = cli(capsys, "advise", "--lengths", DAY, *LLAMA2_7B, "--html", page)
    assert rc == 0 and f"report: {page}" in out
    assert "reference: the article's rule of thumb, a reference, not the answer" in out
    assert any(ln.startswith("recommended: ") for ln in out.splitlines())
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["8"], ["128"])]
    assert [r[0] for r in rows] == ["8", "128"]
    text = page.read_text(encoding="utf-8")
    assert 'src="data:image/png;base64,' in text and "<tr class=best>" in text


def test_a_model_config_gives_the_shape(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "num_hidden_layers": 28,
                "num_attention_heads": 16,
                "hidden_size": 2048,
                "torch_dtype": "bfloat16",
            }
        )
    )
    s = model_shape(str(cfg))
    assert (s.layers, s.kv_heads, s.head_dim, s.heads, s.dtype) == (28, 16, 128, 16, "bfloat16")
    s = model_shape(str(cfg), kv_heads=4, dtype="float32")  # flags win
    assert (s.kv_heads, s.dtype) == (4, "float32")


def test_lengths_as_prompt_and_output_and_as_json_lines(tmp_path):
    a = tmp_path / "a.csv"
    a.write_text("request_id,prompt_tokens,completion_tokens\nx,10,5\ny,3,0\n")
    assert read_lengths(str(a)).histogram == ((3, 1), (15, 1))
    b = tmp_path / "b.jsonl"
    b.write_text('{"prompt": 10, "output": 5}\n7\n{"length": 15, "count": 2}\n')
    assert read_lengths(str(b)).histogram == ((7, 1), (15, 3))


# -- a real run's history ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("advise-run")
    rc = main(
        ["run", str(REPO / "scenarios/baseline-clean.toml"), "--seed", "0", "--in-process"]
        + ["--report-dir", str(d), "--quiet"]
    )
    assert rc == 0
    return (d / "latest").resolve()


def test_from_run_takes_the_lengths_the_run_served(capsys, run_dir, tmp_path):
    events = read_history(run_dir / "history.jsonl")
    prompts = {e["req"]: e["prompt_len"] for e in events if e["e"] == "submit"}
    made = Counter(r for e in events if e["e"] == "step" for r in e["tokens"])
    want = Counter(prompts[r] + n for r, n in made.items())
    t = read_run(str(run_dir))
    assert dict(t.histogram) == dict(want) and t.requests < len(prompts)  # some never produced
    doc = advise_json(capsys, "--from-run", run_dir, *LLAMA2_7B)
    assert doc["traffic"]["requests"] == sum(want.values())
    assert doc["traffic"]["source"].startswith(str(run_dir))
    ledger_file = tmp_path / "ledger.sqlite"
    ledger = Ledger(ledger_file)
    ledger.add_run(soak="s", time="t", seed=0, run_dir=str(run_dir))
    ledger.add_run(soak="s", time="t", seed=1, run_dir=None)  # not kept
    ledger.close()
    assert read_run(str(ledger_file)).histogram == t.histogram


def test_measure_on_this_machine(capsys, tmp_path):
    lengths = tmp_path / "l.txt"
    lengths.write_text("3\n9\n17\n30\n")
    tiny = ["--layers", 1, "--kv-heads", 2, "--heads", 4, "--head-dim", 16]
    doc = advise_json(capsys, "--lengths", lengths, *tiny, "--measure", "--device", "cpu")
    assert doc["cost"] == "measured"
    assert doc["cost_note"].startswith("measured on cpu (CPU time): the torch path")
    assert min(c["step_time_ratio"] for c in doc["candidates"]) == 1
    assert all(c["step_time"] > 0 for c in doc["candidates"])
    assert "measured step time" in doc["reason"]


# -- bad input: one line, exit 2 --------------------------------------------------------------
BAD_LENGTHS = {
    "empty": ("", "no lengths in it", None),
    "comments only": ("# nothing\n\n", "no lengths in it", None),
    "negative": ("12\n-3\n", "length -3: expected a whole number >= 1", 2),
    "zero": ("0\n", "length 0: expected a whole number >= 1", 1),
    "non-numeric": ("12\nabc\n", "length 'abc' is not a number", 2),
    "fractional": ("12.5\n", "expected a whole number", 1),
    "no counts": ("length,count\n10,0\n20,0\n", "a histogram with no counts", None),
    "negative count": ("length,count\n10,-1\n", "count -1", 2),
    "header only": ("length,count\n", "no lengths in it (only a header)", None),
    "two columns, no header": ("10,2\n", "2 columns and no header", 1),
    "unknown header": ("foo,bar\n1,2\n", "neither a length nor a header", 1),
    "bad json line": ('{"length": 3}\n{"length": \n', "not a JSON line", 2),
    "json without a length": ('{"id": 3}\n', "an object naming no length", 1),
}


def one_line_error(capsys, *argv) -> str:
    rc, out, err = cli(capsys, "advise", *argv)
    assert rc == 2 and out == "", (rc, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("case", BAD_LENGTHS, ids=list(BAD_LENGTHS))
def test_bad_lengths_are_one_line_naming_the_file_and_line(capsys, tmp_path, case):
    text, words, line = BAD_LENGTHS[case]
    f = tmp_path / "lengths.csv"
    f.write_text(text, encoding="utf-8")
    err = one_line_error(capsys, "--lengths", f, *LLAMA2_7B)
    assert words in err and f"{f}{'' if line is None else f':{line}'}: " in err


BAD_CONFIGS = {
    "not json": ('{"num_hidden_layers": 2,\n oops}', ":2: not a JSON config"),
    "not an object": ("[1, 2]", "not a config (a JSON object)"),
    "no layers": ('{"num_attention_heads": 8, "hidden_size": 512}', "names no layers"),
    "bad heads": ('{"num_hidden_layers": 2, "num_attention_heads": "x"}', "num_attention_heads"),
    "unknown dtype": (
        '{"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, '
        '"torch_dtype": "complex64"}',
        "torch_dtype 'complex64': unknown dtype",
    ),
}


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=list(BAD_CONFIGS))
def test_a_bad_model_config_is_one_line(capsys, tmp_path, case):
    text, words = BAD_CONFIGS[case]
    cfg = tmp_path / "config.json"
    cfg.write_text(text, encoding="utf-8")
    err = one_line_error(capsys, "--lengths", DAY, "--model-config", cfg)
    assert str(cfg) in err and words in err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--lengths", DAY], "needs a real model's shape"),
        (["--lengths", DAY, *LLAMA2_7B[:-1], "fp4"], "'fp4': unknown dtype"),
        (["--lengths", DAY, *LLAMA2_7B, "--block-sizes", "8,24"], "powers of two"),
        (["--lengths", DAY, *LLAMA2_7B, "--attention-share", "2"], "a share 0 .. 1"),
        (["--lengths", "/nonexistent/l.csv", *LLAMA2_7B], "/nonexistent/l.csv"),
        (["--from-run", REPO / "docs", *LLAMA2_7B], "no history.jsonl"),
        (["--lengths", DAY, "--compare", "/nonexistent/n.csv", *LLAMA2_7B], "n.csv"),
    ],
    ids=["no shape", "bad dtype", "bad sizes", "bad share", "no file", "not a run", "compare"],
)
def test_bad_flags_are_one_line(capsys, argv, words):
    assert words in one_line_error(capsys, *argv)


MEASURE_TRITON = """
import json
from kvchaos.harness.tools.advise_measure import measure
from kvchaos.harness.tools.advise_model import Shape, traffic_of
shape = Shape(layers=1, kv_heads=2, head_dim=16, dtype="float32", heads=4, source="test")
traffic = traffic_of("t", {3: 1, 30: 1})
times, note = measure(traffic, shape, (8, 32), runs=1, triton=True, sample=2, warmup=0)
print(json.dumps([times, note]))
"""


def test_measure_runs_the_triton_kernel_where_it_is_asked():
    """On a GPU --measure times the Triton kernel: here its interpreter takes the same batches."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO.parent)}
    out = subprocess.run(
        [sys.executable, "-c", MEASURE_TRITON], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    times, note = json.loads(out.stdout)
    assert set(times) == {"8", "32"} and all(v > 0 for v in times.values())
    assert "the Triton kernel paged_decode_triton" in note
