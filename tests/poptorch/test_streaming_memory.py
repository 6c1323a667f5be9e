"""Streaming memory: weights, optimizer state and gradient accumulators put off chip by
``Options.TensorLocations.set*Location(TensorLocationSettings().useOnChipStorage(False))`` train to the same
numbers as in tile memory (and eagerly), with a lower tile-memory peak and more cycles."""

import pytest
import torch
from sgd_step import eager_step, train_one_step_like_eager

import popsim
import poptorch

WIDTH, LAYERS, BATCH, STEPS = 96, 4, 8, 3
ROOMY = popsim.Target.small(num_tiles=4, tile_bytes=1024 * 1024)


class Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x, torch.nn.functional.mse_loss(x, y)


def _off_chip(min_elements=None):
    settings = poptorch.TensorLocationSettings().useOnChipStorage(False)
    return settings if min_elements is None else settings.minElementsForOffChip(min_elements)


def _options(*kinds, accumulation=1, min_elements=None):
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.Training.gradientAccumulation(accumulation)
    for kind in kinds:
        getattr(opts.TensorLocations, f"set{kind}Location")(_off_chip(min_elements))
    return opts


def _data(accumulation):
    g = torch.Generator().manual_seed(1)
    n = BATCH * accumulation
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


def _eager():
    """Losses and parameters over STEPS eager steps of Adam."""
    torch.manual_seed(0)
    model = Wide()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data(1)
    losses = []
    for _ in range(STEPS):
        losses.append(eager_step(model, optimizer, x, y))
    return losses, [p.detach().clone() for p in model.parameters()]


def _train(opts, accumulation=1):
    """Losses and parameters over STEPS steps of Adam, and the profile of the compiled program that reads the
    weights (the micro-batch program under gradient accumulation)."""
    torch.manual_seed(0)
    model = Wide()
    x, y = _data(accumulation)
    trained = poptorch.trainingModel(model, opts, torch.optim.Adam(model.parameters(), lr=0.01))
    losses = [trained(x, y)[1].detach().clone().mean() for _ in range(STEPS)]
    programs = trained.profile.programs
    params = [p.detach().clone() for p in trained.parameters()]
    trained.destroy()
    return losses, params, programs["train" if accumulation == 1 else "accumulate"], programs


def _same(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a[1], b[1], rtol=1e-4, atol=1e-5)


def test_weights_and_optimizer_state_off_chip_train_alike_with_less_tile_memory_and_more_cycles(monkeypatch):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    eager = _eager()
    on_chip = _train(_options())
    off_chip = _train(_options("Weight", "Optimizer"))
    _same(on_chip, eager)
    _same(off_chip, on_chip)
    assert off_chip[2]["memory_max_tile_bytes"] < on_chip[2]["memory_max_tile_bytes"]
    assert off_chip[2]["total_cycles"] > on_chip[2]["total_cycles"]
    names = {s["name"] for s in off_chip[2]["steps"]}
    assert any(n.startswith("remote load") for n in names) and any(n.startswith("remote store") for n in names)


def test_a_model_out_of_tile_memory_trains_with_streaming_memory_weights_and_optimizer_state(monkeypatch):
    tight = popsim.Target.small(num_tiles=4, tile_bytes=128 * 1024)
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: tight)
    with pytest.raises(poptorch.Error, match="Out of memory on the simulated IPU"):
        _train(_options())
    off_chip = _train(_options("Weight", "Optimizer"))
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    _same(off_chip, _train(_options()))


def _streamed(programs):
    """Names of the variables the programs load from streaming memory."""
    return {
        s["name"].removeprefix("remote load ")
        for p in programs.values()
        for s in p["steps"]
        if "remote load" in s["name"]
    }


def test_accumulators_off_chip_and_min_elements_for_off_chip(monkeypatch):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    on_chip = _train(_options(accumulation=2), accumulation=2)
    accumulators = _train(_options("Accumulator", accumulation=2), accumulation=2)
    _same(accumulators, on_chip)
    assert _streamed(accumulators[3]) == {f"_accum.layers.{i}.{p}" for i in range(LAYERS) for p in ("weight", "bias")}
    # Biases (WIDTH elements) are below minElementsForOffChip and stay on the chip.
    big_only = _train(_options("Weight", min_elements=WIDTH + 1))
    assert _streamed(big_only[3]) == {f"layers.{i}.weight" for i in range(LAYERS)}
    _same(big_only, _train(_options()))


def test_tensor_location_settings_the_simulator_does_not_model_are_refused():
    opts = poptorch.Options()
    sharded = poptorch.TensorLocationSettings().useOnChipStorage(False).useReplicatedTensorSharding(True)
    with pytest.raises(poptorch.Error, match=r"useReplicatedTensorSharding\(True\) is not modelled"):
        opts.TensorLocations.setWeightLocation(sharded)
    with pytest.raises(poptorch.Error, match=r"useIOTilesToLoad\(True\) is not modelled"):
        opts.TensorLocations.setOptimizerLocation(_off_chip().useIOTilesToLoad(True))
    # A later on-chip setting brings the kind back to tile memory.
    opts.TensorLocations.setWeightLocation(_off_chip()).setWeightLocation(poptorch.TensorLocationSettings())
    assert opts.TensorLocations.streamed == {}


def test_tensor_locations_key_the_executable_cache():
    keys = {poptorch._cache.key({}, _options(*kinds)) for kinds in [(), ("Weight",), ("Optimizer",), ("Activation",)]}
    assert len(keys) == 4


class Narrow(torch.nn.Module):
    """Narrow layers on a large batch: the activations the backward pass reads dominate tile memory."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(LAYERS))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x, torch.nn.functional.mse_loss(x, y)


def _train_narrow(opts):
    """Loss and weights after one SGD step, checked against eager, and the train program's profile."""
    torch.manual_seed(0)
    model, eager = Narrow(), Narrow()
    eager.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(256, 32, generator=g), torch.randn(256, 32, generator=g)
    trained = train_one_step_like_eager(model, eager, opts, x, y)
    return trained.profile.programs["train"]


def test_activations_off_chip_wait_in_streaming_memory_for_the_backward_pass(monkeypatch):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    on_chip = _train_narrow(_options())
    off_chip = _train_narrow(_options("Activation"))
    assert off_chip["memory_max_tile_bytes"] < on_chip["memory_max_tile_bytes"]
    assert off_chip["total_cycles"] > on_chip["total_cycles"]
    stored = {s["name"].removeprefix("remote store ") for s in off_chip["steps"] if "remote store" in s["name"]}
    loaded = {s["name"].removeprefix("remote load ") for s in off_chip["steps"] if "remote load" in s["name"]}
    # Each layer's tanh output, which the backward pass reads, goes off chip and comes back; nothing else.
    assert sum(name.startswith("tanh") for name in stored) == LAYERS and loaded == stored
    # Activations below minElementsForOffChip stay on the chip.
    small_only = _train_narrow(_options("Activation", min_elements=256 * 32 + 1))
    assert small_only["total_cycles"] == on_chip["total_cycles"]
    assert not any("remote" in s["name"] for s in small_only["steps"])


def test_activations_off_chip_in_a_pipeline_are_refused():
    torch.manual_seed(0)
    model = Narrow()
    poptorch.BeginBlock(model.layers[LAYERS // 2], ipu_id=1)
    opts = _options("Activation", accumulation=4)
    trained = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match=r"useOnChipStorage\(False\) with PipelinedExecution is not modelled"):
        trained(torch.randn(16, 32), torch.randn(16, 32))


def test_streamed_weights_serve_inference_and_take_new_host_weights(monkeypatch):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    torch.manual_seed(0)
    model = Wide()
    x, y = _data(1)
    executor = poptorch.inferenceModel(model, _options("Weight"))
    torch.testing.assert_close(executor(x, y)[0], model(x, y)[0])
    with torch.no_grad():
        model.layers[0].weight.mul_(2)
    executor.copyWeightsToDevice()
    torch.testing.assert_close(executor(x, y)[0], model(x, y)[0])
    profile = executor.profile.programs["inference"]
    assert profile["streaming_memory_bytes"] == sum(p.numel() * 4 for p in model.parameters())


def test_streaming_memory_transfers_are_intervals_of_their_own_on_the_call_timeline(monkeypatch):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    torch.manual_seed(0)
    model = Wide()
    x, y = _data(1)
    executor = poptorch.inferenceModel(model, _options("Weight").logCycleCount(True))
    torch.testing.assert_close(executor(x, y)[0], model(x, y)[0])
    program = executor.profile.programs["inference"]
    timeline = program["run_timeline"]
    # Nothing overlaps the loads: the call's cycles are the program's, as before they were split out.
    assert timeline["makespan"] == executor.cycleCount() == program["total_cycles"]
    loads = [e for e in timeline["intervals"] if e.get("transfer") == "streaming memory"]
    assert loads and all("replica 0 IPU 0 streaming memory" in e["lanes"] for e in loads)
    assert all("replica 0 IPU 0 compute" in e["lanes"] for e in loads)  # the tiles wait for them
    remote = [s for s in program["steps"] if s.get("transfer") == "streaming memory"]
    assert {s["name"] for s in remote} == {
        f"remote load layers.{i}.{w}" for i in range(LAYERS) for w in ("weight", "bias")
    }
    sync = ROOMY.bsp_sync_cycles
    assert sum(e["end"] - e["start"] for e in loads) == sum(s["cycles"] + sync for s in remote)
    spans = sorted((e["start"], e["end"]) for e in timeline["intervals"])
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # one after another


def test_optimizer_state_off_chip_streams_on_the_timeline_of_each_training_step(monkeypatch):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    *_, programs = _train(_options("Optimizer", accumulation=2), accumulation=2)
    timeline = programs["accumulate"]["run_timeline"]
    step = [e for e in timeline["intervals"] if e.get("program") == "step"]
    streamed = [e for e in step if e.get("transfer") == "streaming memory"]
    assert streamed and all("replica 0 IPU 0 streaming memory" in e["lanes"] for e in streamed)
    # The call's one step loads and stores the Adam state, as the step program's profile charges it.
    remote = [s for s in programs["apply"]["steps"] if s.get("transfer") == "streaming memory"]
    transfer_cycles = sum(s["cycles"] + ROOMY.bsp_sync_cycles for s in remote)
    assert sum(e["end"] - e["start"] for e in streamed) == transfer_cycles
    # Nothing overlaps on one IPU: the makespan is the sum of the runs' and steps' cycles, as before.
    spans = sorted((e["start"], e["end"]) for e in timeline["intervals"])
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert timeline["makespan"] == sum(end - start for start, end in spans)


class TwoWide(torch.nn.Module):
    """Two wide layers on a small batch: the weights dominate tile memory."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(256, 256, bias=False)
        self.b = torch.nn.Linear(256, 256, bias=False)

    def forward(self, x, y):
        x = self.b(torch.relu(self.a(x)))
        return x, torch.nn.functional.mse_loss(x, y)


def _weight_loads(monkeypatch, tile_kib):
    """{streamed weight: loads in one training step} on tiles of ``tile_kib`` KiB, the step checked against eager."""
    target = popsim.Target.small(num_tiles=4, tile_bytes=tile_kib * 1024)
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: target)
    torch.manual_seed(0)
    model, eager = TwoWide(), TwoWide()
    eager.load_state_dict(model.state_dict())
    x, y = torch.randn(4, 256), torch.randn(4, 256)
    trained = train_one_step_like_eager(model, eager, _options("Weight"), x, y)
    steps = trained.profile.programs["train"]["steps"]
    return {name: sum(s["name"] == f"remote load {name}" for s in steps) for name in ("a.weight", "b.weight")}


def test_a_streamed_weight_is_loaded_once_per_phase_unless_that_does_not_fit(monkeypatch):
    # b.weight has three readers: its forward matmul, the backward matmul for a's gradient, and its update.
    # Roomy tiles: one load for the forward pass and one for the backward pass and update.
    assert _weight_loads(monkeypatch, 512) == {"a.weight": 2, "b.weight": 2}
    # Held from the backward matmul to its update, b.weight does not fit beside the gradients: one load per reader.
    assert _weight_loads(monkeypatch, 320) == {"a.weight": 2, "b.weight": 3}
