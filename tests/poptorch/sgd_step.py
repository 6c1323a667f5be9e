"""Training steps of a model on the simulated IPU checked against the same steps in eager PyTorch."""

import torch

import poptorch

LR = 0.1


def train_one_step_like_eager(model, eager, opts, x, y):
    """One SGD step of ``model`` through ``poptorch.trainingModel(model, opts, ...)`` and of ``eager`` (a copy
    with the same weights) in eager PyTorch on ``(x, y)``; the model returns ``(output, loss)``. Asserts the losses
    and the weights after the step agree, and returns the training model."""
    trained = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=LR))
    loss = trained(x, y)[1]
    eager_loss = eager_step(eager, torch.optim.SGD(eager.parameters(), lr=LR), x, y)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(list(trained.parameters()), list(eager.parameters()), rtol=1e-4, atol=1e-5)
    return trained


def eager_step(model, optimizer, *args):
    """One eager training step of ``model``, whose output's second item is the loss; the loss, detached."""
    optimizer.zero_grad()
    loss = model(*args)[1]
    loss.backward()
    optimizer.step()
    return loss.detach()
