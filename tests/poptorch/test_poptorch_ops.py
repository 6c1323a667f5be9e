"""PopTorch's own ops on the simulated IPU, each compared with the same model run eagerly on the CPU."""

import pytest
import torch

import poptorch


def _opts():
    return poptorch.Options().showCompilationProgressBar(False)


def _inference(module, *args):
    return poptorch.inferenceModel(module, _opts())(*args)


class _Loop(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        def body(a, b):
            return torch.tanh(self.fc(a)) + b, b * 0.5

        return poptorch.for_loop(3, body, [x, y])


def test_for_loop_matches_eager():
    torch.manual_seed(0)
    module, x, y = _Loop(), torch.randn(2, 4), torch.randn(2, 4)
    for got, expected in zip(_inference(module, x, y), module(x, y)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_for_loop_and_cond_are_inference_only():
    class _LoopLoss(_Loop):
        def forward(self, x, y):
            return poptorch.identity_loss(super().forward(x, y)[0].sum(), "none")

    model = poptorch.trainingModel(_LoopLoss(), _opts())
    with pytest.raises(poptorch.Error, match=r"poptorch.for_loop\(\) is only supported in inference."):
        model(torch.randn(2, 4), torch.randn(2, 4))

    class _CondLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

        def forward(self, x, flag):
            out = poptorch.cond(flag, lambda a: a * self.w, [x], lambda a: a - self.w, [x])[0]
            return poptorch.identity_loss(out.sum(), "none")

    model = poptorch.trainingModel(_CondLoss(), _opts())
    with pytest.raises(poptorch.Error, match=r"poptorch.cond\(\) is only supported in inference."):
        model(torch.ones(2), torch.tensor([True]))


def test_for_loop_checks_its_body():
    with pytest.raises(poptorch.Error, match="same number, shapes and dtypes"):
        poptorch.for_loop(2, lambda a: a.sum(), [torch.ones(3)])
    with pytest.raises(poptorch.Error, match="count must be a positive integer"):
        poptorch.for_loop(0, lambda a: a, [torch.ones(3)])


class _Cond(torch.nn.Module):
    def forward(self, x, flag):
        return poptorch.cond(flag, lambda a: [a * 2, a.sum(0)], [x], lambda a: [a - 1, a.amax(0)], [x])


def test_cond_takes_the_branch_of_the_run_time_condition():
    x = torch.randn(3, 4)
    model = poptorch.inferenceModel(_Cond(), _opts())
    for flag in (torch.tensor([True]), torch.tensor([False]), torch.tensor([True])):
        for got, expected in zip(model(x, flag), _Cond()(x, flag)):
            torch.testing.assert_close(got, expected)


class _Slicer(torch.nn.Module):
    def forward(self, x, start):
        part = poptorch.dynamic_slice(x, 1, start, 3, 1)
        strided = poptorch.dynamic_slice(x, 0, start // 2, 2, 2)
        updated = poptorch.dynamic_update(x, part * 10, 1, start, 3)
        return part, strided, updated


def test_dynamic_slice_and_update_follow_the_run_time_offset():
    x = torch.arange(48.0).reshape(6, 8)
    model = poptorch.inferenceModel(_Slicer(), _opts())
    for offset in (0, 2, 5):
        start = torch.tensor([offset])
        for got, expected in zip(model(x, start), _Slicer()(x, start)):
            torch.testing.assert_close(got, expected)
    assert torch.equal(_Slicer()(x, torch.tensor([2]))[0], x[:, 2:5])
    assert torch.equal(_Slicer()(x, torch.tensor([2]))[2][:, 2:5], x[:, 2:5] * 10)


class _Sliced(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(6, 4))

    def forward(self, start):
        rows = poptorch.dynamic_slice(self.table, 0, start, 2, 1)
        return poptorch.identity_loss((rows * rows).sum(), "none")


def test_dynamic_slice_trains_only_the_sliced_rows():
    torch.manual_seed(0)
    module = _Sliced()
    before = module.table.detach().clone()
    poptorch.trainingModel(module, _opts(), torch.optim.SGD(module.parameters(), lr=0.1))(torch.tensor([3]))
    after = module.table.detach()
    torch.testing.assert_close(after[3:5], before[3:5] * 0.8)
    assert torch.equal(after[:3], before[:3]) and torch.equal(after[5:], before[5:])


def test_nop_and_name_scope():
    class _Scoped(torch.nn.Module):
        def forward(self, x):
            with poptorch.NameScope("block"):
                return poptorch.nop(x * 2) + 1

    x = torch.randn(2, 3)
    torch.testing.assert_close(_inference(_Scoped(), x), x * 2 + 1)
    with pytest.raises(poptorch.Error, match="non-empty name"):
        with poptorch.NameScope(""):
            pass


class _Printing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))

    def forward(self, x):
        h = poptorch.ipu_print_tensor(x * self.w, "hidden")
        return poptorch.identity_loss((h * 3).sum(), "none")


def test_ipu_print_tensor_prints_forward_and_gradient_on_the_device(capsys):
    x = torch.tensor([[0.5, 0.25]])
    module = _Printing()
    model = poptorch.trainingModel(module, _opts(), torch.optim.SGD(module.parameters(), lr=0.0))
    capsys.readouterr()
    model(x)
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["hidden: [[0.5, 0.5]]", "hidden gradient: [[3., 3.]]"]
    module(x).backward()
    assert capsys.readouterr().out.splitlines() == ["hidden: [[0.5, 0.5]]", "hidden gradient: [[3., 3.]]"]


def test_ipu_print_tensor_in_inference_prints_each_micro_batch(capsys):
    class _Show(torch.nn.Module):
        def forward(self, x):
            return poptorch.ipu_print_tensor(x + 1, "out") * 2

    model = poptorch.inferenceModel(_Show(), _opts().deviceIterations(2))
    capsys.readouterr()
    out = model(torch.tensor([[1.0], [2.0]]))
    assert capsys.readouterr().out.splitlines() == ["out: [[2.]]", "out: [[3.]]"]
    assert torch.equal(out, torch.tensor([[4.0], [6.0]]))


class _DitheredConvs(torch.nn.Module):
    """Two small convolutions in a MultiConv, each dithered as ``dithering`` says (None: as the model)."""

    def __init__(self, dithering):
        super().__init__()
        self.dithering = dithering
        self.a, self.b = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x, target):
        multi_conv = poptorch.MultiConv()
        if self.dithering is not None:
            multi_conv.enableConvDithering(self.dithering)
        with multi_conv:
            y = self.a(x)
            z = self.b(torch.relu(y))
        return z, torch.nn.functional.mse_loss(z, target)


def _tile_memory(dithering, model_dithering, training):
    """Each tile's tensor bytes of the model's program, and its outputs."""
    torch.manual_seed(7)
    model, x, target = _DitheredConvs(dithering), torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    opts = _opts()
    opts.Training.setConvolutionDithering(model_dithering)
    if training:
        executor = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    else:
        executor = poptorch.inferenceModel(model, opts)
    out, loss = executor(x, target)
    program = "train" if training else "inference"
    if not training:
        for got, expected in zip((out, loss), model(x, target)):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    return executor.profile.programs[program]["memory"]["tensors"]


@pytest.mark.parametrize("training", [False, True])
def test_multiconv_dithers_each_convolution_as_its_own_setting_says(training):
    plain = _tile_memory(None, False, training)
    dithered = _tile_memory(None, True, training)
    assert plain != dithered
    # Per-convolution settings override the model's, for the forward convolutions and their gradients.
    assert _tile_memory([True, True], False, training) == dithered
    assert _tile_memory([False, False], True, training) == plain
    assert _tile_memory(True, False, training) == dithered
    # Dithering only the first convolution places it as the dithered model does, the second as the plain one.
    mixed = _tile_memory([True, False], False, training)
    assert mixed not in (plain, dithered)
    assert _tile_memory([True, False], True, training) == mixed


class _HalfConvs(torch.nn.Module):
    """Two float16 convolutions in a MultiConv accumulating in ``partials`` (None: the model's type)."""

    def __init__(self, partials):
        super().__init__()
        self.partials = partials
        self.a, self.b = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        multi_conv = poptorch.MultiConv()
        if self.partials is not None:
            multi_conv.partialsTypes(self.partials)
        with multi_conv:
            return self.b(torch.relu(self.a(x)))


def _half_tile_memory(partials, model_partials):
    torch.manual_seed(8)
    model, x = _HalfConvs(partials), torch.randn(2, 8, 8, 8)
    reference = model(x)  # in float32 on the CPU
    opts = _opts()
    opts.Precision.setPartialsType(model_partials)
    executor = poptorch.inferenceModel(model.half(), opts)
    torch.testing.assert_close(executor(x.half()).float(), reference, rtol=2e-2, atol=2e-2)
    program = executor.profile.programs["inference"]
    return program["memory"]["tensors"], program["total_cycles"]


def test_multiconv_accumulates_each_convolution_in_its_own_partials_type():
    single, half = _half_tile_memory(None, torch.float), _half_tile_memory(None, torch.half)
    assert single != half
    assert _half_tile_memory([torch.half, torch.half], torch.float) == half
    assert _half_tile_memory(torch.float, torch.half) == single
    # Mixed per-convolution types: each convolution's own type decides its plan, whatever the model-wide one.
    for mixed in ([torch.half, torch.float], [torch.float, torch.half]):
        assert _half_tile_memory(mixed, torch.float) == _half_tile_memory(mixed, torch.half)


@pytest.mark.parametrize(
    ("op", "settings", "differentiable"),
    [
        ("set_available_memory", (0.5,), True),
        ("set_conv_dithering", (True,), True),
        ("set_conv_partials_type", ("float16",), True),
        ("recomputation_checkpoint", (), True),
        ("set_overlap", ("OverlapAccumulate", "input"), False),
    ],
)
def test_marker_ops_copy_their_tensor_and_pass_its_gradient(op, settings, differentiable):
    x = torch.randn(3, 2, requires_grad=True)
    marked = getattr(torch.ops.poptorch, op)(x, *settings)
    torch.testing.assert_close(marked, x)
    assert marked.data_ptr() != x.data_ptr()
    if differentiable:
        (marked * 2).sum().backward()
        torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    else:  # overlapped I/O marks model inputs and outputs: no gradient formula
        with pytest.raises(RuntimeError, match="no autograd formula"):
            marked.sum().backward()
