"""Catalogue (popsim, no torch): program sets that cannot fit are refused from sizes alone, before any
planning, with the numbers."""

import numpy as np
import pytest

import popir
import popsim
from popir import ops
from popsim import executable

TARGET = popsim.Target.small(num_tiles=4, tile_bytes=65_536)  # 256 KiB of tile memory in all


def _graph(param_elements, input_elements=16):
    g = popir.Graph("g")
    x = g.add_input("x", (input_elements,), "float32")
    w = g.add_input("w", (param_elements,), "float32", kind="parameter")
    g.output("y", ops.reduce_sum(x, axes=(0,), keepdims=False) + ops.reduce_sum(w, axes=(0,), keepdims=False))
    return g


@pytest.mark.outcome("clear error")
def test_variables_beyond_the_tile_memory_are_refused_before_planning(monkeypatch):
    planned = []
    monkeypatch.setattr(executable, "lower_graph", lambda *a: planned.append(1))
    with pytest.raises(popsim.OutOfMemoryError, match=r"at least 400,064 bytes .*w 400,000.*262,144 bytes of small"):
        popsim.compile(_graph(100_000), TARGET)
    assert not planned


@pytest.mark.outcome("clear error")
def test_inputs_beyond_the_tile_memory_are_refused():
    with pytest.raises(popsim.OutOfMemoryError, match=r"800,000 bytes of inputs"):
        popsim.compile(_graph(16, input_elements=200_000), TARGET)


@pytest.mark.outcome("clear error")
def test_relax_memory_still_refuses_what_the_simulator_cannot_address():
    g = popir.Graph("g")
    w = g.add_input("w", (2**29 + 1,), "float32", kind="parameter")  # just over 2 GiB, never allocated
    g.output("y", ops.reduce_sum(w, axes=(0,), keepdims=False))
    with pytest.raises(popsim.OutOfMemoryError, match="2,147,483,647 bytes the simulator addresses"):
        popsim.compile(g, TARGET, relax_memory=True)


@pytest.mark.outcome("right result")
def test_a_program_set_that_fits_by_size_still_compiles_and_runs():
    exe = popsim.compile(_graph(1000), TARGET)
    exe.write_variable("w", np.ones(1000, np.float32))
    assert exe.run({"x": np.ones(16, np.float32)})["y"] == pytest.approx(1016)
