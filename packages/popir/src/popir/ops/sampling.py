"""Random samplers built on ``random_uniform``: normal (Box-Muller), exponential, uniform ranges, permutations.

Each draws from its int32[2] seed, so the same seed gives the same numbers on every backend.
"""

import math

from popir.ops.base import reshape
from popir.ops.elementwise import cos, log, sqrt
from popir.ops.movement import slice_
from popir.ops.ordering import argsort
from popir.ops.random import random_uniform


def uniform(seed, shape, low=0.0, high=1.0, dtype="float32"):
    """Uniform values in [low, high)."""
    u = random_uniform(seed, shape=tuple(shape), dtype=dtype)
    return u if (low, high) == (0.0, 1.0) else u * (high - low) + low


def normal(seed, shape, dtype="float32"):
    """Standard normal values by the Box-Muller transform of two uniform draws per element."""
    shape = tuple(shape)
    both = random_uniform(seed, shape=(2,) + shape, dtype="float32")
    first = slice_(both, starts=(0,) + (0,) * len(shape), stops=(1,) + shape)
    second = slice_(both, starts=(1,) + (0,) * len(shape), stops=(2,) + shape)
    radius = sqrt(log(1.0 - first) * -2.0)  # 1 - u lies in (0, 1]: its log is finite
    z = reshape(radius * cos(second * (2.0 * math.pi)), shape=shape)
    return z if dtype == "float32" else z.graph.apply("cast", (z,), {"dtype": dtype})[0]


def exponential(seed, shape, rate=1.0, dtype="float32"):
    """Exponential values with the given ``rate`` (inverse-CDF of a uniform draw)."""
    u = random_uniform(seed, shape=tuple(shape), dtype=dtype)
    return log(1.0 - u) * (-1.0 / rate)


def randperm(seed, n):
    """A uniformly random permutation of 0..n-1 (int32): the order that sorts n uniform keys."""
    return argsort(random_uniform(seed, shape=(n,), dtype="float32"), axis=0)
