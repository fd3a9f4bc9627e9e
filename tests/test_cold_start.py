"""A cold start that costs nothing: `kvchaos --help`, `--version`, `list` and every command's
`--help` load neither torch nor matplotlib, and pytest collects scenarios without torch (a user's
every `pytest` start pays for what the plugin imports)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvchaos.harness.cli import TOOLS

HEAVY = ("torch", "matplotlib")
PROBE = textwrap.dedent(
    """
    import contextlib, io, sys
    from kvchaos.harness.cli import main
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(sys.argv[1:])
        except SystemExit:
            pass
    print(",".join(m for m in {heavy!r} if m in sys.modules))
    """
).format(heavy=HEAVY)


def loaded(*argv: str, before: str = "") -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", before + PROBE, *argv], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return [m for m in out.stdout.strip().split(",") if m]


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["--version"], ["list"], ["run", "--help"]] + [[name, "--help"] for name in TOOLS],
    ids=" ".join,
)
def test_a_command_starts_without_torch_or_matplotlib(argv):
    assert loaded(*argv) == []


def test_the_probe_sees_torch_once_something_loads_it():
    assert loaded("--help", before="import kvchaos.engine.engine\n") == ["torch"]


def test_pytest_collects_scenarios_without_torch(tmp_path):
    (tmp_path / "mine.toml").write_text('[scenario]\nname = "mine"\nseeds = [0, 1]\n')
    (tmp_path / "conftest.py").write_text(
        "import sys\n\n\ndef pytest_collection_finish(session):\n"
        f"    print('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-s", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert "mine.toml::mine[seed=1]" in out.stdout, out.stdout + out.stderr
    assert "HEAVY=\n" in out.stdout


def test_conformance_writes_nothing_into_the_current_folder(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "kvchaos", "conformance", "--examples", "5", "--block-manager"]
        + ["kvchaos.engine.prefix_manager:PrefixCachingManager"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no .hypothesis/, no reports/
