"""The host tier's CUDA path (engine/tier_stream.py): copies on a side stream, each block's event
waited for. Not run on a GPU yet: the `gpu` tests skip without CUDA and are its first check. On
the CPU the tier never builds the side stream nor touches torch.cuda's streams and events."""

from __future__ import annotations

import pytest
import torch

from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario

needs_cuda = (
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)"),
)


def gpu(fn):
    for m in needs_cuda:
        fn = m(fn)
    return fn


SIDE = ("offload_side_blocks", "offload_side_waits", "offload_compute_waits", "offload_host_waits")


def _counters(r) -> dict:
    return next(e for e in r.events if e.get("e") == "run_end")["counters"]


def _no_cuda(*a, **k):
    raise AssertionError("the CPU path built a CUDA stream or event")


def test_the_cpu_path_never_builds_a_cuda_stream_or_event(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", _no_cuda)
    monkeypatch.setattr(torch.cuda, "Event", _no_cuda)
    r = run_scenario(load_scenario("offload-bandwidth-clean"), 1, report_dir=None)
    assert r.verdict == "PASS", r.summary
    assert not set(SIDE) & set(_counters(r))  # the side stream's counts: CUDA only


@gpu
@pytest.mark.parametrize("name", ["offload-tier-clean", "offload-bandwidth-clean"])
def test_a_tier_run_on_cuda_copies_on_the_side_stream_and_holds(name):
    r = run_scenario(load_scenario(name), 0, device="cuda", report_dir=None)
    assert r.verdict == "PASS", r.summary
    c = _counters(r)
    copies = c["offload_stores"] + c["offload_restores"]
    assert copies and c["offload_side_blocks"] > 0
    assert c["offload_side_waits"] == copies  # each copy ordered after the compute stream
    assert c["offload_compute_waits"] > 0 and c["offload_host_waits"] > 0


@gpu
def test_a_store_before_compute_on_cuda_skips_the_real_wait_and_is_caught():
    r = run_scenario(
        load_scenario("offload-store-before-compute-bandwidth-detect"), 0, "cuda", None
    )
    assert r.verdict == "PASS", r.summary
    c = _counters(r)
    assert r.results["fault_verify"]["offload"]["early"]
    # the stores that raced the step in flight did not wait on the compute stream
    assert c["offload_side_waits"] < c["offload_stores"] + c["offload_restores"]


@gpu
def test_the_side_stream_copies_out_and_back_block_by_block():
    from kvchaos.engine.tier_stream import SideStream

    counts: dict[str, int] = {}
    side = SideStream(torch.device("cuda"), counts)
    dev = [torch.randn(2, 2, 6, 4, 2, 8, device="cuda")]
    host = [torch.zeros(2, 2, 5, 4, 2, 8, pin_memory=True)]
    marks = side.store([(1, 0), (3, 2), (4, 4)], dev, host, skip={1}, wait=True)
    side.host_wait(marks)
    assert torch.equal(host[0][:, :, 0], dev[0][:, :, 1].cpu())
    assert torch.equal(host[0][:, :, 4], dev[0][:, :, 4].cpu())
    assert not host[0][:, :, 2].any()  # skipped: its host copy kept
    back = side.restore([(0, 5), (4, 0)], dev, host)
    side.compute_wait(back)
    assert torch.equal(dev[0][:, :, 5].cpu(), host[0][:, :, 0])
    assert counts == {
        "offload_side_blocks": 4,
        "offload_side_waits": 2,
        "offload_compute_waits": 2,
        "offload_host_waits": 3,
    }
