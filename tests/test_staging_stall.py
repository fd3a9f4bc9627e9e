"""The staging stall's variants and their real cost, from ground truth and counts (no timing): a
pinned CPU buffer is mlock'ed and keeps its pages, a pageable one gives them back and the next copy
faults them in (the kernel's own count, which is what "fired" is); each variant pulls its trigger,
fires where its defect is planted and is remediated where it is not; where no page can be dropped
the ramp alone falls back to a busy-wait, and says so."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from kvchaos.engine import CacheConfig, Engine, EngineConfig, ModelConfig
from kvchaos.engine.staging import StagingBuffer
from kvchaos.faults import REGISTRY, ParamError, make_fault
from kvchaos.faults.staging_stall import StagingStall

VARIANTS = StagingStall.variant_names()
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
    assert REGISTRY["staging_stall"] is StagingStall
    for v, text in StagingStall.variants.items():
        f = make_fault("staging_stall", True, {"variant": v}, 0)
        assert StagingStall.label(f.p) == f"staging_stall/{v}"
        assert f.describe()["root_cause"] == text.root_cause != ""
    with pytest.raises(ParamError, match="params.variant: expected one of"):
        StagingStall.check_params({"variant": "wobble"})


def test_every_variant_is_recorded_by_its_label_with_the_kernels_counts_out_of_the_digest():
    """The ramp is named staging_stall/ramp like the others; the kernel's fault counts (minflt)
    are measured, so the digest leaves them out as it leaves out a step's timings."""
    from kvchaos.harness.history.log import stable_line

    f = make_fault("staging_stall", True, {}, 0)
    assert f.describe()["label"] == "staging_stall/ramp"
    f.arm(_engine(), lambda *a, **k: None)
    truth = f.verify()
    assert {"variant", "faulted", "not_applicable", "minflt"} <= set(truth)
    end = {"e": "run_end", "step": 9, "fault_verify": {"staging_stall": truth}}
    counted = {**truth, "minflt": {"9": 50}}
    assert stable_line(end) == stable_line({**end, "fault_verify": {"staging_stall": counted}})


def _engine(rows: int = 8) -> Engine:
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
    cache = CacheConfig(block_size=8, num_blocks=32, max_blocks_per_seq=512, max_num_seqs=rows)
    return Engine(EngineConfig(model=model, cache=cache, device="cpu"))


def _run(
    variant: str, defect: bool, steps: int = 30, rows: int = 8, **params
) -> tuple[Engine, StagingStall]:
    eng, events = _engine(rows), []
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
def test_the_ramp_drops_a_growing_share_and_the_kernel_counts_each_page_faulted_in():
    """64 rows x 512 entries: 32 pages; 4 ramp steps: 8 more reclaimed each step from step 5,
    then all 32 every step. Fired from the kernel's count: at least the dropped pages faulted in
    across each copy (other threads' faults may add to it, never take from it)."""
    eng, f = _run("ramp", True, steps=12, rows=64, at_step=5, ramp_steps=4)
    truth = f.verify()
    assert eng.staging.page_count() == 32 and truth["not_applicable"] is None
    assert truth["first_step"] == 5 and f.triggered == [5]
    assert [(x["step"], x["pages"]) for x in truth["faulted"]] == [
        (5, 8), (6, 16), (7, 24), (8, 32), (9, 32), (10, 32), (11, 32), (12, 32)
    ]  # fmt: skip
    assert all(truth["minflt"][str(x["step"])] >= x["pages"] for x in truth["faulted"])
    assert "unfaulted" not in truth


def test_fired_is_the_kernels_count_not_the_faults_own_word(monkeypatch):
    """Pages dropped but no minor fault counted across the copy (as a platform whose madvise
    does not free them): no cost paid, so not fired; the uploads are named unfaulted."""
    from kvchaos.faults import staging_stall

    monkeypatch.setattr(staging_stall, "minor_faults", lambda: 7)
    monkeypatch.setattr(StagingBuffer, "drop_pages", lambda self, first, count: count)
    _, f = _run("from_start", True, steps=5)
    truth = f.verify()
    assert not truth["fired"] and truth["faulted"] == [] and truth["unfaulted"] == [1, 2, 3, 4, 5]


def test_without_madvise_the_ramp_busy_waits_and_says_so_the_others_cost_nothing(monkeypatch):
    """The one busy-wait left: where no page can be dropped, the ramp charges its modelled cost
    (a share of plateau_us per bad page) and not_applicable says it is modelled; from_start has
    no real cost to pay, so it records not_applicable and never fires."""
    from kvchaos.faults import staging_stall

    waits = []
    monkeypatch.setattr(StagingBuffer, "drop_pages", lambda self, first, count: 0)
    monkeypatch.setattr(staging_stall, "busy_wait", waits.append)
    eng, f = _run("ramp", True, steps=8, rows=64, at_step=5, ramp_steps=4, plateau_us=400.0)
    truth = f.verify()
    assert "modelled, a busy-wait" in truth["not_applicable"] and ("not_applicable", 5) in f.events
    assert [x["pages"] for x in truth["faulted"]] == [8, 16, 24, 32] and truth["minflt"] == {}
    assert waits == pytest.approx([1e-4, 2e-4, 3e-4, 4e-4])
    _, g = _run("from_start", True, steps=3)
    assert not g.verify()["fired"] and "no MADV_DONTNEED" in g.verify()["not_applicable"]
    assert "modelled" not in g.verify()["not_applicable"]


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


def test_the_soak_draws_every_variant_alone_on_a_serving_size_table_and_in_a_mix_its_trigger():
    """Every variant's cost is real (a microsecond a page): drawn alone, on a table of 100 pages
    and up with a floor for a small stall; in a mix, whose table is small, the trigger alone."""
    from kvchaos.harness.tools.soak_space import STAGED_ENTRIES, generate_scenario

    seen, mixed = set(), 0
    for seed in range(300):
        d = generate_scenario(seed)
        f = next((f for f in d.get("faults", []) if f["name"] == "staging_stall"), None)
        if f is None:
            continue
        cache = d["engine"]["cache"]
        if len(d["faults"]) > 1:
            mixed += 1
            assert not f["defect"] and "variant" not in f["params"] and "run" not in d
            continue
        seen.add(f["params"]["variant"])
        assert cache["max_num_seqs"] * cache["max_blocks_per_seq"] >= STAGED_ENTRIES
        assert d["run"]["latency_floor_ms"] < 0.5
    assert seen == set(VARIANTS) and mixed


@linux
def test_the_bench_counts_a_fault_per_dropped_page_and_none_for_the_pinned_copy():
    from kvchaos.harness.bench.staging import page_faults

    r = page_faults(runs=5)
    large = r["large"]
    assert large["pageable_dropped"]["pages_dropped"] == 1024
    assert large["pageable_dropped"]["minflt_median"] >= 1024
    assert large["pageable"]["minflt_median"] < 1024  # pages kept: nothing to fault in
    if large["pinned"]["pinned"]:  # mlock granted: reclaim cannot take a page of it
        assert large["pinned"]["minflt_median"] < 1024


@linux
@pytest.mark.timing  # measured time
def test_a_dropped_serving_size_table_costs_several_times_the_pinned_copy():
    """The real cost the ramp's scenario judges: 1024 pages faulted in, against the same copy
    into a pinned buffer (medians of 40 copies; a page fault is ~0.3-1 us, the copy ~0.1 ms)."""
    from kvchaos.harness.bench.staging import page_faults

    large = page_faults()["large"]
    assert large["pageable_dropped"]["median_us"] > 3 * large["pinned"]["median_us"]
    assert large["dropped_minus_pinned_us"] > 200
