"""The staging stall's variants and their real cost, from ground truth and counts (no timing): a
pinned CPU buffer is mlock'ed and keeps its pages, a pageable one gives them back and the next copy
faults them in (the kernel's own count); each variant pulls its trigger, fires where its defect is
planted and is remediated where it is not; the ramp is recorded as before the variants."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from kvchaos.engine import CacheConfig, Engine, EngineConfig, ModelConfig
from kvchaos.engine.staging import StagingBuffer
from kvchaos.faults import REGISTRY, Fault, ParamError, make_fault
from kvchaos.faults.staging_stall import RAMP_PARAMS, TEXT, VARIANTS, StagingStall

linux = pytest.mark.skipif(sys.platform != "linux", reason="MADV_DONTNEED drops pages on Linux")


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@linux
def test_a_pageable_buffer_gives_its_pages_back_and_the_copy_faults_them_in():
    host = torch.arange(20000, dtype=torch.int32)
    buf = StagingBuffer(host.numel(), pinned=False)
    buf.stage(host)
    assert buf.page_count() == 20 and not buf.pinned
    assert buf.drop_pages(0, buf.page_count()) == 20
    before = _minflt()
    assert torch.equal(buf.stage(host), host)  # the contents are the copy's all the same
    assert _minflt() - before >= 20  # each dropped page faulted in again


@linux
def test_a_pinned_buffer_is_locked_and_keeps_its_pages():
    buf = StagingBuffer(20000, pinned=True)
    if not buf.pinned:
        pytest.skip(f"mlock not granted here: {buf.why}")
    assert buf.drop_pages(0, buf.page_count()) == 0  # nothing to take: its pages are locked
    host = torch.arange(20000, dtype=torch.int32)
    before = _minflt()
    buf.stage(host)
    assert _minflt() - before < 20


def test_variants_are_params_and_labels():
    assert REGISTRY["staging_stall"] is StagingStall and set(TEXT) == set(VARIANTS)
    for v in VARIANTS:
        f = make_fault("staging_stall", True, {"variant": v}, 0)
        assert StagingStall.label(f.p) == f"staging_stall/{v}"
        assert f.describe()["root_cause"] == TEXT[v][0]
    with pytest.raises(ParamError, match="params.variant: expected one of"):
        StagingStall.check_params({"variant": "wobble"})


def test_the_ramp_is_recorded_as_before_the_variants():
    """Its armed record and ground truth hold the keys they held before there were variants, so
    its histories (and their digests) are what they were."""
    f = make_fault("staging_stall", True, {}, 0)
    d = f.describe()
    assert d["label"] == "staging_stall" and list(d["params"]) == list(RAMP_PARAMS)
    f.arm(_engine(), lambda *a, **k: None)
    assert set(f.verify()) - set(Fault(True, {}, 0).verify()) == {
        "page_faults_charged",
        "stall_seconds_charged",
    }


def _engine() -> Engine:
    model = ModelConfig(
        num_layers=1,
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=64,
        vocab_size=61,
        max_position=256,
    )
    cache = CacheConfig(block_size=8, num_blocks=32, max_blocks_per_seq=512, max_num_seqs=8)
    return Engine(EngineConfig(model=model, cache=cache, device="cpu"))


def _run(variant: str, defect: bool, steps: int = 30, **params) -> tuple[Engine, StagingStall]:
    eng, events = _engine(), []
    f = make_fault("staging_stall", defect, {"variant": variant, **params}, 0)
    f.arm(eng, lambda kind, detail, step=None: events.append((kind, step)))
    eng.add_request("a", list(range(6)), steps + 4)
    for step in range(1, steps + 1):
        f.before_step(eng, step)
        out = eng.step()
        f.after_step(eng, step, out)
    f.events = events
    return eng, f


@linux
def test_from_start_fires_from_the_first_upload_and_every_one_after():
    eng, f = _run("from_start", True)
    truth = f.verify()
    assert f.triggered == [1] and truth["fired"] and truth["first_step"] == 1
    pages = -(-eng.table.table.host_tensor.numel() * 4 // 4096)
    assert [x["step"] for x in truth["faulted"]] == list(range(1, 31))
    assert all(x["pages"] == pages for x in truth["faulted"])
    assert eng.counters["staging_reallocs"] == 0 and truth["remediated"] == 0


@linux
def test_bursts_fault_only_inside_their_windows():
    _, f = _run("bursts", True, at_step=5, burst_steps=3, burst_every=10)
    steps = [x["step"] for x in f.verify()["faulted"]]
    assert steps == [5, 6, 7, 15, 16, 17, 25, 26, 27]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_remediated_engine_reallocates_and_never_pays(variant):
    eng, f = _run(variant, False, at_step=5)
    truth = f.verify()
    assert truth["triggered"] == 1 and not truth["fired"]
    assert eng.counters["staging_reallocs"] == 1 and truth["remediated"] == 1
    assert eng.staging.valid() and eng.staging.pinned == StagingBuffer(8, True).pinned


def test_a_staging_finding_is_the_stall_where_its_uploads_reach_one_that_faulted():
    faulted = [{"step": s, "pages": 50} for s in (5, 6, 7)]
    truth = {"fired": True, "first_step": 5, "faulted": faulted}
    f = {
        "checker": "latency",
        "step": 7,
        "kind": "staging_slow",
        "evidence": {"steps": [4, 5, 6, 7]},
    }
    assert StagingStall.explains(f, truth) == "cause"  # step 4: a neighbour's, next to the burst
    off = {**f, "step": 11, "evidence": {"steps": [8, 9, 10, 11]}}  # all sound uploads
    assert StagingStall.explains(off, truth) is None


def test_the_soak_draws_every_variant_the_ramp_as_it_was():
    from kvchaos.harness.tools.soak_space import STAGED_ENTRIES, generate_scenario

    seen = set()
    for seed in range(150):
        d = generate_scenario(seed)
        f = next((f for f in d.get("faults", []) if f["name"] == "staging_stall"), None)
        if f is None:
            continue
        v = f["params"].get("variant", "ramp")
        seen.add(v)
        cache = d["engine"]["cache"]
        if v == "ramp":  # the draws of the soak before the variants
            assert set(f["params"]) == {"at_step", "ramp_steps", "plateau_us"} and "run" not in d
        else:  # a real cost needs a serving-size table, a floor for a small stall
            assert cache["max_num_seqs"] * cache["max_blocks_per_seq"] >= STAGED_ENTRIES
            assert d["run"]["latency_floor_ms"] < 0.5
    assert seen == set(VARIANTS)
