"""The runner: one seed gives one history, bit for bit; an engine exception or Ctrl-C becomes an
ERROR with what was recorded kept; the run folder; running under a user's own BlockManager."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from kvchaos.engine.block_manager import BlockManager
from kvchaos.engine.engine import Engine
from kvchaos.engine.protocols import KVManager
from kvchaos.harness.check.evaluate import evaluate
from kvchaos.harness.history.log import UNSTABLE_KEYS, deterministic_digest, read_history
from kvchaos.harness.report.render import publish
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario, parse_scenario

sys.path.insert(0, str(Path(__file__).parent))  # tests/managers.py

import managers  # noqa: E402

TINY_TOML = """
[scenario]
name = "tiny"
seeds = [0]

[engine]
max_prefill_tokens = 32

[engine.cache]
block_size = 4
num_blocks = 24
max_blocks_per_seq = 8
max_num_seqs = 4

[workload]
num_requests = 6
arrival_rate = 1.5
fork_groups = 1
prompt_len = { dist = "uniform", min = 2, max = 12 }
output_len = { dist = "uniform", min = 2, max = 8 }

[workload.cancel]
rate = 0.2
phases = ["waiting", "decode", "shared"]

[run]
max_steps = 120
"""


@pytest.fixture
def tiny(tmp_path):
    p = tmp_path / "tiny.toml"
    p.write_text(TINY_TOML)
    return load_scenario(p)


def strip(ev):
    return {
        k: strip(v) if isinstance(v, dict) else v for k, v in ev.items() if k not in UNSTABLE_KEYS
    }


def stable_lines(path: Path) -> list[str]:
    return [
        json.dumps(strip(json.loads(line)), sort_keys=True)
        for line in path.read_text().splitlines()
    ]


def results_of(r) -> dict:
    return json.loads((r.run_dir / "results.json").read_text())


def steps_in(run_dir: Path) -> list[int]:
    return [e["step"] for e in read_history(run_dir / "history.jsonl") if e["e"] == "step"]


# -- determinism -------------------------------------------------------------------------------
def test_same_scenario_and_seed_give_the_same_history(tiny, tmp_path):
    a = run_scenario(tiny, 3, report_dir=tmp_path / "a")
    b = run_scenario(tiny, 3, report_dir=tmp_path / "b")
    c = run_scenario(tiny, 4, report_dir=tmp_path / "c")
    assert a.verdict == b.verdict == "PASS"
    assert a.results["history_digest"] == b.results["history_digest"] != c.results["history_digest"]
    la, lb = stable_lines(a.run_dir / "history.jsonl"), stable_lines(b.run_dir / "history.jsonl")
    assert la == lb and len(la) > 30
    assert any('"e": "cancel"' in x for x in la) and any('"e": "oracle"' in x for x in la)
    # the digest is that of the stored history: a run on disk can be verified and re-checked
    events = read_history(a.run_dir / "history.jsonl")
    assert deterministic_digest(events) == a.results["history_digest"]
    checks, _ = evaluate(tiny, events, results_of(a)["fault_verify"], None)  # as analyze does
    rechecked = json.loads(json.dumps([c.to_dict() for c in checks]))
    assert rechecked == results_of(a)["checkers"]


@pytest.mark.parametrize(
    "name", ["table-overflow-detect", "refcount-leak-detect", "prefix-cache-stale-revive-detect"]
)
def test_checkers_judge_a_history_read_back_as_they_did_in_memory(name, tmp_path):
    """In memory a snapshot's unchanged fields are the very objects of the one before, and
    checkers skip what they judged already: read back, nothing is shared; the same findings."""
    from kvchaos.harness.check.evaluate import evaluate
    from kvchaos.harness.scenario.spec import BUILTIN_DIR

    sc = load_scenario(BUILTIN_DIR / f"{name}.toml")
    r = run_scenario(sc, 1, report_dir=tmp_path)
    snaps = [e for e in r.events if e["e"] == "snapshot"]
    assert any(a["table"] is b["table"] for a, b in zip(snaps, snaps[1:]))  # shared in memory
    assert r.findings
    checks, v = evaluate(
        sc, read_history(r.run_dir / "history.jsonl"), r.results["fault_verify"], None
    )
    assert v.verdict == r.verdict
    assert [c.to_dict() for c in checks] == json.loads(json.dumps(r.results["checkers"]))


def test_the_digest_of_events_in_memory_is_that_of_their_lines_read_back(tmp_path):
    """What orjson cannot encode (an int past 64 bits, a lone surrogate) takes the standard
    encoder; NaN, int keys, tuples and unstable fields hash the same in memory and read back."""
    from kvchaos.harness.history.log import History

    events = [
        {"e": "run_start", "step": 0, "time": "now", "config": {"a": (1, 2)}},
        {"e": "oracle", "step": 1, "max_abs_err": float("nan"), "x": float("inf"), "f": 1e-5},
        {"e": "engine", "step": 2, "data": {3: "int key", "pid": 7, "big": 2**70}},
        {"e": "step", "step": 3, "latency_s": 0.5, "tokens": {"r": 4}, "text": "\ud800"},
        {"e": "snapshot", "step": 3, "table": [0, -1], "seq_blocks": {"r": [0]}},
    ]
    h = History(tmp_path / "h.jsonl")
    for ev in events:
        h.append(ev)
    h.close()
    back = read_history(tmp_path / "h.jsonl")
    assert len(back) == len(events)
    assert h.digest() == deterministic_digest(back) == deterministic_digest(events)
    moved = [dict(ev) for ev in events]
    moved[3]["latency_s"] = 9.0  # an unstable field: the digest stands
    assert deterministic_digest(moved) == h.digest()
    moved[3]["tokens"] = {"r": 5}
    assert deterministic_digest(moved) != h.digest()


# -- the run breaks ----------------------------------------------------------------------------
def _fail_before_step(monkeypatch, at: int, exc: BaseException):
    real = Engine.step

    def step(self):
        if self.step_count + 1 == at:
            raise exc
        return real(self)

    monkeypatch.setattr(Engine, "step", step)


def test_engine_exception_becomes_error_with_traceback_and_the_history_kept(
    tiny, tmp_path, monkeypatch
):
    _fail_before_step(monkeypatch, 5, RuntimeError("injected failure at step 5"))
    r = run_scenario(tiny, 0, report_dir=tmp_path)
    assert r.verdict == "ERROR" and "RuntimeError: injected failure at step 5" in r.summary
    res = results_of(r)
    assert res["verdict"] == "ERROR" and res["exit_code"] == 13 and res["reason"] == "error"
    assert res["error"]["error"] == "RuntimeError"
    assert "Traceback (most recent call last)" in res["error"]["traceback"]
    assert "injected failure at step 5" in res["error"]["traceback"]
    assert steps_in(r.run_dir) == [1, 2, 3, 4]
    events = read_history(r.run_dir / "history.jsonl")
    err = [e for e in events if e["e"] == "error"]
    assert len(err) == 1 and "injected failure" in err[0]["traceback"]
    assert events[-1]["e"] == "run_end" and events[-1]["reason"] == "error"


def test_exception_inside_a_step_after_blocks_were_reserved(tiny, tmp_path, monkeypatch):
    real, calls = Engine._upload_table, []

    def upload(self):
        calls.append(self.step_count)
        if len(calls) == 5:
            raise FloatingPointError("staging copy failed")
        return real(self)

    monkeypatch.setattr(Engine, "_upload_table", upload)
    r = run_scenario(tiny, 0, report_dir=tmp_path)
    res = results_of(r)
    assert r.verdict == "ERROR" and res["error"]["error"] == "FloatingPointError"
    events = read_history(r.run_dir / "history.jsonl")
    failing = next(e["step"] for e in events if e["e"] == "error")
    assert failing == calls[-1] >= 5
    assert steps_in(r.run_dir) == list(
        range(1, failing)
    )  # every step before the failing one, none after


def test_ctrl_c_keeps_what_was_recorded(tiny, tmp_path, monkeypatch):
    _fail_before_step(monkeypatch, 3, KeyboardInterrupt())
    r = run_scenario(tiny, 0, report_dir=tmp_path)
    res = results_of(r)
    assert r.verdict == "ERROR" and res["reason"] == "interrupted"
    assert steps_in(r.run_dir) == [1, 2]
    assert read_history(r.run_dir / "history.jsonl")[-1]["reason"] == "interrupted"


def test_every_request_that_produced_tokens_reaches_the_oracle_even_when_the_end_breaks(
    tiny, tmp_path, monkeypatch
):
    """The oracle checks requests in batches; a failure at the run's end (here the final snapshot)
    must not take the queued checks with it, and Ctrl-C while checking still leaves the record."""
    from kvchaos.harness.run.live import LiveRun

    clean = run_scenario(tiny, 0, report_dir=tmp_path / "clean")
    checked = {
        e["req"] for e in read_history(clean.run_dir / "history.jsonl") if e["e"] == "oracle"
    }
    assert len(checked) >= 4

    real = LiveRun.snapshot

    def snapshot(self, step):
        if step > self.engine.step_count:  # the final one, stamped one past the last step
            raise RuntimeError("snapshot broke")
        return real(self, step)

    monkeypatch.setattr(LiveRun, "snapshot", snapshot)
    r = run_scenario(tiny, 0, report_dir=tmp_path / "broken")
    assert r.verdict == "ERROR" and "snapshot broke" in r.summary
    assert {
        e["req"] for e in read_history(r.run_dir / "history.jsonl") if e["e"] == "oracle"
    } == checked

    monkeypatch.setattr(LiveRun, "snapshot", real)
    monkeypatch.setattr(
        "kvchaos.harness.run.oracle.Oracle.check_many",
        lambda self, items, **kw: (_ for _ in ()).throw(KeyboardInterrupt),
    )
    r = run_scenario(tiny, 0, report_dir=tmp_path / "interrupted")
    res = results_of(r)
    assert r.verdict == "ERROR" and res["reason"] == "interrupted"
    assert read_history(r.run_dir / "history.jsonl")[-1]["error"] == "KeyboardInterrupt"


def test_timeout_is_an_error(tiny):
    r = run_scenario(tiny, 0, report_dir=None, timeout_s=1e-9)
    assert r.verdict == "ERROR" and "TimeoutError" in r.summary and "time limit" in r.summary


@pytest.mark.parametrize(
    "fault, message",
    [
        # bad param values are refused at load (tests/test_scenario.py); an engine the fault
        # cannot arm on is left
        (
            {"name": "ordering_race", "defect": False},
            "fault ordering_race needs engine.tp_size >= 2",
        ),
    ],
)
def test_a_fault_that_cannot_arm_is_a_clear_error(tiny, fault, message):
    data = {"scenario": {"name": "badparam"}, "faults": [fault], "workload": {"num_requests": 2}}
    r = run_scenario(parse_scenario(data, "<t>"), 0, report_dir=None)
    assert r.verdict == "ERROR" and message in r.summary


def test_a_rank_whose_first_update_is_late_computes_on_an_empty_table_not_crashes():
    # seed 6: the first request arrives at step 4, after the lag started; rank 1 had no table yet
    r = run_scenario(load_scenario("ordering-race-detect"), 6, report_dir=None)
    assert r.verdict == "PASS", r.summary
    assert r.results["time_to_detect_steps"]["ordering_race"] <= 2


def test_cancel_events_record_the_phase_the_request_was_in(tmp_path):
    """A cancel while sharing blocks is recorded with the phase it interrupted (and shared=True),
    not the state the cancel left it in."""
    r = run_scenario(load_scenario("baseline-clean"), 0, report_dir=tmp_path)
    cancels = [e for e in read_history(r.run_dir / "history.jsonl") if e["e"] == "cancel"]
    assert {e["phase"] for e in cancels} <= {"waiting", "prefill", "decode", "preempted"}
    shared = [e for e in cancels if e["shared"]]
    assert shared and all(e["phase"] == "decode" and e["blocks"] for e in shared)


# -- the run folder ----------------------------------------------------------------------------
def test_run_folder_contents(tiny, tmp_path):
    r = run_scenario(tiny, 0, report_dir=tmp_path)
    assert r.run_dir.parent == tmp_path and r.run_dir.name.endswith("-tiny-s0")
    names = {p.name for p in r.run_dir.iterdir()}
    assert {"scenario.toml", "history.jsonl", "results.json"} <= names
    # the scenario as resolved: loading the run folder's copy gives the very scenario that ran
    assert load_scenario(r.run_dir / "scenario.toml").model_dump() == tiny.model_dump()
    res = results_of(r)
    for key in (
        "verdict",
        "seed",
        "commit",
        "config_hash",
        "checkers",
        "time_to_detect_steps",
        "metrics",
        "history_digest",
        "replay",
        "fault_verify",
        "expectation",
        "steps",
        "wall_s",
    ):
        assert key in res, key
    assert res["seed"] == 0 and res["scenario"] == "tiny" and res["exit_code"] == 0
    events = read_history(r.run_dir / "history.jsonl")
    start = next(e for e in events if e["e"] == "run_start")
    assert start["seed"] == 0 and start["config_hash"] == res["config_hash"] and start["plan"]
    assert start["block_manager"] == "kvchaos.engine.prefix_manager:PrefixCachingManager"
    assert events[-1]["e"] == "run_end" and events[-1]["reason"] == "done"
    assert res["steps"] == len([e for e in events if e["e"] == "step"]) == res["metrics"]["steps"]
    # the scenario's path relative to the report folder (here the folder the file is in)
    rel = os.path.relpath(tiny.source, r.run_dir.parent)
    assert res["replay"] == f"kvchaos run {rel} --seed 0 --device cpu"
    again = run_scenario(tiny, 0, report_dir=tmp_path)
    assert again.run_dir != r.run_dir  # same second, same name: its own folder


def test_no_report_dir_writes_nothing(tiny, tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    r = run_scenario(tiny, 0, report_dir=None)
    assert r.run_dir is None and r.verdict == "PASS" and r.results["history_digest"]
    assert list((tmp_path / "cwd").iterdir()) == []


# -- a user's own BlockManager -----------------------------------------------------------------
class ForwardingBM(managers.Delegate):
    """A user's block manager that forwards every call to the reference one, without its fast
    decode path (append_decode) or `rows`."""


class LeakyBM(BlockManager):
    """A user's block manager with the classic bug: release() returns early, freeing nothing,
    when the sequence still shares a block with another one (a fork or a shared prefix) - so
    cancelling or finishing a forked request leaks its references."""

    def release(self, seq_id, reason):
        blocks = self.blocks.get(seq_id)
        if blocks and any(self.pool.ref[b] > 1 for b in blocks):
            return True
        return super().release(seq_id, reason)


def test_a_forwarding_block_manager_runs_the_same_run(tiny, tmp_path):
    assert isinstance(ForwardingBM(8, 4, 2, 4), KVManager)
    ref = run_scenario(tiny, 1, report_dir=tmp_path / "ref", block_manager=BlockManager)
    own = run_scenario(tiny, 1, report_dir=tmp_path / "own", block_manager=ForwardingBM)
    assert own.verdict == ref.verdict == "PASS"
    ev_ref, ev_own = (read_history(r.run_dir / "history.jsonl") for r in (ref, own))
    start = next(e for e in ev_own if e["e"] == "run_start")
    assert start["block_manager"] == f"{__name__}:ForwardingBM"
    assert own.results["replay"].endswith(f"--block-manager {__name__}:ForwardingBM")

    # same decisions, block for block; everything but the run_start line and the calls made
    # (no append_decode: its decodes come as appends) is identical
    def same(events):
        return [
            {k: v for k, v in strip(e).items() if k != "manager_calls"}
            for e in events
            if e["e"] not in ("run_start", "calls")
        ]

    assert same(ev_own) == same(ev_ref)


def test_block_manager_by_spec_string(tiny):
    r = run_scenario(tiny, 0, report_dir=None, block_manager_spec=f"{__name__}:ForwardingBM")
    assert r.verdict == "PASS"
    bad = run_scenario(tiny, 0, report_dir=None, block_manager_spec="nosuch_module_xyz:BM")
    assert bad.verdict == "ERROR" and "cannot import nosuch_module_xyz" in bad.summary


def test_a_leaky_user_block_manager_is_a_fail_blamed_on_it(tmp_path):
    sc = load_scenario(
        "refcount-leak-clean"
    )  # cancels while sharing, a storm; the reference engine holds
    assert run_scenario(sc, 0, report_dir=None).verdict == "PASS"
    r = run_scenario(sc, 0, report_dir=tmp_path, block_manager=LeakyBM)
    assert r.verdict == "FAIL", r.summary
    assert "block_accounting" in r.summary
    leaks = [f for f in r.findings if f.checker == "block_accounting" and f.kind == "leak"]
    assert leaks and all(f.manifest is False for f in leaks)
    start = next(e for e in read_history(r.run_dir / "history.jsonl") if e["e"] == "run_start")
    assert start["block_manager"] == f"{__name__}:LeakyBM"  # what the report blames
    assert f"--block-manager {__name__}:LeakyBM" in r.results["replay"]


def test_the_report_suspects_the_user_block_manager(tmp_path):
    r = publish(
        run_scenario(
            load_scenario("refcount-leak-clean"), 0, report_dir=tmp_path, block_manager=LeakyBM
        )
    )
    incidents = results_of(r).get("incidents")
    assert incidents, "the run folder has no incidents"
    root = incidents[0]["root_cause"]
    assert root["status"] == "suspected" and "LeakyBM" in root["text"]
