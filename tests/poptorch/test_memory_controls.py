"""Memory controls: serializedMatMul computes the same product as smaller ones, one after another, which
lowers the peak tile memory of the simulated program and costs cycles, as PopTorch documents."""

import copy

import pytest
import torch
from sgd_step import train_one_step_like_eager

import popsim
import poptorch

M, N, P = 128, 256, 256
FACTOR = 4


class Product(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(N, P))
        self.mode = mode

    def forward(self, x):
        return poptorch.serializedMatMul(x, self.w, self.mode, FACTOR)


def _profile(mode, x):
    torch.manual_seed(0)
    model = Product(mode)
    executor = poptorch.inferenceModel(model, poptorch.Options().showCompilationProgressBar(False))
    out = executor(x)
    torch.testing.assert_close(out, x @ model.w, rtol=1e-5, atol=1e-4)
    return executor.profile.programs["inference"]


@pytest.mark.parametrize(
    "mode",
    [
        poptorch.MatMulSerializationMode.InputChannels,
        poptorch.MatMulSerializationMode.ReducingDim,
        poptorch.MatMulSerializationMode.OutputChannels,
    ],
)
def test_serialized_matmul_lowers_peak_tile_memory_and_costs_cycles(monkeypatch, mode):
    small = popsim.Target.small(num_tiles=8, tile_bytes=1024 * 1024)
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: small)
    x = torch.randn(M, N)
    whole = _profile(poptorch.MatMulSerializationMode.Disabled, x)
    split = _profile(mode, x)
    assert split["memory_max_tile_bytes"] < whole["memory_max_tile_bytes"]
    assert split["total_cycles"] > whole["total_cycles"]


def test_serialized_matmul_checks_its_arguments_and_keeps_precision():
    a, b = torch.randn(4, 6), torch.randn(6, 8)
    with pytest.raises(poptorch.Error, match="factor 4 does not divide the ReducingDim dimension \\(6\\)"):
        poptorch.serializedMatMul(a, b, poptorch.MatMulSerializationMode.ReducingDim, 4)
    with pytest.raises(poptorch.Error, match="mode must be a poptorch.MatMulSerializationMode"):
        poptorch.serializedMatMul(a, b, "ReducingDim", 2)
    half_a, half_b = a.half(), b.half()
    kept = poptorch.serializedMatMul(half_a, half_b, poptorch.MatMulSerializationMode.ReducingDim, 3, True)
    assert kept.dtype == torch.float16
    torch.testing.assert_close(kept.float(), half_a.float() @ half_b.float(), rtol=1e-2, atol=1e-2)


def test_tensor_locations_take_settings_and_refuse_what_is_not_modelled():
    opts = poptorch.Options()
    on_chip = poptorch.TensorLocationSettings().useOnChipStorage(True).minElementsForOffChip(16)
    for setter in ("setWeightLocation", "setActivationLocation", "setOptimizerLocation", "setAccumulatorLocation"):
        assert getattr(opts.TensorLocations, setter)(on_chip) is opts.TensorLocations
    off_chip = poptorch.TensorLocationSettings().useOnChipStorage(False)
    opts.TensorLocations.setWeightLocation(off_chip)
    assert opts.TensorLocations.streamed == {"Weight": 2}
    sharded = poptorch.TensorLocationSettings().useReplicatedTensorSharding(True)
    with pytest.raises(poptorch.Error, match=r"useReplicatedTensorSharding\(True\) is not modelled"):
        opts.TensorLocations.setWeightLocation(sharded)
    with pytest.raises(poptorch.Error, match="takes a poptorch.TensorLocationSettings"):
        opts.TensorLocations.setAccumulatorLocation({"useOnChipStorage": False})
    with pytest.raises(poptorch.Error, match="useOnChipStorage takes True or False"):
        poptorch.TensorLocationSettings().useOnChipStorage("no")


WIDTH = 64
BUDGET_TARGET = popsim.Target.small(num_tiles=16, tile_bytes=65_536)


class Budgeted(torch.nn.Module):
    def __init__(self, proportion=None, conv=False):
        super().__init__()
        self.layer = torch.nn.Conv2d(WIDTH, WIDTH, 1) if conv else torch.nn.Linear(WIDTH, WIDTH)
        self.proportion = proportion

    def forward(self, x):
        y = self.layer(x)
        return y if self.proportion is None else poptorch.set_available_memory(y, self.proportion)


def _budgeted_run(monkeypatch, model, x, opts=None):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: BUDGET_TARGET)
    opts = (opts or poptorch.Options()).showCompilationProgressBar(False)
    executor = poptorch.inferenceModel(model, opts)
    torch.testing.assert_close(executor(x), model(x), rtol=1e-5, atol=1e-4)
    program = executor.profile.programs["inference"]
    executor.destroy()
    return program["memory_max_tile_bytes"], program["total_cycles"]


@pytest.mark.parametrize(
    "conv, shape",
    [(False, (WIDTH, WIDTH)), (False, (2, WIDTH // 2, WIDTH)), (True, (1, WIDTH, 8, 8))],
    ids=["linear", "linear-3d", "conv"],
)
def test_set_available_memory_replans_the_op_for_less_temporary_memory(monkeypatch, conv, shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    roomy, tight = Budgeted(1.0, conv), Budgeted(0.1, conv)
    tight.load_state_dict(roomy.state_dict())
    roomy_peak, roomy_cycles = _budgeted_run(monkeypatch, roomy, x)
    tight_peak, tight_cycles = _budgeted_run(monkeypatch, tight, x)
    # The convolution's proportion reaches its plan through the bias add (its cycles change). No plan fits
    # 0.1 of this tile; the least-memory one still saves live bytes, which the allocator (largest block first
    # on each tile) keeps rather than losing them to the hole a freed input leaves.
    assert tight_cycles > roomy_cycles
    assert tight_peak < roomy_peak


def test_set_available_memory_is_an_identity_on_the_cpu_and_checks_its_arguments():
    model = Budgeted(0.2)
    x = torch.rand(2, WIDTH)
    torch.testing.assert_close(model(x), model.layer(x))
    with pytest.raises(poptorch.Error, match="You may only set available memory for torch.tensor values"):
        poptorch.set_available_memory([x], 0.5)
    with pytest.raises(poptorch.Error, match="must be a number from 0 to 1, got 1.5"):
        poptorch.set_available_memory(x, 1.5)


def test_set_available_memory_proportion_per_ipu_bounds_every_plan(monkeypatch):
    torch.manual_seed(0)
    model, x = Budgeted(), torch.randn(WIDTH, WIDTH)
    roomy = _budgeted_run(monkeypatch, model, x, poptorch.Options().setAvailableMemoryProportion({"IPU0": 1.0}))
    tight = _budgeted_run(monkeypatch, model, x, poptorch.Options().setAvailableMemoryProportion({"IPU0": 0.1}))
    assert tight[0] < roomy[0] and tight[1] > roomy[1]
    # The op's own proportion wins over its IPU's.
    own = _budgeted_run(monkeypatch, Budgeted(1.0), x, poptorch.Options().setAvailableMemoryProportion({"IPU0": 0.1}))
    assert own == roomy


def test_set_available_memory_proportion_checks_its_keys_values_and_ipus(monkeypatch):
    opts = poptorch.Options()
    with pytest.raises(poptorch.Error, match='expected to be in a dictionary of {"IPU0": 0.5}.*Invalid key: 0'):
        opts.setAvailableMemoryProportion({0: 0.5})
    with pytest.raises(poptorch.Error, match="must be a number from 0 to 1, got -0.1"):
        opts.setAvailableMemoryProportion({"IPU0": -0.1})
    with pytest.raises(poptorch.Error, match="takes a dictionary"):
        opts.setAvailableMemoryProportion(0.5)
    opts.setAvailableMemoryProportion({"IPU1": 0.3})
    assert opts.available_memory_proportion == {1: 0.3}
    with pytest.raises(poptorch.Error, match="names IPU1, but the model runs on 1 IPU"):
        _budgeted_run(monkeypatch, Budgeted(), torch.randn(2, WIDTH), opts)


LAYERS = 8


class Deep(torch.nn.Module):
    """Narrow layers on a large batch: the activations dominate tile memory."""

    def __init__(self, checkpoint_every=0):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(LAYERS))
        self.every = checkpoint_every

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if self.every and i % self.every == self.every - 1 and i < LAYERS - 1:
                x = poptorch.recomputationCheckpoint(x)
        return x, torch.nn.functional.mse_loss(x, y)


def _train(recomputation, checkpoint_every, ipus=1):
    torch.manual_seed(0)
    model = Deep(checkpoint_every)
    if ipus > 1:
        poptorch.BeginBlock(model.layers[LAYERS // 2], ipu_id=1)
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts._Popart.set("autoRecomputation", recomputation)
    if ipus > 1:
        opts.Training.gradientAccumulation(4)
    trained = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(3)
    x, y = (
        torch.randn(512 * (4 if ipus > 1 else 1), 32, generator=g),
        torch.randn(512 * (4 if ipus > 1 else 1), 32, generator=g),
    )
    out, loss = trained(x, y)
    program = trained.profile.programs["accumulate" if ipus > 1 else "train"]
    return out, loss, [p.detach().clone() for p in trained.parameters()], program


def _recomputation_trades_cycles_for_memory(monkeypatch, recompute, every):
    """On roomy tiles: recomputation gives the same numbers, a lower peak and more cycles. Returns the
    run without recomputation and the roomy target."""
    roomy = popsim.Target.small(num_tiles=4, tile_bytes=1024 * 1024)
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: roomy)
    *kept, kept_program = _train(0, 0)
    *again, again_program = _train(recompute, every)
    torch.testing.assert_close(again[:2], kept[:2])
    torch.testing.assert_close(again[2], kept[2])
    assert again_program["memory_max_tile_bytes"] < kept_program["memory_max_tile_bytes"]
    assert again_program["total_cycles"] > kept_program["total_cycles"]
    return kept, roomy


def test_recomputation_from_checkpoints_trades_cycles_for_tile_memory(monkeypatch):
    kept, roomy = _recomputation_trades_cycles_for_memory(monkeypatch, 4, 2)  # RecomputeAll, checkpoint every 2nd
    # On tiles of 208 KiB the model only trains with recomputation.
    tight = popsim.Target.small(num_tiles=4, tile_bytes=208 * 1024)
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: tight)
    with pytest.raises(poptorch.Error, match="Out of memory on the simulated IPU"):
        _train(0, 0)
    *fits, _ = _train(4, 2)
    torch.testing.assert_close(fits[2], kept[2])
    # Pipeline recomputation: each stage recomputes from its own inputs; numbers unchanged.
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: roomy)
    *piped, _ = _train(3, 2, ipus=2)
    *piped_kept, _ = _train(0, 2, ipus=2)
    torch.testing.assert_close(piped[2], piped_kept[2])


def test_recompute_all_without_checkpoints_lowers_peak_tile_memory(monkeypatch):
    # Every forward activation is recomputed for each backward reader.
    _recomputation_trades_cycles_for_memory(monkeypatch, 4, 0)


NORMED_LAYERS = 6


class Normed(torch.nn.Module):
    """Linear layers behind layer norms (``norms``) or not: the norms' outputs are as large as the layers'."""

    def __init__(self, norms=True):
        super().__init__()
        self.first = torch.nn.Linear(32, 64)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(NORMED_LAYERS))
        self.norms = torch.nn.ModuleList(
            (torch.nn.LayerNorm(64) if norms else torch.nn.Identity()) for _ in range(NORMED_LAYERS)
        )

    def forward(self, x, y):
        x = self.first(x)
        for layer, norm in zip(self.layers, self.norms):
            x = torch.tanh(layer(norm(x)))
        return x, torch.nn.functional.mse_loss(x, y)


def _train_normed(recomputation, norms=True):
    """Loss, weights after one SGD step and the train program's profile, on the IPU and eagerly."""
    torch.manual_seed(0)
    model = Normed(norms)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(256, 32, generator=g), torch.randn(256, 64, generator=g)
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts._Popart.set("autoRecomputation", recomputation)
    trained = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    _, loss = trained(x, y)
    weights = [p.detach().clone() for p in trained.parameters()]
    torch.manual_seed(0)
    eager = Normed(norms)
    eager_loss = eager(x, y)[1]
    eager_loss.backward()
    torch.optim.SGD(eager.parameters(), lr=0.1).step()
    torch.testing.assert_close(loss, eager_loss.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights, [p.detach() for p in eager.parameters()], rtol=1e-4, atol=1e-5)
    return trained.profile.programs["train"]


@pytest.mark.parametrize("recomputation", [1, 2], ids=["Standard", "NormOnly"])
def test_standard_and_norm_only_recomputation_trade_cycles_for_tile_memory(monkeypatch, recomputation):
    monkeypatch.setattr(
        poptorch._device, "target_of", lambda options: popsim.Target.small(num_tiles=4, tile_bytes=1024 * 1024)
    )
    kept = _train_normed(0)
    again = _train_normed(recomputation)
    assert again["memory_max_tile_bytes"] < kept["memory_max_tile_bytes"]
    assert again["total_cycles"] > kept["total_cycles"]


def test_norm_only_recomputation_recomputes_nothing_without_norm_layers(monkeypatch):
    monkeypatch.setattr(
        poptorch._device, "target_of", lambda options: popsim.Target.small(num_tiles=4, tile_bytes=1024 * 1024)
    )
    kept, norm_only = _train_normed(0, norms=False), _train_normed(2, norms=False)
    assert norm_only["memory_max_tile_bytes"] == kept["memory_max_tile_bytes"]
    assert norm_only["total_cycles"] == kept["total_cycles"]


class SideBranch(torch.nn.Module):
    """Normed's layers (no norms) with, if ``side``, a wide branch between them that never reaches the loss."""

    def __init__(self, side):
        super().__init__()
        self.main = Normed(norms=False)
        self.side = torch.nn.Linear(32, 512) if side else None

    def forward(self, x, y):
        main = self.main
        h = main.first(x)
        extra = []
        for i, layer in enumerate(main.layers):
            if self.side is not None and i % 2 == 0:
                extra.append(torch.relu(self.side(x.detach())).sum(dim=1))
            h = torch.tanh(layer(h))
        return h, torch.nn.functional.mse_loss(h, y), *extra


def _backward_nodes(side):
    """The backward pass's steps (recomputed forward ops included) under Standard recomputation, with the
    loss and weights after one step checked against eager."""
    torch.manual_seed(0)
    model = SideBranch(side)
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 32, generator=g), torch.randn(64, 64, generator=g)
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts._Popart.set("autoRecomputation", 1)
    trained = train_one_step_like_eager(model, eager, opts, x, y)
    steps = trained.profile.programs["train"]["steps"]
    origins = [s.get("origin") or {} for s in steps]
    return sorted((o.get("module") or "", o["op"]) for o in origins if o.get("role") == "backward")


def test_standard_recomputation_walks_only_the_ops_on_a_path_to_the_loss():
    # A side branch that does not reach the loss neither is recomputed nor moves the checkpoints.
    with_side = _backward_nodes(side=True)
    assert with_side == _backward_nodes(side=False)
    assert ("", "tanh") in with_side  # the backward pass recomputes some forward activations


def test_recomputation_settings_are_checked():
    opts = poptorch.Options()
    with pytest.raises(poptorch.Error, match="takes a popart.RecomputationType value 0-4"):
        opts._Popart.set("autoRecomputation", 7)
    assert opts._Popart.set("autoRecomputation", 3) is opts._Popart and opts.recomputation == "pipeline"
    opts._Popart.set("autoRecomputation", 1)
    assert opts.recomputation == "standard"


def test_standard_recomputation_in_a_pipeline_is_refused():
    torch.manual_seed(0)
    model = Deep()
    poptorch.BeginBlock(model.layers[LAYERS // 2], ipu_id=1)
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts._Popart.set("autoRecomputation", 2)
    opts.Training.gradientAccumulation(4)
    trained = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(poptorch.Error, match=r"autoRecomputation 2 \(NormOnly\) with PipelinedExecution is not"):
        trained(torch.randn(16, 32), torch.randn(16, 32))
