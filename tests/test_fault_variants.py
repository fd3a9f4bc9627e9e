"""A fault's variants, declared once (Fault.variants in faults/base.py): params.variant's domain,
the label, the expected checkers and the text an incident quotes all follow from it; the soak's
declared draws name every variant, in the fault's order."""

from __future__ import annotations

import pytest

from kvchaos.faults import REGISTRY
from kvchaos.faults.base import COUNT, Fault, OneOf, ParamError, Variant
from kvchaos.harness.tools.soak_space import SPACE


class Two(Fault):
    name = "two"
    detectors = ("latency",)
    defaults = {"variant": "a", "n": 1}
    domains = {"n": COUNT}
    variants = {"a": Variant("a's cause", "a's fix"), "b": Variant(detectors=("liveness",))}


def test_variants_make_the_domain_label_detectors_and_text():
    assert Two.domains == {"n": COUNT, "variant": OneOf(("a", "b"))}
    assert Two.variant_names() == ("a", "b") and Two.variant_of({}) == "a"
    assert (Two.root_cause, Two.remediation) == ("a's cause", "a's fix")  # its default's
    assert Two.label() == "two/a" and Two.label({"variant": "b"}) == "two/b"
    assert Two.detectors_for() == ("latency",) and Two.detectors_for({"variant": "b"}) == (
        "liveness",
    )
    b = Two(True, {"variant": "b"}, 0)
    assert (b.root_cause, b.remediation) == ("a's cause", "a's fix")  # b has none: the fault's
    assert b.describe()["label"] == "two/b"
    with pytest.raises(ParamError, match=r"params.variant: expected one of \['a', 'b'\]"):
        Two.check_params({"variant": "c"})


def test_a_bare_default_and_a_fault_without_variants():
    class Bare(Two):
        name, bare_default = "bare", True
        root_cause, remediation = "its own", "its own fix"

    assert Bare.label() == "bare" and Bare.label({"variant": "b"}) == "bare/b"
    assert Bare(False, {"variant": "b"}, 0).root_cause == "its own"  # b has none: the class's
    assert Bare(False, {}, 0).root_cause == "a's cause"

    class Plain(Fault):
        name, detectors = "plain", ("latency",)

    assert Plain.variant_names() == () and Plain.variant_of({"variant": "x"}) is None
    assert Plain.label({"variant": "x"}) == "plain" and Plain.detectors_for() == ("latency",)


def test_a_default_that_is_no_variant_fails_at_import():
    with pytest.raises(TypeError, match="fault odd: default variant 'c'"):

        class Odd(Fault):  # noqa: F841
            name = "odd"
            defaults = {"variant": "c"}
            variants = {"a": Variant()}


def test_every_builtin_variant_has_both_texts_or_neither():
    for name, cls in REGISTRY.items():
        for v, x in cls.variants.items():
            assert bool(x.root_cause) == bool(x.remediation), (name, v)
            f = cls(False, {"variant": v}, 0)
            assert f.root_cause and f.remediation, (name, v)


def test_the_soaks_declared_draws_name_every_variant_in_order():
    """SPACE keeps its own lists: a variant added later is drawn on a stream of its own, so no
    seed's draw changes; together with the default's share (any, unchecked) and the tier's draw
    (load_abort) they name every variant, in the fault's order."""
    faults = SPACE["faults"]
    drawn = {
        "refcount_leak": ["any", *SPACE["leak_variant"]["variant"]],
        "staging_stall": SPACE["staging_variant"]["variant"],
        "table_overflow": [
            "unchecked",
            *faults["table_overflow"]["variant"],
            *SPACE["table_overflow_geometry"]["variant"],
        ],
        "ordering_race": list(SPACE["ordering_race_variants"]),
        "prefix_cache": faults["prefix_cache"]["variant"],
        "async_free": [*faults["async_free"]["variant"], "load_abort"],
        "offload": SPACE["offload"]["variant"],
    }
    assert sorted(drawn) == sorted(n for n, c in REGISTRY.items() if c.variants)
    for name, names in drawn.items():
        assert tuple(names) == REGISTRY[name].variant_names(), name
