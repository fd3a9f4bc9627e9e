"""Scenario files: the built-ins load and cover the four failure modes; a malformed file gives one
ScenarioError naming the file, the key and what is allowed. Workloads: one seed, one plan; lengths
replayed from CSV / JSONL, with bad lines named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvchaos.faults import REGISTRY, make_fault
from kvchaos.harness.run.workload import build_plan
from kvchaos.harness.scenario.spec import (
    BUILTIN_DIR,
    CHECKERS,
    ScenarioError,
    builtin_scenarios,
    load_scenario,
    parse_scenario,
    read_lengths,
)

HEAD = '[scenario]\nname = "bad"\n'


def write(tmp_path: Path, text: str, name: str = "bad.toml") -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def load_error(path: Path) -> str:
    with pytest.raises(ScenarioError) as ei:
        load_scenario(path)
    msg = str(ei.value)
    assert "\n" not in msg and "Traceback" not in msg  # one line
    return msg


# -- the built-in scenarios --------------------------------------------------------------------
def test_every_builtin_scenario_loads_and_is_named_after_its_file():
    files = sorted(BUILTIN_DIR.glob("*.toml"))
    scs = builtin_scenarios()
    assert len(scs) == len(files) >= 10
    for f, sc in zip(files, scs):
        assert sc.name == f.stem and sc.source == str(f)
        assert load_scenario(f.stem).name == sc.name  # built-in names resolve
        sc.engine_config()  # a valid engine


def test_builtins_cover_each_failure_mode_detected_and_remediated():
    scs = builtin_scenarios()
    for name, fault in REGISTRY.items():
        detect = [
            s for s in scs if s.expect.outcome == "detect" and [f.name for f in s.faults] == [name]
        ]
        clean = [
            s
            for s in scs
            if s.expect.outcome == "clean"
            and [(f.name, f.defect) for f in s.faults] == [(name, False)]
        ]
        assert detect and clean, name
        for s in detect:
            assert s.faults[0].defect and s.expect.checkers
            own = fault.detectors_for(s.faults[0].params)  # (the variant's)
            assert set(s.expect.checkers) <= set(own), (s.name, own)
            assert f"fault_{name}" in s.markers and "scenario" in s.markers
    # (any block manager's, on the synchronous engine: async_free needs async_scheduling)
    everywhere = {n for n, f in REGISTRY.items() if f.any_manager and n != "async_free"}
    mixed = [
        s for s in scs if s.expect.outcome == "clean" and {f.name for f in s.faults} == everywhere
    ]
    assert mixed and not any(f.defect for f in mixed[0].faults)
    baseline = [s for s in scs if not s.faults and s.expect.outcome == "clean"]
    assert baseline


# -- malformed files ---------------------------------------------------------------------------
MALFORMED = [
    # (file body after [scenario] name = "bad", substrings the message must hold)
    (
        'colour = "red"\n',
        ["scenario.colour: unknown key", "'description'", "'tags'"],
    ),  # inside [scenario]
    ("[workload.cancel]\nbogus = 1\n", ["workload.cancel.bogus: unknown key", "'storm_step'"]),
    (
        '[workload]\nprompt_len = { dist = "uniform", mean = 3 }\n',
        ["workload.prompt_len.mean: unknown key", "'median'"],
    ),
    (
        '[[faults]]\nname = "refcount_leak"\ndefect = false\nwhen = 3\n',
        ["faults.0.when: unknown key", "'params'"],
    ),
    ('[workload]\nnum_requests = "many"\n', ["workload.num_requests", "valid integer", "'many'"]),
    (
        "[workload]\nnum_requests = -1\n",
        ["workload.num_requests", "greater than or equal to 0", "-1"],
    ),
    ("[run]\nmax_steps = 1.5\n", ["run.max_steps", "integer", "1.5"]),
    ("[scenario.x]\n", ["scenario.x: unknown key"]),
    (
        '[[faults]]\nname = "cache_thrash"\n',
        ["faults.0.name", "'table_overflow'", "'ordering_race'", "'cache_thrash'"],
    ),
    ('[expect]\noutcome = "maybe"\n', ["expect.outcome", "'clean' or 'detect'", "'maybe'"]),
    (
        '[workload]\noutput_len = { dist = "zipf" }\n',
        ["workload.output_len.dist", "'lognormal'", "'bimodal'", "'zipf'"],
    ),
    (
        '[workload]\nprompt_len = { dist = "uniform", min = 9, max = 3 }\n',
        ["workload.prompt_len", "min <= max"],
    ),
    ('[run]\nlatency_signal = "gpu_s"\n', ["run.latency_signal", "'host_s'", "'gpu_s'"]),
    (
        '[engine.cache]\noverflow_policy = "grow"\n',
        ["engine.cache.overflow_policy", "'reject'", "'resize'", "'grow'"],
    ),
    (
        "[engine.model]\nnum_heads = 4\nnum_kv_heads = 3\n",
        ["engine.model.num_kv_heads", "multiple of"],
    ),
    ("[engine]\ntp_size = 3\n", ["engine.tp_size", "must divide num_kv_heads"]),
    (
        "[engine]\nwarp_size = 32\n",
        ["engine.warp_size: unknown key", "'max_prefill_tokens'", "'tp_size'"],
    ),
    ("[engine]\nseed = 3\n", ["engine.seed: unknown key", "--seed"]),
    ("[engine.cache]\nblock_sz = 16\n", ["engine.cache.block_sz: unknown key", "'block_size'"]),
    ('[engine.cache]\nblock_size = "16"\n', ["engine.cache.block_size: expected int", "'16'"]),
    ("[engine.cache]\nnum_blocks = 0\n", ["engine.cache.num_blocks", "must be > 0"]),
    ("[engine]\nmodel = 3\n", ["engine.model: expected a table"]),
    ('[[faults]]\nname = "refcount_leak"\n', ["expect.outcome 'clean' with a planted defect"]),
    (
        '[[faults]]\nname = "refcount_leak"\ndefect = false\n'
        '[expect]\noutcome = "detect"\nchecker = ["x"]\n',
        ["expect.checker: unknown key", "'checkers'"],
    ),
    (
        '[expect]\noutcome = "detect"\ncheckers = ["block_accounting"]\n',
        ["'detect' needs a fault with defect = true"],
    ),
    (
        '[[faults]]\nname = "refcount_leak"\n[expect]\noutcome = "detect"\nchecker = []\n',
        ["expect.checker: unknown key"],
    ),
    (
        '[[faults]]\nname = "refcount_leak"\n[expect]\noutcome = "detect"\n',
        ["'detect' needs at least one checker"],
    ),
    (
        '[[faults]]\nname = "refcount_leak"\n'
        '[expect]\noutcome = "detect"\ncheckers = ["leak_detector"]\n',
        ["unknown checker 'leak_detector'", "'block_accounting'", "'liveness'"],
    ),
    (
        '[[faults]]\nname = "refcount_leak"\ndefect = false\nparams = { storm_at = 3 }\n',
        ["faults.0.params.storm_at: unknown param of fault refcount_leak", "'storm_step'"],
    ),
]


@pytest.mark.parametrize(
    "body, expected", MALFORMED, ids=[m[1][0].split(":")[0][:40] for m in MALFORMED]
)
def test_malformed_file_gives_one_clear_error(tmp_path, body, expected):
    path = write(tmp_path, HEAD + body)
    msg = load_error(path)
    assert msg.startswith(f"{path}: "), msg
    for want in expected:
        assert want in msg, (want, msg)


# -- fault param values: refused at load, each with the key path, the value and its domain -------
STEPS_FROM_1 = "expected an int >= 1"
PHASES = "['waiting', 'prefill', 'decode', 'preempted', 'shared']"
BAD_PARAMS = [
    # (fault, params as TOML, the message after "<file>: faults.0.params.")
    ("table_overflow", "at_step = 0", f"at_step: {STEPS_FROM_1}, got 0"),
    ("table_overflow", "long_requests = -1", "long_requests: expected an int >= 0, got -1"),
    ("table_overflow", "neighbours = 2.5", "neighbours: expected an int >= 0, got 2.5"),
    ("table_overflow", "overshoot = 1.0", "overshoot: expected a number > 1, got 1.0"),
    ("table_overflow", 'overshoot = "1.5"', "overshoot: expected a number > 1, got '1.5'"),
    ("table_overflow", "overshoot = inf", "overshoot: expected a number > 1, got inf"),
    ("table_overflow", "boundary = 1", "boundary: expected true or false, got 1"),
    ("refcount_leak", "fraction = 1.5", "fraction: expected a number in [0, 1], got 1.5"),
    (
        "refcount_leak",
        "storm_fraction = -0.1",
        "storm_fraction: expected a number in [0, 1], got -0.1",
    ),
    ("refcount_leak", "storm_step = 0", "storm_step: expected an int >= 1 or unset (None), got 0"),
    (
        "refcount_leak",
        "storm_step = true",
        "storm_step: expected an int >= 1 or unset (None), got True",
    ),
    ("refcount_leak", 'paths = "decode"', f"paths: expected a list of {PHASES}, got 'decode'"),
    (
        "refcount_leak",
        'cancel_phases = ["decode", "finished"]',
        f"cancel_phases.1: expected one of {PHASES}, got 'finished'",
    ),  # the element, by index
    ("staging_stall", "ramp_steps = 0", "ramp_steps: expected an int >= 1, got 0"),
    ("staging_stall", "burst_every = 0", "burst_every: expected an int >= 1, got 0"),
    ("staging_stall", "plateau_us = -5.0", "plateau_us: expected a number >= 0, got -5.0"),
    ("staging_stall", 'at_step = "20"', f"at_step: {STEPS_FROM_1}, got '20'"),
    ("ordering_race", "probability = 2", "probability: expected a number in [0, 1], got 2"),
    ("ordering_race", "lag_steps = 0", "lag_steps: expected an int >= 1, got 0"),
    ("ordering_race", "lag_rank = -1", "lag_rank: expected an int >= 0, got -1"),
    (
        "ordering_race",
        "lag_rank = 2",
        "lag_rank: expected an int in [0, 1] (a rank of engine.tp_size = 2), got 2",
    ),
    ("ordering_race", "from_step = false", f"from_step: {STEPS_FROM_1}, got False"),
]


def _fault_body(fault: str, params: str) -> str:
    return (
        f'[engine]\ntp_size = 2\n[[faults]]\nname = "{fault}"\n'
        f"defect = false\nparams = {{ {params} }}\n"
    )


@pytest.mark.parametrize(
    "fault, params, expected", BAD_PARAMS, ids=[f"{b[0]}-{b[1]}" for b in BAD_PARAMS]
)
def test_bad_fault_param_value_is_refused_at_load(tmp_path, fault, params, expected):
    path = write(tmp_path, HEAD + _fault_body(fault, params))
    assert load_error(path) == f"{path}: faults.0.params.{expected}"


def test_bad_param_of_a_later_fault_names_its_index(tmp_path):
    body = (
        _fault_body("table_overflow", "at_step = 2")
        + '[[faults]]\nname = "staging_stall"\ndefect = false\n'
        "params = { ramp_steps = -3 }\n"
    )
    msg = load_error(write(tmp_path, HEAD + body))
    assert msg.endswith(": faults.1.params.ramp_steps: expected an int >= 1, got -3"), msg


def test_fault_param_values_at_the_edges_of_their_domains_load(tmp_path):
    for fault, params in [
        ("table_overflow", "at_step = 1, long_requests = 0, neighbours = 0, overshoot = 2"),
        (
            "refcount_leak",
            'paths = [], cancel_phases = ["waiting", "waiting"], fraction = 0, '
            "storm_step = 1, storm_fraction = 1",
        ),
        ("staging_stall", "burst_every = 1, ramp_steps = 1, plateau_us = 0"),
        ("ordering_race", "lag_rank = 0, lag_steps = 5, probability = 1.0, from_step = 1"),
    ]:
        sc = load_scenario(write(tmp_path, HEAD + _fault_body(fault, params), f"{fault}.toml"))
        REGISTRY[fault](False, sc.faults[0].params, 0)  # and it constructs


def test_every_fault_param_has_a_domain_holding_its_default():
    for name, cls in REGISTRY.items():
        assert set(cls.domains) == set(cls.defaults), name
        assert (
            cls.check_params(dict(cls.defaults)) == cls.defaults
        )  # storm_step's None default included


@pytest.mark.parametrize("path", sorted(BUILTIN_DIR.glob("*.toml")), ids=lambda p: p.stem)
def test_builtin_scenario_fault_params_are_valid(path):
    sc = load_scenario(path)
    for f in sc.faults:
        REGISTRY[f.name].check_params(f.params, sc.engine_config())
        make_fault(f.name, f.defect, f.params, 0)


@pytest.mark.parametrize(
    "name, params, message",
    [
        (
            "staging_stall",
            {"ramp_steps": 0},
            "fault staging_stall: params.ramp_steps: expected an int >= 1, got 0",
        ),
        (
            "table_overflow",
            {"neighbours": True},
            "fault table_overflow: params.neighbours: expected an int >= 0, got True",
        ),
        (
            "refcount_leak",
            {"paths": ["nope"]},
            f"fault refcount_leak: params.paths.0: expected one of {PHASES}, got 'nope'",
        ),
        (
            "ordering_race",
            {"lag": 1},
            "fault ordering_race: params.lag: unknown param of fault ordering_race; allowed: "
            "['from_step', 'lag_rank', 'lag_steps', 'probability', 'variant']",
        ),
    ],
)
def test_constructing_a_fault_with_a_bad_param_is_a_clear_value_error(name, params, message):
    with pytest.raises(ValueError) as ei:
        make_fault(name, True, params, 0)
    assert str(ei.value) == message


def test_unknown_top_level_key(tmp_path):
    path = write(tmp_path, 'colour = "red"\n' + HEAD)
    msg = load_error(path)
    assert msg == (
        f"{path}: colour: unknown key; allowed: ['engine', 'expect', 'faults', 'run', 'scenario', "
        f"'workload']"
    )


def test_missing_name(tmp_path):
    msg = load_error(write(tmp_path, '[scenario]\ndescription = "x"\n'))
    assert "scenario.name: Field required" in msg


def test_bad_toml_syntax_names_the_file_and_line(tmp_path):
    path = write(tmp_path, HEAD + "[workload\nnum_requests = 3\n")
    msg = load_error(path)
    assert msg.startswith(f"{path}: not valid TOML") and "line 3" in msg


def test_missing_file_names_it_and_lists_the_builtins(tmp_path):
    msg = load_error(tmp_path / "nope.toml")
    assert (
        "nope.toml: no such scenario file or built-in scenario" in msg and "baseline-clean" in msg
    )


def test_parse_scenario_of_a_dict_names_its_source():
    with pytest.raises(ScenarioError, match=r"^<mine>: workload.bogus: unknown key"):
        parse_scenario({"scenario": {"name": "x"}, "workload": {"bogus": 1}}, "<mine>")


def test_unknown_checker_list_matches_the_checkers():
    from kvchaos.harness.check.checkers import CHECKERS as RUN

    assert list(CHECKERS) == list(RUN)


# -- workload plans ----------------------------------------------------------------------------
def plan_of(sc, seed):
    p = build_plan(sc.workload, sc.engine_config().model.vocab_size, seed)
    return json.dumps([a.to_dict() for a in p.actions]), [a.prompt for a in p.actions]


def test_same_seed_same_plan_different_seed_different_plan():
    sc = load_scenario("baseline-clean")
    a, b, c = plan_of(sc, 4), plan_of(sc, 4), plan_of(sc, 5)
    assert a == b  # byte-identical, prompts included
    assert a[0] != c[0] and a[1] != c[1]
    actions = json.loads(a[0])
    assert {x["op"] for x in actions} == {"submit", "fork", "cancel"}
    assert sum(x["op"] == "submit" for x in actions) == sc.workload.num_requests


@pytest.mark.parametrize(
    "dist",
    [
        {"dist": "fixed", "value": 7},
        {"dist": "uniform", "min": 3, "max": 9},
        {"dist": "lognormal", "median": 6, "sigma": 1.0, "min": 2, "max": 30},
        {"dist": "bimodal", "modes": [4, 40], "min": 1, "max": 64},
    ],
)
def test_length_distributions_stay_in_bounds(dist):
    sc = parse_scenario(
        {"scenario": {"name": "x"}, "workload": {"num_requests": 200, "prompt_len": dist}}
    )
    lens = [x["prompt_len"] for x in json.loads(plan_of(sc, 1)[0]) if x["op"] == "submit"]
    d = sc.workload.prompt_len
    if d.dist == "fixed":
        assert set(lens) == {7}
    else:
        assert d.min <= min(lens) and max(lens) <= d.max and len(set(lens)) > 2
    if d.dist == "bimodal":  # two clusters, nothing in the middle
        assert all(x < 15 or x > 25 for x in lens) and min(lens) < 15 < 25 < max(lens)


def _replay_scenario(tmp_path, name):
    return write(
        tmp_path, HEAD + f'[workload]\nnum_requests = 99\nlengths_file = "{name}"\n', "replay.toml"
    )


def test_lengths_file_csv_replayed_in_order_relative_to_the_scenario_file(tmp_path, monkeypatch):
    (tmp_path / "lens.csv").write_text("prompt_len,output_len\n5,3\n\n12,1\n2,30\n")
    path = _replay_scenario(tmp_path, "lens.csv")
    monkeypatch.chdir(tmp_path.parent)  # not where the file is
    sc = load_scenario(path)
    subs = [x for x in json.loads(plan_of(sc, 0)[0]) if x["op"] == "submit"]
    assert [(x["prompt_len"], x["max_new"]) for x in subs] == [
        (5, 3),
        (12, 1),
        (2, 30),
    ]  # num_requests ignored


def test_lengths_file_jsonl(tmp_path):
    (tmp_path / "lens.jsonl").write_text(
        '{"prompt_len": 3, "output_len": 4}\n\n{"prompt_len": 8, "output_len": 1}\n'
    )
    assert read_lengths(str(tmp_path / "lens.jsonl")) == [(3, 4), (8, 1)]
    sc = load_scenario(_replay_scenario(tmp_path, "lens.jsonl"))
    assert len([x for x in json.loads(plan_of(sc, 0)[0]) if x["op"] == "submit"]) == 2


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("l.csv", "4,4\n5,x\n", "l.csv:2: expected prompt_len,output_len"),
        ("l.csv", "4,4\n5\n", "l.csv:2: expected prompt_len,output_len"),
        ("l.csv", "4,4\n\n3,0\n", "l.csv:3: lengths must be >= 1"),
        ("l.csv", "-3,4\n", "l.csv:1: lengths must be >= 1"),
        ("l.csv", "prompt_len,output_len\n", "l.csv: no lengths in the file"),
        (
            "l.jsonl",
            '{"prompt_len": 3, "output_len": 4}\n{"prompt_len": 3}\n',
            'l.jsonl:2: expected {"prompt_len"',
        ),
        ("l.jsonl", '{"prompt_len": 3, "output_len": 4}\nnot json\n', "l.jsonl:2: expected"),
        ("l.jsonl", '\n{"prompt_len": 0, "output_len": 4}\n', "l.jsonl:2: lengths must be >= 1"),
    ],
)
def test_lengths_file_errors_name_the_line_at_load_time(tmp_path, name, text, expected):
    (tmp_path / name).write_text(text)
    path = _replay_scenario(tmp_path, name)
    msg = load_error(path)
    assert msg.startswith(f"{path}: workload.lengths_file: ") and expected in msg, msg


def test_lengths_file_missing(tmp_path):
    path = _replay_scenario(tmp_path, "gone.csv")
    msg = load_error(path)
    assert "workload.lengths_file: cannot read" in msg and "gone.csv" in msg


def test_a_fault_class_must_give_every_param_a_domain():
    from kvchaos.faults.base import COUNT, Fault

    with pytest.raises(
        TypeError,
        match=r"fault half: domains \['a'\] must name exactly the params of defaults \['a', 'b'\]",
    ):

        class Half(Fault):  # noqa: F841
            name = "half"
            defaults = {"a": 1, "b": 2}
            domains = {"a": COUNT}
