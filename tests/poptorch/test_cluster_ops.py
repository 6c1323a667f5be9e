"""poptorch.fps and poptorch.nearest (torch_cluster's operators) on the CPU and on the simulated IPU."""

import math

import numpy as np
import pytest
import torch

import poptorch


def _opts():
    return poptorch.Options().showCompilationProgressBar(False)


def _fps_reference(points, ptr, ratio):
    """Farthest point sampling in NumPy, starting from each sample's first point."""
    out = []
    for start, end in zip(ptr, ptr[1:]):
        segment = points[start:end]
        chosen = [0]
        distance = ((segment - segment[0]) ** 2).sum(axis=1)
        for _ in range(math.ceil(ratio * (end - start)) - 1):
            chosen.append(int(distance.argmax()))
            distance = np.minimum(distance, ((segment - segment[chosen[-1]]) ** 2).sum(axis=1))
        out.extend(start + c for c in chosen)
    return np.array(out)


class _Sample(torch.nn.Module):
    def __init__(self, ptr, ratio):
        super().__init__()
        self.ptr, self.ratio = ptr, ratio

    def forward(self, src):
        return poptorch.fps(src, self.ptr, self.ratio)


def test_fps_picks_the_farthest_points_per_sample():
    src = torch.randn(13, 3, generator=torch.Generator().manual_seed(0))
    ptr, ratio = [0, 6, 13], 0.5
    expected = _fps_reference(src.numpy(), ptr, ratio)
    assert len(expected) == 3 + 4 and expected[0] == 0 and expected[3] == 6  # ceil(3.0) + ceil(3.5) points
    np.testing.assert_array_equal(_Sample(ptr, ratio)(src).numpy(), expected)
    on_ipu = poptorch.inferenceModel(_Sample(ptr, ratio), _opts())(src)
    assert on_ipu.dtype == torch.int32  # as PopTorch returns int64 outputs
    np.testing.assert_array_equal(on_ipu.numpy(), expected)


def test_fps_random_start_samples_distinct_points_of_each_sample():
    torch.manual_seed(1)
    picks = poptorch.fps(torch.randn(10, 2), [0, 4, 10], 0.5, random_start=True).tolist()
    assert len(picks) == 5 and len(set(picks)) == 5
    assert all(p < 4 for p in picks[:2]) and all(4 <= p < 10 for p in picks[2:])


def test_fps_checks_its_arguments_as_poptorch():
    src = torch.randn(4, 2)
    with pytest.raises(poptorch.Error, match="`fps` must take a torch.tensor `src` input"):
        poptorch.fps(src.numpy(), [0, 4])
    with pytest.raises(poptorch.Error, match="`ptr` must be a list of integers"):
        poptorch.fps(src, (0, 4))
    with pytest.raises(poptorch.Error, match="`ptr` must contain at least 2 elements"):
        poptorch.fps(src, [0])
    with pytest.raises(poptorch.Error, match="`ratio` must be of float type"):
        poptorch.fps(src, [0, 4], 1)
    with pytest.raises(poptorch.Error, match="`random_start` must be of bool type"):
        poptorch.fps(src, [0, 4], 0.5, 1)
    with pytest.raises(poptorch.Error, match="within the 4 points"):
        poptorch.fps(src, [0, 5])


class _Nearest(torch.nn.Module):
    def forward(self, x, y, batch_x, batch_y):
        return poptorch.nearest(x, y, batch_x, batch_y)


def test_nearest_respects_samples_on_cpu_and_ipu():
    generator = torch.Generator().manual_seed(2)
    x, y = torch.randn(7, 2, generator=generator), torch.randn(5, 2, generator=generator)
    batch_x, batch_y = torch.tensor([0, 0, 0, 1, 1, 1, 1]), torch.tensor([0, 0, 1, 1, 1])
    distance = np.linalg.norm(x.numpy()[:, None] - y.numpy()[None], axis=2)
    distance[batch_x.numpy()[:, None] != batch_y.numpy()[None]] = np.inf
    expected = distance.argmin(axis=1)
    assert (expected[:3] < 2).all() and (expected[3:] >= 2).all()
    np.testing.assert_array_equal(poptorch.nearest(x, y, batch_x.tolist(), batch_y.tolist()).numpy(), expected)
    on_ipu = poptorch.inferenceModel(_Nearest(), _opts())(x, y, batch_x, batch_y)
    np.testing.assert_array_equal(on_ipu.numpy(), expected)
    unbatched = np.linalg.norm(x.numpy()[:, None] - y.numpy()[None], axis=2).argmin(axis=1)
    np.testing.assert_array_equal(poptorch.nearest(x, y).numpy(), unbatched)


def test_nearest_checks_its_arguments():
    x = torch.randn(3, 2)
    with pytest.raises(poptorch.Error, match="`nearest` must take a torch.tensor `y` input"):
        poptorch.nearest(x, [1.0])
    with pytest.raises(poptorch.Error, match="both `batch_x` and `batch_y`"):
        poptorch.nearest(x, x, [0, 0, 1])
    with pytest.raises(poptorch.Error, match="same number of features"):
        poptorch.nearest(x, torch.randn(3, 4))
