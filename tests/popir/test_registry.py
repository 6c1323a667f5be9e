"""The registry is complete: every primitive has a rule, a reference, a VJP or a non-differentiable tag,
and a sample entry in the op database (tests/opdb.py)."""

import pytest
from opdb import OPDB, composites, primitives

import popir


def test_every_primitive_is_complete_and_in_the_op_database():
    missing = []
    for name, opdef in popir.all_ops().items():
        if not callable(opdef.infer) or not callable(opdef.ref):
            missing.append(f"{name}: no shape rule or reference")
        if opdef.differentiable and not callable(opdef.vjp):
            missing.append(f"{name}: differentiable but no vjp")
        if name not in OPDB or not OPDB[name].primitive:
            missing.append(f"{name}: no primitive entry in tests/opdb.py")
    assert not missing, "\n".join(missing)


def test_database_primitives_are_registered_and_composites_are_not():
    registered = popir.all_ops()
    assert {e.name for e in primitives()} <= set(registered)
    assert not {e.name for e in composites()} & set(registered)


@pytest.mark.parametrize(
    "name",
    [
        "softmax",
        "log_softmax",
        "layer_norm",
        "group_norm",
        "gelu",
        "linear",
        "nll_loss",
        "cross_entropy",
        "mse_loss",
        "batch_norm",
        "embedding",
        "dropout",
    ],
)
def test_core_composites_are_listed_with_a_torch_equivalent(name):
    entry = OPDB[name]
    assert not entry.primitive and (entry.torch or name == "dropout")


def test_differentiable_entries_name_real_inputs():
    for entry in OPDB.values():
        if entry.grad and entry.primitive:
            assert popir.get_op(entry.name).differentiable, entry.name


def test_defining_an_op_twice_or_without_vjp_fails():
    with pytest.raises(popir.IRError, match="registered twice"):
        popir.defop("exp", infer=lambda x: x, ref=lambda x: x, vjp=lambda *a: a)
    with pytest.raises(popir.IRError, match="no vjp"):
        popir.defop("__test_no_vjp", infer=lambda x: x, ref=lambda x: x)
