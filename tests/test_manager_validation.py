"""A block manager is checked before any run: loaded, built on a tiny pool, its declaration of
protocol v2 (one without it is refused, naming the migration table), its attributes and a smoke
sequence (admit, append, fork, release, snapshot). What is not a manager is one line and exit 2
(in pytest, a usage error, never INTERNALERROR); a smoke call that raises or answers wrongly is a
FAIL run, exit 11; a module of the current directory is importable.
And a manager that shares only full blocks (no copy-on-write) runs its forks to PASS: each fork
it refuses becomes a fresh request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvchaos.harness.cli import main
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.run.user_code import validate_manager
from kvchaos.harness.scenario.spec import load_scenario

TESTS = Path(__file__).parent
KVCHAOS = Path(sys.executable).parent / "kvchaos"
pytest_plugins = ["pytester"]

MODULES = {
    "bm_none.py": "NOTHING = None\n",
    "bm_plain.py": """
        PLAIN = object()

        class Plain:
            def __init__(self, *args):
                pass

        def returns_none(*args):
            return None
        """,
    "bm_explodes.py": """
        class Explodes:
            def __init__(self, num_blocks, block_size, max_num_seqs, max_blocks_per_seq):
                raise RuntimeError("no GPU here")
        """,
    "bm_syntax.py": "def broken(:\n    pass\n",
    "bm_raises.py": "raise RuntimeError('import-time boom')\n",
    "bm_needs_dep.py": "import nosuchdep_xyz\n",
    "bm_wrong.py": """
        from kvchaos.engine.block_manager import BlockManager

        class DictCopies(BlockManager):
            def append(self, seq_id, token_ids):
                super().append(seq_id, token_ids)
                return {}

        class ForkCrashes(BlockManager):
            def fork(self, parent_id, child_id):
                return [][0]
        """,
    "bm_v1.py": """
        from kvchaos.engine.protocols import Snapshot

        class FirstProtocol:
            block_size, num_blocks, num_free_blocks, num_free_rows = 2, 8, 8, 4

            def __init__(self, *args):
                pass

            def append(self, seq_id, num_new_tokens):
                return []

            def free(self, seq_id):
                return False

            def snapshot(self):
                return Snapshot(8, list(range(8)), [0] * 8, {})
        """,
    "bm_v2.py": """
        from kvchaos.engine.protocols import Snapshot

        class OnlyDeclares:
            kvchaos_protocol = 2

            def __init__(self, *args):
                pass

        class V2(OnlyDeclares):
            block_size, num_blocks, num_free_blocks = 2, 8, 8

            def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
                return 0

            def append(self, seq_id, token_ids):
                return []

            def block_ids(self, seq_id):
                return []

            def release(self, seq_id, reason):
                return False

            def snapshot(self):
                return Snapshot(8, list(range(8)), [0] * 8, {})

        class AnswersTooMuch(V2):
            def admit(self, seq_id, token_ids, num_new_tokens, max_computed):
                return len(token_ids) + 1

        class ReleaseSaysNothing(V2):
            def release(self, seq_id, reason):
                pass

        class EndStepCrashes(V2):
            capabilities = frozenset({"end_step"})

            def end_step(self, computed):
                raise KeyError("smoke-z")

        class ReservesOutsideThePool(V2):
            reserved_blocks = (8,)

        class SnapshotWithoutBlocks(V2):
            def snapshot(self):
                return Snapshot(8, list(range(8)), [0] * 8, None)
        """,
}
BAD = [
    ("bm_none:NOTHING", "'bm_none:NOTHING' is NoneType, not a block manager class or factory"),
    ("bm_plain:PLAIN", "'bm_plain:PLAIN' is object, not a block manager class or factory"),
    ("bm_plain:Plain", "'bm_plain:Plain': Plain does not declare kvchaos_protocol = 2: protocol"),
    ("bm_plain:returns_none", "'bm_plain:returns_none'(8, 2, 4, 4) returned None"),
    ("os:path.join", "calling it on a tiny pool (8, 2, 4, 4: num_blocks, block_size, max_num"),
    ("bm_explodes:Explodes", "raised RuntimeError: no GPU here"),
    ("bm_syntax:BM", "importing bm_syntax raised SyntaxError"),
    ("bm_raises:BM", "importing bm_raises raised RuntimeError: import-time boom"),
    ("bm_needs_dep:BM", "importing bm_needs_dep raised ModuleNotFoundError: No module named"),
    ("bm_nosuch:BM", "cannot import bm_nosuch"),
    ("bm_v2:OnlyDeclares", "declares kvchaos_protocol = 2 but lacks block_size, num_blocks, num"),
    ("bm_v2:ReservesOutsideThePool", "reserved_blocks is (8,), not a tuple of block ids in [0, 8)"),
]


# managers with a bug the smoke sequence meets: a FAIL run (exit 11), not bad input
SMOKE_FAILS = [
    ("bm_wrong:DictCopies", "append('smoke-a', [6]) answered {}: copies must be a list of"),
    ("bm_wrong:ForkCrashes", "fork('smoke-a', 'smoke-b') raised IndexError"),
    ("bm_v2:AnswersTooMuch", "admit('smoke-a', [1, 2, 3, 4, 5], 5, 4) answered 6: computed token"),
    ("bm_v2:ReleaseSaysNothing", "release('smoke-a', 'finished') answered None: release answers"),
    ("bm_v2:EndStepCrashes", "end_step({'smoke-a': 5}) raised KeyError: 'smoke-z'"),
    ("bm_v2:SnapshotWithoutBlocks", "snapshot() field seq_blocks is nothing, not dict"),
]


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """The user's folder, the current directory, holding their modules."""
    for name, text in MODULES.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_object may add the cwd
    for name in MODULES:
        monkeypatch.delitem(sys.modules, name.removesuffix(".py"), raising=False)
    return tmp_path


@pytest.mark.parametrize("spec, message", BAD, ids=[s for s, _ in BAD])
def test_a_bad_block_manager_is_one_line_and_exit_2_before_any_run(capsys, user_dir, spec, message):
    rc = main(["run", "baseline-clean", "--block-manager", spec, "--report-dir", "r"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", out
    assert err.startswith("kvchaos: error: ") and err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err and not (user_dir / "r").exists()


@pytest.mark.parametrize("spec, message", SMOKE_FAILS, ids=[s for s, _ in SMOKE_FAILS])
def test_a_manager_failing_the_smoke_sequence_is_a_fail_run(capsys, user_dir, spec, message):
    rc = main(["run", "baseline-clean", "--block-manager", spec, "--report-dir", "r", "-q"])
    out, err = capsys.readouterr()
    assert rc == 11 and err == "", err
    (run,) = [p for p in (user_dir / "r").iterdir() if p.is_dir() and not p.is_symlink()]
    results = json.loads((run / "results.json").read_text())
    assert results["verdict"] == "FAIL" and message in results["summary"], results["summary"]


NOT_V2 = (  # the whole line, after the spec
    "FirstProtocol does not declare kvchaos_protocol = 2: protocol v1 was removed in kvchaos 0.2; "
    "move it to v2 with the migration table in docs/adapters.md ('Moving a manager from the first "
    "protocol to v2')"
)


@pytest.mark.parametrize(
    "command", [["run", "baseline-clean", "--report-dir", "r"], ["conformance"]]
)
def test_a_manager_of_the_first_protocol_is_refused_in_one_line_naming_the_migration_table(
    capsys, user_dir, command
):
    rc = main([*command, "--block-manager", "bm_v1:FirstProtocol"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", out
    assert err == f"kvchaos: error: 'bm_v1:FirstProtocol': {NOT_V2}\n", err
    heading = "## Moving a manager from the first protocol to v2"
    assert heading in (Path(__file__).parents[1] / "docs" / "adapters.md").read_text()


def test_a_module_not_found_says_where_kvchaos_looked_and_what_to_do(user_dir):
    with pytest.raises(ValueError) as e:
        validate_manager("bm_nosuch:BM")
    assert str(user_dir) in str(e.value) and "PYTHONPATH" in str(e.value)
    assert "run from the folder that holds bm_nosuch" in str(e.value)


BUILT_TO_FAIL = {"HangsWhenBuilt", "ExitsWhenBuilt"}  # tests/test_isolation.py's


def test_every_manager_of_the_tests_and_canaries_passes_the_door_but_one():
    """The door judges whether a manager can be driven, not whether it is right: the bugs the
    runs are there to catch pass it, except a fork that does not count its holders, which
    crashes on the smoke sequence's second release, and an admit answering past its tokens (an
    answer no engine can take, at the first admit)."""
    import inspect

    from kvchaos.harness.tools import canaries

    sys.path.insert(0, str(TESTS))
    import managers

    refused = []
    for mod in (managers, canaries):
        for name, cls in vars(mod).items():
            if name in BUILT_TO_FAIL:  # they hang or end the process at the door, on purpose
                continue
            if inspect.isclass(cls) and cls.__module__ == mod.__name__ and hasattr(cls, "snapshot"):
                try:
                    validate_manager(f"{mod.__name__}:{name}")
                except ValueError as e:
                    refused.append((name, str(e)))
    why = dict(refused)
    assert sorted(why) == ["AdmitAnswersPastItsTokens", "ForkNoIncref"], refused
    assert "release('smoke-b', 'aborted') raised ValueError: decref of free" in why["ForkNoIncref"]
    assert "admit('smoke-a'" in why["AdmitAnswersPastItsTokens"]


def test_a_module_of_the_current_directory_is_importable(tmp_path):
    (tmp_path / "mybm.py").write_text(
        "from kvchaos.engine.block_manager import BlockManager\n\n"
        "class MyBM(BlockManager):\n    pass\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run(
        [str(KVCHAOS), "conformance", "--block-manager", "mybm:MyBM", "--examples", "10"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "12 of 12 applicable properties passed" in p.stdout  # v2, as the plain reference


@pytest.mark.parametrize(
    "module, spec, message",
    [
        (
            "bm_explodes",
            "bm_explodes:Explodes",
            "calling it on a tiny pool (8, 2, 4, 4: num_blocks, block_size, max_num_seqs, "
            "max_blocks_per_seq) raised RuntimeError: no GPU here",
        ),
        ("bm_v1", "bm_v1:FirstProtocol", NOT_V2),
    ],
)
def test_in_pytest_a_bad_block_manager_is_a_usage_error(pytester, module, spec, message):
    pytester.makepyfile(**{module: textwrap.dedent(MODULES[f"{module}.py"])})
    pytester.makepyfile(test_mine="def test_mine():\n    pass\n")
    res = pytester.runpytest_subprocess("--kvchaos-block-manager", spec)
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    err = res.stderr.str()
    assert "INTERNALERROR" not in err + res.stdout.str() and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [f"ERROR: --kvchaos-block-manager: {spec!r}: {message}"], err


def test_replay_checks_an_overriding_block_manager_first(tmp_path, capsys):
    from kvchaos.harness.report.render import publish

    r = publish(run_scenario(load_scenario("baseline-clean"), 0, "cpu", tmp_path / "runs"))
    rc = main(["replay", str(r.run_dir), "--block-manager", "os:path.join"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "'os:path.join': calling it" in err, err


@pytest.mark.parametrize("name", ["fork-heavy-clean", "mixed-clean"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_manager_that_shares_only_full_blocks_runs_forks_to_pass(name, seed):
    """Prefix-cache style: no copy-on-write, so a fork of a partly filled last block is refused;
    the engine runs that child as a fresh request."""
    sys.path.insert(0, str(TESTS))
    r = run_scenario(
        load_scenario(name), seed, "cpu", None, block_manager_spec="managers:SharesFullBlocksOnly"
    )
    assert r.verdict == "PASS", r.summary
    refused = [e for e in r.events if e.get("kind") == "refusal" and e["data"]["call"] == "fork"]
    assert refused and not any(e["data"].get("changed") for e in refused)
    if name == "fork-heavy-clean":  # and the forks of full blocks were shared
        assert r.results["exercised"]["fork_calls"] > len(refused)
