"""[workload.shapes]: the shapes prefix-cache bugs need occur on the run that asks for them, a plan
without the section is what it was, and the counters read them from the history alone."""

from __future__ import annotations

from kvchaos.harness.check.shapes import prefix_shapes
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.run.workload import build_plan
from kvchaos.harness.scenario.spec import load_scenario


def test_every_shape_occurs_on_the_shapes_scenario():
    r = run_scenario(load_scenario("prefix-shapes-clean"), 0, report_dir=None)
    shapes = r.results["exercised"]["prefix_shapes"]
    assert not [f for f in r.findings if f.checker != "latency"], r.summary  # (time: no assertion)
    assert all(shapes[k] > 0 for k in shapes), shapes


def test_shapes_leave_the_rest_of_the_plan_as_it_was():
    sc = load_scenario("prefix-shapes-clean")
    cfg = sc.engine_config()
    w = sc.workload
    args = (cfg.model.vocab_size, 3, cfg.cache.block_size, cfg.cache, cfg.max_prefill_tokens)
    with_shapes = build_plan(w, *args).actions
    without = build_plan(w.model_copy(update={"shapes": None}), *args).actions
    own = [a for a in with_shapes if not a.req.startswith("s")]
    assert [a.to_dict() | {"p": a.prompt} for a in own] == [
        a.to_dict() | {"p": a.prompt} for a in without
    ]
    assert {a.req[:2] for a in with_shapes} >= {"sb", "sa", "sp", "sw"}


def _submit(req: str, ids: list[int], max_new: int = 0) -> dict:
    return {"e": "submit", "step": 1, "req": req, "prompt_ids": ids, "max_new": max_new}


def test_the_stale_index_shape_needs_the_queue_cycled_and_the_old_chain_again():
    p1, p2, b = [1, 2], [3, 4], [7, 8]
    fill = _submit("f", list(range(100, 110)))  # a pool of 8 blocks x 2 tokens: cycled
    shape = [_submit("a", p1 + b), _submit("c", p2 + b), fill, _submit("d", p1 + b)]
    assert prefix_shapes(shape, 2, 8)["stale_index"] == 1
    assert prefix_shapes([shape[0], shape[1], shape[3]], 2, 8)["stale_index"] == 0  # not cycled
    same = [_submit("a", p1 + b), _submit("c", p1 + b), fill, _submit("d", p1 + b)]
    assert prefix_shapes(same, 2, 8)["stale_index"] == 0  # never after another prefix


def test_refused_hits_and_full_hits_are_read_from_engine_events():
    ev = [
        {
            "e": "engine",
            "kind": "refusal",
            "data": {"call": "admit", "seq": "x", "free": 6, "needed": 5, "tokens": 8},
        },
        {
            "e": "engine",
            "kind": "refusal",
            "data": {"call": "admit", "seq": "y", "free": 2, "needed": 5, "tokens": 8},
        },
        {"e": "engine", "kind": "hit", "data": {"req": "z", "known": 8, "answered": 6}},
        {"e": "cancel", "step": 3, "req": "w", "phase": "prefill"},
    ]
    got = prefix_shapes(ev, 2, 4)
    assert got == {"stale_index": 0, "prefill_aborts": 1, "refused_hits": 1, "full_hits": 1}
