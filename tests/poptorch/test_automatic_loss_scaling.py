"""Automatic loss scaling: the device halves or doubles the loss scaling from the float16 gradients each step."""

import copy

import numpy as np
import pytest
import torch

import poptorch

FP16_MAX = float(np.finfo(np.float16).max)
EDGE = 0.0625 * FP16_MAX  # PopART's default bin edge, as a fraction of float16's maximum
UPPER_PROPORTION = 1e-7
MAX_SCALE = 2.0**15  # PopART keeps the final scale a power of 2 within float16's range
LR = 0.01
# Layers whose backward matmuls or convolutions produce the tracked gradients (of the weight and the input).
TRACKED_LAYERS = (torch.nn.Linear, torch.nn.Conv2d)
# The reference's hook on the first Linear (whose input needs no gradient) fires without an input gradient.
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


class HalfNet(torch.nn.Module):
    def __init__(self, gain):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2)).half()
        self.gain = gain

    def forward(self, x):
        return poptorch.identity_loss(self.net(x).float().pow(2).mean() * self.gain, "none")


class HalfConvNet(HalfNet):
    def __init__(self, gain):
        super().__init__(gain)
        self.net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.Tanh(), torch.nn.Conv2d(3, 2, 3)).half()


def _opts(settings=None):
    """Options with automatic loss scaling and PopART's ``settings`` (name -> value) set as a user sets them."""
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.Training.setAutomaticLossScaling(True)
    for name, value in (settings or {}).items():
        opts._Popart.set(f"automaticLossScalingSettings.{name}", value)
    return opts


def _track_input_grads(model):
    """The gradients of the tracked layers' inputs, filled by each backward pass (cleared by _scaled_backward)."""
    input_grads = []
    for layer in model.modules():
        if isinstance(layer, TRACKED_LAYERS):
            layer.register_full_backward_hook(lambda m, grad_in, grad_out: input_grads.extend(grad_in))
    return input_grads


def _scaled_backward(model, x, scale, input_grads, edge=EDGE):
    """Backward of the scaled float16 loss; returns (elements at or above the bin ``edge``, elements tracked)."""
    model.zero_grad()
    input_grads.clear()
    (model(x) * scale).backward()
    weights = [layer.weight.grad for layer in model.modules() if isinstance(layer, TRACKED_LAYERS)]
    tracked = weights + [g for g in input_grads if g is not None]
    return sum(int((g.float().abs() >= edge).sum()) for g in tracked), sum(g.numel() for g in tracked)


def _next_scale(scale, upper, elements, proportion=UPPER_PROPORTION):
    """PopART's rule: halve when more than ``proportion`` of the elements reach the edge, else double up to
    the cap."""
    return scale / 2 if upper > proportion * elements else min(scale * 2, MAX_SCALE)


def _reference_steps(model, x, scale, steps, settings=None):
    """Eager torch step by step: backward of the scaled loss in float16, SGD on the unscaled gradients, then
    PopART's rule on the float16 outputs of the backward matmuls (still scaled): each Linear's weight gradient
    and the gradient of its input. PopART's ``settings`` move the bin edge and the threshold, and with an
    update period P only every P-th step (the first included) updates the scale. Returns the scale after each
    step."""
    settings = settings or {}
    edge = settings.get("binEdgeLocation", EDGE / FP16_MAX) * FP16_MAX
    proportion = settings.get("thresholdUpperCountProportion", UPPER_PROPORTION)
    period = settings.get("updatePeriod", 1)
    scales = []
    params = list(model.parameters())
    input_grads = _track_input_grads(model)
    for step in range(steps):
        upper, elements = _scaled_backward(model, x, scale, input_grads, edge)
        with torch.no_grad():
            for p in params:
                p.copy_((p.float() - (p.grad.float() / scale) * LR).half())
        if step % period == 0:
            scale = _next_scale(scale, upper, elements, proportion)
        scales.append(scale)
    return scales


def _factor(optimizer):
    return float(optimizer.state_dict()["ipu_state"]["lossScaleUpdateFactor"])


def _run(gain, initial_scale, steps, net=HalfNet, shape=(3, 4), settings=None):
    torch.manual_seed(0)
    model = net(gain)
    reference = copy.deepcopy(model)
    x = torch.randn(*shape).half()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=LR, loss_scaling=initial_scale)
    training = poptorch.trainingModel(model, _opts(settings), optimizer)
    scales = []
    for _ in range(steps):
        training(x)
        scales.append(initial_scale * _factor(optimizer))
    assert optimizer.loss_scaling == initial_scale  # the optimizer keeps its own; the device scales it
    expected = _reference_steps(reference, x, initial_scale, steps, settings)
    training.copyWeightsToHost()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
    return scales, expected


def test_overflowing_gradients_halve_the_scale():
    scales, expected = _run(gain=4.0, initial_scale=32768.0, steps=4)
    assert scales[0] == 16384.0
    assert scales == expected


def test_convolution_gradients_are_tracked():
    scales, expected = _run(gain=4.0, initial_scale=32768.0, steps=3, net=HalfConvNet, shape=(2, 2, 7, 7))
    assert scales[0] == 16384.0
    assert scales == expected


def test_tiny_gradients_double_the_scale_up_to_2_to_the_15():
    scales, expected = _run(gain=1e-3, initial_scale=8192.0, steps=3)
    assert scales == [16384.0, 32768.0, 32768.0]
    assert scales == expected


def test_bin_edge_and_threshold_set_through_popart_options():
    # With PopART's defaults this model's gradients halve the scale at once; a higher bin edge and a larger
    # threshold proportion let it grow, as the eager rule with the same settings does.
    torch.manual_seed(0)
    assert _reference_steps(HalfNet(4.0), torch.randn(3, 4).half(), 8192.0, 1) == [4096.0]
    settings = {"binEdgeLocation": 0.5, "thresholdUpperCountProportion": 0.05}
    scales, expected = _run(gain=4.0, initial_scale=8192.0, steps=3, settings=settings)
    assert scales[0] == 16384.0
    assert scales == expected


def test_the_update_period_updates_every_nth_step():
    scales, expected = _run(gain=1e-3, initial_scale=1.0, steps=4, settings={"updatePeriod": 2})
    assert scales == [2.0, 2.0, 4.0, 4.0]
    assert scales == expected


def test_enabled_through_popart_options():
    opts = poptorch.Options()
    opts._Popart.set("automaticLossScalingSettings.enabled", True)
    assert opts.Training.automatic_loss_scaling_settings == {
        "binEdgeLocation": 0.0625,
        "thresholdUpperCountProportion": 1e-7,
        "updatePeriod": 1,
    }
    opts._Popart.set("automaticLossScalingSettings.gradientTensorTrackingMethod", 1)  # the default


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("binEdgeLocation", 1.5, r"Out of range value for 'binEdgeLocation'.*\[0, 1\]"),
        ("thresholdUpperCountProportion", -0.1, r"Out of range value for 'thresholdUpperCountProportion'"),
        ("updatePeriod", 0, "positive integer"),
        ("gradientTensorTrackingMethod", 0, "not modelled.*ConvAndMatmulGradients"),
        ("gradientTensorTrackingMethod", 2, "not modelled.*ConvAndMatmulGradients"),
        ("toTrackTensors", ["Mul:0"], "not modelled"),
    ],
)
def test_settings_popart_refuses_or_the_simulator_does_not_model_are_refused(name, value, message):
    with pytest.raises(poptorch.Error, match=message):
        poptorch.Options()._Popart.set(f"automaticLossScalingSettings.{name}", value)


def test_float32_gradients_are_refused():
    model = torch.nn.Linear(4, 2)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = model

        def forward(self, x):
            return poptorch.identity_loss(self.lin(x).sum(), "none")

    net = Net()
    training = poptorch.trainingModel(net, _opts(), poptorch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match="float16 gradients"):
        training(torch.randn(2, 4))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_replicas_share_one_decision_from_their_summed_counts(accumulation):
    """R=2: only the second replica's half of the batch overflows, and the factor halves for both; the steps
    match the eager rule on the combined batch (scale sequence and weights)."""
    torch.manual_seed(0)
    model = HalfNet(4.0)
    reference = copy.deepcopy(model)
    replicas, steps, scale = 2, 3, 4096.0
    micro_batches = replicas * accumulation
    # Every micro-batch small (alone they double the scale) except the last, whose large inputs push its
    # gradients past the bin edge.
    chunks = [torch.randn(3, 4) * 0.1 for _ in range(micro_batches - 1)] + [torch.randn(3, 4) * 10.0]
    opts = _opts().replicationFactor(replicas)
    opts.Training.gradientAccumulation(accumulation)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=LR, loss_scaling=scale)
    training = poptorch.trainingModel(model, opts, optimizer)
    # The device splits the combined batch by replica, each replica's part by micro-batch.
    per_replica = [torch.cat(chunks[r::replicas]) for r in range(replicas)]
    x = torch.cat(per_replica).half()
    scales = []
    for _ in range(steps):
        training(x)
        scales.append(scale * _factor(optimizer))
    training.copyWeightsToHost()
    expected = _reference_accumulated(reference, [c.half() for c in chunks], scale, steps)
    assert expected[0] == scale / 2  # the overflowing replica halves the scale for both
    assert scales == expected
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)


def test_replicas_with_grouped_weights_share_one_decision():
    """A bias grouped per replica (Consecutive, one replica a group): each replica steps its own bias from its
    own gradient, and both take the one decision from the counts of every replica."""
    torch.manual_seed(0)
    model = HalfNet(4.0)
    reference = [copy.deepcopy(model) for _ in range(2)]
    model.net[0].bias = torch.nn.Parameter(torch.stack([model.net[0].bias.detach()] * 2))
    chunks = [(torch.randn(3, 4) * spread).half() for spread in (0.1, 10.0)]
    optimizer = poptorch.optim.SGD(model.parameters(), lr=LR, loss_scaling=4096.0)
    training = poptorch.trainingModel(model, _opts().replicationFactor(2), optimizer)
    training.per_replica_params["net.0.bias"] = (
        poptorch.CommGroupType.Consecutive,
        1,
        poptorch.VariableRetrievalMode.OnePerGroup,
    )
    scales = []
    for _ in range(3):
        training(torch.cat(chunks))
        scales.append(4096.0 * _factor(optimizer))
    training.copyWeightsToHost()
    assert scales == _reference_grouped_bias(reference, chunks, 4096.0, 3)
    assert scales[0] == 2048.0
    for r, replica in enumerate(reference):
        torch.testing.assert_close(model.net[0].bias[r], replica.net[0].bias, rtol=2e-3, atol=2e-3)
    for name, value in reference[0].named_parameters():
        if name != "net.0.bias":
            torch.testing.assert_close(model.get_parameter(name), value, rtol=2e-3, atol=2e-3)


def _reference_grouped_bias(replicas, chunks, scale, steps):
    """As _reference_accumulated over one micro-batch per replica model, except that each replica's first
    bias steps from its own gradient only; the other parameters from the mean over the replicas."""
    scales = []
    input_grads = [_track_input_grads(model) for model in replicas]
    for _ in range(steps):
        upper = elements = 0
        for model, x, grads in zip(replicas, chunks, input_grads):
            large, tracked = _scaled_backward(model, x, scale, grads)
            upper, elements = upper + large, elements + tracked
        with torch.no_grad():
            shared = [sum(m.get_parameter(n).grad for m in replicas) for n, _ in replicas[0].named_parameters()]
            for model in replicas:
                for (name, p), total in zip(model.named_parameters(), shared):
                    grad = p.grad.float() if name == "net.0.bias" else total.float() / len(replicas)
                    p.copy_((p.float() - (grad / scale) * LR).half())
        scale = _next_scale(scale, upper, elements)
        scales.append(scale)
    return scales


def test_gradient_accumulation_counts_every_micro_batch():
    torch.manual_seed(0)
    model = HalfNet(4.0)
    reference = copy.deepcopy(model)
    micro_batches, steps = 2, 4
    scales, _ = _accumulated_as_reference(model, reference, _opts(), micro_batches, steps)
    assert scales == [8192.0, 4096.0, 8192.0, 4096.0]  # both ways: a large element in either micro-batch halves


def _accumulated_as_reference(model, reference, opts, micro_batches, steps):
    """Train ``model`` with gradient accumulation of ``micro_batches`` for ``steps`` steps under automatic
    loss scaling: the scales and weights equal ``reference`` trained step by step on the host. Returns the
    scales and the training model."""
    x = torch.randn(3 * micro_batches, 4).half()
    opts.Training.gradientAccumulation(micro_batches)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=LR, loss_scaling=4096.0)
    training = poptorch.trainingModel(model, opts, optimizer)
    scales = []
    for _ in range(steps):
        training(x)
        scales.append(4096.0 * _factor(optimizer))
    training.copyWeightsToHost()
    assert scales == _reference_accumulated(reference, x.chunk(micro_batches), 4096.0, steps)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
    return scales, training


def _reference_accumulated(model, micro_batches, scale, steps):
    """As _reference_steps, the float16 gradients summed over the micro-batches and their mean applied; the
    large elements of every micro-batch count towards the step's decision."""
    scales = []
    input_grads = _track_input_grads(model)
    params = list(model.parameters())
    for _ in range(steps):
        upper = elements = 0
        sums = [torch.zeros_like(p) for p in params]
        for x in micro_batches:
            large, tracked = _scaled_backward(model, x, scale, input_grads)
            upper, elements = upper + large, elements + tracked
            sums = [s + p.grad for s, p in zip(sums, params)]
        with torch.no_grad():
            for p, s in zip(params, sums):
                p.copy_((p.float() - ((s.float() / len(micro_batches)) / scale) * LR).half())
        scale = _next_scale(scale, upper, elements)
        scales.append(scale)
    return scales


def test_inference_is_refused():
    with pytest.raises(poptorch.Error, match="automatic loss scaling is for training"):
        poptorch.inferenceModel(torch.nn.Linear(2, 2), _opts())


def test_setting_the_optimizer_keeps_the_device_scale():
    torch.manual_seed(0)
    model = HalfNet(1e-3)
    x = torch.randn(3, 4).half()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=LR, loss_scaling=1.0)
    training = poptorch.trainingModel(model, _opts(), optimizer)
    training(x)
    optimizer.param_groups[0]["lr"] = LR / 2
    training.setOptimizer(optimizer)
    training(x)
    assert _factor(optimizer) == 4.0


def test_a_loaded_factor_is_uploaded():
    torch.manual_seed(0)
    x = torch.randn(3, 4).half()
    model = HalfNet(1e-3)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=LR, loss_scaling=1.0)
    poptorch.trainingModel(model, _opts(), optimizer)(x)
    saved = optimizer.state_dict()
    fresh_model = HalfNet(1e-3)
    fresh = poptorch.optim.SGD(fresh_model.parameters(), lr=LR, loss_scaling=1.0)
    fresh.load_state_dict(saved)
    poptorch.trainingModel(fresh_model, _opts(), fresh)(x)
    assert _factor(fresh) == 4.0


def test_the_factor_starts_at_one_when_compiled_and_carries_over_to_a_new_optimizer():
    torch.manual_seed(0)
    model = HalfNet(1e-3)
    x = torch.randn(3, 4).half()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=LR, loss_scaling=1.0)
    training = poptorch.trainingModel(model, _opts(), optimizer)
    training.compile(x)
    assert _factor(optimizer) == 1.0
    training(x)
    replacement = poptorch.optim.SGD(model.parameters(), lr=LR, loss_scaling=1.0)
    training.setOptimizer(replacement)
    assert _factor(replacement) == 2.0
    training(x)
    assert _factor(replacement) == 4.0


def test_each_ipu_counts_its_own_large_gradient_elements_in_a_pipeline():
    # As PopART's histograms, each IPU counts the large elements of the gradients it produces into a count of
    # its own, reset on that IPU: only the step's sum of the counts crosses an IPU-Link, not every
    # micro-batch's.
    torch.manual_seed(0)
    model = HalfNet(4.0)
    reference = copy.deepcopy(model)
    model.net[2] = poptorch.BeginBlock(model.net[2], ipu_id=1)
    micro_batches, steps = 3, 3  # two pipeline stages need 2 x 2 - 1 micro-batches
    opts = _opts().setExecutionStrategy(poptorch.PipelinedExecution())
    _, training = _accumulated_as_reference(model, reference, opts, micro_batches, steps)
    crossing = [s for s in training.profile.programs["accumulate"]["steps"] if s.get("busiest_link_bytes", 0)]
    assert sorted(s["origin"]["role"] for s in crossing) == ["backward", "forward"]
