"""Chains of elementwise nodes run as one fused vertex per block (popops map expressions), exactly as the
separate vertices would."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import popir
import popsim
from popir import ops
from popsim import _opcodes as oc

SMALL = popsim.Target.small(num_tiles=8, tile_bytes=65536)


def _compute_sets(exe, program):
    return [s["name"] for s in exe.profile.programs[program]["steps"] if s["kind"] == "compute"]


def _check(g, feeds):
    exe = popsim.compile(g, SMALL)
    got, want = exe.run(feeds), popir.interpreter.run(g, feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    return exe


def test_a_chain_with_scalars_comparisons_where_and_casts_is_one_vertex_and_exact():
    g = popir.Graph("chain")
    x = g.add_input("x", (40, 30), "float32")
    y = g.add_input("y", (40, 30), "float32")
    s = g.add_input("s", (), "float32")
    big = ops.gt(x * s + 1.5, y)
    picked = ops.where(big, x - y, ops.maximum(x, y) / 3.0)
    g.output("z", ops.cast(ops.cast(picked, dtype="float16"), dtype="float32") * s)
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((40, 30)).astype(np.float32),
        "y": rng.standard_normal((40, 30)).astype(np.float32),
        "s": np.array(0.7, np.float32),
    }
    exe = _check(g, feeds)
    assert _compute_sets(exe, "chain") == ["mul+add+gt+sub+maximum+div+where+cast+cast+mul"]
    # A fused vertex keeps leaf addresses where other rows keep dtype codes: the table check reads it so.
    exe.validate()
    loaded = popsim.Executable.from_bytes(exe.to_bytes())
    np.testing.assert_array_equal(loaded.run(feeds)["z"], exe.run(feeds)["z"])


def test_integer_chains_keep_integer_semantics():
    g = popir.Graph("ints")
    a = g.add_input("a", (50,), "int32")
    b = g.add_input("b", (50,), "int32")
    g.output("q", ops.remainder(a * 3 - b, b) + ops.div(a, b))
    feeds = {"a": np.arange(-25, 25, dtype=np.int32), "b": np.arange(1, 51, dtype=np.int32) * -1}
    exe = _check(g, feeds)
    assert len(_compute_sets(exe, "ints")) == 1


def test_a_chain_beyond_one_vertex_splits_and_stays_exact():
    g = popir.Graph("wide")
    xs = [g.add_input(f"x{i}", (64,), "float32") for i in range(9)]
    total = xs[0]
    for x in xs[1:]:
        total = total * 0.5 + x
    g.output("total", total)
    rng = np.random.default_rng(1)
    exe = _check(g, {f"x{i}": rng.standard_normal(64).astype(np.float32) for i in range(9)})
    sets = _compute_sets(exe, "wide")
    assert 1 < len(sets) < 16
    assert all(name.count("+") < oc.EXPR_MAX_OPS for name in sets)


def test_values_read_elsewhere_are_not_fused():
    g = popir.Graph("shared")
    x = g.add_input("x", (64,), "float32")
    t = ops.abs(x)
    g.output("t", t)
    g.output("u", t * 2.0 + 1.0)
    exe = _check(g, {"x": np.linspace(-2, 2, 64, dtype=np.float32)})
    assert _compute_sets(exe, "shared") == ["abs", "mul+add"]


@pytest.mark.parametrize("reads_old_after_update", [True, False])
def test_a_fused_read_of_a_state_counts_where_the_fused_vertex_runs(reads_old_after_update):
    # doubled reads m but runs inside `out`'s vertex, after m's update: m must then not be updated in place.
    g = popir.Graph("state")
    m = g.add_input("m", (64,), "float32", kind="optimizer_state")
    x = g.add_input("x", (64,), "float32")
    doubled = m * 2.0
    if reads_old_after_update:
        g.update(m, m + 1.0)
        g.output("out", doubled + x)
    else:
        g.output("out", doubled + x)
        g.update(m, m + 1.0)
    exe = popsim.compile(g, SMALL)
    start = np.arange(64, dtype=np.float32)
    exe.write_variable("m", start)
    feeds = {"x": np.ones(64, np.float32)}
    outputs, updates = popir.interpreter.step(g, {"m": start, **feeds})
    np.testing.assert_array_equal(exe.run(feeds)["out"], outputs["out"])
    np.testing.assert_array_equal(exe.read_variable("m"), updates["m"])


@st.composite
def elementwise_graphs(draw):
    """A random DAG of exactly rounded elementwise ops over a matrix, a row vector and a scalar; some
    intermediates are outputs too, so fusion stops at different places."""
    rows, cols = draw(st.integers(1, 5)), draw(st.integers(1, 70))
    g = popir.Graph("dag")
    values = [
        g.add_input("x", (rows, cols), "float32"),
        g.add_input("y", (rows, cols), "float32"),
        g.add_input("v", (cols,), "float32"),
        g.add_input("s", (), "float32"),
    ]
    for i in range(draw(st.integers(1, 14))):
        a, b = draw(st.sampled_from(values)), draw(st.sampled_from(values))
        kind = draw(st.sampled_from(["add", "sub", "mul", "div", "maximum", "minimum", "where", "half", "neg", "abs"]))
        if kind == "where":
            c = draw(st.sampled_from(values))
            out = ops.where(ops.gt(a, b), c, a)
        elif kind == "half":
            out = ops.cast(ops.cast(a, dtype="float16"), dtype="float32")
        elif kind in ("neg", "abs"):
            out = getattr(ops, kind)(a)
        else:
            out = getattr(ops, kind)(a, b)
        values.append(out)
        if draw(st.booleans()) and draw(st.booleans()):
            g.output(f"v{i}", out)
    g.output("last", values[-1])
    return g, rows, cols


@settings(max_examples=30)
@given(case=elementwise_graphs(), seed=st.integers(0, 2**16))
def test_random_elementwise_dags_fuse_and_stay_exact(case, seed):
    g, rows, cols = case
    rng = np.random.default_rng(seed)
    feeds = {
        "x": rng.standard_normal((rows, cols)).astype(np.float32),
        "y": rng.standard_normal((rows, cols)).astype(np.float32),
        "v": rng.standard_normal(cols).astype(np.float32),
        "s": np.array(rng.standard_normal(), np.float32),
    }
    _check(g, feeds)


def test_each_distinct_fused_expression_counts_as_a_codelet_of_its_own():
    def code_bytes(*outputs):
        g = popir.Graph("code")
        x = g.add_input("x", (64,), "float32")
        for i, make in enumerate(outputs):
            g.output(f"y{i}", make(x))
        exe = popsim.compile(g, popsim.Target.small(num_tiles=1))
        return exe.profile.programs["code"]["memory"]["code"][0]

    one = code_bytes(lambda x: x * 2.0 + 1.0)
    assert code_bytes(lambda x: x * 2.0 + 1.0, lambda x: x * 3.0 + 2.0) == one  # the same program twice
    assert code_bytes(lambda x: x * 2.0 + 1.0, lambda x: (x - 3.0) * x) == 2 * one
