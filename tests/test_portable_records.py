"""A run's record travels: its replay command names a built-in scenario by name and any other
path relative to the report folder; results.json says which kvchaos and which block manager ran
(a distribution's version, or the commit of the checkout its file is in); a report folder kvchaos
makes keeps itself out of git."""

from __future__ import annotations

import json
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest

from kvchaos.harness.history.log import read_history
from kvchaos.harness.report.paths import GITIGNORE, make_report_dir, rel_command
from kvchaos.harness.report.render import publish
from kvchaos.harness.run import provenance
from kvchaos.harness.run.provenance import manager_version
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.inputs import replay_command
from kvchaos.harness.scenario.spec import load_scenario, parse_scenario

TINY = '[scenario]\nname = "tiny"\n\n[workload]\nnum_requests = 2\n'


def test_a_builtin_is_named_by_name_wherever_it_is_installed(tmp_path):
    sc = load_scenario("baseline-clean")
    assert Path(sc.source).is_absolute()  # loaded from the package's own folder
    for run_dir in (None, tmp_path / "reports" / "run"):
        cmd = replay_command(sc, 3, "cpu", run_dir=run_dir)
        assert cmd == "kvchaos run baseline-clean --seed 3 --device cpu"


def test_other_paths_are_relative_to_the_report_folder(tmp_path):
    proj = tmp_path / "proj"
    (proj / "scenarios").mkdir(parents=True)
    (proj / "scenarios" / "mine.toml").write_text(TINY)
    (proj / "bm.py").write_text("")
    run_dir = proj / "reports" / "20260101-000000-tiny-s0"
    sc = load_scenario(proj / "scenarios" / "mine.toml")
    cmd = replay_command(sc, 0, "cpu", f"{proj}/bm.py:Mine", run_dir=run_dir)
    assert (
        cmd
        == "kvchaos run ../scenarios/mine.toml --seed 0 --device cpu --block-manager ../bm.py:Mine"
    )
    # built in memory: the run folder's own copy, inside the report folder
    mem = parse_scenario({"scenario": {"name": "tiny"}})
    assert replay_command(mem, 0, "cpu", run_dir=run_dir) == (
        f"kvchaos run {run_dir.name}/scenario.toml --seed 0 --device cpu"
    )
    # outside the folder that holds the report folder: absolute, as given
    elsewhere = tmp_path / "other" / "x.toml"
    elsewhere.parent.mkdir()
    elsewhere.write_text(TINY)
    far = proj / "deep" / "reports" / "run"
    assert f"kvchaos run {elsewhere} " in replay_command(
        load_scenario(elsewhere), 0, "cpu", run_dir=far
    )


def test_a_copied_project_reads_its_replay_from_where_it_landed(tmp_path, monkeypatch):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "mine.toml").write_text(TINY)
    monkeypatch.chdir(proj)
    r = run_scenario(load_scenario("mine.toml"), 0, device="cpu", report_dir="reports")
    stored = json.loads((r.run_dir / "results.json").read_text())["replay"]
    assert stored == "kvchaos run ../mine.toml --seed 0 --device cpu"
    assert str(tmp_path) not in stored
    moved = tmp_path / "elsewhere" / "proj"
    shutil.copytree(proj, moved)
    monkeypatch.chdir(moved)
    base = moved / "reports"
    assert rel_command(stored, base=base) == "kvchaos run mine.toml --seed 0 --device cpu"
    assert rel_command(stored, base=base, absolute=True) == (
        f"kvchaos run {moved / 'mine.toml'} --seed 0 --device cpu"
    )
    assert rel_command("kvchaos run baseline-clean --seed 0", base=base).endswith(
        "baseline-clean --seed 0"
    )


def _git(cwd: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.email=k@example.com", "-c", "user.name=k", *args]
    return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    if shutil.which("git") is None:
        pytest.skip("no git")
    repo = tmp_path / "repo"
    (repo / "mybm").mkdir(parents=True)
    (repo / "mybm" / "__init__.py").write_text(
        "from kvchaos.engine.block_manager import BlockManager\n\n\n"
        "class Mine(BlockManager):\n    pass\n"
    )
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    monkeypatch.syspath_prepend(str(repo))
    return repo


def test_the_manager_version_is_its_checkout_commit_or_its_distribution(checkout):
    sha = _git(checkout, "rev-parse", "HEAD")
    assert manager_version("mybm:Mine") == f"git {sha}"
    (checkout / "mybm" / "__init__.py").write_text("# changed\n", encoding="utf-8")
    provenance.git_version.cache_clear()
    assert manager_version("mybm:Mine") == f"git {sha}-dirty"
    # an installed distribution's module: its version (a venv inside a checkout included)
    version = metadata.version("hypothesis")
    assert manager_version("hypothesis.stateful:RuleBasedStateMachine") == f"hypothesis {version}"
    # kvchaos's own managers: kvchaos's version
    own = manager_version("kvchaos.engine.block_manager:BlockManager")
    assert own == manager_version(None) == f"kvchaos {provenance.kvchaos_version()}"


def test_results_record_both_versions_outside_the_history(checkout, tmp_path):
    from mybm import Mine

    sc = parse_scenario({"scenario": {"name": "tiny"}, "workload": {"num_requests": 2}})
    r = publish(run_scenario(sc, 0, device="cpu", report_dir=tmp_path / "out", block_manager=Mine))
    res = json.loads((r.run_dir / "results.json").read_text())
    sha = _git(checkout, "rev-parse", "HEAD")
    assert res["manager_version"] == f"git {sha}" and res["kvchaos_version"]
    start = read_history(r.run_dir / "history.jsonl")[0]
    assert "manager_version" not in start and sha not in json.dumps(start)  # not in the digest
    again = run_scenario(
        sc, 0, device="cpu", report_dir=tmp_path / "out", block_manager_spec="mybm:Mine"
    )
    assert again.results["history_digest"] == res["history_digest"]
    assert f"git {sha}" in (r.run_dir / "report.html").read_text()  # shown where it is read


def test_a_report_folder_kvchaos_makes_keeps_out_of_git(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("no git")
    proj = tmp_path / "proj"
    proj.mkdir()
    _git(proj, "init", "-q")
    sc = parse_scenario({"scenario": {"name": "tiny"}, "workload": {"num_requests": 2}})
    run_scenario(sc, 0, device="cpu", report_dir=proj / "reports")
    assert (proj / "reports" / ".gitignore").read_text() == GITIGNORE
    assert "*" in GITIGNORE.splitlines()
    assert _git(proj, "status", "--porcelain", "--untracked-files=all") == ""
    # a folder that was there already is the user's: left as it is
    mine = tmp_path / "mine"
    mine.mkdir()
    make_report_dir(mine)
    assert not (mine / ".gitignore").exists()
