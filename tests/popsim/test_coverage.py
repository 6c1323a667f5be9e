"""Every popir primitive has a popsim lowering, and missing ones are all reported at compile time."""

import pytest

import popir
import popsim
from popir import ops


def test_every_popir_op_has_a_popsim_kernel():
    missing = sorted(set(popir.all_ops()) - popsim.supported_ops())
    assert not missing, f"popir ops without a popsim lowering: {missing}"


def test_unsupported_ops_are_all_listed_at_compile_time(monkeypatch):
    from popsim import lowerings

    for name in ("exp", "neg"):
        monkeypatch.delitem(lowerings.LOWERINGS, name)
    g = popir.Graph("g")
    x = g.add_input("x", (4,), "float32")
    with g.source_line("model.py:3 in forward"):
        g.output("y", -ops.exp(x))
    with pytest.raises(popsim.UnsupportedOpError, match="model.py:3") as info:
        popsim.compile(g, "small")
    assert info.value.ops == ("exp", "neg")
