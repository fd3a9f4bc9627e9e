"""`kvchaos clean`: run folders older than an age go, with what each freed; everything else in
the report folder stays; the index and latest describe the runs left; bad input is one line."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from kvchaos.harness.cli import main
from kvchaos.harness.report.index import update_index
from kvchaos.harness.tools.clean import parse_age

DAY = 86400.0


def _run(d: Path, name: str, age_s: float, files=("results.json", "history.jsonl")) -> Path:
    run = d / name
    run.mkdir(parents=True)
    then = time.time() - age_s
    for f in files:
        body = {"scenario": name, "seed": 0, "verdict": "PASS", "pad": "x" * 5000}
        (run / f).write_text(json.dumps(body if f == "results.json" else {"e": "pad"}) + "\n")
        os.utime(run / f, (then, then))
    return run


@pytest.fixture
def reports(tmp_path):
    d = tmp_path / "reports"
    _run(d, "old-a", 10 * DAY)
    _run(d, "old-torn", 9 * DAY, files=("history.jsonl",))  # a run that died: still a run
    _run(d, "recent", 3 * DAY)
    _run(d, "newest", 3600)
    soak = d / "soak-20250101-000000"  # not a run folder: its runs are below it
    (soak / "runs").mkdir(parents=True)
    (d / "ledger.sqlite").write_text("mine")
    for p in (soak, d / "ledger.sqlite"):
        os.utime(p, (time.time() - 30 * DAY,) * 2)
    update_index(d)
    return d


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def names(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def test_old_run_folders_go_and_the_rest_stays(reports, capsys):
    before = names(reports)
    assert (reports / "latest").resolve().name == "newest"
    rc, out, err = cli(capsys, "clean", "--report-dir", reports, "--older-than", "7d")
    assert rc == 0 and err == ""
    assert names(reports) == before - {"old-a", "old-torn"}  # soak folder, ledger, index stay
    lines = out.strip().splitlines()
    assert [ln.split()[1] for ln in lines[:2]] == [
        str(reports / "old-a"),
        str(reports / "old-torn"),
    ]
    assert lines[0].endswith("last written 10.0d ago)") and "9.0d ago" in lines[1]
    assert all(re.match(r"removed \S+ \(\d+(\.\d+)? KB, ", ln) for ln in lines[:2])
    assert "removed 2 run folders older than 7d" in lines[-1] and "freed; 2 kept" in lines[-1]
    assert re.search(r"\d+(\.\d+)? KB freed", lines[-1])
    index = (reports / "index.html").read_text()
    assert 'data-scenario="old-a"' not in index and 'data-scenario="newest"' in index
    assert set(json.loads((reports / "index.json").read_text())) == {"recent", "newest"}
    assert (reports / "latest").resolve().name == "newest"  # its run was kept: unchanged


def test_dry_run_lists_and_removes_nothing(reports, capsys):
    before = names(reports)
    rc, out, _ = cli(capsys, "clean", "--report-dir", reports, "--older-than", "2d", "--dry-run")
    assert rc == 0 and names(reports) == before
    listed = [ln for ln in out.splitlines() if ln.startswith("would remove ")]
    assert len(listed) == 3 and "would remove 3 run folders" in out
    assert "to free; 1 kept" in out


def test_latest_follows_the_runs_left(reports, capsys):
    os.symlink("old-a", reports / "latest.tmp")
    os.replace(reports / "latest.tmp", reports / "latest")  # pointed at a run that goes
    assert cli(capsys, "clean", "--report-dir", reports, "--older-than", "1d")[0] == 0
    assert (reports / "latest").resolve().name == "newest"
    assert cli(capsys, "clean", "--report-dir", reports, "--older-than", "1s")[0] == 0
    assert not (reports / "latest").is_symlink() and not (reports / "latest").exists()
    assert json.loads((reports / "index.json").read_text()) == {}
    assert "soak-20250101-000000" in names(reports)


@pytest.mark.parametrize("age", ["7x", "7", "", "d", "-3d", "7d junk"])
def test_a_bad_age_is_one_line_and_exit_2(reports, capsys, age):
    before = names(reports)
    rc, out, err = cli(capsys, "clean", "--report-dir", reports, f"--older-than={age}")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--older-than" in err and "7d, 12h" in err
    assert names(reports) == before


def test_a_missing_report_folder_is_one_line_and_exit_2(tmp_path, capsys):
    rc, _, err = cli(capsys, "clean", "--report-dir", tmp_path / "nope", "--older-than", "7d")
    assert rc == 2 and "no such folder" in err and len(err.strip().splitlines()) == 1


def test_ages_and_help(capsys):
    assert parse_age("7d") == 7 * DAY and parse_age("1d12h") == 1.5 * DAY
    assert parse_age("90s") == 90 and parse_age("2w") == 14 * DAY
    with pytest.raises(SystemExit):
        main(["clean", "--help"])
    out = capsys.readouterr().out
    for words in ("results.json or history.jsonl", "--dry-run", "--older-than AGE", "latest"):
        assert words in out, words
