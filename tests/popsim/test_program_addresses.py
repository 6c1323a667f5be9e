"""The exchange-row builder's address of every element of a Copy's destination equals the per-element
binary search it replaces (a TileMapping's blocks always cover its elements in order)."""

from types import SimpleNamespace

import numpy as np

from popsim import program
from popsim.mapping import TileMapping


def _tensor(mapping):
    return SimpleNamespace(storage=SimpleNamespace(mapping=mapping), size=mapping.size, itemsize=4)


def _check(mapping, bases):
    t = _tensor(mapping)
    fast = program._all_element_addresses(t, lambda storage: bases)
    slow = program.element_addresses(t, np.arange(t.size), lambda storage: bases)
    np.testing.assert_array_equal(fast[0], slow[0])
    np.testing.assert_array_equal(fast[1], slow[1])


def test_in_order_blocks_match_the_binary_search():
    rng = np.random.default_rng(0)
    for _ in range(50):
        count = int(rng.integers(1, 20))
        sizes = rng.integers(1, 30, count)
        stops = np.cumsum(sizes)
        mapping = TileMapping(rng.integers(0, 8, count), stops - sizes, stops, int(sizes.sum()))
        _check(mapping, rng.integers(0, 1000, count) * 8)
