"""kvchaos installs one import name and lives beside a user's own code: a project with its own
`engine/` and `harness/` packages keeps working under the always-loaded pytest plugin, the plugin
imports nothing heavy until it is used, and a second copy of kvchaos's modules is refused."""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvchaos.harness.run.user_code import second_copies
from kvchaos.harness.scenario.managers import canonical_spec

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("engine", "faults", "harness", "scenarios")  # installed as kvchaos.<folder>
SMALL = """
[engine.cache]
block_size = 4
num_blocks = 48
max_num_seqs = 4
max_blocks_per_seq = 8
[engine.model]
num_layers = 1
hidden_size = 32
num_heads = 2
num_kv_heads = 1
vocab_size = 64
[workload]
num_requests = 3
prompt_len = { dist = "fixed", value = 4 }
output_len = { dist = "fixed", value = 4 }
"""


def _env() -> dict:
    """The environment of a user's shell: kvchaos installed, the repository not on the path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


def test_one_top_level_name_is_installed():
    from importlib import metadata

    dist = metadata.distribution("kvchaos")
    assert (dist.read_text("top_level.txt") or "kvchaos").split() == ["kvchaos"]
    eps = {(e.group, e.name): e.value for e in dist.entry_points}
    assert eps[("console_scripts", "kvchaos")] == "kvchaos.harness.cli:main"
    assert eps[("pytest11", "kvchaos")] == "kvchaos.harness.pytest_plugin"


def test_the_plugin_imports_no_torch_until_it_is_used(tmp_path):
    proj = _write(
        tmp_path,
        {
            "test_trivial.py": """
            import sys

            def test_the_plugin_is_loaded_and_torch_is_not(pytestconfig):
                assert pytestconfig.pluginmanager.has_plugin("kvchaos")
                heavy = {"torch", "numpy", "pydantic", "kvchaos.engine.engine", "kvchaos.faults"}
                assert not heavy & set(sys.modules), heavy & set(sys.modules)
            """
        },
    )
    p = _pytest(proj)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 passed" in p.stdout


def test_a_project_with_its_own_engine_and_harness_packages_keeps_working(tmp_path):
    """The collision: an inference-engine project with its own engine/block_manager.py and
    harness/, tested with `python -m pytest` (its root on sys.path) while the plugin is loaded."""
    proj = _write(
        tmp_path,
        {
            "engine/__init__.py": "",
            "engine/block_manager.py": "class MyBlockManager:\n    mine = True\n",
            "harness/__init__.py": "",
            "harness/runner.py": "def run():\n    return 'mine'\n",
            "tests/test_mine.py": """
            from engine.block_manager import MyBlockManager
            from harness.runner import run

            def test_my_own_packages():
                assert MyBlockManager.mine and run() == "mine"
            """,
        },
    )
    p = _pytest(proj, "tests")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 passed" in p.stdout
    # the same project with a scenario collected beside its tests
    (proj / "scenarios").mkdir()
    (proj / "scenarios" / "tiny.toml").write_text(
        '[scenario]\nname = "tiny"\nseeds = [0]\n' + SMALL, encoding="utf-8"
    )
    p = _pytest(proj, "tests", "scenarios", "--kvchaos-report-dir", str(tmp_path / "reports"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 passed" in p.stdout


def test_a_manager_built_on_the_old_top_level_names_is_refused_in_one_line(tmp_path):
    """A manager importing `engine.*` from a checkout on the path loads a second copy of kvchaos's
    modules: one line, exit 2, naming the kvchaos.* import to use."""
    _write(
        tmp_path,
        {
            "oldbm.py": """
            from engine.block_manager import BlockManager

            class OldBM(BlockManager):
                pass
            """
        },
    )
    env = {**_env(), "PYTHONPATH": str(REPO)}
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvchaos",
            "run",
            "baseline-clean",
            "--block-manager",
            "oldbm:OldBM",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "import kvchaos.engine.block_manager instead" in err
    assert not (tmp_path / "reports").exists()


def test_second_copies_are_found_by_file_not_by_name(tmp_path, monkeypatch):
    import importlib

    assert second_copies() == []  # this test session itself holds none
    _write(
        tmp_path,
        {"engine/__init__.py": "", "engine/errors.py": "class OutOfBlocks(Exception): ...\n"},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("engine", "engine.errors"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.import_module("engine.errors")  # a user's own engine package: not a copy
    try:
        assert second_copies() == []
    finally:
        for name in ("engine", "engine.errors"):
            sys.modules.pop(name, None)


@pytest.mark.parametrize(
    "recorded, today",
    [
        ("engine.block_manager:BlockManager", "kvchaos.engine.block_manager:BlockManager"),
        ("kvchaos.engine.block_manager:BlockManager", "kvchaos.engine.block_manager:BlockManager"),
        ("mypkg.bm:MyBlockManager", "mypkg.bm:MyBlockManager"),
        ("engine.nosuch:X", "engine.nosuch:X"),  # not one of ours: a user's own engine package
        (None, None),
    ],
)
def test_recorded_block_manager_specs_map_to_today_s_names(recorded, today):
    assert canonical_spec(recorded) == today


def test_python_dash_m_kvchaos_lists_the_scenarios(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "kvchaos", "list"],
        cwd=tmp_path,
        env={**_env(), "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "table-overflow-detect" in p.stdout and "baseline-clean" in p.stdout


def _setuptools() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _package(folder: Path) -> str:
    return ".".join(("kvchaos", *folder.relative_to(REPO).parts))


def _tree(pattern: str) -> list[Path]:
    return [
        p
        for top in SHIPPED
        for p in (REPO / top).rglob(pattern)
        if p.is_file() and "__pycache__" not in p.parts
    ]


def test_the_package_list_misses_no_subpackage():
    """pyproject.toml lists the packages by hand: setuptools' discovery, under the kvchaos = "."
    mapping, finds them as top-level engine, harness, ... (not kvchaos.engine). A folder with an
    __init__.py missing from the list would be left out of the wheel without a word."""
    listed = set(_setuptools()["packages"])
    on_disk = {"kvchaos"} | {_package(p.parent) for p in _tree("__init__.py")}
    assert not on_disk - listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    gone = {n for n in listed if not (REPO.joinpath(*n.split(".")[1:])).is_dir()}
    assert not gone, f"listed in [tool.setuptools] packages but not in the tree: {sorted(gone)}"


def test_every_data_file_is_in_the_package_data():
    """Templates and scenario files ship through package-data: a file no glob of its folder's
    package matches (or in a folder not in the package list) is left out of the wheel."""
    cfg = _setuptools()
    data = cfg["package-data"]
    missed = sorted(
        str(p.relative_to(REPO))
        for p in _tree("*")
        if p.suffix not in (".py", ".pyc")
        and not (
            _package(p.parent) in cfg["packages"]
            and any(fnmatch.fnmatch(p.name, g) for g in data.get(_package(p.parent), []))
        )
    )
    assert not missed, f"not shipped (pyproject.toml package-data / packages): {missed}"
    assert len(_tree("*.toml")) >= 20 and _tree("*.j2")  # the walk sees the data it guards
