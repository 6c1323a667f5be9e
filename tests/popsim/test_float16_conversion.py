"""The engine's float16 conversions (the CPU's F16C instructions where it has them, else a table of every
half's value for widening and the compiler's conversion for narrowing) round exactly as NumPy does: every
half widens to its own value, and narrowing rounds to nearest even at every tie, overflows to infinity and
keeps subnormals and signed zeros."""

import numpy as np

import popir
import popsim
from popir import ops

SMALL = popsim.Target.small(num_tiles=4, tile_bytes=1 << 20)


def _cast(values, to):
    g = popir.Graph("cast")
    g.output("y", ops.cast(g.add_input("x", values.shape, values.dtype.name), dtype=to))
    return popsim.compile(g, SMALL).run({"x": values})["y"]


def _assert_same_bits(got, want):
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    bits = np.uint16 if want.dtype == np.float16 else np.uint32
    np.testing.assert_array_equal(got[~nan].view(bits), want[~nan].view(bits))


def test_every_half_widens_to_its_value():
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    _assert_same_bits(_cast(halves, "float32"), halves.astype(np.float32))


def test_narrowing_rounds_every_tie_and_its_neighbours_like_numpy():
    finite = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = np.sort(finite[np.isfinite(finite)].astype(np.float32))
    ties = (finite[:-1] + (finite[1:] - finite[:-1]) / 2).astype(np.float32)
    values = np.concatenate(
        [
            finite,
            ties,
            np.nextafter(ties, np.float32(np.inf)),
            np.nextafter(ties, np.float32(-np.inf)),
            np.array([65519.0, 65520.0, 1e6, -1e6, np.inf, -np.inf, np.nan, -0.0, 1e-8, -1e-8, 3e-8], np.float32),
        ]
    )
    with np.errstate(over="ignore"):  # beyond float16's range: infinity, as the engine gives
        want = values.astype(np.float16)
    _assert_same_bits(_cast(values, "float16"), want)
