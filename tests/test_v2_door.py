"""A protocol v2 manager comes in by the user door: checked before any run,
then run by `kvchaos run --block-manager module:Class` on a table the engine builds. Its reserved
ids (vLLM's null block 0) are outside the usable pool: accounting and leaks count usable ids, and
handing one out is a finding."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvchaos.harness.cli import main
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.run.user_code import validate_manager
from kvchaos.harness.scenario.spec import BUILTIN_DIR, load_scenario

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))  # tests/managers.py, named by spec

import managers  # noqa: E402


def test_the_door_takes_a_v2_manager():
    assert validate_manager("managers:PlainV2") is managers.PlainV2


@pytest.mark.parametrize("name", ["baseline-clean", "prefix-samples-clean"])
def test_a_v2_manager_with_a_null_block_runs_clean_scenarios_to_pass(name):
    sc = load_scenario(BUILTIN_DIR / f"{name}.toml", "cpu")
    r = run_scenario(sc, 1, "cpu", None, block_manager=managers.PlainV2)
    assert r.verdict == "PASS", r.summary
    assert r.results["block_manager_protocol"] == 2
    snaps = [e for e in r.events if e["e"] == "snapshot"]
    assert snaps and all(e["reserved"] == [0] for e in snaps)
    held = {b for e in snaps for bs in e["seq_blocks"].values() for b in bs}
    assert 0 not in held and len(held) > 10  # the pool was used, all but its null block
    last = snaps[-1]
    assert len(last["free"]) == last["num_blocks"] - 1 and not last["seq_blocks"]  # all returned


def test_handing_out_a_reserved_block_is_a_finding_named_once():
    sc = load_scenario(BUILTIN_DIR / "baseline-clean.toml", "cpu")
    r = run_scenario(sc, 0, "cpu", None, block_manager=managers.HandsOutNullBlock)
    assert r.verdict == "FAIL", r.summary
    found = [f for f in r.findings if f.kind == "reserved_block"]
    assert len(found) == 1 and found[0].step == 1, found
    assert found[0].message == "reserved block 0 handed out: free (the manager reserves [0])"
    held = [f for f in r.findings if f.checker == "block_accounting" and f.kind != "reserved_block"]
    assert not held, held  # conservation counts the usable ids: it holds


def test_kvchaos_run_takes_a_v2_manager_by_spec(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(TESTS)
    rc = main(
        ["run", "baseline-clean", "--block-manager", "managers:PlainV2", "--seed", "0"]
        + ["--report-dir", str(tmp_path), "--format", "json", "-q"]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["verdict"] == "PASS", out
    results = json.loads(Path(out["runs"][0]["run_dir"], "results.json").read_text())
    assert results["block_manager"] == "managers:PlainV2"
    assert results["block_manager_protocol"] == 2


def test_conformance_drives_a_v2_manager_in_v2_calls():
    from kvchaos.harness.conformance.suite import run_conformance

    ok = {r.name: r.status for r in run_conformance(managers.PlainV2, examples=40)}
    assert ok["data"] == ok["release_reasons"] == ok["reserved_never_handed_out"] == "passed"
    assert "failed" not in ok.values() and ok["hit_over_cap"] == "not applicable", ok
    bad = {r.name: r for r in run_conformance(managers.HandsOutNullBlock, examples=40)}
    assert [n for n, r in bad.items() if r.status == "failed"] == ["reserved_never_handed_out"]
    assert "reserved block 0" in bad["reserved_never_handed_out"].message


def test_a_request_is_judged_against_the_usable_pool_and_snapshots_carry_reserved_ids():
    """A manager reserving block 0 has num_blocks - 1 to hand out: a request needing all of them
    can never fit and is refused at once, naming the reserved id; the snapshot says which."""
    from kvchaos.engine import CacheConfig, Engine, EngineConfig, ModelConfig
    from kvchaos.engine.errors import RequestRejected

    model = ModelConfig(num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8,
                        intermediate_size=32, vocab_size=31, max_position=64)  # fmt: skip
    cache = CacheConfig(block_size=4, num_blocks=8, max_blocks_per_seq=8, max_num_seqs=2)
    eng = Engine(EngineConfig(model=model, cache=cache, attention_backend="torch"),
                 managers.PlainV2(8, 4))  # fmt: skip
    with pytest.raises(
        RequestRejected, match=r"needs 8 blocks, the pool has 7 usable \(1 reserved"
    ):
        eng.add_request("all", list(range(30)), 2)
    eng.add_request("fits", list(range(26)), 2)  # 7 blocks
    eng.step()
    assert eng.snapshot().reserved == [0]


class IdsOutsideThePool(managers.PlainV2):
    """Answers block_ids with one id past the pool it sized (the KV pool has no such block)."""

    def block_ids(self, seq_id):
        ids = list(super().block_ids(seq_id))
        return ids[:-1] + [10**6] if len(ids) > 2 else ids


def test_a_block_id_outside_the_pool_is_a_finding_against_the_manager_not_a_harness_error():
    r = run_scenario(load_scenario("baseline-clean"), 0, "cpu", None, IdsOutsideThePool)
    assert r.verdict == "FAIL", r.summary
    (f,) = [f for f in r.findings if f.checker == "manager_calls"]
    assert "block_ids(" in f.message and "outside the pool [0, " in f.message
