"""The worked example of an adapter (kvchaos.harness.adapters.example, docs/adapters.md): a toy
engine's own manager, wrapped method by method, passes the door, conformance v2 on what it
declares, and a clean prefix scenario with its cache serving hits; a page it reuses loses its
key, and conformance catches the adapter when it caches pages a failed step never wrote."""

from __future__ import annotations

from kvchaos.harness.adapters.example import MyKV, MyKVManager
from kvchaos.harness.conformance.suite import run_conformance
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.run.user_code import validate_manager
from kvchaos.harness.scenario.spec import BUILTIN_DIR, load_scenario

SPEC = "kvchaos.harness.adapters.example:MyKVManager"


def test_mykv_serves_a_dropped_requests_full_pages_until_it_reuses_them():
    kv = MyKV(4, 2)
    assert kv.reserve("a", 5) and kv.blocks("a") == [0, 1, 2]
    kv.drop("a", [7, 8, 9, 10, 11])  # computed: two full pages are cached, the third is partial
    assert kv.free == [3, 2, 1, 0]  # its tail is reused first
    assert kv.lookup([7, 8, 9, 10, 12]) == [0, 1] and kv.lookup([7, 9]) == []
    assert kv.reserve("b", 3, kv.lookup([7, 8, 9])) and kv.blocks("b") == [0, 3]
    assert kv.lookup([7, 8, 9, 10]) == [0, 1]
    assert kv.reserve("c", 4) and kv.blocks("c") == [2, 1]
    assert kv.lookup([7, 8, 9, 10]) == [0]  # page 1 went to c: its key is gone
    assert not kv.reserve("c", 5) and kv.blocks("c") == [2, 1]  # no room: nothing changes


def test_the_example_adapter_passes_the_door_and_conformance():
    assert validate_manager(SPEC) is MyKVManager
    results = {r.name: r.status for r in run_conformance(MyKVManager, examples=60)}
    assert results["data"] == results["hit_over_cap"] == results["refusal"] == "passed", results
    assert "failed" not in results.values(), results


def test_the_example_adapter_runs_a_prefix_scenario_with_hits():
    sc = load_scenario(BUILTIN_DIR / "prefix-samples-clean.toml", "cpu")
    r = run_scenario(sc, 0, "cpu", None, block_manager=MyKVManager)
    assert r.verdict == "PASS", r.summary
    bs = r.events[0]["config"]["cache"]["block_size"]
    hits = [e["data"] for e in r.events if e["e"] == "engine" and e["kind"] == "hit"]
    assert len(hits) > 3 and all(h["used"] % bs == 0 for h in hits)  # whole pages


class CachesUnwrittenPages(MyKVManager):
    """Caches every page it reserved, computed or not: a failed step's pages are served."""

    def release(self, seq_id, reason):
        if seq_id not in self.done:
            return False
        self.done.pop(seq_id)
        self.kv.drop(seq_id, self.tokens.pop(seq_id))
        return True


def test_conformance_catches_an_adapter_that_caches_pages_a_failed_step_never_wrote():
    results = run_conformance(CachesUnwrittenPages, examples=100, shrink_steps=100)
    results = {r.name: r for r in results}
    bad = [n for n, r in results.items() if r.status == "failed"]
    assert bad == ["data"], bad
    assert any("failed_step" in step for step in results["data"].steps)  # Hypothesis's rules
    assert any(line.startswith("m.") for line in results["data"].reproducer)  # the calls
