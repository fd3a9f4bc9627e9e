"""[workload.prefix]: prompts sharing prefixes (groups, repeats, block-aligned segments), samples
sent as plain submits once the first decodes, multi-turn chains whose planned prompt continues the
previous turn's. One seed, one plan; an absent section leaves every plan as it was; bad values
name workload.prefix.<key>."""

from __future__ import annotations

import hashlib
import json

import pytest

from kvchaos.harness.history.log import History
from kvchaos.harness.report.evidence import plan_line
from kvchaos.harness.run.live import LiveRun
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.run.workload import build_plan
from kvchaos.harness.scenario.spec import ScenarioError, load_scenario, parse_scenario

PREFIX_SCENARIOS = [
    "prefix-shared-clean",
    "prefix-multiturn-clean",
    "prefix-samples-clean",
    "prefix-segments-clean",
]


def scenario(prefix: dict, **workload):
    w = {"num_requests": 60, "prompt_len": {"dist": "uniform", "min": 4, "max": 12}, **workload}
    return parse_scenario({"scenario": {"name": "p"}, "workload": {**w, "prefix": prefix}})


def plan(sc, seed=0, block_size=4):
    return build_plan(sc.workload, sc.engine_config().model.vocab_size, seed, block_size)


def dump(p) -> str:
    return json.dumps([(a.to_dict(), a.prompt) for a in p.actions])


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def base_prompts(p) -> list[list[int]]:
    return [a.prompt for a in p.actions if a.op == "submit" and a.after is None]


def sharing(prompts: list[list[int]], at_least: int) -> list[list[int]]:
    """The prompts starting with >= at_least tokens another prompt starts with too."""
    return [
        p
        for i, p in enumerate(prompts)
        if any(common(p, q) >= at_least for j, q in enumerate(prompts) if j != i)
    ]


# -- plans ---------------------------------------------------------------------------------------
def test_same_seed_same_plan():
    sc = scenario({"groups": 3, "repeat": 0.2, "samples": 2, "turns": 2, "segments": 5})
    assert dump(plan(sc, 7)) == dump(plan(sc, 7))  # byte-identical, prompts included
    assert dump(plan(sc, 7)) != dump(plan(sc, 8))
    ops = [a.op for a in plan(sc, 7).actions]
    assert (ops.count("submit"), ops.count("turn")) == (60 * 2, 60 * 2)


def test_absent_section_keeps_the_plan_byte_for_byte():
    # baseline-clean seed 0, as built before [workload.prefix] existed (prompts included)
    p = plan(load_scenario("baseline-clean"), 0, 16)
    blob = json.dumps(
        [(a.step, a.op, a.req, a.prompt, a.max_new, a.parent, a.when, a.origin) for a in p.actions]
    )
    assert hashlib.sha256(blob.encode()).hexdigest()[:16] == "063e76b0c9c18368"
    assert all("after" not in a.to_dict() for a in p.actions)


@pytest.mark.parametrize("share", [0.0, 0.5, 0.8, 1.0])
def test_a_share_of_prompts_starts_with_a_group_prefix(share):
    sc = scenario({"groups": 4, "prefix_len": {"dist": "fixed", "value": 20}, "share": share})
    prompts = base_prompts(plan(sc, 3))
    shared = sharing(prompts, 20)
    frac = len(shared) / len(prompts)
    assert abs(frac - share) <= 0.15, frac
    assert share > 0 or frac == 0.0  # random prompts of 256 ids share no 20-token prefix
    assert len({tuple(p[:20]) for p in shared}) == (4 if share else 0)  # the groups' prefixes
    assert all(common(p, q) < 24 for p in shared for q in shared if p is not q)  # then own


def test_repeats_are_exact_copies_of_earlier_prompts():
    sc = scenario({"groups": 0, "share": 0.0, "repeat": 0.3})
    prompts = base_prompts(plan(sc, 1))
    repeated = sum(p in prompts[:i] for i, p in enumerate(prompts))
    assert 0.15 * len(prompts) <= repeated <= 0.45 * len(prompts)


def test_samples_are_plain_submits_of_the_same_prompt_after_the_first_decodes():
    p = plan(scenario({"groups": 2, "samples": 3}, num_requests=5), 2)
    subs = {a.req: a for a in p.actions if a.op == "submit"}
    assert len(subs) == 15
    for i in range(5):
        first = subs[f"r{i}"]
        for k in (1, 2):
            s = subs[f"r{i}s{k}"]
            assert (s.prompt, s.after, s.when, s.step) == (
                first.prompt,
                first.req,
                "decode",
                first.step,
            )
            assert s.to_dict()["after"] == first.req
            assert f"when {first.req} is in phase decode" in plan_line(s.to_dict())


def test_turns_chain_each_after_the_previous_finished():
    p = plan(scenario({"groups": 1, "turns": 3}, num_requests=4), 5)
    turns = {a.req: a for a in p.actions if a.op == "turn"}
    assert len(turns) == 12
    for i in range(4):
        prev = f"r{i}"
        for k in (1, 2, 3):
            t = turns[f"r{i}t{k}"]
            assert (t.parent, t.when) == (prev, "finished") and 4 <= len(t.prompt) <= 16
            assert t.to_dict()["prompt_len"] == len(t.prompt)  # the new user tokens only
            prev = t.req
    t = turns["r0t2"]
    assert plan_line(t.to_dict()) == (
        f"turn r0t2 ({len(t.prompt)} tokens after r0t1's, up to {t.max_new} new) once r0t1 has "
        f"finished at step {t.step}"
    )


def test_segments_are_whole_blocks_shared_after_different_prefixes():
    bs = 4
    sc = scenario({"groups": 3, "share": 0.7, "segments": 5, "prefix_len": {"min": 5, "max": 20}})
    prompts = base_prompts(plan(sc, 4, bs))
    assert all(len(p) % bs == 0 for p in prompts)  # prefix and own part: whole blocks
    blocks = {tuple(p[i : i + bs]) for p in prompts for i in range(0, len(p), bs)}
    assert len(blocks) <= 5  # every block one of the segments
    seen: dict[tuple, set] = {}  # a block's tokens -> the different prefixes before it
    for p in prompts:
        for i in range(bs, len(p), bs):
            seen.setdefault(tuple(p[i : i + bs]), set()).add(tuple(p[:i]))
    assert max(len(v) for v in seen.values()) >= 10  # equal blocks after different prefixes


# -- validation -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prefix, expected",
    [
        ({"share": 1.5}, "workload.prefix.share: Input should be less than or equal to 1"),
        ({"groups": 0}, "workload.prefix.share: share 0.8 needs groups >= 1"),
        ({"samples": 0}, "workload.prefix.samples: Input should be greater than or equal to 1"),
        ({"turns": -1}, "workload.prefix.turns: Input should be greater than or equal to 0"),
        ({"segments": "x"}, "workload.prefix.segments: Input should be a valid integer"),
        ({"prefix_len": {"min": 9, "max": 3}}, "workload.prefix.prefix_len: need 1 <= min"),
        ({"turn_len": {"dist": "zipf"}}, "workload.prefix.turn_len.dist: Input should be"),
        ({"colour": 1}, "workload.prefix.colour: unknown key; allowed: ['groups', 'prefix_len'"),
    ],
)
def test_bad_values_name_the_prefix_key(prefix, expected):
    with pytest.raises(ScenarioError) as ei:
        parse_scenario({"scenario": {"name": "p"}, "workload": {"prefix": prefix}}, "s.toml")
    msg = str(ei.value)
    assert msg.startswith(f"s.toml: {expected}") and "\n" not in msg, msg


# -- live runs ----------------------------------------------------------------------------------
def live(sc, seed=0) -> LiveRun:
    run = LiveRun(sc, seed, "cpu", History(None))
    run.arm()
    run.finish(run.run())
    return run


def test_a_turns_planned_prompt_continues_the_previous_turn_as_verified():
    sc = load_scenario("prefix-multiturn-clean")
    run = live(sc)
    seqs, events = run.engine.seqs, run.h.events
    submitted = {e["req"]: e["step"] for e in events if e["e"] == "submit"}
    finished = {r: e["step"] for e in events if e["e"] == "step" for r in e["finished"]}
    oracle = {e["req"]: e for e in events if e["e"] == "oracle"}
    turns = [a for a in run.plan.actions if a.op == "turn"]
    assert len(turns) == 3 * sc.workload.num_requests
    for t in turns:
        prev = seqs[t.parent]
        want = run.planned[t.parent] + prev.tokens[prev.prompt_len :] + t.prompt
        assert run.planned[t.req] == want == seqs[t.req].tokens[: seqs[t.req].prompt_len]
        assert submitted[t.req] > finished[t.parent]  # sent once the previous turn finished
        o = oracle[t.req]  # checked on the whole conversation so far, and clean
        assert o["checked"] > 0 and o["first_divergence"] is None
        assert o["prompt_mismatch_at"] is None
    assert max(len(run.planned[t.req]) for t in turns) > 50  # conversations grow


def test_a_turn_whose_previous_turn_was_refused_is_dropped_with_its_followers():
    sc = parse_scenario(
        {
            "scenario": {"name": "p"},
            "engine": {"cache": {"block_size": 4, "max_blocks_per_seq": 6, "num_blocks": 32}},
            "workload": {
                "num_requests": 2,
                "prompt_len": {"dist": "fixed", "value": 10},
                "output_len": {"dist": "fixed", "value": 8},
                "prefix": {"groups": 0, "share": 0.0, "turns": 3},
            },
        }
    )
    run = live(sc)
    kinds = {(e["e"], e["req"]) for e in run.h.events if e["e"] in ("submit", "reject")}
    assert {("submit", "r0"), ("reject", "r0t1"), ("submit", "r1"), ("reject", "r1t1")} <= kinds
    assert not any(r.endswith(("t2", "t3")) for _, r in kinds)


@pytest.mark.parametrize("name", PREFIX_SCENARIOS)
def test_prefix_scenarios_pass_and_are_deterministic(name):
    sc = load_scenario(name)
    a, b = run_scenario(sc, 1, "cpu", None), run_scenario(sc, 1, "cpu", None)
    assert a.verdict == "PASS", a.summary
    assert a.results["history_digest"] == b.results["history_digest"]
    ends = [e for e in a.events if e["e"] == "run_end"]
    assert ends[0]["reason"] == "done" and ends[0]["counters"]["preemptions"] > 0  # pool pressure


def test_samples_need_no_fork():
    r = run_scenario(
        load_scenario("prefix-samples-clean"), 0, "cpu", None, block_manager_spec="managers:NoFork"
    )
    assert r.verdict == "PASS", r.summary
    assert sum(e["e"] == "submit" and "s" in e["req"][1:] for e in r.events) == 18
