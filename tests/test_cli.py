"""The kvchaos command line: help, list, run with its table, one exit code per verdict, and bad
input refused with exit 2 and one clear line (no traceback, no run started); every command's exit
codes in its help; output for logs and pipes (full-width tables, plain progress lines, --format
json) and where the reports are."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvchaos
from kvchaos.engine.engine import Engine
from kvchaos.harness.check.verdict import EXIT_CODES
from kvchaos.harness.cli import build_parser, main
from kvchaos.harness.commands import EXITS
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import builtin_scenarios, load_scenario

KVCHAOS = Path(sys.executable).with_name("kvchaos")


@pytest.fixture(autouse=True)
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich: no truncated names in tables


def cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse: --help, usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def run_dirs(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_dir() and not p.is_symlink()) if d.exists() else []


def write_scenario(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / f"{name}.toml"
    p.write_text(f'[scenario]\nname = "{name}"\n' + text)
    return p


def test_help_from_the_console_script():
    out = subprocess.run([str(KVCHAOS), "--help"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stderr == ""
    assert "list" in out.stdout and "run" in out.stdout
    # the column is as wide as the longest command's name
    verdicts = "0 PASS, 10 MISSED, 11 FAIL, 12 INCONCLUSIVE, 13 ERROR"
    assert re.search(rf"\n  run +{verdicts}\n", out.stdout)
    assert re.search(r"\n  all +2 bad input, 130 interrupted\n", out.stdout)


def test_version(capsys):
    out = subprocess.run([str(KVCHAOS), "--version"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout == f"kvchaos {kvchaos.__version__}\n"
    rc, out, _ = cli(capsys, "--version")
    assert rc == 0 and out.strip() == f"kvchaos {kvchaos.__version__}"


def subcommands() -> dict[str, argparse.ArgumentParser]:
    p = build_parser()
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices


def documented(help_text: str) -> set[int]:
    """The codes of an `exit codes:` section."""
    section = help_text.split("exit codes")[-1]
    return {int(c) for c in re.findall(r"(?m)^ +(\d+)  \S", section)}


# where each command's exit codes are defined: its EXIT_* constants must all be in its help
SOURCES = {
    "run": ["kvchaos.harness.check.verdict"],
    "analyze": ["kvchaos.harness.check.verdict"],
    "replay": ["kvchaos.harness.tools.replay"],
    "shrink": ["kvchaos.harness.tools.shrink"],
    "explain": ["kvchaos.harness.tools.explain"],
    "soak": ["kvchaos.harness.tools.soak", "kvchaos.harness.tools.soak_summary"],
    "gpu-check": ["kvchaos.harness.bench.gpu_check"],
    "selftest": ["kvchaos.harness.tools.selftest"],
    "bench": [],
    "list": [],
    "conformance": ["kvchaos.harness.conformance.suite"],
    "clean": ["kvchaos.harness.tools.clean"],
    "advise": ["kvchaos.harness.tools.advise"],
    "ledger": [],
}


def test_every_command_documents_its_exit_codes(capsys):
    cmds = subcommands()
    assert {"list", "run", "analyze", "replay", "shrink", "soak", "gpu-check"} <= set(cmds)
    rc, top, _ = cli(capsys, "--help")
    assert rc == 0
    for name in cmds:
        assert name in SOURCES, f"{name}: which module defines its exit codes?"
        rc, out, _ = cli(capsys, name, "--help")
        codes = documented(out)
        assert rc == 0 and {0, 2, 130} <= codes, (name, out)
        defined = set()
        for module in SOURCES[name]:
            mod = importlib.import_module(module)
            defined |= {v for k, v in vars(mod).items() if k.startswith("EXIT_") and type(v) is int}
            if name in ("run", "analyze"):
                defined |= set(mod.EXIT_CODES.values())
        assert defined <= codes, (name, defined - codes)
        epilog = top.split("exit codes")[-1]
        line = next(ln for ln in epilog.splitlines() if ln.split()[:1] == [name])
        assert {int(c) for c in re.findall(r"(\d+) ", line)} == {c for c, _, _ in EXITS[name]}


def test_run_help(capsys):
    rc, out, _ = cli(capsys, "run", "--help")
    assert rc == 0
    for flag in (
        "--seed",
        "--seeds",
        "--device",
        "--report-dir",
        "--block-manager",
        "--tag",
        "--timeout",
    ):
        assert flag in out
    assert "   10  MISSED: a planted defect fired" in out and "  130  interrupted" in out
    assert "--format {text,json}" in out


def test_list_shows_every_builtin_with_expectation_and_markers(capsys):
    rc, out, err = cli(capsys, "list")
    assert rc == 0 and err == ""
    for sc in builtin_scenarios():
        assert sc.name in out
    row = next(line for line in out.splitlines() if "refcount-leak-detect" in line)
    assert (
        "detect by" in row
        and "block_accounting" in row
        and "fault_refcount_leak" in row
        and "(defect)" in row
    )
    row = next(line for line in out.splitlines() if "refcount-leak-clean" in line)
    assert "clean" in row and "(trigger only)" in row
    row = next(line for line in out.splitlines() if "async-free-abort-detect" in line)
    assert "async_free/abort (defect)" in row  # a fault with variants: named by its label


def test_run_baseline_from_the_console_script_prints_the_table(tmp_path):
    """And the same seed gives the same history in another process (the staging scenario records a
    buffer re-allocation, whose process id must not leak into the digest). Its latency limit is
    out of reach: this run's verdict is the history's, not the load beside it (timing's)."""
    from kvchaos.harness.scenario.spec import BUILTIN_DIR

    calm = tmp_path / "staging-stall-from-start-clean.toml"
    text = (BUILTIN_DIR / calm.name).read_text()
    calm.write_text(text.replace("[run]\n", "[run]\nlatency_slo_ratio = 1e9\n", 1))
    out = subprocess.run(
        [
            str(KVCHAOS),
            "run",
            "baseline-clean",
            str(calm),
            "--seed",
            "0",
            "--report-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert (
        "kvchaos: 2 runs" in out.stdout
        and "baseline-clean" in out.stdout
        and "PASS 1/1" in out.stdout
    )
    assert "overall: PASS" in out.stdout
    dirs = run_dirs(tmp_path)
    assert len(dirs) == 2
    # the batch ends saying where its reports are
    assert out.stdout.splitlines()[-1] == (
        f"reports: {tmp_path}  index: {tmp_path / 'index.html'}  latest: {tmp_path / 'latest'}"
        f" -> {(tmp_path / 'latest').resolve().name}"
    )
    stall = next(d for d in dirs if "staging-stall-from-start-clean" in d.name)
    theirs = json.loads((stall / "results.json").read_text())["history_digest"]
    ours = run_scenario(load_scenario(calm), 0, report_dir=None).results["history_digest"]
    assert theirs == ours


def test_run_detect_scenario_passes(capsys, tmp_path):
    rc, out, _ = cli(
        capsys, "run", "table-overflow-detect", "--seed", "1", "--report-dir", tmp_path, "-q"
    )
    assert rc == 0
    row = next(line for line in out.splitlines() if "table-overflow-detect" in line)
    cells = [
        c.strip() for c in row.split("│")[1:-1]
    ]  # scenario, seeds, verdicts, time to detect, steps
    assert cells[:3] == ["table-overflow-detect", "1", "PASS 1/1"] and int(cells[3]) <= 2
    assert len(run_dirs(tmp_path)) == 1


BAD = [
    (["run", "--seeds", "abc"], "--seeds 'abc': expected a count"),
    (["run", "--seeds", "0"], "--seeds 0: the count must be >= 1"),
    (["run", "--seeds", "1,x"], "--seeds '1,x'"),
    (
        ["run", "no-such-scenario", "--seed", "0"],
        "no-such-scenario: no such scenario file or built-in scenario",
    ),
    (
        ["run", "baseline-clean", "--block-manager", "nosuch:thing"],
        "'nosuch:thing': cannot import nosuch",
    ),
    (
        ["run", "baseline-clean", "--block-manager", "kvchaos.engine.block_manager:Nope"],
        "has no attribute Nope",
    ),
    (["run", "baseline-clean", "--block-manager", "justamodule"], "expected module:attr"),
    (["run", "--tag", "no-such-tag"], "no scenario matches"),
    (["list", "missing.toml"], "missing.toml: no such scenario file"),
]


@pytest.mark.parametrize("argv, message", BAD, ids=[" ".join(a[1:]) for a, _ in BAD])
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, argv, message):
    rc, out, err = cli(
        capsys, *argv, *(["--report-dir", tmp_path / "r"] if argv[0] == "run" else [])
    )
    assert rc == 2
    assert err.startswith("kvchaos: error: ") and err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err + out
    assert run_dirs(tmp_path / "r") == []  # nothing ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_device_cuda_without_a_gpu(capsys, tmp_path):
    rc, _, err = cli(capsys, "run", "baseline-clean", "--device", "cuda", "--report-dir", tmp_path)
    assert rc == 2 and err == "kvchaos: error: --device cuda: no CUDA device is available\n"


def test_argparse_errors_exit_2_naming_the_flag(capsys):
    rc, _, err = cli(capsys, "run", "--seed", "x")
    assert rc == 2 and err.count("\n") == 1 and "argument --seed: 'x': expected a seed" in err
    rc, _, err = cli(capsys, "run", "--seed", "1", "--seeds", "3")
    assert rc == 2 and "not allowed with argument" in err


LEAK_FAULT = '[[faults]]\nname = "refcount_leak"\n'
SMALL = (
    "[workload]\nnum_requests = 8\nfork_groups = 1\n"
    "[engine.cache]\nnum_blocks = 48\nblock_size = 4\n"
)


def test_exit_code_per_verdict(capsys, tmp_path, monkeypatch):
    """One scenario per verdict, each through the command line; several at once exit with the
    worst."""
    files = {
        "PASS": write_scenario(
            tmp_path,
            "leak-caught",
            SMALL
            + LEAK_FAULT
            + '[expect]\noutcome = "detect"\ncheckers = ["block_accounting"]\nwithin_steps = 2\n',
        ),
        # the leak fires, but the expectation names a checker that cannot see it
        "MISSED": write_scenario(
            tmp_path,
            "leak-wrong-checker",
            SMALL + LEAK_FAULT + '[expect]\noutcome = "detect"\ncheckers = ["cross_rank"]\n',
        ),
        # no cancel ever happens: the planted leak cannot fire
        "INCONCLUSIVE": write_scenario(
            tmp_path,
            "leak-never-fires",
            SMALL + LEAK_FAULT + "params = { cancel_phases = [] }\n"
            '[expect]\noutcome = "detect"\ncheckers = ["block_accounting"]\n',
        ),
        # the ordering race needs two ranks: the run cannot start
        "ERROR": write_scenario(
            tmp_path,
            "race-one-rank",
            SMALL + '[[faults]]\nname = "ordering_race"\ndefect = false\n',
        ),
        "FAIL": write_scenario(
            tmp_path, "clean-under-leaky-bm", SMALL + '[workload.cancel]\nphases = ["shared"]\n'
        ),
    }
    (tmp_path / "leaky_bm.py").write_text(
        "from kvchaos.engine.block_manager import BlockManager\n"
        "class Leaky(BlockManager):\n"
        "    def release(self, seq_id, reason):\n"
        "        blocks = self.blocks.get(seq_id)\n"
        "        if blocks and any(self.pool.ref[b] > 1 for b in blocks):\n"
        "            return True\n"
        "        return super().release(seq_id, reason)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for verdict, path in files.items():
        extra = ["--block-manager", "leaky_bm:Leaky"] if verdict == "FAIL" else []
        rc, out, _ = cli(capsys, "run", path, "--seed", "0", "--report-dir", tmp_path / "r", *extra)
        assert rc == EXIT_CODES[verdict], (verdict, out)
        assert f"{verdict} 1/1" in out
        if verdict != "PASS":  # the failure line says how to replay it
            assert f"replay: kvchaos run {path} --seed 0 --device cpu" in out
    rc, out, _ = cli(
        capsys,
        "run",
        files["PASS"],
        files["INCONCLUSIVE"],
        files["MISSED"],
        "--seed",
        "0",
        "--report-dir",
        tmp_path / "r",
        "-q",
    )
    assert rc == EXIT_CODES["MISSED"] and "overall: MISSED" in out


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_ctrl_c_stops_the_run_and_keeps_the_record(capsys, tmp_path, monkeypatch, fmt):
    """In-process (the patched step is this process's); isolated: tests/test_isolation.py."""
    real = Engine.step

    def step(self):
        if self.step_count == 2:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Engine, "step", step)
    rc, out, err = cli(
        capsys,
        "run",
        "baseline-clean",
        "refcount-leak-clean",
        "--seeds",
        "3",
        "--report-dir",
        tmp_path,
        "--format",
        fmt,
        "--in-process",
    )
    assert rc == 130 and "interrupted" in err
    (only,) = run_dirs(tmp_path)  # the first run, and nothing after it
    if fmt == "json":  # the document still comes, saying so
        doc = json.loads(out)
        assert doc["interrupted"] and doc["exit_code"] == 130
        assert [Path(x["run_dir"]) for x in doc["runs"]] == [only]
    else:
        assert "overall: ERROR" in out and f"reports: {tmp_path}" in out
    res = json.loads((only / "results.json").read_text())
    assert res["reason"] == "interrupted" and res["steps"] == 2
    # the batch's index is still written, with the interrupted run in it
    assert list(json.loads((tmp_path / "index.json").read_text())) == [only.name]
    assert (tmp_path / "latest").resolve() == only.resolve()


def test_a_batch_builds_the_index_once_with_every_run(capsys, tmp_path, monkeypatch):
    from kvchaos.harness.report import index as report

    calls = []
    real = report.update_index
    monkeypatch.setattr(report, "update_index", lambda *a, **k: calls.append(a) or real(*a, **k))
    rc, _, _ = cli(capsys, "run", "baseline-clean", "--seeds", "3", "--report-dir", tmp_path, "-q")
    assert rc == 0 and len(calls) == 1
    dirs = run_dirs(tmp_path)
    assert (
        sorted(json.loads((tmp_path / "index.json").read_text())) == [d.name for d in dirs]
        and len(dirs) == 3
    )
    html = (tmp_path / "index.html").read_text()
    assert all(d.name in html for d in dirs)


# Two names that only differ at the end, longer than a CI log's default 80 columns.
LONG = "ordering-race-across-eight-tensor-parallel-ranks-under-host-staging-pressure"


def test_in_a_log_tables_keep_long_names_and_progress_is_plain_lines(tmp_path):
    """stdout is a pipe here, as in CI, and COLUMNS is not set: nothing may be truncated."""
    files = [write_scenario(tmp_path, f"{LONG}-{k}", SMALL) for k in ("clean", "again")]
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    argv = [str(KVCHAOS), "run", *map(str, files), "--seed", "0"]
    out = subprocess.run(
        [*argv, "--report-dir", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    progress = [ln for ln in lines if ln.startswith("[")]
    assert len(progress) == 2, out.stdout
    for i, (ln, k) in enumerate(zip(progress, ("clean", "again")), 1):
        assert re.fullmatch(rf"\[{i}/2\] {LONG}-{k} seed 0: PASS \(\d+\.\d s\)", ln), ln
    rows = [ln for ln in lines if ln.startswith("│")]
    assert [ln.split("│")[1].strip() for ln in rows] == [f"{LONG}-clean", f"{LONG}-again"]
    assert "…" not in out.stdout and "\x1b[" not in out.stdout  # no ellipsis, no colour codes
    # list, too
    out = subprocess.run(
        [str(KVCHAOS), "list", *map(str, files)], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0 and "…" not in out.stdout
    assert f"{LONG}-clean " in out.stdout and f"{LONG}-again " in out.stdout


def test_format_json_is_one_document_matching_the_run_folders(capsys, tmp_path):
    caught = write_scenario(
        tmp_path,
        "leak-caught",
        SMALL + LEAK_FAULT + '[expect]\noutcome = "detect"\ncheckers = ["block_accounting"]\n',
    )
    missed = write_scenario(
        tmp_path,
        "leak-wrong-checker",
        SMALL + LEAK_FAULT + '[expect]\noutcome = "detect"\ncheckers = ["cross_rank"]\n',
    )
    r = tmp_path / "r"
    rc, out, err = cli(
        capsys, "run", caught, missed, "--seeds", "0,1", "--report-dir", r, "--format", "json"
    )
    doc = json.loads(out)  # stdout is that document and nothing else
    assert rc == doc["exit_code"] == EXIT_CODES["MISSED"] and doc["verdict"] == "MISSED"
    assert doc["report_dir"] == str(r) and doc["index"] == str(r / "index.html")
    assert Path(doc["latest"]).resolve() == Path(doc["runs"][-1]["run_dir"]).resolve()
    runs = doc["runs"]
    assert [(x["scenario"], x["seed"]) for x in runs] == [
        ("leak-caught", 0),
        ("leak-caught", 1),
        ("leak-wrong-checker", 0),
        ("leak-wrong-checker", 1),
    ]
    assert sorted(Path(x["run_dir"]) for x in runs) == run_dirs(r)
    for x in runs:
        res = json.loads((Path(x["run_dir"]) / "results.json").read_text())
        assert (x["verdict"], x["summary"]) == (res["verdict"], res["summary"])
        # results.json's paths are relative to the report folder; the document's absolute
        src = caught if x["scenario"] == "leak-caught" else missed
        assert res["replay"].startswith(f"kvchaos run ../{src.name} ")
        assert x["replay"] == res["replay"].replace(f"../{src.name}", str(src))
        assert x["exit_code"] == EXIT_CODES[x["verdict"]]
    assert {x["verdict"] for x in runs} == {"PASS", "MISSED"}
    # the progress and where the reports are go to stderr
    assert (
        "[1/4] leak-caught seed 0: PASS" in err and "[4/4] leak-wrong-checker seed 1: MISSED" in err
    )
    assert err.splitlines()[-1].startswith(f"reports: {r}  index: {r / 'index.html'}")
    rc, out, err = cli(
        capsys, "run", caught, "--seed", "0", "--report-dir", r, "--format", "json", "-q"
    )
    assert rc == 0 and json.loads(out)["runs"][0]["verdict"] == "PASS" and err == ""


def test_list_format_json(capsys):
    rc, out, _ = cli(capsys, "list", "--format", "json")
    scs = {s["name"]: s for s in json.loads(out)["scenarios"]}
    assert rc == 0 and set(scs) == {s.name for s in builtin_scenarios()}
    leak = scs["refcount-leak-detect"]
    assert (
        leak["expect"]["outcome"] == "detect" and "block_accounting" in leak["expect"]["checkers"]
    )
    assert leak["faults"] == [{"name": "refcount_leak", "defect": True}]
    assert "fault_refcount_leak" in leak["markers"] and leak["seeds"]


def test_the_docs_list_every_commands_exit_codes():
    usage = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    start = usage.index("## Verdicts and exit codes")
    section = usage[start : usage.index("\n## ", start + 1)]
    for verdict, code in EXIT_CODES.items():
        assert f"`{verdict}` {code}" in section
    bullets = re.split(r"\n- ", section)
    for name, codes in EXITS.items():
        if name == "run":
            continue  # the verdicts above
        bullet = next(b for b in bullets if f"`{name}`" in b.split(":")[0])
        assert {c for c, _, _ in codes} <= {int(n) for n in re.findall(r"\b(\d+)\b", bullet)}, name
    assert "2 on bad input" in section and "130 when" in section
