"""The pytest plugin, driven through pytester: a folder of the user's scenario files becomes one
item per scenario x seed with markers; failures say verdict, evidence and how to replay; JUnit
XML carries seed and scenario; bad files are collection errors naming the key; the fixtures and
--kvchaos-block-manager reach the run."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import hypothesis  # noqa: F401  imported here, so that pytester's in-process runs (which drop the
import pytest  # modules they import) do not import (and assertion-rewrite) them afresh each time

import kvchaos.harness.cli  # noqa: F401
import kvchaos.harness.run.runner  # noqa: F401

pytest_plugins = ["pytester"]

SMALL = """
[engine.cache]
block_size = 4
num_blocks = 40
max_blocks_per_seq = 12
max_num_seqs = 6

[workload]
num_requests = 6
fork_groups = 1
prompt_len = { dist = "uniform", min = 2, max = 10 }
output_len = { dist = "uniform", min = 2, max = 8 }

[run]
max_steps = 60
"""

LEAK_DETECT = """
[[faults]]
name = "refcount_leak"

[expect]
outcome = "detect"
checkers = ["block_accounting"]
within_steps = 2
"""

LEAKY_BM = """
from kvchaos.engine.block_manager import BlockManager

class Leaky(BlockManager):
    def release(self, seq_id, reason):
        blocks = self.blocks.get(seq_id)
        if blocks and any(self.pool.ref[b] > 1 for b in blocks):
            return True  # forgets a sequence that shares a block
        return super().release(seq_id, reason)
"""


def scenario(name: str, body: str = "", tags=(), seeds=(0,)) -> str:
    return (
        f'[scenario]\nname = "{name}"\ntags = {json.dumps(list(tags))}\n'
        f"seeds = {json.dumps(list(seeds))}\n" + SMALL + body
    )


@pytest.fixture
def suite(pytester):
    d = pytester.mkdir("my_scenarios")
    (d / "leak.toml").write_text(scenario("leak", LEAK_DETECT, tags=["nightly"], seeds=[0, 1]))
    (d / "leak-soak.toml").write_text(scenario("leak-soak", LEAK_DETECT, tags=["soak"]))
    # seeds 1 and 2 of this one cancel a forked request while it shares its parent's blocks
    (d / "clean.toml").write_text(
        scenario("clean", '[workload.cancel]\nphases = ["shared", "decode"]\n', seeds=[1])
    )
    (d / "notes.toml").write_text('title = "not a scenario: no [scenario] table"\n')
    return pytester


def names(items) -> list[str]:
    return sorted(i.name for i in items)


def collected(pytester, *args) -> list[str]:
    """The item names a --collect-only run selects (after -m / -k deselection)."""
    out = pytester.runpytest("--collect-only", "-q", *args).stdout.lines
    return sorted(line.split("::")[-1] for line in out if "::" in line)


def test_folder_collected_per_scenario_and_seed_with_markers(suite):
    items, _ = suite.inline_genitems("my_scenarios")
    assert names(items) == ["clean[seed=1]", "leak-soak[seed=0]", "leak[seed=0]", "leak[seed=1]"]
    marks = {i.name: {m.name for m in i.iter_markers()} for i in items}
    assert marks["leak[seed=0]"] == {"scenario", "fault_refcount_leak", "nightly"}
    assert marks["leak-soak[seed=0]"] == {"scenario", "fault_refcount_leak", "soak"}
    assert marks["clean[seed=1]"] == {"scenario"}


def test_marker_expression_selects(suite):
    assert collected(suite, "my_scenarios", "-m", "fault_refcount_leak and not soak") == [
        "leak[seed=0]",
        "leak[seed=1]",
    ]
    assert collected(suite, "my_scenarios", "-m", "soak") == ["leak-soak[seed=0]"]
    assert collected(suite, "my_scenarios", "-m", "scenario and not fault_refcount_leak") == [
        "clean[seed=1]"
    ]


def test_scenario_tags_are_declared_markers_under_strict_markers(suite):
    assert collected(
        suite,
        "my_scenarios",
        "--strict-markers",
        "-W",
        "error::pytest.PytestUnknownMarkWarning",
        "-m",
        "nightly",
    ) == ["leak[seed=0]", "leak[seed=1]"]


@pytest.mark.parametrize(
    "seeds, expected",
    [("2", ["leak[seed=0]", "leak[seed=1]"]), ("3,7", ["leak[seed=3]", "leak[seed=7]"])],
)
def test_kvchaos_seeds(suite, seeds, expected):
    items, _ = suite.inline_genitems("my_scenarios/leak.toml", "--kvchaos-seeds", seeds)
    assert names(items) == expected


def test_runs_pass_and_reports_land_in_the_report_dir(suite):
    report = suite.path / "reports"
    res = suite.runpytest("my_scenarios", "-m", "not soak", "--kvchaos-report-dir", str(report))
    res.assert_outcomes(passed=3)
    dirs = [p for p in report.iterdir() if p.is_dir() and not p.is_symlink()]
    assert len(dirs) == 3 and all((d / "results.json").exists() for d in dirs)
    # the session ends saying where they are
    res.stdout.fnmatch_lines([f"kvchaos: 3 runs in {report}  index: {report / 'index.html'}  *"])
    # the index is built once, at the session's end, and lists every run; latest is the newest
    index = json.loads((report / "index.json").read_text())
    assert sorted(index) == sorted(d.name for d in dirs)
    assert (report / "index.html").is_file() and (report / "latest").resolve() in {
        d.resolve() for d in dirs
    }


def test_by_default_runs_land_in_reports_under_the_rootdir_and_are_not_collected(
    suite, monkeypatch
):
    """Not in pytest's temporary folders (it deletes them): reports/ beside the project's config,
    wherever pytest starts; and a later `pytest` does not collect the run folders' scenario.toml."""
    suite.makeini("[pytest]\n")  # the rootdir: the project
    monkeypatch.chdir(suite.path / "my_scenarios")
    res = suite.runpytest("clean.toml")
    res.assert_outcomes(passed=1)
    report = suite.path / "reports"
    (run,) = [p for p in report.iterdir() if p.is_dir() and not p.is_symlink()]
    assert (run / "results.json").is_file() and (run / "scenario.toml").is_file()
    assert (report / "index.html").is_file() and (report / "latest").resolve() == run.resolve()
    assert not (suite.path / "my_scenarios" / "reports").exists()
    res.stdout.fnmatch_lines([f"kvchaos: 1 run in {report}  index: *  latest: * -> {run.name}"])
    monkeypatch.chdir(suite.path)
    assert collected(suite) == sorted(
        ["clean[seed=1]", "leak-soak[seed=0]", "leak[seed=0]", "leak[seed=1]"]
    )


def test_failing_item_says_verdict_evidence_and_replay_and_junit_has_properties(suite):
    wrong = LEAK_DETECT.replace('checkers = ["block_accounting"]', 'checkers = ["cross_rank"]')
    (suite.path / "my_scenarios" / "wrong.toml").write_text(scenario("wrong", wrong))
    xml = suite.path / "junit.xml"
    res = suite.runpytest(
        "my_scenarios/wrong.toml",
        "my_scenarios/clean.toml",
        f"--junitxml={xml}",
        "--kvchaos-report-dir",
        str(suite.path / "runs"),
    )
    res.assert_outcomes(passed=1, failed=1)
    out = res.stdout.str()
    assert "MISSED: fired but not caught by ['cross_rank']" in out
    assert "evidence: [block_accounting @ step" in out and "leaked" in out
    assert "replay: kvchaos run " in out and "wrong.toml --seed 0 --device cpu" in out
    cases = {c.get("name"): c for c in ET.parse(xml).getroot().iter("testcase")}
    assert set(cases) == {"wrong[seed=0]", "clean[seed=1]"}
    for name, case in cases.items():
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        assert props["scenario"] == name.split("[")[0] and props["seed"] == name[-2]
        assert props["verdict"] == ("MISSED" if name.startswith("wrong") else "PASS")


def test_malformed_scenario_file_is_a_collection_error_naming_the_key(suite):
    (suite.path / "my_scenarios" / "broken.toml").write_text(
        scenario("broken", "[expect]\noutcomes = 'clean'\n")
    )
    res = suite.runpytest("my_scenarios", "--collect-only")
    res.assert_outcomes(errors=1)
    out = res.stdout.str()
    assert "broken.toml: expect.outcomes: unknown key; allowed:" in out and "'outcome'" in out
    assert "Traceback" not in out


def test_scenario_file_with_bad_toml_is_reported_not_skipped(suite):
    # a second [run] table: not TOML at all, in a folder not named "scenarios"
    (suite.path / "my_scenarios" / "typo.toml").write_text(
        scenario("typo", "[run]\nmax_steps = 5\n")
    )
    res = suite.runpytest("my_scenarios", "--collect-only", "-q")
    res.assert_outcomes(
        errors=1
    )  # typo.toml; notes.toml, valid TOML with no [scenario], is simply not a scenario
    assert "typo.toml: not valid TOML" in res.stdout.str() and "notes.toml" not in res.stdout.str()


def test_kvchaos_run_and_engine_fixtures_in_a_user_test(pytester):
    """kvchaos_run keeps its run in the test's tmp_path, or in --kvchaos-report-dir when given."""
    pytester.makepyfile(
        test_mine="""
        from pathlib import Path

        from kvchaos.engine.config import CacheConfig, EngineConfig

        def test_my_scenario(kvchaos_run, tmp_path, pytestconfig):
            r = kvchaos_run({"scenario": {"name": "mine"}, "workload": {"num_requests": 3,
                             "output_len": {"dist": "fixed", "value": 3}}}, seed=2)
            assert r.verdict == "PASS", r.summary
            assert r.seed == 2 and (r.run_dir / "history.jsonl").exists()
            given = pytestconfig.getoption("--kvchaos-report-dir")
            assert r.run_dir.parent == (Path(given) if given else tmp_path)

        def test_my_engine(kvchaos_engine):
            eng = kvchaos_engine(EngineConfig(cache=CacheConfig(block_size=4, num_blocks=16)))
            eng.add_request("a", [1, 2, 3], 2)
            while eng.has_unfinished():
                eng.step()
            assert eng.seqs["a"].num_generated == 2 and eng.bm.num_free_blocks == 16
    """
    )
    pytester.runpytest().assert_outcomes(passed=2)
    assert not (pytester.path / "reports").exists()  # a unit test's run: not in the project
    kept = pytester.path / "kept"
    pytester.runpytest("--kvchaos-report-dir", str(kept)).assert_outcomes(passed=2)
    runs = [p for p in kept.iterdir() if p.is_dir() and not p.is_symlink()]
    assert [p.name.endswith("-mine-s2") for p in runs] == [True]


def test_block_manager_option_reaches_the_run_and_the_fixtures(suite):
    suite.makepyfile(leaky_bm=LEAKY_BM)
    suite.syspathinsert()
    suite.makepyfile(
        test_bm="""
        from kvchaos.engine.config import EngineConfig

        def test_engine_uses_it(kvchaos_engine):
            assert type(kvchaos_engine(EngineConfig()).bm.manager).__name__ == "Leaky"
    """
    )
    report = suite.path / "reports"
    res = suite.runpytest(
        "my_scenarios/clean.toml",
        "test_bm.py",
        "--kvchaos-block-manager",
        "leaky_bm:Leaky",
        "--kvchaos-report-dir",
        str(report),
        "-m",
        "not conformance",  # its conformance items: tests/test_conformance.py
    )
    res.assert_outcomes(
        passed=1, failed=1
    )  # the scenario that passes on the reference block manager fails
    out = res.stdout.str()
    assert "FAIL: bug found: block_accounting" in out
    assert (
        "--block-manager leaky_bm:Leaky" in out
    )  # the replay line runs it under the same block manager
    (run,) = [p for p in report.iterdir() if p.is_dir() and not p.is_symlink()]
    start = next(
        json.loads(x)
        for x in (run / "history.jsonl").read_text().splitlines()
        if '"run_start"' in x
    )
    assert start["block_manager"] == "leaky_bm:Leaky"
    suite.runpytest("my_scenarios/clean.toml", "--kvchaos-report-dir", str(report)).assert_outcomes(
        passed=1
    )


def test_an_index_that_cannot_be_written_fails_no_test(suite):
    report = suite.path / "reports"
    (report / "index.html").mkdir(parents=True)  # in the way of the listing
    res = suite.runpytest("my_scenarios/clean.toml", "--kvchaos-report-dir", str(report))
    res.assert_outcomes(passed=1)
    assert res.ret == 0
    res.stdout.fnmatch_lines(["*kvchaos: could not update*index.html*"])


@pytest.mark.parametrize(
    "flag, value, said",
    [
        ("--kvchaos-seeds", "1,,2", "entry 2 is empty"),
        ("--kvchaos-seeds", "0", "the count must be >= 1"),
        ("--kvchaos-device", "tpu", "expected auto, cpu, cuda or cuda:N"),
        ("--kvchaos-timeout", "0", "seconds > 0"),
        ("--kvchaos-timeout", "nan", "seconds > 0"),
    ],
)
def test_a_bad_kvchaos_flag_is_one_usage_error(pytester, flag, value, said):
    pytester.makepyfile(test_mine="def test_mine():\n    pass\n")
    res = pytester.runpytest_subprocess(f"{flag}={value}")
    assert res.ret == pytest.ExitCode.USAGE_ERROR
    lines = [ln for ln in res.stderr.str().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"ERROR: {flag}: ") and said in lines[0], lines
