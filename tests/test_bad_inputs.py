"""Bad input, from the corpus in tests/bad_inputs/: every case exits 2 with one line on stderr that
names the file, key or flag, no traceback, and nothing written outside the report folder."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from kvchaos.harness.cli import main
from kvchaos.harness.report import paths, render
from kvchaos.harness.scenario import footprint
from kvchaos.harness.scenario.spec import builtin_scenarios

REPO = Path(__file__).resolve().parents[1]
CORPUS = Path(__file__).with_name("bad_inputs")
TABLE = tomllib.loads((CORPUS / "cases.toml").read_text(encoding="utf-8"))
PINNED_RAM = 4 * footprint.GiB  # the sizes cases are judged against the same memory everywhere
RUN = "reports/20250101-000000-bad-input-run-s0"  # the run folder a case can damage
TINY = """[scenario]
name = "bad-input-tiny"
seeds = [0, 1]
[engine.cache]
block_size = 4
num_blocks = 32
max_blocks_per_seq = 8
max_num_seqs = 4
[workload]
num_requests = 2
prompt_len = { dist = "fixed", value = 3 }
output_len = { dist = "fixed", value = 2 }
[run]
max_steps = 12
"""


def _file_expectation(path: Path) -> str:
    if path.name in TABLE["files"]:
        return TABLE["files"][path.name]
    first = path.read_text(encoding="utf-8").partition("\n")[0]
    assert first.startswith("# expect: "), f"{path.name}: no '# expect:' line"
    return first.removeprefix("# expect: ")


def _cases() -> list:
    out = [
        pytest.param(
            {"argv": ["run", str(p), "--seed", "0"], "expect": _file_expectation(p)}, id=p.stem
        )
        for p in sorted(CORPUS.glob("*.toml"))
        if p.name != "cases.toml"
    ]
    return out + [pytest.param(c, id=c["id"]) for c in TABLE["case"]]


CASES = _cases()
# the issue's classes, by the prefix of their cases' ids
CLASSES = (
    "name- size- seeds- seed- timeout- device- world-size- report-dir- file- scenario-".split()
)
CLASSES += ["analyze-", "replay-", "shrink-", "float-", "length-", "expect-", "path-"]


# -- preparations a case names (setup = ...) -----------------------------------------------------
def plain_file(work: Path, monkeypatch) -> None:
    (work / "plain.txt").write_text("not a folder\n")


def read_only_folder(work: Path, monkeypatch) -> None:
    (work / "locked").mkdir()
    (work / "locked").chmod(0o555)
    if os.access(work / "locked", os.W_OK):
        pytest.skip("this user writes into read-only folders (root): not bad input for it")


def broken_link(work: Path, monkeypatch) -> None:
    (work / "dangling").symlink_to(work / "nowhere")


def disk_full(work: Path, monkeypatch) -> None:
    usage = shutil.disk_usage(work)
    monkeypatch.setattr(paths.shutil, "disk_usage", lambda p: usage._replace(free=0))


def folder_named_toml(work: Path, monkeypatch) -> None:
    (work / "x.toml").mkdir()


def big_file(work: Path, monkeypatch) -> None:
    (work / "big.toml").write_text("# padding\n" * 200_000)


def history_is_a_folder(work: Path, monkeypatch) -> None:
    (work / RUN / "history.jsonl").unlink()
    (work / RUN / "history.jsonl").mkdir()


class _FullFile:
    """An open file on a full disk: opening worked, writing does not."""

    def __init__(self, f) -> None:
        self._f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _fill_disk_after(monkeypatch, reports: Path, publishes: int, before: bool) -> None:
    """Every write under reports/ fails with ENOSPC once `publishes` runs were published (before:
    as the next publish starts, so its report files are what fails)."""
    state = {"full": False, "published": 0}
    real_open, real_publish = io.open, render.publish

    def open_(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        named = isinstance(file, (str, os.PathLike))  # not a file descriptor
        inside = named and Path(os.path.abspath(file)).is_relative_to(reports.absolute())
        return _FullFile(f) if state["full"] and inside and set(mode) & set("wax+") else f

    def publish(result, *a, **k):
        state["full"] = state["full"] or (before and state["published"] == publishes)
        out = real_publish(result, *a, **k)
        state["published"] += 1
        state["full"] = state["full"] or (not before and state["published"] == publishes)
        return out

    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(render, "publish", publish)


def disk_fills_after_first_run(work: Path, monkeypatch) -> None:
    (work / "tiny.toml").write_text(TINY)
    _fill_disk_after(monkeypatch, work / "reports", 1, before=False)


def disk_fills_in_second_report(work: Path, monkeypatch) -> None:
    (work / "tiny.toml").write_text(TINY)
    _fill_disk_after(monkeypatch, work / "reports", 1, before=True)


SETUPS = {
    f.__name__: f
    for f in (
        plain_file,
        read_only_folder,
        broken_link,
        disk_full,
        folder_named_toml,
        big_file,
        history_is_a_folder,
        disk_fills_after_first_run,
        disk_fills_in_second_report,
    )
}


def _run_folder(work: Path, case: dict) -> None:
    """A run folder as `kvchaos run` leaves one (the parts the commands read), then damaged."""
    run = work / RUN
    run.mkdir(parents=True)
    (work / "reports" / "latest").symlink_to(run.name)
    files = {
        "scenario.toml": '[scenario]\nname = "bad-input-run"\nseeds = [0]\n',
        "history.jsonl": '{"e": "run_start", "step": 0, "scenario": "bad-input-run", "seed": 0}\n'
        '{"e": "run_end", "step": 1, "reason": "done", "fault_verify": {}}\n',
        "results.json": json.dumps(
            {"scenario": "bad-input-run", "seed": 0, "device": "cpu", "verdict": "PASS"}
        ),
        **case.get("run_files", {}),
    }
    for name, text in files.items():
        (run / name).write_bytes(text.encode("latin-1"))
    for name in case.get("remove", []):
        (run / name).unlink()


def _under_rlimit_as(argv: list[str], limit: int, cwd: Path) -> tuple[int, str, str]:
    """The command in a process of its own, its address space capped as `ulimit -v` does: the
    memory estimate must see the cap, and refuse before anything big is allocated."""
    import resource

    if min(footprint.host_limits())[0] < limit:
        pytest.skip("this machine has less memory than the cap: the cap is not what refuses")
    path = os.pathsep.join(filter(None, [str(REPO.parent), os.environ.get("PYTHONPATH")]))

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    p = subprocess.run(
        [sys.executable, "-m", "kvchaos", *argv],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": path},
        preexec_fn=cap,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.returncode, p.stdout, p.stderr


def _tree(root: Path, skip: Path) -> dict[str, tuple]:
    """Every path under root but skip, with what would show a change."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == skip:
            dirnames.clear()
            continue
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            if p == skip:
                continue
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def _run_folders(reports: Path) -> set[Path]:
    return {d for d in reports.iterdir() if d.is_dir() and not d.is_symlink()}


def _finished(run: Path) -> bool:
    """A run's record is whole: results.json with a verdict, a history ending in run_end."""
    try:
        verdict = json.loads((run / "results.json").read_text())["verdict"]
        last = (run / "history.jsonl").read_text().splitlines()[-1]
    except (OSError, ValueError, IndexError, KeyError):
        return False
    return bool(verdict) and json.loads(last)["e"] == "run_end"


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """The working directory, two folders down a sandbox, so that a name climbing out of
    reports/ with ../ still lands where the test looks."""
    work = tmp_path / "a" / "work"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("KVCHAOS_PLOTS", "none")
    monkeypatch.setattr(footprint, "available", lambda device: (PINNED_RAM, "available (pinned)"))
    return tmp_path, work


def test_the_corpus_covers_every_class_with_60_cases():
    ids = [p.id for p in CASES]
    assert len(ids) >= 60 and len(set(ids)) == len(ids)
    for prefix in CLASSES:
        assert sum(i.startswith(prefix) for i in ids) >= 2, prefix


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_and_writes_nothing_outside_the_report_dir(
    case, sandbox, monkeypatch, capsys
):
    root, work = sandbox
    reports = work / "reports"
    _run_folder(work, case)  # a report folder holds runs from before
    if "setup" in case:
        SETUPS[case["setup"]](work, monkeypatch)
    argv = [a.replace("{run}", RUN).replace("{corpus}", str(CORPUS)) for a in case["argv"]]
    if argv[0] == "run":
        argv += [] if "--report-dir" in argv else ["--report-dir", "reports"]
    before, runs_before = _tree(root, skip=reports), _run_folders(reports)
    repo_reports = set(os.listdir(REPO / "reports")) if (REPO / "reports").is_dir() else set()

    if "rlimit_as" in case:
        rc, out, err = _under_rlimit_as(argv, case["rlimit_as"], work)
    else:
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse
            rc = e.code
        out, err = capsys.readouterr()

    assert rc == 2, (out, err)
    assert err.count("\n") == 1 and err.endswith("\n") and err.startswith("kvchaos"), err
    assert case["expect"] in err, err
    assert "Traceback" not in out + err
    assert case.get("stdout", "") in out
    assert _tree(root, skip=reports) == before  # nothing written outside the report folder
    new_runs = _run_folders(reports) - runs_before
    assert len([r for r in new_runs if _finished(r)]) == case.get("finished_runs", 0)
    assert not [p for p in root.rglob("*") if p.name.endswith(".tmp")]  # no temporary files
    if (REPO / "reports").is_dir():
        new = set(os.listdir(REPO / "reports")) - repo_reports
        assert not [n for n in new if "bad-input" in n]


# -- the same rules where the corpus does not reach ----------------------------------------------
pytest_plugins = ["pytester"]


def test_pytest_refuses_an_escaping_name_at_collection(pytester):
    d = pytester.mkdir("my_scenarios")
    shutil.copy(CORPUS / "name-dotdot-escape.toml", d / "escape.toml")
    result = pytester.runpytest(str(d))
    assert result.ret == pytest.ExitCode.INTERRUPTED  # a collection error: nothing ran
    result.stdout.fnmatch_lines(["*escape.toml: scenario.name: '../../../tmp/escape': a name is*"])
    assert not [p for p in pytester.path.rglob("*") if "escape" in p.name and p.is_dir()]


@pytest.mark.parametrize(
    "value, expect",
    [("", "'': an empty path"), (" ", "' ': an empty path"), ("/dev/null", "not a folder")],
)
def test_pytest_refuses_a_blank_or_unusable_report_dir_before_collecting(pytester, value, expect):
    pytester.makefile(".toml", tiny=TINY)
    result = pytester.runpytest(f"--kvchaos-report-dir={value}", "tiny.toml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--kvchaos-report-dir: *{expect}*"])
    assert sorted(p.name for p in pytester.path.iterdir()) == ["tiny.toml"]


def test_a_run_folder_is_always_inside_the_report_dir(tmp_path):
    from kvchaos.harness.run.runner import new_run_dir
    from kvchaos.harness.scenario.spec import ScenarioError

    reports = tmp_path / "deep" / "reports"
    for name in ("../../escape", "a/b", "/abs"):  # names a Scenario's validator never saw
        with pytest.raises(ScenarioError, match="its run folder would not be in"):
            new_run_dir(reports, name, 0)
    assert [p.name for p in tmp_path.rglob("*")] == []
    assert new_run_dir(reports, "fine", 0).parent == reports


def test_sizes_are_judged_against_the_memory_really_available(monkeypatch):
    import psutil

    from kvchaos.harness.scenario.spec import ScenarioError, load_scenario

    with pytest.raises(ScenarioError) as e:
        load_scenario(CORPUS / "size-num-requests-1e9.toml")
    need, have = (
        float(x.replace(",", "")) for x in re.findall(r"([\d,.]+) GiB", str(e.value))[::2]
    )
    least, words = footprint.available("cpu")  # free RAM, or a limit of this process if less
    assert need > 10_000 and f"GiB {words}" in str(e.value)
    assert have == pytest.approx(least / footprint.GiB, abs=2.0)
    ram = footprint.host_limits()[0]  # (free memory moves between two looks: within a GiB)
    assert ram[1] == "available host RAM" and least <= ram[0] + footprint.GiB
    assert ram[0] == pytest.approx(psutil.virtual_memory().available, abs=2 * footprint.GiB)
    # the estimate refuses nothing real: each fits in 128 MiB (the largest, the staging ramp's
    # serving-size table of 4 MiB kept in its snapshots, ~82)
    for sc in builtin_scenarios():
        assert sum(p.bytes for p in footprint.estimate(sc)) < 128 * 2**20, sc.name


def test_on_cuda_the_device_parts_are_judged_by_the_device(monkeypatch):
    from kvchaos.harness.scenario.spec import ScenarioError, load_scenario

    free = {"cpu": 4 * footprint.GiB, "cuda": 64 * footprint.GiB}
    monkeypatch.setattr(footprint, "available", lambda d: (free[d.split(":")[0]], d))
    big_pool = CORPUS / "size-block-size-1e5.toml"  # a 12 GiB KV pool, lives on the device
    with pytest.raises(ScenarioError, match="the KV pool"):
        load_scenario(big_pool)
    assert load_scenario(big_pool, "cuda").name == "bad-input-size-block-size-1e5"
    free["cuda"] = footprint.GiB
    with pytest.raises(ScenarioError, match=r"1\.0 GiB cuda:0"):
        load_scenario(big_pool, "cuda:0")
    monkeypatch.setattr(footprint, "available", lambda d: (None, d) if "cuda" in d else (1, d))
    with pytest.raises(ScenarioError, match="the requests"):  # what stays on the host, still
        load_scenario(CORPUS / "size-num-requests-1e9.toml", "cuda")


def test_analyze_of_a_cut_short_history_is_an_error_analysis_naming_what_is_missing(
    tmp_path, capsys
):
    from kvchaos.harness.report.render import publish
    from kvchaos.harness.run.runner import run_scenario
    from kvchaos.harness.scenario.spec import parse_scenario

    sc = parse_scenario(tomllib.loads(TINY), "tiny")
    run = publish(run_scenario(sc, 0, report_dir=tmp_path)).run_dir
    history = (run / "history.jsonl").read_text().splitlines(keepends=True)
    (run / "history.jsonl").write_text("".join(history[:-1]) + '{"e": "st')  # killed mid-write
    assert main(["analyze", str(run), "--no-plots"]) == 13
    out, err = capsys.readouterr()
    assert err == "" and "ERROR" in out and "no run_end event: the run was cut short" in out


def test_a_cgroup_memory_limit_is_read_along_the_process_path(tmp_path):
    """v2 (memory.max) and v1 (memory.limit_in_bytes): the tightest limit on the way up, less the
    usage without reclaimable page cache; a folder the mount does not show is skipped."""
    v2 = tmp_path / "v2"
    for d, limit, current in (("", "max", 9 << 30), ("job", str(4 << 30), 3 << 30)):
        (v2 / d).mkdir(parents=True, exist_ok=True)
        (v2 / d / "memory.max").write_text(limit + "\n")
        (v2 / d / "memory.current").write_text(f"{current}\n")
        (v2 / d / "memory.stat").write_text(f"anon 1\ninactive_file {1 << 30}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job/step_0\n")  # step_0 is not shown: its parent's limit holds
    [(left, words)] = footprint.cgroup_limits(v2, proc)
    assert left == (4 << 30) - (3 << 30) + (1 << 30)
    assert words == f"left under the cgroup memory limit ({v2 / 'job' / 'memory.max'}: 4.0 GiB)"

    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    (v1 / "memory" / "memory.usage_in_bytes").write_text("1\n")
    proc.write_text("4:memory:/x\n1:cpu:/x\n")
    assert footprint.cgroup_limits(v1, proc) == []
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    assert footprint.cgroup_limits(v1, proc)[0][0] == (2 << 30) - 1
    assert footprint.cgroup_limits(tmp_path / "none", tmp_path / "no-proc-file") == []


def test_every_fault_explains_any_finding_on_the_least_truth_its_type_allows():
    """What a fault's explains reads with [] its Truth requires: on the least truth that passes
    the check analyze makes (every NotRequired key left out), no finding makes it raise."""
    from types import SimpleNamespace

    from typing_extensions import NotRequired, get_origin, get_type_hints, is_typeddict

    from kvchaos.faults import REGISTRY
    from kvchaos.faults.base import CHECKER_NAMES
    from kvchaos.harness.check.verdict import truth_problem

    def least(td) -> dict:  # (the modules' postponed annotations hide NotRequired from typing)
        hints = get_type_hints(td, include_extras=True)
        required = {k: h for k, h in hints.items() if get_origin(h) is not NotRequired}
        return {k: least(h) if is_typeddict(h) else [] for k, h in required.items()}

    evidence = {"req": "r0", "owner": "r0", "row": 0, "block": 1, "blocks": [1], "rank": 0}
    evidence |= {"ranks": [0], "writers": ["r0"], "parent_block": 0, "origin": "r0"}
    kinds = [None, "leak", "refcount", "end_leak", "starvation", "foreign_write", "wrong_read"]
    kinds += ["poisoned_read", "cache_content", "hit_blocks", "conservation", "divergence"]
    for name, fault in REGISTRY.items():
        truth = {**least(fault.truth), "fired": True, "first_step": 0, "triggered": 1}
        assert sorted(truth) == ["fired", "first_step", "touched", "triggered"], name
        sc = SimpleNamespace(faults=[SimpleNamespace(name=name)])
        assert truth_problem(sc, {name: truth}) is None, name
        assert "touched" in truth_problem(sc, {name: {**truth, "touched": 1}}), name
        for checker in CHECKER_NAMES:
            for kind in kinds:
                for ev in ({}, evidence):
                    finding = {"checker": checker, "step": 3, "kind": kind, "evidence": ev}
                    assert fault.explains(finding, truth) in (None, "cause", "consequence")


@pytest.mark.parametrize(
    "name, value",
    [
        ("KVCHAOS_RANK_TIMEOUT", "abc"),
        ("KVCHAOS_RANK_TIMEOUT", "-1"),
        ("KVCHAOS_RANK_TIMEOUT", "nan"),
        ("KVCHAOS_CPU_THREADS", "0"),
        ("KVCHAOS_CPU_THREADS", "1.5"),
        ("KVCHAOS_TELEMETRY_EVERY", "ten"),
        ("KVCHAOS_TELEMETRY_INTERVAL_S", "inf"),
    ],
)
def test_a_bad_number_in_the_environment_is_the_commands_usage_error(
    name, value, monkeypatch, capsys
):
    monkeypatch.setenv(name, value)
    assert main(["list"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{name}={value!r}" in err[0] and "expected" in err[0], err


def test_an_unset_or_empty_environment_number_is_its_default(monkeypatch):
    from kvchaos.engine import env

    monkeypatch.setenv("KVCHAOS_CPU_THREADS", "")
    monkeypatch.delenv("KVCHAOS_RANK_TIMEOUT", raising=False)
    assert env.number("KVCHAOS_CPU_THREADS") == 1 and env.number("KVCHAOS_RANK_TIMEOUT") == 60.0
    monkeypatch.setenv("KVCHAOS_RANK_TIMEOUT", " 2.5 ")
    assert env.number("KVCHAOS_RANK_TIMEOUT") == 2.5
