"""Nothing runs and blocks sit with sequences that do not run (idle, or resumed and waiting behind
the head): the newest gives its blocks back (engine/scheduler.py `_give_back`). The rule held only
when the plan's estimate said the head lacks room and nothing was left running; soak seed 1015
(the tier mixes on the prefix-caching reference) found the two stalls it missed, each a run that
never finished (liveness at max_steps)."""

from __future__ import annotations

import tomllib

from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import parse_scenario

ENGINE = """
[engine]
max_prefill_tokens = 33
async_scheduling = true
offload = { host_blocks = 228, cold_steps = 4, latency_steps = 2, preempt = false }

[engine.cache]
prefix_caching = true
block_size = 2
num_blocks = 38
max_blocks_per_seq = 31
max_num_seqs = 8

[workload.prefix]
groups = 2
prefix_len = { dist = "uniform", min = 9, max = 19 }
share = 0.7

[workload.think]
share = 0.996
think_steps = { dist = "uniform", min = 4, max = 9 }
"""

# soak seed 1015 as drawn: its admission refused past the estimate stalled the run from step 133
SOAK_1015 = (
    ENGINE
    + """
[workload]
num_requests = 15
arrival_rate = 0.74
prompt_len = { dist = "uniform", min = 8, max = 24 }
output_len = { dist = "uniform", min = 8, max = 13 }

[[faults]]
name = "offload"
defect = false
params = { variant = "restore_race" }

[[faults]]
name = "async_free"
defect = false
params = { cancels = 4, variant = "preempt" }

[[faults]]
name = "prefix_cache"
defect = false
params = { pairs = 1, pressure_tokens = 0, variant = "partial_key" }
"""
)

# its shrunk neighbour: the one running sequence stuck mid-prefill from step 62
STUCK_PREFILL = (
    ENGINE
    + """
[workload]
num_requests = 15
output_len = { dist = "fixed", value = 6 }

[[faults]]
name = "prefix_cache"
defect = false
"""
)


def _run(text: str, name: str):
    d = tomllib.loads(f'[scenario]\nname = "{name}"\nseeds = [1015]\n' + text)
    d["expect"] = {"outcome": "clean"}
    return run_scenario(parse_scenario(d, f"<{name}>"), 1015, report_dir=None)


def _steps(r) -> list[dict]:
    return [e for e in r.events if e.get("e") == "step"]


def _unfinished(r) -> set[str]:
    submitted = {e["req"] for e in r.events if e.get("e") == "submit"}
    finished = {q for e in _steps(r) for q in e["finished"]}
    cancelled = {e["req"] for e in r.events if e.get("e") == "cancel"}
    return submitted - finished - cancelled


def test_a_head_refused_past_its_estimate_with_nothing_running_gets_a_give_back():
    """r13's admission, hit revived, takes 20 blocks where its estimate said 17 of the 19 free;
    r12, restored and resumed, waits behind it holding 19. The plan ran r13, the manager refused
    it, and nothing gave back: for ever. Now the give-back follows the refusal, the same step."""
    r = _run(SOAK_1015, "soak-1015")
    assert r.verdict == "PASS", r.summary
    assert not [f for f in r.findings if f.checker == "liveness"], r.summary
    assert not _unfinished(r)
    gave = []  # steps where a refused admission ran once another gave its blocks back
    for e in r.events:
        if e.get("e") != "calls":
            continue
        calls = e["calls"]
        for i, (name, args, out) in enumerate(calls):
            if name != "admit" or not (isinstance(out, dict) and "refused" in out):
                continue
            after = calls[i + 1 :]
            back = [a[0] for n, a, _ in after if n == "release" and a[0] != args[0]]
            ran = [o for n, a, o in after if n == "admit" and a[0] == args[0]]
            if back and ran and not isinstance(ran[0], dict):
                gave.append(e["step"])
    assert gave, "no refused admission was followed by a give-back"


def test_the_one_running_sequence_stuck_mid_prefill_gets_a_give_back():
    """r8 runs alone, its next chunk past the free blocks; r10, restored, and others wait holding
    theirs behind a head stored out that cannot fit. The rule asked for nothing running."""
    r = _run(STUCK_PREFILL, "stuck-prefill")
    assert r.verdict == "PASS", r.summary
    assert not [f for f in r.findings if f.checker == "liveness"], r.summary
    assert not _unfinished(r)
    ran = [e for e in _steps(r) if e["running"] == 1 and e["preempted"]]
    assert ran  # a give-back while one ran
    assert len(_steps(r)) < 400
