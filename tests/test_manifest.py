"""Latent vs manifest, per finding, on hand-made histories: manifest only where a request whose
output diverged, at or after the finding, is one the finding touches."""

from __future__ import annotations

from kvchaos.harness.check.evaluate import mark_manifest
from kvchaos.harness.check.findings import CheckResult, Finding


def diverged(req, at):
    return {"e": "oracle", "step": at + 5, "req": req, "first_divergence": 2, "divergence_step": at}


def judge(checker, finding, *events):
    c = CheckResult(checker=checker, valid=False, findings=[finding], error=None, checked=1)
    mark_manifest([c], list(events))
    return c.findings[0].manifest


def test_a_finding_on_a_request_that_diverged_after_it_is_manifest():
    f = Finding(
        checker="table_integrity",
        step=10,
        message="",
        evidence={"row": 1, "owner": "r1"},
        manifest=False,
        kind="foreign_block",
    )
    assert judge("table_integrity", f, diverged("r1", 12)) is True


def test_a_divergence_before_the_finding_is_not_its_doing():
    f = Finding(
        checker="table_integrity",
        step=10,
        message="",
        evidence={"row": 1, "owner": "r1"},
        manifest=False,
        kind="foreign_block",
    )
    assert judge("table_integrity", f, diverged("r1", 4)) is False


def test_a_finding_on_another_request_stays_latent_whatever_diverged_elsewhere():
    f = Finding(
        checker="block_accounting",
        step=10,
        message="",
        evidence={"req": "r2"},
        manifest=False,
        kind="leak",
    )
    assert judge("block_accounting", f, diverged("r1", 12)) is False


def test_a_finding_that_names_no_request_stays_latent():
    end = Finding(
        checker="block_accounting",
        step=40,
        message="",
        evidence={"free": 5, "total": 8},
        manifest=False,
        kind="end_leak",
    )
    assert judge("block_accounting", end, diverged("r1", 41)) is False
    nobody = Finding(
        checker="table_integrity",
        step=10,
        message="",
        evidence={"row": 3, "owner": None},
        manifest=False,
        kind="foreign_block",
    )
    assert judge("table_integrity", nobody, diverged("r1", 12)) is False


def test_cross_rank_is_manifest_through_the_requests_live_at_its_step():
    f = Finding(
        checker="cross_rank",
        step=7,
        message="",
        evidence={"ranks": [1]},
        manifest=None,
        kind="stale_table",
    )
    snap = {"e": "snapshot", "step": 7, "live": ["r1", "r2"]}
    assert judge("cross_rank", f, snap, diverged("r2", 7)) is True
    assert judge("cross_rank", f, snap, diverged("r3", 7)) is False
