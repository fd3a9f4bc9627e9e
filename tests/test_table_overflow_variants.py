"""The table_overflow variants (faults/table_overflow.py, table_overflow_shapes.py): their params
and errors, the default's record as before variants, each variant's detect scenario fired (ground
truth) and caught on seed 0, each clean scenario held with its trigger pulled and the table edge it
breaks reached (results["exercised"]), the kernels' stride judged as they read the table, and the
soak drawing every variant on an engine it fits."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvchaos.engine import CacheConfig, EngineConfig
from kvchaos.faults import make_fault
from kvchaos.faults.base import ParamError
from kvchaos.faults.table_overflow import DEFAULT, READ_SIDE, TableOverflow
from kvchaos.harness.check import reach
from kvchaos.harness.check.checkers import check_table_integrity
from kvchaos.harness.check.reach import REACH as ALL_REACH
from kvchaos.harness.report.incident import build_incidents
from kvchaos.harness.run.runner import run_scenario
from kvchaos.harness.scenario.spec import load_scenario, parse_scenario

OTHERS = [v for v in TableOverflow.variant_names() if v != DEFAULT]
CFG = EngineConfig(
    max_prefill_tokens=24,
    cache=CacheConfig(block_size=4, num_blocks=128, max_blocks_per_seq=16, max_num_seqs=8),
)
# the table edge each clean scenario's trigger must reach: the manager path its variant breaks
REACH = {v: p for v, p in ALL_REACH["table_overflow"].items() if v != "unchecked"}


def name(variant: str, outcome: str) -> str:
    return f"table-overflow-{variant.replace('_', '-')}-{outcome}"


@pytest.fixture(scope="module")
def runs() -> dict:
    """Each variant's detect and clean scenario on seed 0, once for the module."""
    return {
        (v, o): run_scenario(load_scenario(name(v, o)), 0, "cpu", None)
        for v in OTHERS
        for o in ("detect", "clean")
    }


def fired(r) -> list[dict]:
    return [e["detail"] for e in r.events if e.get("e") == "fault" and e["kind"] == "fired"]


# -- params ------------------------------------------------------------------------------------
def test_the_default_variant_keeps_its_name_params_and_record():
    f = make_fault("table_overflow", True, {}, 0)
    assert f.p["variant"] == DEFAULT and TableOverflow.label({}) == "table_overflow"
    assert "variant" not in f.describe()["params"]
    assert f.describe()["label"] == "table_overflow"
    v = make_fault("table_overflow", True, {"variant": "off_by_one"}, 0)
    assert v.describe()["label"] == "table_overflow/off_by_one"
    assert v.describe()["params"]["variant"] == "off_by_one" and "vllm#10730" in v.root_cause


def test_params_that_do_not_fit_the_engine_are_refused_naming_the_key():
    cases = {
        ("floor_width", replace(CFG, cache=replace(CFG.cache, block_size=2))): "block_size >= 3",
        ("stride_mismatch", CFG): "overflow_policy = \"resize\", got 'reject'",
        ("chunked_growth", replace(CFG, max_prefill_tokens=32)): "max_prefill_tokens 32",
        ("chunked_growth", replace(CFG, max_prefill_tokens=64)): "below a row's 64 tokens",
    }
    for (variant, cfg), said in cases.items():
        with pytest.raises(ParamError, match=r"fault table_overflow: params\.variant: ") as err:
            TableOverflow.check_params({"variant": variant}, cfg)
        assert said in str(err.value)
    with pytest.raises(ParamError, match=r"params\.variant: expected one of \['unchecked'"):
        TableOverflow.check_params({"variant": "off-by-one"})
    for v in ("article", "off_by_one", "last_row", "chunked_growth"):
        TableOverflow.check_params({"variant": v}, CFG)  # the shapes the scenarios use


# -- detect: fired from ground truth, caught ------------------------------------------------------
@pytest.mark.parametrize("variant", OTHERS)
def test_each_variant_fires_and_is_caught_on_seed_0(runs, variant):
    r = runs[variant, "detect"]
    assert r.verdict == "PASS", r.summary
    truth = r.results["fault_verify"]["table_overflow"]
    assert truth["fired"] and truth["variant"] == variant and truth["triggered"] >= 1
    assert r.results["time_to_detect_steps"]["table_overflow"] <= 2
    assert set(truth["overlong"]) & set(truth["touched"]["requests"]) or variant in READ_SIDE
    first = fired(r)[0]
    rejected = {e["req"] for e in r.events if e.get("e") == "reject"}
    if variant == "off_by_one":  # admission on: two blocks over is refused, one over let in
        assert "far_over" in rejected and "edge_over" not in rejected
    elif variant == "last_row":  # the spilled entry fell past the whole table
        assert first["past_end"] >= 1
    elif variant == "chunked_growth":  # the chunk that spilled began inside the row
        start, end = first["chunks"]["chunk_over"]
        assert start < 64 < end and end - start <= 24
    elif variant == "stride_mismatch":
        assert first["kernel_stride"] == 16 and first["table_width"] == 24 and first["misread"]
    elif variant == "slot_past_pool":  # the request holding the pool's last block, misread
        assert first == {"pool_blocks": 47, "misread": first["misread"]} and first["misread"]
        assert 47 in truth["touched"]["blocks"] and 0 in truth["touched"]["blocks"]
    elif variant == "kernel_block_size":
        assert first["kernel_block_size"] == 8 and first["block_size"] == 4 and first["misread"]


def test_the_stride_variant_is_caught_from_the_table_the_kernels_read(runs):
    r = runs["stride_mismatch", "detect"]
    table = next(c for c in r.results["checkers"] if c["checker"] == "table_integrity")
    rows = [f for f in table["findings"] if f["kind"] in ("foreign_block", "overlong")]
    assert rows and all(f["evidence"].get("view") == "kernel" for f in rows)  # the host is right
    snaps = [e for e in r.events if e.get("e") == "snapshot"]
    host_only = [{k: v for k, v in e.items() if k != "kernel_stride"} for e in snaps]
    judged = check_table_integrity(host_only)
    assert not [f for f in judged.findings if f.kind in ("foreign_block", "overlong")]


def test_the_geometry_variants_are_caught_from_the_pool_the_kernels_address(runs):
    """slot_past_pool: the request handed the pool's last block writes into block 0 (a foreign
    write, the harness's own record of the slots) and is read as block 0 (the kernel view);
    kernel_block_size: every misread row is judged from the kernel view, the host table right."""
    r = runs["slot_past_pool", "detect"]
    table = next(c for c in r.results["checkers"] if c["checker"] == "table_integrity")
    writes = [f for f in table["findings"] if f["kind"] == "foreign_write"]
    holders = {
        q
        for e in r.events
        if e.get("e") == "snapshot"
        for q, bs in e["seq_blocks"].items()
        if 47 in bs
    }
    assert any(f["evidence"]["req"] in holders and 0 in f["evidence"]["blocks"] for f in writes)
    kernel = [f for f in table["findings"] if f["evidence"].get("view") == "kernel"]
    assert kernel and all(f["evidence"]["owner"] in holders for f in kernel)
    for f in kernel:  # block 47 read as block 0
        ev = f["evidence"]
        assert (0, 47) in set(zip(ev["row_now"], ev["row_expected"])), ev
    r = runs["kernel_block_size", "detect"]
    table = next(c for c in r.results["checkers"] if c["checker"] == "table_integrity")
    rows = [f for f in table["findings"] if f["kind"] in ("foreign_block", "overlong")]
    assert rows and all(f["evidence"].get("view") == "kernel" for f in rows)
    snaps = [e for e in r.events if e.get("e") == "snapshot"]
    assert all(e["kernel_block_size"] == 8 and e["block_size"] == 4 for e in snaps)
    geometry = ("kernel_block_size", "block_size")
    host_only = [{k: v for k, v in e.items() if k not in geometry} for e in snaps]
    judged = check_table_integrity(host_only)
    assert not [f for f in judged.findings if f.kind in ("foreign_block", "overlong")]


def test_the_clean_geometry_runs_ask_and_are_aligned(runs):
    for v in ("slot_past_pool", "kernel_block_size"):
        r = runs[v, "clean"]
        snaps = [e for e in r.events if e.get("e") == "snapshot"]
        assert not [e for e in snaps if {"pool_blocks", "kernel_block_size"} & set(e)]
        asked = [e for e in r.events if e.get("e") == "fault" and e["kind"] == "trigger"]
        assert asked and all(e["detail"]["reached"] for e in asked)


def test_a_kernel_view_finding_is_the_stride_fault_s_alone():
    f = {"checker": "table_integrity", "step": 5, "kind": "foreign_block"}
    f["evidence"] = {"row": 1, "owner": "x", "view": "kernel"}
    truth = {"first_step": 3, "touched": {"requests": [], "rows": [], "blocks": []}}
    assert TableOverflow.explains(f, {**truth, "variant": "stride_mismatch"}) == "cause"
    assert TableOverflow.explains(f, truth) is None
    assert TableOverflow.explains({**f, "step": 2}, {**truth, "variant": "stride_mismatch"}) is None
    for v in ("slot_past_pool", "kernel_block_size"):
        assert TableOverflow.explains(f, {**truth, "variant": v}) == "cause"
    assert TableOverflow.explains(f, {**truth, "variant": "last_row"}) is None


def test_incidents_name_the_variant(runs):
    r = runs["floor_width", "detect"]
    incident = build_incidents(r.results, r.events)[0]
    assert incident["title"].startswith("table_overflow/floor_width caught by")
    assert "cdiv(max_model_len, block_size)" in incident["remediation"]
    for v, said in (("slot_past_pool", "flashinfer#3740"), ("kernel_block_size", "vllm#42872")):
        r = runs[v, "detect"]
        incident = build_incidents(r.results, r.events)[0]
        assert incident["title"].startswith(f"table_overflow/{v} caught by")
        assert said in incident["root_cause"]["text"] and "align" in incident["remediation"]


# -- clean: held, trigger pulled, the edge reached -------------------------------------------------
@pytest.mark.parametrize("variant", OTHERS)
def test_each_clean_scenario_holds_and_reaches_the_path_its_variant_breaks(runs, variant):
    r = runs[variant, "clean"]
    assert r.verdict == "PASS", r.summary
    truth = r.results["fault_verify"]["table_overflow"]
    assert not truth["fired"] and truth["triggered"] >= 1 and truth["remediated"] >= 1
    reached = r.results["exercised"]
    assert reach.reached(reached, REACH[variant]), (variant, reached)


def test_the_article_s_resize_remediation_holds_at_its_shape():
    sc = load_scenario("table-overflow-article-resize-clean")
    cc = sc.engine_config(device="cpu", seed=0).cache
    assert (cc.max_num_seqs, cc.max_blocks_per_seq, cc.block_size) == (100, 128, 16)
    r = run_scenario(sc, 0, "cpu", None)
    assert r.verdict == "PASS", r.summary
    assert r.results["exercised"]["resizes"] == 1
    submit = next(e for e in r.events if e.get("e") == "submit" and e["req"] == "long0")
    assert submit["prompt_len"] + submit["max_new"] == 2050


# -- the soak ----------------------------------------------------------------------------------
def test_the_soak_draws_every_variant_on_an_engine_it_fits():
    from kvchaos.harness.tools.soak_space import SPACE, generate_scenario

    drawn = (
        SPACE["faults"]["table_overflow"]["variant"] + SPACE["table_overflow_geometry"]["variant"]
    )
    assert drawn == OTHERS  # the default: its own share; the geometry variants: their own stream

    seen = set()
    for seed in range(300):
        d = generate_scenario(seed)
        to = [f for f in d.get("faults", []) if f["name"] == "table_overflow"]
        if to:
            seen.add(to[0]["params"].get("variant", DEFAULT))
            parse_scenario(d, f"<soak {seed}>")  # its params fit the engine drawn
    assert seen == set(TableOverflow.variant_names())


def test_list_names_each_scenario_s_variant(capsys):
    from kvchaos.harness.cli import main

    assert main(["list", "--tag", "fault_table_overflow"]) == 0
    out = capsys.readouterr().out.replace("\n", " ")
    for v in OTHERS:
        assert f"table_overflow/{v}" in out
