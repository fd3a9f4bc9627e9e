"""One number per fact, from one source: a user's manager that forgets to free a preempted
sequence's blocks gets an incident whose title, summary, impact, report.html and results.json
say the same blocks leaked and requests cancelled; requests affected separate a wrong output from
a request that only held blocks; a latency line compares windows that do not overlap."""

from __future__ import annotations

import re
import statistics

import pytest

from kvchaos.engine.block_manager import BlockManager
from kvchaos.harness.report import render
from kvchaos.harness.report.impact import MIN_LATENCY_STEPS, impact_of, latency_change
from kvchaos.harness.report.render import publish
from kvchaos.harness.report.view import RunView
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario


class ForgetsPreempted(BlockManager):
    """A user's manager: release(seq, "preempted") answers True and frees nothing."""

    def release(self, seq_id, reason):
        if reason == "preempted":
            return True
        return super().release(seq_id, reason)


def _run_under(name: str, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(render.PLOTS_ENV, raising=False)
        sc = load_scenario(name)
        d = tmp_path_factory.mktemp(name)
        r = publish(run_scenario(sc, 0, device="cpu", report_dir=d, block_manager=ForgetsPreempted))
    assert r.verdict == "FAIL", r.summary
    (inc,) = r.results["incidents"]
    return r, inc, (r.run_dir / inc["file"]).read_text(), (r.run_dir / "report.html").read_text()


@pytest.fixture(scope="module")
def forgets(tmp_path_factory):
    """refcount_leak's trigger (cancels, a storm) on a small pool that preempts."""
    return _run_under("refcount-leak-clean", tmp_path_factory)


@pytest.fixture(scope="module")
def forgets_plain(tmp_path_factory):
    """No fault: the workload's own cancels and forks."""
    return _run_under("baseline-clean", tmp_path_factory)


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_blocks_leaked_is_one_number_everywhere(forgets):
    r, inc, md, html = forgets
    bl = inc["impact"]["blocks_leaked"]
    acct = next(c for c in r.results["checkers"] if c["checker"] == "block_accounting")
    end = next(f for f in acct["findings"] if f["kind"] == "end_leak")
    out = end["evidence"]["total"] - end["evidence"]["free"]
    # this manager leaks more than the requests the leak findings name: the end's count is it
    assert bl["never_returned_at_end"] == out == bl["count"] > len(bl["blocks"]) > 0
    n = bl["count"]
    assert f"{n} blocks leaked" in inc["title"] and f"blocks leaked: {n};" in inc["summary"]
    assert f"Blocks leaked: {n} (never returned to the pool by the end of the run)" in md
    assert f"{len(bl['blocks'])} of them named: {bl['blocks']}" in md
    # every number of blocks "leaked" or "never returned" in the incident is the same one
    said = {int(x) for x in re.findall(r"(\d+) blocks (?:leaked|never returned)", md)}
    assert said == {n}, said
    said_html = {int(x) for x in re.findall(r"(\d+) blocks (?:leaked|never returned)", html)}
    assert said_html == {n} and f"blocks leaked {n} (never returned" in _text(html)


def test_requests_cancelled_is_what_the_history_shows(forgets, forgets_plain):
    r, inc, md, html = forgets_plain
    events, plan = r.events, r.events[0]["plan"]
    cancelled = r.results["metrics"]["cancelled"]
    assert cancelled == sum(1 for e in events if e["e"] == "cancel")
    planned = {op: sum(1 for a in plan if a["op"] == op) for op in ("submit", "fork", "cancel")}
    assert planned["cancel"] > cancelled  # some planned cancels never found their phase
    forked = sum(1 for e in events if e["e"] == "submit" and e.get("parent"))
    assert (
        f"the workload alone ({planned['submit']} submits, {planned['fork']} forks, "
        f"{planned['cancel']} cancels planned; done: {r.results['metrics']['requests'] - forked} "
        f"submitted, {forked} forked, {cancelled} cancelled)" in md
    )
    assert f"({cancelled} cancelled, " in _text(html)  # the run's header, the same count
    assert {int(x) for x in re.findall(r"(\d+) cancelled", _text(html))} == {cancelled}
    # a fault's own actions: planned and done by it (its origin), said as such
    r, inc, md, html = forgets
    mine = [a for a in r.events[0]["plan"] if a["origin"] == "refcount_leak"]
    done = sum(1 for e in r.events if e["e"] == "cancel" and e["origin"] == "refcount_leak")
    assert all(a["op"] == "cancel" for a in mine) and len(mine) > done
    assert f"({len(mine)} cancels planned; done: {done} cancelled)" in md


def test_requests_affected_separate_a_wrong_output_from_held_blocks(forgets):
    _, inc, md, html = forgets
    im = inc["impact"]
    assert im["requests_affected"] and im["requests_output_wrong"] == []
    assert not any(a["output_wrong"] for a in im["requests_affected"])
    assert f"Requests affected: {len(im['requests_affected'])} (0 with a wrong output)" in md
    assert "no wrong output seen (held blocks, starved or never finished): " in md
    assert "output wrong (" not in md and "output wrong (" not in html


def _events(findings_reqs=(), diverged=()):
    start = {"e": "run_start", "step": 0, "scenario": "x", "seed": 0, "plan": []}
    steps = [
        {"e": "step", "step": s, "latency_s": 1e-3, "host_s": 1e-4, "tokens": {"r1": [1]}}
        for s in range(1, 6)
    ]
    oracle = [
        {"e": "oracle", "req": r, "checked": 5, "first_divergence": 2 if r in diverged else None}
        | ({"divergence_step": 3} if r in diverged else {})
        for r in ("r1", "r2", "r3")
    ]
    return [start, *steps, *oracle]


def test_a_reader_of_wrong_kv_and_a_diverged_request_are_wrong_outputs_a_holder_is_not():
    v = RunView(_events(diverged=("r1",)))
    f = lambda kind, req, checker: {  # noqa: E731
        "checker": checker,
        "step": 3,
        "kind": kind,
        "message": "",
        "evidence": {"req": req, "blocks": [4]},
    }
    findings = [
        f("divergence", "r1", "oracle_divergence"),
        f("wrong_read", "r2", "kv_reads"),
        f("leak", "r3", "block_accounting"),  # held the block, read nothing wrong
    ]
    im = impact_of(v, {}, None, findings, 3)
    assert im["requests_output_wrong"] == ["r1", "r2"]
    assert {a["req"]: a["output_wrong"] for a in im["requests_affected"]} == {
        "r1": True,
        "r2": True,
        "r3": False,
    }


def _run(latency_ms: dict[int, float], decode: set[int]) -> RunView:
    steps = [
        {
            "e": "step",
            "step": s,
            "latency_s": ms / 1e3,
            "host_s": ms / 1e4,
            "prefill_tokens": 0,
            "decode_tokens": 1 if s in decode else 0,
        }
        for s, ms in sorted(latency_ms.items())
    ]
    return RunView([{"e": "run_start", "step": 0}, *steps])


def test_latency_windows_never_overlap_and_agree_with_the_history():
    # two decode steps before step 14, a few slow ones after, then an idle (starved) engine
    ms = {s: 0.036 for s in range(1, 400)}
    ms.update({10: 3.2, 12: 3.2, 14: 26.0, 15: 27.0, 16: 28.0, 20: 26.5})
    decode = {10, 12, 14, 15, 16, 20}
    assert latency_change(_run(ms, decode), 14, "latency_s") is None  # 2 before: no baseline
    ms.update({8: 3.0, 9: 3.4})
    lat = latency_change(_run(ms, decode | {8, 9}), 14, "latency_s")
    before = [ms[s] for s in sorted(decode | {8, 9}) if s < 14]
    after = [ms[s] for s in sorted(decode) if s >= 14]
    assert (lat["baseline_steps"], lat["after_steps"]) == (len(before), len(after))
    assert lat["baseline_ms"] == pytest.approx(statistics.median(before))
    assert lat["after_ms"] == pytest.approx(statistics.median(after))
    # the idle steps are named as left out, never in the median
    assert lat["other_steps_after"] == sum(1 for s in ms if s >= 14) - len(after)
    assert min(lat["baseline_steps"], lat["after_steps"]) >= MIN_LATENCY_STEPS


def test_the_figure_zooms_on_the_steps_where_things_happen(forgets_plain):
    from kvchaos.harness.report.plots import draw, focus

    r, inc, _, _ = forgets_plain
    v = RunView(r.events)
    busy = [s["step"] for s in v.steps if s.get("prefill_tokens") or s.get("decode_tokens")]
    acts = [e["step"] for e in r.events if e["e"] in ("submit", "cancel")]
    assert v.last_step >= 10 * max(busy + acts)  # starved: nothing ran for most of the run
    fig = draw(v, r.results["fault_verify"], [inc])
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        assert lo <= min(busy + acts) and max(busy + acts) <= hi < v.last_step / 5, (lo, hi)
    det = inc["detection"]["first_step"]
    assert det > hi  # found past the span: named at the edge, not squeezed into view
    notes = [t.get_text() for t in fig.axes[0].texts]
    assert any(f"at step {det}" in t for t in notes), notes
    assert f"of 0-{v.last_step} shown" in fig.axes[-1].get_xlabel()
    # a run busy from start to end keeps its whole axis
    ms = {s: 1.0 for s in range(1, 100)}
    assert focus(_run(ms, set(ms)), {"fired": {}, "leaks": [], "error": None}, []) is None
