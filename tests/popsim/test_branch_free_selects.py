"""The engine chooses without branches (where's operand, a running max or min), so the choice must stay exact
whatever the data: NaNs, infinities, signed zeros and a mix of both branches, in every dtype's path (float32
and int32 as bit copies, float16 through doubles, fused expressions per element)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import popir
import popsim
from popir import ops

ONE_TILE = popsim.Target.small(num_tiles=1, tile_bytes=1 << 20)
SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0])


def _values(rng, shape, dtype):
    """Normal values with a quarter replaced by NaN, infinities, signed zeros and ones."""
    x = rng.standard_normal(shape)
    special = rng.random(shape) < 0.25
    x[special] = rng.choice(SPECIALS, size=int(special.sum()))
    return x.astype(dtype)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(["float32", "float16"]), st.integers(1, 300), st.integers(0, 2**16))
def test_where_and_a_fused_where_pick_the_exact_element(dtype, n, seed):
    rng = np.random.default_rng(seed)
    g = popir.Graph("where")
    c, x, y = g.add_input("c", (n,), "bool"), g.add_input("x", (n,), dtype), g.add_input("y", (n,), dtype)
    g.output("picked", ops.where(c, x, y))
    g.output("fused", ops.where(ops.gt(x, y), x * y, y - x))
    feeds = {"c": rng.random(n) < 0.5, "x": _values(rng, n, dtype), "y": _values(rng, n, dtype)}
    with np.errstate(invalid="ignore"):  # inf - inf and 0 * inf: NaN, as the engine gives
        want = popir.interpreter.run(g, feeds)
    got = popsim.compile(g, ONE_TILE).run(feeds)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name


@settings(max_examples=20, deadline=None)
@given(
    st.sampled_from(["float32", "float16"]),
    st.sampled_from(["max", "min"]),
    st.integers(1, 9),
    st.integers(1, 40),
    st.integers(0, 2**16),
)
def test_a_running_max_or_min_propagates_nan_and_keeps_the_exact_element(dtype, op, rows, group, seed):
    g = popir.Graph("reduce")
    x = g.add_input("x", (rows, group), dtype)
    g.output("y", {"max": ops.reduce_max, "min": ops.reduce_min}[op](x, axes=(1,), keepdims=False))
    xv = _values(np.random.default_rng(seed), (rows, group), dtype)
    want = {"max": np.max, "min": np.min}[op](xv, axis=1)  # NaN propagates
    got = popsim.compile(g, ONE_TILE).run({"x": xv})["y"]
    assert got.tobytes() == want.tobytes()
