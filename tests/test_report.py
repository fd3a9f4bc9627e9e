"""Incident reports, report.html, the index and `kvchaos analyze`, on real runs of the built-in
detect scenarios (one seed each) and a clean run."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
from pathlib import Path

import markupsafe
import pytest

from kvchaos.engine.block_manager import BlockManager
from kvchaos.faults import REGISTRY
from kvchaos.harness.cli import main as cli_main
from kvchaos.harness.history.log import read_history
from kvchaos.harness.report import index as report_index
from kvchaos.harness.report import render
from kvchaos.harness.report.paths import rel, rel_command
from kvchaos.harness.report.render import publish
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario, parse_scenario

SECTIONS = (
    "Verdict, Summary, Impact, Trigger, Detection, Root cause, Remediation, Timeline, "
    "Reproduction, Minimal reproducer, What held"
).split(", ")
DETECT = {
    "table-overflow-detect": "table_overflow",
    "refcount-leak-detect": "refcount_leak",
    "ordering-race-detect": "ordering_race",
}
STALL = "staging-stall-detect"  # caught by latency: whether it is, is measured time (timing)
FAULTS = {**DETECT, STALL: "staging_stall"}


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


@pytest.fixture(scope="module")
def stall(tmp_path_factory):
    d = tmp_path_factory.mktemp("stall")  # its own folder: the others' index and latest stand
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(render.PLOTS_ENV, raising=False)
        r = publish(run_scenario(load_scenario(STALL), 0, device="cpu", report_dir=d))
    assert r.verdict == "PASS", r.summary
    return d, {STALL: r}


def _incident(runs, name):
    r = runs[1][name]
    assert len(r.results["incidents"]) == 1, [i["title"] for i in r.results["incidents"]]
    inc = r.results["incidents"][0]
    md = (r.run_dir / inc["file"]).read_text()
    return r, inc, md, read_history(r.run_dir / "history.jsonl")


def _sections(md: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", md, flags=re.M)
    return {parts[i].strip(): parts[i + 1].strip() for i in range(1, len(parts), 2)}


@pytest.mark.parametrize("name", [*DETECT, pytest.param(STALL, marks=pytest.mark.timing)])
def test_every_section_is_there_and_filled_from_the_run(request, name):
    r, inc, md, events = _incident(
        request.getfixturevalue("stall" if name == STALL else "runs"), name
    )
    fault = FAULTS[name]
    start = next(e for e in events if e["e"] == "run_start")
    verify = next(e for e in events if e["e"] == "run_end")["fault_verify"][fault]
    assert md.startswith(f"# {inc['title']}") and inc["severity"] in md.splitlines()[2]
    sec = _sections(md)
    assert list(sec) == SECTIONS
    assert all(sec.values()), [k for k, v in sec.items() if not v]
    label = next(e for e in events if e["e"] == "fault" and e["kind"] == "armed")["detail"]["label"]
    assert label.split("/")[0] == fault  # a fault with variants: named mode/variant
    assert inc["kind"] == "detection" and inc["fingerprint"]["failure_mode"] == label
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
        rel_command(r.results["replay"]),
        0,
        start["commit"],
        start["config_hash"],
    )
    assert rep["command"] in sec["Reproduction"] and start["config_hash"] in sec["Reproduction"]
    assert sec["Minimal reproducer"] == f"not shrunk yet: run `kvchaos shrink {rel(r.run_dir)}`"
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


@pytest.mark.timing
def test_staging_stall_gives_the_latency_ratio_and_says_outputs_stayed_correct(stall):
    r, inc, md, events = _incident(stall, STALL)
    lat = inc["impact"]["latency"]
    assert lat["ratio"] > 1 and lat["after_ms"] > lat["baseline_ms"]
    assert (
        lat["from_step"]
        == next(e for e in events if e["e"] == "fault" and e["kind"] == "fired")["step"]
    )
    kinds = ("latency_window", "staging_window")  # the trend, or the copy beside its probe
    win = next(e for e in inc["detection"]["evidence"] if e["type"] in kinds)
    steps = {e["step"]: e for e in events if e["e"] == "step"}
    assert win["window"] and all(
        abs(w["ms"] - steps[w["step"]][win["signal"]] * 1e3) < 1e-2 for w in win["window"]
    )
    assert inc["impact"]["tokens_diverged"] == 0 and inc["impact"]["manifest"] == "none"
    assert "outputs stayed correct" in md and f"x{lat['ratio']:.2f}" in md
    assert inc["severity"] == "CAUGHT"  # planted and caught as designed: no SEV


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
    assert inc["impact"]["manifest"] == "manifest" and inc["severity"] == "CAUGHT"


def test_clean_run_writes_no_incident_and_the_index_lists_every_run(runs):
    d, out = runs
    r = out["baseline-clean"]
    assert r.results["incidents"] == [] and not list(r.run_dir.glob("incident-*.md"))
    html = (r.run_dir / "report.html").read_text()
    assert "None: nothing to write up" in html and "data:image/png;base64," not in html
    for name in DETECT:  # every run with a finding gets its figure by default, caught ones too
        assert '<img class="plot"' in (out[name].run_dir / "report.html").read_text(), name
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
        for (
            k
        ) in "verdict summary checkers time_to_detect_steps fault_verify history_digest".split():
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
    # the traceback itself, from the history's error event, in the incident and report.html
    tb = next(e for e in read_history(r.run_dir / "history.jsonl") if e["e"] == "error")
    assert inc["error"]["traceback"] == tb["traceback"].rstrip() and "ValueError" in tb["traceback"]
    md = (r.run_dir / "incident-001.md").read_text()
    html = (r.run_dir / "report.html").read_text()
    last = tb["traceback"].strip().splitlines()[-1]
    for text in (md, html):
        assert "Traceback (most recent call last)" in text and "see history.jsonl" not in text
        assert last.replace(">", "&gt;") in text or last in text
    assert "data:image/png" not in html  # broke before its first step


def test_a_bad_plots_setting_is_one_clear_error(runs, tmp_path, monkeypatch):
    monkeypatch.setenv(render.PLOTS_ENV, "sometimes")
    r = runs[1]["baseline-clean"]
    with pytest.raises(
        ValueError,
        match="KVCHAOS_PLOTS='sometimes': expected one of findings, failures, incidents, all, none",
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


class LeakyBM(BlockManager):
    """A user's block manager that leaks: release() frees nothing while a block is shared."""

    def release(self, seq_id, reason):
        blocks = self.blocks.get(seq_id)
        if blocks and any(self.pool.ref[b] > 1 for b in blocks):
            return True
        return super().release(seq_id, reason)


@pytest.fixture(scope="module")
def leaky(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(render.PLOTS_ENV, raising=False)
        sc = load_scenario("refcount-leak-clean")  # trigger only: nothing of the fault's leaks
        d = tmp_path_factory.mktemp("leaky")
        r = publish(run_scenario(sc, 0, device="cpu", report_dir=d, block_manager=LeakyBM))
    assert r.verdict == "FAIL", r.summary
    return r


def test_a_leaky_block_manager_gets_one_story_in_every_section(leaky):
    (inc,) = leaky.results["incidents"]
    md = (leaky.run_dir / inc["file"]).read_text()
    sec = _sections(md)
    # the evidence: the blocks each leak finding names, and the pool's count at the end
    ev = [e for e in inc["detection"]["evidence"] if e["type"] == "leak"]
    blocks = sorted({b for e in ev for b in e["blocks"]})
    acct = next(c for c in leaky.results["checkers"] if c["checker"] == "block_accounting")
    end = next(f["evidence"] for f in acct["findings"] if f["kind"] == "end_leak")
    assert len(blocks) == end["total"] - end["free"] > 0
    bl = inc["impact"]["blocks_leaked"]
    assert bl["count"] == len(blocks) and bl["blocks"] == blocks
    assert bl["matches_fault_verify"] is None and bl["trigger_only_fault"] == "refcount_leak"
    # a bug found in the system under test, titled so; every section says the same numbers
    assert inc["kind"] == "bug" and inc["title"].startswith("bug found: block_accounting")
    assert f"{len(blocks)} blocks leaked in {__name__}:LeakyBM" in inc["title"]
    assert "false alarm" not in md.lower()
    affected = {a["req"] for a in inc["impact"]["requests_affected"]}
    assert affected == {e["req"] for e in ev}
    assert f"requests affected: {len(affected)} (0 with a wrong output); " in sec["Summary"]
    assert f"blocks leaked: {len(blocks)};" in sec["Summary"] and "verify" not in sec["Summary"]
    assert f"Blocks leaked: {len(blocks)} (never returned to the pool by the end" in sec["Impact"]
    assert f"{len(blocks)} of them named: {blocks}, held by" in sec["Impact"]
    assert "matches" not in sec["Impact"] and "planted no defect" in sec["Impact"]
    # nothing fired, so no firing step and no time to detect is claimed
    assert "the fault first fired" not in sec["Detection"] and "no planted defect fired" in md
    for e in ev:  # a request that finished (not cancelled) is not said to be cancelled
        assert ("cancel at step" in e["text"]) == bool(e["cancel"])
        assert e["cancel"] or f"finished at step {e['finished_step']}" in e["text"]
    # report.html tells the same story, with its figure drawn by default
    html = (leaky.run_dir / "report.html").read_text()
    shown = str(markupsafe.escape(inc["summary"]))  # as the template escapes it
    assert inc["title"] in html and shown in html and '<img class="plot"' in html
    assert f"{len(blocks)} of them named: {blocks}, held by" in html
    assert "does NOT match" not in html


def test_a_recorded_false_alarm_renders_as_a_bug_found(leaky, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(leaky.run_dir, copy)
    results = json.loads((copy / "results.json").read_text())
    results["verdict"] = "FALSE_ALARM"  # what older releases recorded
    render.write_reports(copy, results, plots=False)
    (inc,) = results["incidents"]
    assert results["verdict"] == inc["verdict"]["run"] == "FAIL"
    assert (
        inc["title"].startswith("bug found")
        and "FALSE_ALARM" not in (copy / "report.html").read_text()
    )


def test_shrink_keeps_the_figure_analyze_drew(runs, tmp_path, monkeypatch):
    from kvchaos.harness.tools.shrink import _update_results

    monkeypatch.setenv(render.PLOTS_ENV, "none")  # whatever the environment says
    r = runs[1]["table-overflow-detect"]
    copy = tmp_path / "run"
    shutil.copytree(r.run_dir, copy)
    results = json.loads((copy / "results.json").read_text())
    minimal = {"scenario_path": str(copy / "min.toml"), "test_path": str(copy / "test_min.py")}
    _update_results(copy, results, minimal)
    html = (copy / "report.html").read_text()
    assert '<img class="plot"' in html and "min.toml" in html


def test_reproduction_lines_are_relative_to_the_project(runs, tmp_path, monkeypatch):
    r = runs[1]["refcount-leak-detect"]
    proj = tmp_path / "proj"
    copy = proj / "reports" / r.run_dir.name
    shutil.copytree(r.run_dir, copy)
    monkeypatch.chdir(proj)
    results = json.loads((copy / "results.json").read_text())
    results["replay"] = f"kvchaos run {proj}/scenarios/x.toml --report-dir={proj}/reports --seed 0"
    render.write_reports(copy, results, plots=False)
    sec = _sections((copy / "incident-001.md").read_text())
    assert "kvchaos run scenarios/x.toml --report-dir=reports --seed 0" in sec["Reproduction"]
    assert f"kvchaos analyze reports/{copy.name}" in sec["Reproduction"]
    assert f"kvchaos shrink reports/{copy.name}" in sec["Minimal reproducer"]
    assert str(proj) not in sec["Reproduction"] + (copy / "report.html").read_text()
    assert rel("/elsewhere/x.toml") == "/elsewhere/x.toml"  # outside the project: as recorded
    assert rel_command("kvchaos run '/a b/x.toml'", cwd=Path("/a b")) == "kvchaos run x.toml"


def _fake_run(d, name, started, end, **extra):
    run = d / name
    run.mkdir()
    results = {"scenario": name, "seed": 0, "verdict": "PASS", "started": started, **extra}
    (run / "results.json").write_text(json.dumps(results))
    (run / "history.jsonl").write_text("")
    os.utime(run / "history.jsonl", (end, end))


def test_index_groups_batches_and_has_filters_and_columns(runs, tmp_path):
    t0 = datetime.datetime(2026, 1, 2, 3, 4, 5).timestamp()
    iso = lambda t: datetime.datetime.fromtimestamp(t).isoformat(timespec="seconds")  # noqa: E731
    for i, t in enumerate((0, 20, 40, 5000, 5010)):  # two batches by time, no batch id
        _fake_run(tmp_path, f"t{i}", iso(t0 + t), t0 + t + 5)
    for i in range(2):  # one recorded batch id, in between
        _fake_run(tmp_path, f"b{i}", iso(t0 + 100 + i), t0 + 100 + i, batch="session-7")
    leak = runs[1]["refcount-leak-detect"]
    shutil.copytree(leak.run_dir, tmp_path / leak.run_dir.name)
    report_index.update_index(tmp_path)
    html = (tmp_path / "index.html").read_text()
    groups = [g.split("</tbody>")[0] for g in html.split('<tbody class="batch"')[1:]]
    names = [set(re.findall(r'data-scenario="([^"]+)"', g)) for g in groups]
    assert {"t3", "t4"} in names and {"t0", "t1", "t2"} in names and {"b0", "b1"} in names
    assert "batch session-7" in html and len(groups) == 4
    # filters: inline script, no external assets; the columns a reader sorts runs by
    for sel in ("f-verdict", "f-scenario", "f-fault"):
        assert f'<select id="{sel}">' in html
    assert "<script>" in html and "<script src" not in html and "http" not in html
    assert "<option>refcount_leak</option>" in html
    row = html.split(f'data-scenario="{leak.results["scenario"]}"')[1].split("</tr>")[0]
    assert 'data-faults="refcount_leak"' in html and "simulated, 1 rank" in row
    assert ">cpu<" in row and ">reference<" in row
    assert f'<td class="scn"><a href="{leak.run_dir.name}/report.html">' in row  # no truncation


def test_publish_records_the_batch(tmp_path, monkeypatch):
    sc = parse_scenario({"scenario": {"name": "tiny"}, "workload": {"num_requests": 2}})
    r = publish(run_scenario(sc, 0, device="cpu", report_dir=tmp_path), batch="b-1")
    monkeypatch.setenv(render.BATCH_ENV, "b-2")
    r2 = publish(run_scenario(sc, 1, device="cpu", report_dir=tmp_path))
    assert [json.loads((x.run_dir / "results.json").read_text())["batch"] for x in (r, r2)] == [
        "b-1",
        "b-2",
    ]
