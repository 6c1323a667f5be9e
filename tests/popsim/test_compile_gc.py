"""popsim.compile pauses Python's cyclic garbage collector while it builds (its many short-lived objects
would trigger collections) and leaves it as it found it, on success and on error."""

import gc

import numpy as np
import pytest

import popir
import popsim
from popir import ops
from popsim import executable

TARGET = popsim.Target.small(num_tiles=4)


def _graph():
    g = popir.Graph("g")
    x = g.add_input("x", (4, 8), "float32")
    g.output("y", ops.relu(x))
    return g


@pytest.fixture
def collector():
    """Restore the collector's state after a test that changes it."""
    enabled = gc.isenabled()
    yield
    (gc.enable if enabled else gc.disable)()


@pytest.mark.parametrize("enabled", [True, False])
def test_compile_builds_without_cyclic_gc_and_restores_its_state(monkeypatch, collector, enabled):
    seen = []
    lower = executable.lower_graph
    monkeypatch.setattr(executable, "lower_graph", lambda *a: seen.append(gc.isenabled()) or lower(*a))
    (gc.enable if enabled else gc.disable)()
    exe = popsim.compile(_graph(), TARGET)
    assert seen == [False] and gc.isenabled() == enabled
    x = np.arange(-16, 16, dtype=np.float32).reshape(4, 8)
    np.testing.assert_array_equal(exe.run({"x": x})["y"], np.maximum(x, 0))


def test_a_failed_compile_restores_the_collector(collector):
    gc.enable()
    with pytest.raises(popsim.Error):
        popsim.compile({}, TARGET)
    assert gc.isenabled()
