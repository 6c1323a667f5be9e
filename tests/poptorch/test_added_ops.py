"""Ops added for PopTorch's supported-ops list, each on the simulated IPU against eager: forward through
inferenceModel and, where differentiable, the gradient through one trainingModel step. Random samplers are
checked by their statistics and by the device RNG's seeding (same randomSeed, same numbers)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from op_check import check_forward, check_gradient, options

import poptorch

_G = torch.Generator().manual_seed(0)


def _randn(*shape):
    return torch.randn(*shape, generator=_G)


X, Y = _randn(3, 4), _randn(3, 4)
X5 = _randn(2, 2, 4, 5, 6)

# name -> (fn, inputs, differentiable)
CASES = {
    "isnan": (lambda t: torch.isnan(t / (t > 0).float()), [X], False),
    "floor_divide_float": (lambda t: torch.floor_divide(t, 0.3), [X], False),
    "div_trunc_float": (lambda t: torch.div(t, 0.3, rounding_mode="trunc"), [X], False),
    "cumprod": (lambda t: torch.cumprod(t, 1), [X], True),
    "median": (torch.median, [X], True),
    "median_dim": (lambda t: torch.median(t, 1), [X], False),
    "median_dim_keepdim": (lambda t: torch.median(t, 0, keepdim=True)[0], [X], True),
    "bucketize": (lambda t: torch.bucketize(t, torch.tensor([-1.0, 0.0, 0.5])), [X], False),
    "bucketize_right": (lambda t: torch.bucketize(t, torch.tensor([-1.0, 0.0, 0.5]), right=True), [X], False),
    "cdist": (torch.cdist, [X, Y[:2]], True),
    "cdist_p1": (lambda a, b: torch.cdist(a, b, p=1.0), [X, Y[:2]], True),
    "index_fill": (lambda t: t.index_fill(1, torch.tensor([0, 2]), -1.0), [X], True),
    "index_fill_": (lambda t: t.clone().index_fill_(0, torch.tensor([1]), 2.0), [X], True),
    "index_reduce_prod": (lambda t, s: t.index_reduce(0, torch.tensor([0, 2, 0]), s, "prod"), [X, Y], True),
    "index_reduce_amax": (
        lambda t, s: t.index_reduce(1, torch.tensor([0, 0, 3, 1]), s, "amax", include_self=False),
        [X, Y],
        True,
    ),
    "index_reduce_mean": (lambda t, s: t.index_reduce(0, torch.tensor([1, 1, 0]), s, "mean"), [X, Y], True),
    "scatter_reduce_sum": (
        lambda t, s: t.scatter_reduce(0, torch.tensor([[0, 1, 2, 0], [2, 2, 1, 0]]), s[:2], "sum"),
        [X, Y],
        True,
    ),
    "scatter_reduce_amax": (
        lambda t, s: t.scatter_reduce(1, torch.tensor([[0, 1], [2, 2], [3, 3]]), s[:, :2], "amax", include_self=False),
        [X, Y],
        True,
    ),
    "scatter_reduce_mean": (
        lambda t, s: t.scatter_reduce(1, torch.tensor([[0, 0], [1, 2], [3, 3]]), s[:, :2], "mean"),
        [X, Y],
        True,
    ),
    "bincount": (lambda k: torch.bincount(k, minlength=6), [torch.tensor([0, 1, 1, 3, 5])], False),
    "max_pool3d": (lambda t: F.max_pool3d(t, 2), [X5], True),
    "max_pool3d_padded_ceil": (
        lambda t: F.max_pool3d(t, (2, 3, 2), stride=(1, 2, 2), padding=1, ceil_mode=True),
        [X5],
        True,
    ),
    "avg_pool3d_exclude_pad": (lambda t: F.avg_pool3d(t, 2, padding=1, count_include_pad=False), [X5], True),
    "avg_pool3d_ceil": (lambda t: F.avg_pool3d(t, (3, 2, 2), stride=2, ceil_mode=True), [X5], True),
    "adaptive_avg_pool3d": (lambda t: F.adaptive_avg_pool3d(t, (3, 2, 4)), [X5], True),
    "conv_transpose3d": (
        lambda t, w: F.conv_transpose3d(t, w, stride=(2, 1, 2), padding=(1, 0, 1), output_padding=(1, 0, 0)),
        [X5, _randn(2, 3, 3, 2, 3)],
        True,
    ),
    "conv_transpose3d_groups_dilation": (
        lambda t, w: F.conv_transpose3d(t, w, groups=2, dilation=(2, 1, 1)),
        [X5, _randn(2, 1, 2, 2, 2)],
        True,
    ),
    "bilinear": (lambda a, b, w: F.bilinear(a, b, w), [X, Y[:, :3], _randn(5, 4, 3)], True),
    "embedding_bag_mean": (
        lambda w: F.embedding_bag(torch.tensor([0, 2, 1, 4, 3]), w, torch.tensor([0, 2, 2])),
        [_randn(5, 3)],
        True,
    ),
    "embedding_bag_max": (
        lambda w: F.embedding_bag(torch.tensor([0, 2, 1, 4, 3]), w, torch.tensor([0, 1]), mode="max"),
        [_randn(5, 3)],
        True,
    ),
    "embedding_bag_sum_2d": (
        lambda w: F.embedding_bag(torch.tensor([[0, 2], [1, 4]]), w, mode="sum"),
        [_randn(5, 3)],
        True,
    ),
    "rrelu_eval": (F.rrelu, [X], True),
}
_LOG_PROBS, _TARGETS = _randn(6, 3, 5), torch.tensor([[1, 2, 2], [3, 1, 0], [4, 0, 0]])
_IN_LENGTHS, _TARGET_LENGTHS = torch.tensor([6, 5, 4]), torch.tensor([3, 2, 1])
for _reduction in ("mean", "sum", "none"):
    CASES[f"ctc_loss_{_reduction}"] = (
        lambda x, r=_reduction: F.ctc_loss(
            torch.log_softmax(x, 2), _TARGETS, _IN_LENGTHS, _TARGET_LENGTHS, reduction=r
        ),
        [_LOG_PROBS],
        True,
    )
# Blank 4, an impossible alignment (target longer than its input: infinite loss, zeroed), list lengths.
CASES["ctc_loss_module"] = (
    lambda x: torch.nn.CTCLoss(blank=4, zero_infinity=True)(
        torch.log_softmax(x, 2), _TARGETS % 4, [6, 1, 6], [3, 2, 1]
    ),
    [_LOG_PROBS],
    True,
)


class _CtcModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 5)
        self.loss = torch.nn.CTCLoss()

    def forward(self, x, targets, input_lengths, target_lengths):
        return self.loss(torch.log_softmax(self.fc(x), 2), targets, input_lengths, target_lengths)


def test_ctc_loss_is_the_final_loss_and_trains_as_eager():
    torch.manual_seed(0)
    model = _CtcModel()
    eager = copy.deepcopy(model)
    args = (_randn(6, 3, 4), _TARGETS, _IN_LENGTHS, _TARGET_LENGTHS)
    training = poptorch.trainingModel(model, options(), torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(2):
        loss = training(*args)
        optimizer.zero_grad()
        eager_loss = eager(*args)
        eager_loss.backward()
        optimizer.step()
        torch.testing.assert_close(loss, eager_loss.detach(), rtol=1e-5, atol=1e-5)
    training.destroy()


@pytest.mark.parametrize("name", sorted(CASES))
def test_added_op_matches_eager(name):
    fn, inputs, differentiable = CASES[name]
    check_forward(fn, inputs)
    if differentiable:
        check_gradient(fn, inputs)


def test_bincount_needs_a_static_length():
    with pytest.raises(poptorch.Error, match="pass minlength=N"):
        check_forward(torch.bincount, [torch.tensor([0, 1, 1])])
    with pytest.raises(poptorch.Error, match="index 7, out of range for bincount with minlength=6"):
        check_forward(lambda k: torch.bincount(k, minlength=6), [torch.tensor([0, 7])])


N = 4000


class _Samplers(torch.nn.Module):
    def forward(self, x):
        return (
            torch.randn(N),
            torch.normal(x, 2.0),
            x.new_empty(N).uniform_(-1.0, 3.0),
            x.new_empty(N).exponential_(2.0),
            torch.distributions.Normal(1.0, 0.5).sample((N,)),
            torch.distributions.Exponential(4.0).sample((N,)),
            F.rrelu(-x, 0.1, 0.3, training=True),
            torch.randperm(10),
        )


# (mean, standard deviation) of each sampler's distribution
MOMENTS = [
    (0.0, 1.0),
    (1.0, 2.0),
    (1.0, 4.0 / math.sqrt(12.0)),
    (0.5, 0.5),
    (1.0, 0.5),
    (0.25, 0.25),
    (-0.2, 0.2 / math.sqrt(12.0)),
]


def test_random_samplers_follow_their_distributions_and_the_seed():
    x = torch.ones(N)
    model = poptorch.inferenceModel(_Samplers(), options().randomSeed(7))
    first, second = model(x), model(x)
    for out, (mean, std) in zip(first, MOMENTS):
        assert out.shape == (N,)
        # Four standard errors of the mean; the spread within 5%.
        assert abs(out.mean().item() - mean) < 4 * std / math.sqrt(N), (out.mean(), mean)
        assert out.std().item() == pytest.approx(std, rel=0.05)
    assert first[3].min() >= 0 and first[2].min() >= -1.0 and first[2].max() < 3.0
    assert sorted(first[-1].tolist()) == list(range(10))
    assert not torch.equal(first[0], second[0])  # each run draws afresh
    again = poptorch.inferenceModel(_Samplers(), options().randomSeed(7))(x)
    assert all(torch.equal(a, b) for a, b in zip(first, again))  # same seed, same numbers
    other = poptorch.inferenceModel(_Samplers(), options().randomSeed(8))(x)
    assert not torch.equal(first[0], other[0])


# Concatenated 1-D targets (the rows of _TARGETS cut to their lengths), lengths as a tensor or as a list.
_FLAT_TARGETS = torch.tensor([1, 2, 2, 3, 1, 4])


@pytest.mark.parametrize("lengths", [(_IN_LENGTHS, _TARGET_LENGTHS), ([6, 5, 4], [3, 2, 1])], ids=["tensors", "lists"])
def test_ctc_loss_takes_concatenated_targets_as_eager(lengths):
    def fn(x):
        return F.ctc_loss(torch.log_softmax(x, 2), _FLAT_TARGETS, *lengths, reduction="none")

    check_forward(fn, [_LOG_PROBS])
    check_gradient(fn, [_LOG_PROBS])


def test_ctc_loss_with_concatenated_targets_as_model_inputs_matches_eager():
    torch.manual_seed(0)
    model = _CtcModel()
    args = (_randn(6, 3, 4), _FLAT_TARGETS, _IN_LENGTHS, _TARGET_LENGTHS)
    device = poptorch.inferenceModel(copy.deepcopy(model), options())
    torch.testing.assert_close(device(*args), model(*args).detach(), rtol=1e-5, atol=1e-5)
