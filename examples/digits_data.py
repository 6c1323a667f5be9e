"""Datasets for the examples, with no download: scikit-learn's bundled digits, or local Fashion-MNIST files.

``load_digits_28`` upsamples the 8x8 digits that ship with scikit-learn to the 28x28 the tutorial CNN expects.
``read_idx`` reads the IDX files Fashion-MNIST (and MNIST) are distributed in, gzipped or not.
"""

import gzip
import pathlib
import struct

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

_IDX_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path):
    """The array stored in IDX file ``path`` (``.gz`` allowed)."""
    path = pathlib.Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number)")
    ndim = data[3]
    shape = struct.unpack_from(f">{ndim}I", data, 4)
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    body = np.frombuffer(data, dtype=dtype, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape}, found {body.size} values")
    return body.reshape(shape)


def _normalise(images):
    images = torch.as_tensor(images, dtype=torch.float32)
    return ((images - images.mean()) / images.std()).unsqueeze(1)


def load_fashion_mnist(data_dir):
    """(train, test) TensorDatasets from the four Fashion-MNIST IDX files in ``data_dir``."""
    data_dir = pathlib.Path(data_dir)

    def find(stem):
        for name in (stem, stem + ".gz"):
            if (data_dir / name).exists():
                return data_dir / name
        raise FileNotFoundError(f"{stem}[.gz] not found in {data_dir}")

    def split(prefix):
        images = read_idx(find(f"{prefix}-images-idx3-ubyte")).astype(np.float32) / 255.0
        labels = read_idx(find(f"{prefix}-labels-idx1-ubyte")).astype(np.int64)
        return TensorDataset(_normalise(images), torch.from_numpy(labels))

    return split("train"), split("t10k")


def load_digits_28(test_fraction=0.2, seed=0):
    """(train, test) TensorDatasets of scikit-learn's digits, upsampled to 1x28x28 and normalised."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False).squeeze(1)
    images = _normalise(images)
    labels = torch.as_tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(labels) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])
