"""``Options.enableSyntheticData(True)``: no host I/O, as PopART's RandomNormal synthetic data mode.

Every input is generated on the device instead of streamed from the host: float inputs from a standard
normal distribution (seeded by ``Options.randomSeed``), integer and boolean inputs as zeros. Outputs are
not streamed back: the host receives zeros of the outputs' shapes.
"""

import numpy as np


def inputs(feeds_by_name, seed):
    """Synthetic replacements for ``{name: array}`` of one call's inputs (same shapes and dtypes)."""
    rng = np.random.default_rng(seed)
    synthetic = {}
    for name, array in feeds_by_name.items():
        if np.issubdtype(array.dtype, np.floating):
            synthetic[name] = rng.standard_normal(array.shape).astype(array.dtype)
        else:
            synthetic[name] = np.zeros(array.shape, dtype=array.dtype)
    return synthetic


def outputs(array):
    """What the host receives for an output when host I/O is disabled."""
    return np.zeros_like(array)
