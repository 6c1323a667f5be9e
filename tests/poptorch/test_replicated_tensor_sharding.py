"""Replicated tensor sharding of optimizer state, in tile or streaming memory: each replica's optimizer step
holds and updates only its shard (tile memory, optimizer cycles, streaming-memory bytes and transfers fall
with the replicas), gradients are reduce-scattered and updated weights all-gathered, and the numbers equal
the unsharded run and eager torch step by step."""

import copy

import numpy as np
import pytest
import torch
from sgd_step import eager_step

import popsim
import poptorch

REPLICAS, WIDTH, BATCH, STEPS = 2, 96, 4, 3
ROOMY = popsim.Target.small(num_tiles=4, tile_bytes=1024 * 1024)
STATE_SLOTS = ("exp_avg", "exp_avg_sq")
# Sizes no replica count divides: 143, 11, 55 and 5 elements leave padding in the last shards.
ODD_SIZES = (13, 11, 5)
OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    # poptorch.optim.LAMB steps on the host with the device's rule when used eagerly.
    "lamb": lambda params: poptorch.optim.LAMB(params, lr=0.01, weight_decay=0.01),
    # The global gradient norm the clipping takes sums the replicas' partial norms too.
    "lamb_clipped": lambda params: poptorch.optim.LAMB(params, lr=0.01, max_grad_norm=0.05),
}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, y):
        out = self.second(torch.tanh(self.first(x)))
        return out, torch.nn.functional.mse_loss(out, y)


def _data():
    g = torch.Generator().manual_seed(1)
    n = BATCH * REPLICAS
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


def _options(sharded, min_elements=None, replicas=REPLICAS, on_chip=False):
    opts = poptorch.Options().showCompilationProgressBar(False).replicationFactor(replicas).logCycleCount(True)
    location = poptorch.TensorLocationSettings().useOnChipStorage(on_chip).useReplicatedTensorSharding(sharded)
    if min_elements is not None:
        location.minElementsForReplicatedTensorSharding(min_elements)
    opts.TensorLocations.setOptimizerLocation(location)
    return opts


def _states(model, optimizer):
    return [optimizer.state[p][slot].detach().clone() for p in model.parameters() for slot in STATE_SLOTS]


def _eager():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = _data()
    losses = []
    for _ in range(STEPS):
        losses.append(eager_step(model, optimizer, x, y))
    return losses, [p.detach().clone() for p in model.parameters()], _states(model, optimizer)


def _train(opts):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    trained = poptorch.trainingModel(model, opts, optimizer)
    x, y = _data()
    losses = [trained(x, y)[1].detach().clone().mean() for _ in range(STEPS)]
    cycles = trained.cycleCount()
    params = [p.detach().clone() for p in trained.parameters()]
    trained.copyWeightsToHost()
    result = (losses, params, _states(model, optimizer), trained.profile, cycles)
    trained.destroy()
    return result


def _same(a, b, atol):
    for got, expected in zip(a[:3], b[:3], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=atol)


@pytest.fixture(scope="module")
def runs():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
        return _eager(), _train(_options(False)), _train(_options(True))


def test_sharded_optimizer_state_trains_like_the_unsharded_run_and_eager(runs):
    eager, unsharded, sharded = runs
    _same(unsharded, eager, atol=1e-4)  # Adam divides by the root of tiny second moments: float noise grows
    _same(sharded, unsharded, atol=0)


def test_each_replica_holds_and_moves_a_shard_of_the_weights_optimizer_state(runs):
    _, unsharded, sharded = runs
    # The weights' moments (WIDTH x WIDTH >= the default 8192 elements) are sharded; the biases' are not.
    shard_saving = 2 * len(STATE_SLOTS) * WIDTH * WIDTH * 4 // REPLICAS
    apply_unsharded, apply_sharded = unsharded[3].programs["apply"], sharded[3].programs["apply"]
    assert apply_sharded["streaming_memory_bytes"] == apply_unsharded["streaming_memory_bytes"] - shard_saving
    loads = {s["name"]: s["bytes"] for s in apply_sharded["steps"] if s["name"].startswith("remote load")}
    assert loads["remote load _opt.first.weight.exp_avg"] == WIDTH * WIDTH * 4 // REPLICAS
    assert loads["remote load _opt.first.bias.exp_avg"] == WIDTH * 4
    assert apply_sharded["total_cycles"] < apply_unsharded["total_cycles"]
    assert sharded[4] < unsharded[4]


def test_gradients_are_reduce_scattered_and_weights_all_gathered(runs):
    _, unsharded, sharded = runs
    levels = [level["name"] for level in sharded[3].replication["all_reduce"]["levels"]]
    assert levels == [
        "IPU-Links in an IPU-M2000",  # the biases' gradients
        "reduce-scatter: IPU-Links in an IPU-M2000",
        "all-gather: IPU-Links in an IPU-M2000",
    ]
    assert [level["name"] for level in unsharded[3].replication["all_reduce"]["levels"]] == levels[:1]
    timeline = sharded[3].replication["timeline"]
    apply = next(e for e in timeline if e.get("program") == "apply")
    gather = next(e for e in timeline if e.get("collective", "").startswith("all-gather"))
    scatter = next(e for e in timeline if e.get("collective", "").startswith("reduce-scatter"))
    assert scatter["start"] + scatter["cycles"] <= apply["start"]
    assert gather["start"] == apply["start"] + apply["cycles"]


LINKS = "IPU-Links in an IPU-M2000"


@pytest.mark.parametrize(
    ("minimum", "count", "weight_state_bytes", "bias_state_bytes", "levels"),
    [
        # Above the weight's elements: every state stays whole, in streaming memory, and is all-reduced.
        ("minElementsForReplicatedTensorSharding", WIDTH * WIDTH + 1, WIDTH * WIDTH * 4, WIDTH * 4, [LINKS]),
        # PopART decides where a tensor lives before sharding it: a shard smaller than minElementsForOffChip
        # still goes off chip when its whole tensor does not fall below it (the bias's state stays on chip).
        (
            "minElementsForOffChip",
            WIDTH * WIDTH,
            WIDTH * WIDTH * 4 // REPLICAS,
            None,
            [LINKS, f"reduce-scatter: {LINKS}", f"all-gather: {LINKS}"],
        ),
    ],
)
def test_the_minimum_element_counts_apply_to_the_whole_tensor(
    monkeypatch, minimum, count, weight_state_bytes, bias_state_bytes, levels
):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    opts = _options(True)
    location = poptorch.TensorLocationSettings().useOnChipStorage(False).useReplicatedTensorSharding(True)
    opts.TensorLocations.setOptimizerLocation(getattr(location, minimum)(count))
    torch.manual_seed(0)
    model = Net()
    trained = poptorch.trainingModel(model, opts, torch.optim.Adam(model.parameters(), lr=0.01))
    trained(*_data())
    assert _levels(trained.profile) == levels
    steps = trained.profile.programs["apply"]["steps"]
    loads = {s["name"]: s["bytes"] for s in steps if s["name"].startswith("remote load")}
    assert loads["remote load _opt.first.weight.exp_avg"] == weight_state_bytes
    assert loads.get("remote load _opt.first.bias.exp_avg") == bias_state_bytes


def test_sharding_weights_or_accumulators_is_refused_and_optimizer_state_is_sharded_on_or_off_chip():
    locations = poptorch.Options().TensorLocations
    for on_chip in (True, False):
        sharded = poptorch.TensorLocationSettings().useOnChipStorage(on_chip).useReplicatedTensorSharding(True)
        reasons = {
            "setWeightLocation": "all-gather it before each of its readers",
            "setAccumulatorLocation": "reduce-scatter each micro-batch's gradient into every replica's accumulator",
            "setActivationLocation": "each replica's own values",
        }
        for setter, reason in reasons.items():
            with pytest.raises(poptorch.Error, match=rf"useReplicatedTensorSharding\(True\) is not modelled.*{reason}"):
                getattr(locations, setter)(sharded)
        assert locations.setOptimizerLocation(sharded).sharded_optimizer == 8192
    assert locations.setOptimizerLocation(poptorch.TensorLocationSettings()).sharded_optimizer is None


def test_lamb_all_reduces_the_norms_of_sharded_updates(monkeypatch):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    results = []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = Net()
        trained = poptorch.trainingModel(model, _options(sharded), poptorch.optim.LAMB(model.parameters(), lr=0.01))
        trained(*_data())
        results.append(([p.detach().clone() for p in trained.parameters()], trained.profile.replication))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    levels = [level["name"] for level in results[1][1]["all_reduce"]["levels"]]
    assert levels == [
        "IPU-Links in an IPU-M2000",
        "reduce-scatter: IPU-Links in an IPU-M2000",
        "norms: IPU-Links in an IPU-M2000",
        "all-gather: IPU-Links in an IPU-M2000",
    ]


def _levels(profile):
    return [level["name"] for level in profile.replication["all_reduce"]["levels"]]


def _programs(kind, replicas, sharded):
    """The profile's programs of one training step with optimizer ``kind``, state on the chip."""
    torch.manual_seed(0)
    model = Net()
    opts = _options(sharded, replicas=replicas, on_chip=True)
    trained = poptorch.trainingModel(model, opts, OPTIMIZERS[kind](model.parameters()))
    g = torch.Generator().manual_seed(1)
    trained(torch.randn(BATCH * replicas, WIDTH, generator=g), torch.randn(BATCH * replicas, WIDTH, generator=g))
    programs = trained.profile.programs
    trained.destroy()
    return programs


@pytest.mark.parametrize("kind", ["sgd_momentum", "adam", "lamb"])
def test_each_replica_holds_and_updates_a_shard_so_step_memory_and_cycles_fall_with_the_replicas(monkeypatch, kind):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    # Unsharded, one replica's step is the same program whatever the replicas.
    runs = [_programs(kind, replicas, sharded) for replicas, sharded in ((2, False), (2, True), (4, True))]
    unsharded = runs[0]
    # The optimizer step of one replica computes on its state, weight and gradient shards only, and copies its
    # updated weight shard into the weight in place: its cycles fall as the replicas grow, even SGD's.
    for figure in ("compute_cycles", "total_cycles"):
        values = [run["apply"][figure] for run in runs]
        assert values[0] > values[1] > values[2], (figure, values)
    # Each weight's updated shard is written back as soon as it is computed, so it is not held beside the next
    # weight's shards; the sharded weights are updated last, so each write-back shares an exchange phase with the
    # next weight's gradient slice or the step's final copies (no sync of its own).
    written = [step["name"] for step in runs[1]["apply"]["steps"] if "slice_update" in step["name"]]
    assert len(written) == 2 and all(name.count("slice_update") == 1 and "+" in name for name in written)
    # Its peak tile memory falls too, even SGD's over 2 replicas (half its momentum): the step holds one
    # weight's shards at a time, slices a weight's shard once its gradient's is spent, and computes the updated
    # shard in the buffer of the weight's shard.
    for run in runs[1:]:
        assert run["apply"]["memory_max_tile_bytes"] < unsharded["apply"]["memory_max_tile_bytes"]
    # The state stays on the chip between steps, and the step takes its weight shard from the whole weight: the
    # forward and backward program holds no shard variable, only less state, and the overall peak falls.
    peak = [max(p["memory_max_tile_bytes"] for p in run.values()) for run in runs]
    for run, run_peak in zip(runs[1:], peak[1:]):
        assert run["accumulate"]["memory_max_tile_bytes"] < unsharded["accumulate"]["memory_max_tile_bytes"]
        assert run_peak < peak[0]


class OddNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(ODD_SIZES[0], ODD_SIZES[1])
        self.second = torch.nn.Linear(ODD_SIZES[1], ODD_SIZES[2])

    def forward(self, x, y):
        out = self.second(torch.tanh(self.first(x)))
        return out, torch.nn.functional.mse_loss(out, y)


def _odd_data(replicas):
    g = torch.Generator().manual_seed(2)
    n = BATCH * replicas
    return torch.randn(n, ODD_SIZES[0], generator=g), torch.randn(n, ODD_SIZES[2], generator=g)


def _state_of(optimizer, model):
    return [
        (slot, value.detach().clone())
        for p in model.parameters()
        for slot, value in sorted(optimizer.state[p].items())
        if isinstance(value, torch.Tensor) and value.shape == p.shape
    ]


GROUPED_OPTIMIZERS = {
    "sgd_momentum": lambda model: torch.optim.SGD(
        [
            {"params": model.first.parameters(), "lr": 0.1, "momentum": 0.5, "weight_decay": 0.01},
            {"params": model.second.parameters()},
        ],
        lr=0.05,
        momentum=0.9,
    ),
    # Each group's trust ratios take norms over its own parameters' sharded tensors.
    "lamb": lambda model: poptorch.optim.LAMB(
        [{"params": model.first.parameters(), "lr": 0.02, "weight_decay": 0.1}, {"params": model.second.parameters()}],
        lr=0.01,
    ),
}


# Each case's optimizer of a model and its gradient accumulation: the optimizers, then parameter groups with
# their own hyper-parameters, each replica's two micro-batches making up the combined batch.
PADDED_CASES = {
    **{kind: (lambda model, make=make: make(model.parameters()), 1) for kind, make in OPTIMIZERS.items()},
    **{f"groups_{kind}": (make, 2) for kind, make in GROUPED_OPTIMIZERS.items()},
}


@pytest.mark.parametrize("case", PADDED_CASES)
def test_padded_shards_train_like_eager_step_by_step_and_the_host_reads_the_whole_state(monkeypatch, case):
    """Each replica's shard of a parameter is updated with the hyper-parameters of the parameter's group."""
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    make_optimizer, accumulation = PADDED_CASES[case]
    replicas = 4
    x, y = _odd_data(replicas)
    torch.manual_seed(0)
    reference = OddNet()
    eager_optimizer = make_optimizer(reference)
    torch.manual_seed(0)
    model = OddNet()
    optimizer = make_optimizer(model)
    # Every tensor is sharded, however small.
    opts = _options(True, 1, replicas, on_chip=True)
    opts.Training.gradientAccumulation(accumulation)
    trained = poptorch.trainingModel(model, opts, optimizer)
    for _ in range(STEPS):
        loss = eager_step(reference, eager_optimizer, x, y)
        losses = trained(x, y)[1]
        if accumulation == 1:  # else the model returns the losses of each replica's last micro-batch
            torch.testing.assert_close(losses.mean(), loss, rtol=1e-5, atol=1e-6)
        for got, expected in zip(trained.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(got.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    levels = _levels(trained.profile)
    # Every gradient is reduce-scattered (none all-reduced whole), every new weight all-gathered.
    assert levels[0].startswith("reduce-scatter") and levels[-1].startswith("all-gather")
    assert "IPU-Links in an IPU-M2000" not in levels
    trained.copyWeightsToHost()
    state, expected = _state_of(optimizer, model), _state_of(eager_optimizer, reference)
    assert [slot for slot, _ in state] == [slot for slot, _ in expected] and state
    for (_, got), (_, want) in zip(state, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_shards_are_padded_as_popart_pads_them():
    """PopART's example: 30 elements over 4 replicas are shards of 8, 8, 7 and 7 elements, each padded to 8."""
    whole = np.arange(1, 31, dtype=np.float32).reshape(5, 2, 3)
    shards = poptorch._replication._split(whole, 4)
    assert shards.shape == (4, 8)
    assert [int(np.count_nonzero(shard)) for shard in shards] == [8, 8, 7, 7]
    np.testing.assert_array_equal(shards[2], [3, 7, 11, 15, 19, 23, 27, 0])
    np.testing.assert_array_equal(poptorch._replication._join(shards, whole.shape), whole)


def test_a_sharded_parameters_gradient_and_updated_value_are_anchored_whole(monkeypatch):
    """The updated weight an anchor streams is the joined one (after the all-gather), as unsharded: not the
    view of the replica whose step ran last, which updated only its shard."""
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    anchored = []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = Net()
        opts = _options(sharded)
        opts.anchorTensor("grad", "Gradient___model.first.weight")
        opts.anchorTensor("new", "UpdatedVar___model.first.weight")
        trained = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        trained(*_data())
        updated = torch.as_tensor(trained.getAnchoredTensor("new"))
        torch.testing.assert_close(updated, model.first.weight.detach(), rtol=0, atol=0)
        anchored.append((trained.getAnchoredTensor("grad"), updated))
        trained.destroy()
    (grad, new), (sharded_grad, sharded_new) = anchored
    torch.testing.assert_close(sharded_grad, grad, rtol=0, atol=0)
    torch.testing.assert_close(sharded_new, new, rtol=1e-6, atol=1e-7)


def test_a_state_the_host_already_holds_is_split_over_the_replicas(monkeypatch):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    replicas = 4
    x, y = _odd_data(replicas)
    torch.manual_seed(0)
    model = OddNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):  # eager steps: the optimizer holds moments the device starts from
        eager_step(model, optimizer, x, y)
    reference = copy.deepcopy(model)
    eager_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    eager_optimizer.load_state_dict(optimizer.state_dict())
    trained = poptorch.trainingModel(model, _options(True, 1, replicas, on_chip=True), optimizer)
    trained(x, y)
    eager_step(reference, eager_optimizer, x, y)
    for got, expected in zip(trained.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.detach(), expected.detach(), rtol=1e-5, atol=1e-6)


def test_sharding_the_state_of_a_parameter_whose_replica_groups_differ_is_refused_with_the_reason(monkeypatch):
    """PopTorch documents no sharding within a parameter's replica groups: PopART shards over every replica."""
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    model = Net()
    with torch.no_grad():  # two groups: the host parameter holds one value per group
        model.first.weight = torch.nn.Parameter(torch.stack([model.first.weight] * 2))
    trained = poptorch.trainingModel(model, _options(True, 1, 4, on_chip=True), torch.optim.Adam(model.parameters()))
    trained.per_replica_params["first.weight"] = (
        poptorch.CommGroupType.Consecutive,
        2,
        poptorch.VariableRetrievalMode.OnePerGroup,
    )
    g = torch.Generator().manual_seed(1)
    data = torch.randn(BATCH * 4, WIDTH, generator=g), torch.randn(BATCH * 4, WIDTH, generator=g)
    expected = (
        r"replicaGrouping\(CommGroupType.Consecutive, 2, VariableRetrievalMode.OnePerGroup\) of parameter "
        r"'first.weight' gives it 2 groups of replicas holding different values.*PopART shards optimizer state and "
        r"reduce-scatters the gradient over every replica.*"
        r"minElementsForReplicatedTensorSharding above its 9216 elements"
    )
    with pytest.raises(poptorch.Error, match=expected):
        trained(*data)


def test_a_replica_grouping_of_one_group_keeps_its_parameters_state_sharded(monkeypatch):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    torch.manual_seed(0)
    model = Net()
    trained = poptorch.trainingModel(model, _options(True, 1, 4, on_chip=True), torch.optim.Adam(model.parameters()))
    trained.per_replica_params["first.weight"] = (
        poptorch.CommGroupType.All,
        0,
        poptorch.VariableRetrievalMode.OnePerGroup,
    )
    g = torch.Generator().manual_seed(1)
    trained(torch.randn(BATCH * 4, WIDTH, generator=g), torch.randn(BATCH * 4, WIDTH, generator=g))
    assert _levels(trained.profile)[0].startswith("reduce-scatter")


class TwoIpuNet(Net):
    def __init__(self):
        super().__init__()
        self.second = poptorch.BeginBlock(self.second, ipu_id=1)


def test_sharded_execution_over_two_ipus_trains_like_eager_and_keeps_each_shard_on_its_ipu(monkeypatch):
    """Each IPU updates the shards of its own layer's weights: the slices and the write-backs cross no IPU-Link,
    and the step's peak tile memory is no higher than unsharded."""
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    x, y = _data()
    torch.manual_seed(0)
    reference = Net()
    eager_optimizer = OPTIMIZERS["sgd_momentum"](reference.parameters())
    peaks = []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = TwoIpuNet()
        opts = _options(sharded, 1, on_chip=True).setExecutionStrategy(poptorch.ShardedExecution())
        trained = poptorch.trainingModel(model, opts, OPTIMIZERS["sgd_momentum"](model.parameters()))
        for _ in range(STEPS):
            loss = trained(x, y)[1].mean()
            if sharded:
                eager_optimizer.zero_grad()
                expected = reference(x, y)[1]
                expected.backward()
                eager_optimizer.step()
                torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
                for got, want in zip(trained.parameters(), reference.parameters(), strict=True):
                    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
        apply = trained.profile.programs["apply"]
        peaks.append(apply["memory_max_tile_bytes"])
        trained.destroy()
    shard_steps = [s for s in apply["steps"] if set(s["name"].split("+")) <= {"slice", "slice_update"}]
    assert shard_steps and all(s["busiest_link_bytes"] == 0 for s in shard_steps)
    assert {ipu for s in shard_steps for ipu in s["ipus"]} == {0, 1}
    assert peaks[1] < peaks[0]
