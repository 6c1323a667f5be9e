"""Calls the PopTorch user guide's example scripts make, checked in our own words against eager PyTorch."""

import torch

import poptorch


def _opts():
    return poptorch.Options().showCompilationProgressBar(False)


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, target=None):
        out = self.fc(x)
        if target is None:
            return out
        return out, torch.nn.functional.mse_loss(out, target)


def test_inference_model_may_wrap_a_model_again():
    # The guide wraps one model with inferenceModel several times without destroy(); PopTorch allows it
    # (only a second trainingModel is refused). Each wrapper runs the model's current weights.
    torch.manual_seed(0)
    model = _Linear()
    x = torch.randn(2, 4)
    first = poptorch.inferenceModel(model, _opts())
    torch.testing.assert_close(first(x), model.fc(x).detach())
    second = poptorch.inferenceModel(model, _opts())
    torch.testing.assert_close(second(x), first(x))

    training = poptorch.trainingModel(model, _opts())
    training(x, torch.zeros(2, 3))
    third = poptorch.inferenceModel(model, _opts())
    eager = model.fc(x).detach()  # reading the model syncs the trained weights to the host
    torch.testing.assert_close(third(x), eager)

    model.destroy()  # destroys every wrapper and unwraps the model
    assert type(model) is _Linear
    assert not any(w.isCompiled() for w in (first, second, third, training))
