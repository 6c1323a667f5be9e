"""scaled_dot_product_attention stays one op through capture and equals eager PyTorch, forward and gradient,
with causal, boolean and additive masks, a custom scale, grouped-query heads and rows that see nothing."""

import copy

import pytest
import torch
import torch.nn.functional as F

import poptorch

B, H, L, S, E = 2, 2, 5, 6, 4


def _bool_mask():
    mask = torch.rand(B, 1, L, S) > 0.3
    mask[..., 0] = True
    return mask


CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "scale": {"scale": 0.3},
    "bool_mask": {"attn_mask": _bool_mask()},
    "additive_mask": {"attn_mask": torch.randn(L, S)},
    "row_sees_nothing": {"attn_mask": torch.tensor([[True] * S] * (L - 1) + [[False] * S])},
}


class Attention(torch.nn.Module):
    def __init__(self, heads_kv=H, **kwargs):
        super().__init__()
        self.q = torch.nn.Linear(E, E * H)
        self.kv = torch.nn.Linear(E, 2 * E * heads_kv)
        self.heads_kv = heads_kv
        self.kwargs = kwargs

    def forward(self, x, y):
        q = self.q(x[:, :L]).reshape(B, L, H, E).transpose(1, 2)
        k, v = self.kv(y).reshape(B, S, 2, self.heads_kv, E).permute(2, 0, 3, 1, 4)
        gqa = {"enable_gqa": True} if self.heads_kv != H else {}
        out = F.scaled_dot_product_attention(q, k, v, **self.kwargs, **gqa)
        return out, poptorch.identity_loss((out * out).sum(), reduction="none")


def _data():
    return torch.randn(B, S, E), torch.randn(B, S, E)


@pytest.mark.parametrize("name", sorted(CASES) + ["grouped_query"])
def test_forward_and_gradient_equal_eager(name):
    torch.manual_seed(0)
    model = Attention(heads_kv=1) if name == "grouped_query" else Attention(**CASES[name])
    eager = copy.deepcopy(model)
    x, y = _data()
    out, _ = poptorch.inferenceModel(copy.deepcopy(model))(x, y)
    torch.testing.assert_close(out, eager(x, y)[0], rtol=1e-5, atol=1e-5)

    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    _, loss = training(x, y)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    expected = eager(x, y)[1]
    expected.backward()
    eager_opt.step()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-5)
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=n)


def test_kept_as_one_op_through_capture():
    from poptorch._capture import _export, _TensorOutputs

    program = _export(_TensorOutputs(Attention(is_causal=True)), _data(), {})
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.scaled_dot_product_attention.default in targets


class UniformDropout(torch.nn.Module):
    def forward(self, v):
        q = torch.zeros(B, H, L, E)
        return F.scaled_dot_product_attention(q, q[:, :, :1].expand(B, H, S, E), v, dropout_p=0.5)


def test_dropout_drops_attention_weights():
    # Equal weights 1/S on values of one: each output is (kept weights) / S / (1 - p).
    out = poptorch.inferenceModel(UniformDropout())(torch.ones(B, H, S, E))
    kept = out * S * 0.5
    torch.testing.assert_close(kept, kept.round(), rtol=0, atol=1e-5)
    assert kept.min() >= 0 and kept.max() <= S
    assert len(torch.unique(kept.round())) > 1
