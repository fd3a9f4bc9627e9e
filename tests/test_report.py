"""Incident reports, report.html, the index and `kvchaos analyze`, on real runs of the built-in
detect scenarios (one seed each) and a clean run."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from kvchaos.faults import REGISTRY
from kvchaos.harness.cli import main as cli_main
from kvchaos.harness.judge.history import read_history
from kvchaos.harness.judge.runner import run_scenario
from kvchaos.harness.judge.scenario import load_scenario, parse_scenario
from kvchaos.harness.report import index as report_index
from kvchaos.harness.report import render
from kvchaos.harness.report.render import publish

SECTIONS = [
    "Verdict",
    "Summary",
    "Impact",
    "Trigger",
    "Detection",
    "Root cause",
    "Remediation",
    "Timeline",
    "Reproduction",
    "Minimal reproducer",
    "What held",
]
DETECT = {
    "table-overflow-detect": "table_overflow",
    "refcount-leak-detect": "refcount_leak",
    "staging-stall-detect": "staging_stall",
    "ordering-race-detect": "ordering_race",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("reports")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(render.PLOTS_ENV, raising=False)
        out = {
            name: publish(run_scenario(load_scenario(name), 0, device="cpu", report_dir=d))
            for name in [*DETECT, "baseline-clean"]
        }
    for name, r in out.items():
        assert r.verdict == "PASS", f"{name}: {r.summary}"
        assert "report_error" not in r.results, r.results.get("report_error")
    return d, out


def _incident(runs, name):
    r = runs[1][name]
    assert len(r.results["incidents"]) == 1, [i["title"] for i in r.results["incidents"]]
    inc = r.results["incidents"][0]
    md = (r.run_dir / inc["file"]).read_text()
    return r, inc, md, read_history(r.run_dir / "history.jsonl")


def _sections(md: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", md, flags=re.M)
    return {parts[i].strip(): parts[i + 1].strip() for i in range(1, len(parts), 2)}


@pytest.mark.parametrize("name", list(DETECT))
def test_every_section_is_there_and_filled_from_the_run(runs, name):
    r, inc, md, events = _incident(runs, name)
    fault = DETECT[name]
    start = next(e for e in events if e["e"] == "run_start")
    verify = next(e for e in events if e["e"] == "run_end")["fault_verify"][fault]
    assert md.startswith(f"# {inc['title']}") and inc["severity"] in md.splitlines()[2]
    sec = _sections(md)
    assert list(sec) == SECTIONS
    assert all(sec.values()), [k for k, v in sec.items() if not v]
    assert inc["kind"] == "detection" and inc["fingerprint"]["failure_mode"] == fault
    assert "PASS" in sec["Verdict"] and r.results["summary"] in sec["Verdict"]
    assert f"fired first at step {verify['first_step']}" in sec["Summary"]
    # trigger: the fault's own parameters, as armed in this run
    armed = next(e for e in events if e["e"] == "fault" and e["kind"] == "armed")["detail"]
    assert inc["trigger"]["params"] == armed["params"]
    assert all(f"{k}=" in sec["Trigger"] for k in armed["params"])
    # detection: the first expected finding at or after the first firing, and its time to detect
    det = inc["detection"]
    assert det["fault_first_step"] == verify["first_step"]
    assert det["time_to_detect_steps"] == r.results["time_to_detect_steps"][fault]
    assert det["first_step"] == verify["first_step"] + det["time_to_detect_steps"]
    assert det["evidence"] and det["time_to_detect_ms"] > 0
    # root cause and remediation: the planted defect's own knowledge, known (reference block
    # manager)
    assert inc["root_cause"] == {
        "status": "known",
        "text": REGISTRY[fault].root_cause,
        "source": f"the planted {fault} defect",
    }
    assert (
        REGISTRY[fault].root_cause in sec["Root cause"]
        and REGISTRY[fault].remediation in sec["Remediation"]
    )
    # timeline: from the history, the first firing marked as a fault event
    assert any(
        t["mark"] == "fault" and t["step"] == verify["first_step"] and "fired" in t["event"]
        for t in inc["timeline"]
    )
    assert f"| {verify['first_step']} |" in sec["Timeline"]
    # reproduction: the exact command, seed, commit and config hash of this run
    rep = inc["reproduction"]
    assert (rep["command"], rep["seed"], rep["commit"], rep["config_hash"]) == (
        r.results["replay"],
        0,
        start["commit"],
        start["config_hash"],
    )
    assert rep["command"] in sec["Reproduction"] and start["config_hash"] in sec["Reproduction"]
    assert sec["Minimal reproducer"] == f"not shrunk yet: run `kvchaos shrink {r.run_dir}`"
    held = [c["checker"] for c in r.results["checkers"] if c["valid"] is True]
    assert [c["checker"] for c in inc["what_held"]] == held and all(
        f"- {c} (" in sec["What held"] for c in held
    )
    # the same content, structured, in results.json on disk
    assert json.loads((r.run_dir / "results.json").read_text())["incidents"] == json.loads(
        json.dumps(r.results["incidents"])
    )


def test_table_overflow_names_the_victim_row_and_the_intruders(runs):
    r, inc, md, events = _incident(runs, "table-overflow-detect")
    rows = [e for e in inc["detection"]["evidence"] if e["type"] == "table_rows"]
    assert rows
    ev = rows[0]
    snaps = {e["step"]: e for e in events if e["e"] == "snapshot"}
    after, before = snaps[ev["step"]], snaps[ev["before_step"]]
    w = after["table_width"]
    assert ev["before_step"] < ev["step"]
    assert after["table"][ev["row"] * w : (ev["row"] + 1) * w] == ev["after"]
    assert before["table"][ev["row"] * w : (ev["row"] + 1) * w] == ev["before"]
    assert ev["intruders"] and all(b in ev["after"] for b in ev["intruders"])
    # the intruders are the overflowing request's blocks past its row's width, and its row is
    # the one above
    over = next(e for e in inc["detection"]["evidence"] if e["type"] == "overlong")
    assert over["victim_row"] == ev["row"] == over["row"] + 1
    assert set(ev["intruders"]) <= set(after["seq_blocks"][over["req"]][w:])
    assert f"victim row {ev['row']}" in md and str(ev["intruders"]) in md
    assert inc["impact"]["manifest"] in ("latent", "manifest")


def test_refcount_leak_lists_the_blocks_the_fault_leaked(runs):
    r, inc, md, events = _incident(runs, "refcount-leak-detect")
    leaks = next(e for e in events if e["e"] == "run_end")["fault_verify"]["refcount_leak"]["leaks"]
    verified = sorted({b for x in leaks for b in x["blocks"]})
    bl = inc["impact"]["blocks_leaked"]
    assert (
        bl["blocks"] == verified
        and bl["count"] == len(verified) > 0
        and bl["matches_fault_verify"] is True
    )
    assert bl["requests"] == sorted({x["req"] for x in leaks})
    assert str(verified) in md and "matches what the checker found" in md
    cancels = {e["req"]: e for e in events if e["e"] == "cancel"}
    shown = [e for e in inc["detection"]["evidence"] if e["type"] == "leak"]
    assert {e["req"] for e in shown} == {x["req"] for x in leaks}
    for e in shown:  # each leak names the cancel that leaked it, as recorded
        c = cancels[e["req"]]
        assert (e["cancel"]["step"], e["cancel"]["blocks"]) == (c["step"], c["blocks"]) and e[
            "in_fault_verify"
        ]
        assert f"cancel at step {c['step']} in phase {c['phase']}" in md


def test_staging_stall_gives_the_latency_ratio_and_says_outputs_stayed_correct(runs):
    r, inc, md, events = _incident(runs, "staging-stall-detect")
    lat = inc["impact"]["latency"]
    assert lat["ratio"] > 1 and lat["after_ms"] > lat["baseline_ms"]
    assert (
        lat["from_step"]
        == next(e for e in events if e["e"] == "fault" and e["kind"] == "fired")["step"]
    )
    win = next(e for e in inc["detection"]["evidence"] if e["type"] == "latency_window")
    steps = {e["step"]: e for e in events if e["e"] == "step"}
    assert win["window"] and all(
        abs(w["ms"] - steps[w["step"]][win["signal"]] * 1e3) < 1e-2 for w in win["window"]
    )
    assert inc["impact"]["tokens_diverged"] == 0 and inc["impact"]["manifest"] == "none"
    assert "outputs stayed correct" in md and f"x{lat['ratio']:.2f}" in md
    assert inc["severity"] == "SEV3"


def test_ordering_race_names_the_stale_rank_and_the_diverged_tokens(runs):
    r, inc, md, events = _incident(runs, "ordering-race-detect")
    lag = next(e for e in events if e["e"] == "fault" and e["kind"] == "armed")["detail"]["params"][
        "lag_rank"
    ]
    stale = {r for e in events if e["e"] == "step" for r in e["stale_ranks"]}
    assert inc["detection"]["stale_ranks"] == [lag] and stale == {lag}
    assert f"rank {lag} computed on the scheduler's table of step" in md
    diverged = [e for e in events if e["e"] == "oracle" and e["first_divergence"] is not None]
    assert (
        inc["impact"]["tokens_diverged"]
        == sum(e["checked"] - e["first_divergence"] for e in diverged)
        > 0
    )
    assert inc["impact"]["manifest"] == "manifest" and inc["severity"] == "SEV1"


def test_clean_run_writes_no_incident_and_the_index_lists_every_run(runs):
    d, out = runs
    r = out["baseline-clean"]
    assert r.results["incidents"] == [] and not list(r.run_dir.glob("incident-*.md"))
    html = (r.run_dir / "report.html").read_text()
    assert "None: nothing to write up" in html and "data:image/png;base64," not in html
    for name in DETECT:  # by default only runs that did not pass get the figure; analyze draws it
        assert "data:image/png;base64," not in (out[name].run_dir / "report.html").read_text()
    index = (d / "index.html").read_text()
    order = [index.index(f"{x.run_dir.name}/report.html") for x in out.values()]
    assert order == sorted(order, reverse=True)  # newest first: the clean run was the last one
    assert (d / "latest").is_symlink() and (d / "latest").resolve() == r.run_dir.resolve()


def test_analyze_reproduces_the_stored_verdict_and_findings(runs, tmp_path, capsys):
    for name, r in runs[1].items():
        copy = tmp_path / r.run_dir.name
        shutil.copytree(r.run_dir, copy)
        (copy / "results.json").unlink()  # rebuilt from the history alone
        assert cli_main(["analyze", str(copy)]) == 0
        again = json.loads((copy / "results.json").read_text())
        stored = json.loads((r.run_dir / "results.json").read_text())
        for k in (
            "verdict",
            "summary",
            "checkers",
            "time_to_detect_steps",
            "fault_verify",
            "history_digest",
        ):
            assert again[k] == stored[k], (name, k)
        assert [i["title"] for i in again["incidents"]] == [i["title"] for i in stored["incidents"]]
        assert sorted(p.name for p in copy.glob("incident-*.md")) == [
            i["file"] for i in stored["incidents"]
        ]
        assert f"{copy}: PASS" in capsys.readouterr().out
        assert '<img class="plot" alt=' in (copy / "report.html").read_text()


def test_analyze_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert cli_main(["analyze", str(tmp_path)]) == 2
    assert "not a run folder (no history.jsonl in it" in capsys.readouterr().err


def test_minimal_reproducer_section_points_at_the_shrunk_files(runs, tmp_path):
    r = runs[1]["table-overflow-detect"]
    copy = tmp_path / "run"
    shutil.copytree(r.run_dir, copy)
    results = json.loads((copy / "results.json").read_text())
    results["minimal_reproducer"] = {
        "scenario_path": "min/overflow.toml",
        "test_path": "min/test_overflow.py",
    }
    render.write_reports(copy, results, plots=False)
    md = _sections((copy / "incident-001.md").read_text())["Minimal reproducer"]
    assert "`min/overflow.toml`" in md and "`min/test_overflow.py`" in md and "not shrunk" not in md


def test_fail_root_cause_is_suspected(runs, tmp_path):
    r = runs[1]["baseline-clean"]
    copy = tmp_path / "run"
    shutil.copytree(r.run_dir, copy)
    results = json.loads((copy / "results.json").read_text())
    lat = next(c for c in results["checkers"] if c["checker"] == "latency")
    lat.update(
        valid=False,
        findings=[
            {
                "checker": "latency",
                "step": 30,
                "message": "climbed",
                "manifest": None,
                "kind": "latency_climb",
                "evidence": {"signal": "host_s", "window": [29, 30]},
            }
        ],
    )
    results.update(verdict="FAIL", summary="latency fired with nothing planted")
    render.write_reports(copy, results, plots=False)
    (inc,) = results["incidents"]
    assert inc["kind"] == "bug" and inc["root_cause"]["status"] == "suspected"
    assert (
        REGISTRY["staging_stall"].root_cause in inc["root_cause"]["text"]
    )  # latency is what catches a stall
    assert "latency" not in [c["checker"] for c in inc["what_held"]]
    assert _sections((copy / "incident-001.md").read_text())["Root cause"].startswith(
        "**suspected**"
    )


def test_missed_detection_is_a_sev1_incident_with_a_figure(tmp_path, monkeypatch):
    monkeypatch.delenv(render.PLOTS_ENV, raising=False)
    sc = load_scenario("staging-stall-detect")
    sc.expect.within_steps = 0  # the stall takes several steps to show: demand it at once
    r = publish(run_scenario(sc, 0, device="cpu", report_dir=tmp_path))
    assert r.verdict == "MISSED", r.summary
    (inc,) = r.results["incidents"]
    assert inc["kind"] == "missed" and inc["severity"] == "SEV1"
    assert inc["detection"]["status"].startswith(
        "not caught: ['latency'] had to fire within 0 steps"
    )
    assert (
        inc["root_cause"]["status"] == "known"
        and "The harness then failed" in inc["root_cause"]["text"]
    )
    assert (
        "data:image/png;base64," in (r.run_dir / "report.html").read_text()
    )  # not a PASS: drawn by default


def test_error_run_becomes_an_incident(tmp_path, monkeypatch):
    monkeypatch.delenv(render.PLOTS_ENV, raising=False)
    sc = parse_scenario(
        {
            "scenario": {"name": "broken"},
            "faults": [{"name": "ordering_race", "defect": True}],
            "expect": {"outcome": "detect", "checkers": ["cross_rank"]},
        }
    )
    r = publish(run_scenario(sc, 0, device="cpu", report_dir=tmp_path))
    assert r.verdict == "ERROR"
    (inc,) = r.results["incidents"]
    assert inc["kind"] == "error" and "needs engine.tp_size >= 2" in inc["title"]
    assert inc["root_cause"]["status"] == "suspected" and "ValueError" in inc["root_cause"]["text"]
    assert (r.run_dir / "incident-001.md").is_file()
    assert (
        "data:image/png" not in (r.run_dir / "report.html").read_text()
    )  # broke before its first step


def test_a_bad_plots_setting_is_one_clear_error(runs, tmp_path, monkeypatch):
    monkeypatch.setenv(render.PLOTS_ENV, "sometimes")
    r = runs[1]["baseline-clean"]
    with pytest.raises(
        ValueError,
        match="KVCHAOS_PLOTS='sometimes': expected one of failures, incidents, all, none",
    ):
        render.write_reports(r.run_dir, json.loads((r.run_dir / "results.json").read_text()))


def test_a_failing_report_never_costs_the_run_its_results(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(render, "write_reports", boom)
    sc = parse_scenario({"scenario": {"name": "tiny"}, "workload": {"num_requests": 2}})
    r = publish(run_scenario(sc, 0, device="cpu", report_dir=tmp_path))
    stored = json.loads((r.run_dir / "results.json").read_text())
    assert (
        stored["report_error"] == "RuntimeError: disk on fire"
        and stored["verdict"] == r.verdict == "PASS"
    )
    assert read_history(r.run_dir / "history.jsonl")[-1]["e"] == "run_end"


def test_latest_falls_back_to_a_text_file_without_symlinks(runs, tmp_path, monkeypatch):
    d, out = runs
    for r in out.values():
        shutil.copytree(r.run_dir, tmp_path / r.run_dir.name)

    def no_symlinks(*a, **k):
        raise OSError("operation not permitted")

    monkeypatch.setattr(report_index.os, "symlink", no_symlinks)
    report_index.update_index(tmp_path)
    assert (tmp_path / "LATEST").read_text().strip() == out["baseline-clean"].run_dir.name
    assert not (tmp_path / "latest").exists() and not list(tmp_path.glob(".latest*"))
    index = (tmp_path / "index.html").read_text()
    assert all(f'href="{r.run_dir.name}/report.html"' in index for r in out.values())
