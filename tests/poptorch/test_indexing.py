"""Advanced indexing on the simulated IPU against eager PyTorch: several index tensors (broadcast together,
mixed with slices and None), index_put_ with and without accumulate, boolean-mask assignment, gradients."""

import copy

import pytest
import torch

import poptorch

I = torch.tensor([[0, 3], [1, -1]])  # noqa: E741
J = torch.tensor([2, -4])
K = torch.tensor([1, 0])

READS = {
    "two_indices": lambda x: x[I, J],
    "separated_by_slice": lambda x: x[I, :, J],
    "after_slice": lambda x: x[:, J, K],
    "with_none": lambda x: x[:, J, None, K],
    "three_indices": lambda x: x[I, J, K],
    "one_index_middle": lambda x: x[:, I],
    "broadcast_columns": lambda x: x[torch.arange(4)[:, None], torch.tensor([[1, 2, 0]])],
}


def _put(x, indices, values, accumulate=False):
    return x.clone().index_put_(indices, values, accumulate=accumulate)


WRITES = {
    "put_scalar": lambda x: _put(x, (J, K), torch.tensor(7.0)),
    "put_rows": lambda x: _put(x, (I,), torch.arange(30.0).reshape(5, 6)),
    "put_accumulate_duplicates": lambda x: _put(x, (torch.tensor([1, 1, 2]), K[[0, 0, 1]]), torch.ones(6), True),
    "setitem_slice_then_indices": lambda x: _setitem(x, (slice(None), J, K), 3.0),
    "setitem_mask": lambda x: _setitem(x, x > 0, 0.0),
}


def _setitem(x, key, value):
    y = x.clone()
    y[key] = value
    return y


class Apply(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("name", sorted({**READS, **WRITES}))
def test_forward_equals_eager(name):
    fn = {**READS, **WRITES}[name]
    x = torch.randn(4, 5, 6)
    out = poptorch.inferenceModel(Apply(fn))(x)
    torch.testing.assert_close(out, fn(x), rtol=1e-6, atol=1e-6)


class IndexedLoss(torch.nn.Module):
    """Reads and writes a parameter through advanced indexing, so every path carries a gradient."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 5, 6))
        self.v = torch.nn.Parameter(torch.randn(2, 6))

    def forward(self, x):
        w = self.w * x
        read = w[I, J].sum() + (w[:, J, None, K] ** 2).sum() + w[I, :, J].tanh().sum()
        put = w.index_put((J, K), self.v, accumulate=True)
        replaced = w.index_put((torch.tensor([0, 2]), torch.tensor([1, 3])), self.v * 2)
        loss = read + (put**2).mean() + (replaced.sin()).sum()
        return poptorch.identity_loss(loss, reduction="none")


def test_gradients_equal_eager():
    torch.manual_seed(0)
    model = IndexedLoss()
    eager = copy.deepcopy(model)
    x = torch.rand(4, 5, 6) + 0.5
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    for _ in range(2):
        loss = training(x)
        eager_opt.zero_grad()
        expected = eager(x)
        expected.backward()
        eager_opt.step()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=name)


def test_boolean_mask_read_suggests_where():
    with pytest.raises(poptorch.Error, match=r"torch\.where"):
        poptorch.inferenceModel(Apply(lambda x: x[x > 0]))(torch.randn(3, 4))


def test_boolean_mask_assignment_of_a_tensor_suggests_where():
    model = Apply(lambda x: _setitem(x, x > 0, torch.arange(12.0)[:1].expand(1)))
    out = poptorch.inferenceModel(model)(torch.randn(3, 4))  # one element: a plain where
    assert out.shape == (3, 4)
    with pytest.raises(poptorch.Error, match=r"torch\.where"):
        poptorch.inferenceModel(Apply(lambda x: _put(x, (x > 0,), torch.ones(5))))(torch.randn(3, 4))


class LargeTable(torch.nn.Module):
    """A 256 KiB table: more than a quarter of a tile, so popsim gathers and scatters it in slices."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(64, 16, 64))

    def forward(self, i, j):
        rows = self.table[i, j]
        return rows, poptorch.identity_loss((rows**2).sum(), reduction="none")


def test_large_table_gathers_and_scatters_in_slices():
    torch.manual_seed(0)
    model = LargeTable()
    eager = copy.deepcopy(model)
    i, j = torch.tensor([0, 63, 17, 63, -1]), torch.tensor([[3], [15]])
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    rows, loss = training(i, j)
    expected_rows, expected = eager(i, j)
    expected.backward()
    torch.testing.assert_close(rows, expected_rows.detach())
    torch.testing.assert_close(model.table, eager.table - 0.1 * eager.table.grad)
