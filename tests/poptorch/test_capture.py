"""capture(): small models captured with torch.export and run by the popir interpreter match eager torch."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_ops_vs_torch import check_against_torch, run_captured
from torch import nn

import popir
from poptorch._capture import RNG_SEED, capture, flatten_call
from poptorch._losses import identity_loss, ipu_print_tensor


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class TutorialCNN(nn.Module):
    """The PopTorch tutorial's classifier, shrunk: conv, pool, conv, pool, two linears, log-softmax."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 5, 3), nn.Conv2d(5, 8, 3)
        self.pool = nn.MaxPool2d(2)
        self.bn = nn.BatchNorm2d(5)
        self.fc1, self.fc2 = nn.Linear(8 * 2 * 2, 12), nn.Linear(12, 4)

    def forward(self, x, labels=None):
        x = self.pool(F.relu(self.bn(self.conv1(x))))
        x = self.pool(F.relu(self.conv2(x)))
        x = F.log_softmax(self.fc2(F.relu(self.fc1(x.flatten(1)))), dim=1)
        return x if labels is None else (x, F.nll_loss(x, labels))


def _transformer(train):
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return layer.train(train)


@pytest.mark.parametrize("train", [False, True])
def test_models_match_eager_forward_and_backward(train):
    torch.manual_seed(0)
    check_against_torch(MLP().train(train), [torch.randn(5, 6)], "mlp")
    check_against_torch(TutorialCNN().train(train), [torch.randn(3, 1, 14, 14)], "cnn", backward=train)
    check_against_torch(_transformer(train), [torch.randn(2, 5, 8)], "transformer")


def test_parameters_buffers_and_inputs_are_named_graph_inputs():
    model = TutorialCNN()
    model.conv1.weight.requires_grad_(False)
    cap = capture(model, (torch.randn(2, 1, 14, 14), torch.tensor([1, 3])))
    kinds = {v.name: v.kind for v in cap.graph.inputs}
    assert cap.parameters == [n for n, _ in model.named_parameters()]
    assert cap.buffers == [n for n, _ in model.named_buffers()]
    assert cap.frozen == {"conv1.weight"}
    assert all(kinds[n] == "parameter" for n in cap.parameters)
    assert all(kinds[n] == "buffer" for n in cap.buffers)
    assert [kinds[n] for n in cap.input_names] == ["input", "input"]
    assert cap.input_specs == [(torch.Size([2, 1, 14, 14]), torch.float32), (torch.Size([2]), torch.int64)]
    assert cap.graph.input(cap.input_names[1]).dtype == popir.DType.int32
    assert cap.output_dtypes == [torch.float32, torch.float32]
    cap.graph.verify()


def test_every_node_records_the_users_source_line():
    cap = capture(MLP(), (torch.randn(2, 6),))
    assert cap.graph.nodes
    for node in cap.graph.nodes:
        assert node.source and "test_capture.py" in node.source and "self.fc" in node.source


def test_batch_norm_in_train_mode_updates_running_stats_like_torch():
    model = TutorialCNN().train()
    x = torch.randn(4, 1, 14, 14)
    cap, _, feeds = run_captured(model, [x])
    _, state = popir.interpreter.step(cap.graph, feeds)
    model(x)
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        np.testing.assert_allclose(state[name], model.get_buffer(name).numpy(), rtol=1e-5, atol=1e-6)


def test_eval_mode_uses_running_stats_and_leaves_them():
    model = TutorialCNN().eval()
    model.bn.running_mean.fill_(0.3)
    cap = check_against_torch(model, [torch.randn(2, 1, 14, 14)], "cnn eval", backward=False)
    assert not cap.graph.updates


def test_dropout_in_train_mode_uses_the_rng_seed_input():
    model = nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5)).train()
    cap = capture(model, (torch.randn(8, 4),))
    seed = cap.graph.input(RNG_SEED)
    assert seed.kind == "buffer" and seed.shape == (2,) and seed.dtype == popir.DType.int32
    feeds = {cap.input_names[0]: np.ones((8, 4), np.float32), RNG_SEED: np.array([1, 2], np.int32)}
    feeds.update({n: p.detach().numpy() for n, p in model.named_parameters()})
    out = popir.interpreter.run(cap.graph, feeds)[cap.outputs[0]]
    dense = model[0](torch.ones(8, 4)).detach().numpy()
    dropped = out == 0
    assert 0.3 < dropped.mean() < 0.7
    np.testing.assert_allclose(out[~dropped], 2 * dense[~dropped], rtol=1e-5)
    feeds[RNG_SEED] = np.array([1, 3], np.int32)
    assert not np.array_equal(popir.interpreter.run(cap.graph, feeds)[cap.outputs[0]] == 0, dropped)
    assert RNG_SEED not in [v.name for v in capture(model.eval(), (torch.randn(8, 4),)).graph.inputs]


class Structured(nn.Module):
    def forward(self, x, scale, y=None, *, extra):
        return {"a": x * scale, "pair": (x, y + extra)}, [x.argmax(1)]


def test_output_structure_constants_and_kwargs():
    x, y, extra = torch.randn(2, 3), torch.randn(2, 3), torch.randn(3)
    cap = capture(Structured(), (x, 2.5, y), {"extra": extra})
    leaves = flatten_call((x, 2.5, y), {"extra": extra})
    assert cap.constant_args == {1: 2.5} and leaves[1] == 2.5
    assert cap.input_names == ["x", "y", "extra"]
    feeds = dict(zip(cap.input_names, (x.numpy(), y.numpy(), extra.numpy())))
    outs = popir.interpreter.run(cap.graph, feeds)
    rebuilt = torch.utils._pytree.tree_unflatten([torch.from_numpy(outs[n]) for n in cap.outputs], cap.out_spec)
    expected = Structured()(x, 2.5, y, extra=extra)
    assert rebuilt[0].keys() == expected[0].keys()
    torch.testing.assert_close(rebuilt[0]["a"], expected[0]["a"])
    torch.testing.assert_close(rebuilt[0]["pair"][1], expected[0]["pair"][1])
    assert rebuilt[1][0].dtype == torch.int32 and cap.output_dtypes[-1] == torch.int64


class InPlace(nn.Module):
    def forward(self, x, acc):
        acc.add_(x)
        return x * 2


def test_in_place_input_updates_become_outputs():
    x, acc = torch.randn(3), torch.randn(3)
    cap = capture(InPlace(), (x, acc))
    assert cap.input_mutations == {"acc": cap.input_mutations["acc"]}
    outs = popir.interpreter.run(cap.graph, {"x": x.numpy(), "acc": acc.numpy()})
    np.testing.assert_allclose(outs[cap.input_mutations["acc"]], (acc + x).numpy())
    assert len(cap.outputs) == 1


def test_float64_and_int64_inputs_are_narrowed():
    class M(nn.Module):
        def forward(self, a, i):
            return a * 2, i + 1

    cap = capture(M(), (torch.randn(3, dtype=torch.float64), torch.arange(3)))
    assert [cap.graph.input(n).dtype for n in cap.input_names] == [popir.DType.float32, popir.DType.int32]
    assert cap.output_dtypes == [torch.float64, torch.int64]
    assert cap.input_specs[0][1] == torch.float64


def _loss_names(model, *args):
    cap = capture(model, args)
    producers = {id(v): n for n, v in cap.graph.outputs.items()}
    return cap, [producers.get(id(v)) for v in cap.losses]


class Losses(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind, self.fc = kind, nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.fc(x)
        if self.kind == "none":
            return out
        if self.kind == "identity":
            return out, identity_loss(F.mse_loss(out, y) + out.abs().mean(), reduction="mean")
        if self.kind == "scaled":
            return out, F.mse_loss(out, y) * 0.5
        if self.kind == "two":
            return out, F.mse_loss(out, y) + F.l1_loss(out, y)
        return out, ipu_print_tensor(F.smooth_l1_loss(out, y))


@pytest.mark.parametrize(("kind", "count"), [("none", 0), ("identity", 1), ("scaled", 1), ("two", 2), ("printed", 1)])
def test_final_losses_are_detected(kind, count):
    x, y = torch.randn(2, 4), torch.randn(2, 3)
    cap, names = _loss_names(Losses(kind), x, y)
    assert len(cap.losses) == count
    if kind in ("identity", "scaled"):
        assert names == ["output_1"]  # the user's returned loss, so training minimises what they return
    for loss in cap.losses:
        assert loss.shape == () and loss.dtype == popir.DType.float32


def test_identity_loss_eager_and_gradients():
    x = torch.randn(3, 2, requires_grad=True)
    for reduction, expected in (("sum", x.sum()), ("mean", x.mean()), ("none", x)):
        out = identity_loss(x, reduction)
        torch.testing.assert_close(out, expected)
        (g,) = torch.autograd.grad(out.sum(), x)
        torch.testing.assert_close(g, torch.autograd.grad(expected.sum(), x)[0])
    with pytest.raises(ValueError, match="reduction"):
        identity_loss(x, "max")


def test_ipu_print_tensor_prints_and_passes_through(capsys):
    x = torch.arange(3.0)
    assert torch.equal(ipu_print_tensor(x, "t="), x)
    assert "t=" in capsys.readouterr().out
