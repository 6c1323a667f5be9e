"""A one-layer regressor with its loss and data, shared by the executor and options tests."""

import torch

import poptorch


def quiet_options():
    """Options without the compilation progress bar."""
    return poptorch.Options().showCompilationProgressBar(False)


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.loss = torch.nn.MSELoss()

    def forward(self, x, y):
        out = self.fc(x)
        return out, self.loss(out, y)


def regression_data(n=4):
    """``n`` seeded inputs and targets for ``Regressor``."""
    torch.manual_seed(1)
    return torch.randn(n, 4), torch.randn(n, 3)
