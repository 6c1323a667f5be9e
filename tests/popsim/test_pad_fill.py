"""A constant pad writes its border with Fill vertices on the tiles that hold it, as popops does: no copy
reads a constant for it (no zeros cross the exchange), only the interior is copied, and results equal
NumPy's ``np.pad`` bit for bit."""

import numpy as np
import pytest

import popir
import popsim
from popir import ops
from popsim import program as popsim_program

TARGET = popsim.Target.small(num_tiles=16)


@pytest.fixture
def compiled(monkeypatch):
    """Compile a graph recording each Copy's (name, its sources' categories, elements written)."""
    copies = []
    copy = popsim_program._Flattener.copy

    def record(self, step):
        written = step.index.size
        copies.append((step.name, [s.category for s in step.srcs], written))
        return copy(self, step)

    monkeypatch.setattr(popsim_program._Flattener, "copy", record)
    return lambda g: (popsim.compile(g, TARGET), copies)


CASES = [
    ((3, 37, 29), ((0, 0), (2, 1), (3, 4)), 0.0, "float32"),
    ((2, 5, 300), ((1, 0), (0, 2), (0, 84)), -1.5, "float32"),
    ((4, 9), ((0, 3), (5, 0)), 2.25, "float16"),
    ((6, 11), ((2, 2), (1, 1)), 7.0, "int32"),
]


@pytest.mark.parametrize("shape, pads, value, dtype", CASES)
def test_pad_fills_its_border_on_its_tiles_and_copies_only_the_interior(compiled, shape, pads, value, dtype):
    g = popir.Graph("pad")
    x = g.add_input("x", shape, dtype)
    g.output("y", ops.pad(x, pads=pads, value=value))
    exe, copies = compiled(g)
    rng = np.random.default_rng(1)
    feed = (rng.normal(size=shape) * 100).astype(dtype)
    out = exe.run({"x": feed})["y"]
    want = np.pad(feed, pads, constant_values=np.array(value).astype(dtype))
    assert out.dtype == want.dtype
    np.testing.assert_array_equal(out, want)
    pad_copies = [c for c in copies if c[0] == "pad"]
    assert pad_copies, copies
    assert all(categories != ["constant"] and "constant" not in categories for _, categories, _ in pad_copies)
    assert sum(written for *_, written in pad_copies) == int(np.prod(shape))
