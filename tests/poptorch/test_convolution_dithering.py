"""Training.setConvolutionDithering(True): each convolution's tiles start at a column hashed from its shape,
which spreads small convolutions' temporaries more evenly over the tiles; every number stays as eager's."""

import copy

import numpy as np
import torch

import poptorch


class _SmallConvs(torch.nn.Module):
    """Four identical small convolutions: each plan uses a few of the IPU's tiles."""

    def __init__(self):
        super().__init__()
        self.convs = torch.nn.ModuleList(torch.nn.Conv2d(4, 4, 3, padding=1) for _ in range(4))

    def forward(self, x, target=None):
        for conv in self.convs:
            x = torch.relu(conv(x))
        return x if target is None else (x, torch.nn.functional.mse_loss(x, target))


def _options(dithering):
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.Training.setConvolutionDithering(dithering)
    return opts


def _train(dithering, model, x, target):
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    training = poptorch.trainingModel(model, _options(dithering), optimizer)
    out, loss = training(x, target)
    training.copyWeightsToHost()
    return out, loss, [p.detach().clone() for p in model.parameters()]


def test_a_dithered_training_step_is_eager_s_and_the_undithered_one_bit_for_bit():
    torch.manual_seed(0)
    model = _SmallConvs()
    x, target = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    eager = copy.deepcopy(model)
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    want_out, want_loss = eager(x, target)
    want_loss.backward()
    optimizer.step()
    runs = {d: _train(d, model, x, target) for d in (False, True)}
    out, loss, params = runs[True]
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    for got, want in zip(params, eager.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    for got, plain in zip([out, loss, *params], [runs[False][0], runs[False][1], *runs[False][2]]):
        np.testing.assert_array_equal(got.detach().numpy(), plain.detach().numpy())


def test_dithering_lowers_the_busiest_tile_of_small_convolutions():
    torch.manual_seed(1)
    model, x = _SmallConvs(), torch.randn(2, 4, 8, 8)
    busiest, outs = {}, {}
    for dithering in (False, True):
        inference = poptorch.inferenceModel(copy.deepcopy(model), _options(dithering))
        outs[dithering] = inference(x)
        busiest[dithering] = max(inference.profile.programs["inference"]["memory"]["tensors"])
    torch.testing.assert_close(outs[True], model(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(outs[True].numpy(), outs[False].numpy())
    assert busiest[True] < busiest[False]


def test_dithering_is_part_of_the_executable_cache_key():
    plain, dithered = poptorch.Options(), poptorch.Options()
    dithered.Training.setConvolutionDithering(True)
    assert dithered.Training.convolution_dithering and not plain.Training.convolution_dithering
    assert plain._compile_key() != dithered._compile_key()


class _MultiConv(torch.nn.Module):
    def __init__(self, dithering):
        super().__init__()
        self.dithering = dithering
        self.conv = torch.nn.Conv2d(1, 2, 3)

    def forward(self, x):
        with poptorch.MultiConv().enableConvDithering(self.dithering):
            return self.conv(x)


def test_a_multiconv_s_own_dithering_runs_under_either_model_setting_as_eager():
    x = torch.randn(1, 1, 5, 5)
    for own in (True, False):
        model = _MultiConv(own)
        for dithering in (True, False):
            executor = poptorch.inferenceModel(model, _options(dithering))
            torch.testing.assert_close(executor(x), model(x), rtol=1e-5, atol=1e-5)
            executor.destroy()
