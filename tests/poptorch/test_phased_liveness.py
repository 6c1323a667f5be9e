"""Phased execution's ``Liveness``: with an off-chip setting, activations wait in streaming memory between
the forward and backward passes (OffChipAfterFwd, OffChipAfterFwdNoOverlap) or between any two phases
(OffChipAfterEachPhase): the same numbers as AlwaysLive, a lower tile-memory peak, more cycles."""

import pytest
import torch
from sgd_step import eager_step, train_one_step_like_eager

import popsim
import poptorch

PHASES, WIDTH, BATCH = 3, 32, 512
ROOMY = popsim.Target.small(num_tiles=4, tile_bytes=1024 * 1024)


class Phased(torch.nn.Module):
    """Narrow layers on a large batch, one block (phase) per pair: activations dominate tile memory."""

    def __init__(self, phases=PHASES, width=WIDTH):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(2 * phases))

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            if i % 2 == 0:
                poptorch.Block.start(str(i // 2), ipu_id=0)
            x = torch.tanh(layer(x))
        return x, torch.nn.functional.mse_loss(x, y)


def _strategy(liveness, parallel=False, count=PHASES):
    """Serial phases on IPU 0, or parallel ones alternating between IPUs 0 and 1."""
    phases = [poptorch.Phase(str(p)) for p in range(count)]
    if not parallel:
        strategy = poptorch.SerialPhasedExecution(*phases).setTensorsLiveness(liveness)
    else:
        off_chip = liveness == poptorch.Liveness.OffChipAfterFwd
        strategy = poptorch.ParallelPhasedExecution(*phases).sendTensorsOffChipAfterFwd(off_chip)
    for p in range(count):
        strategy.phase(p).ipus(p % 2 if parallel else 0)
    return strategy


def _train(
    liveness, parallel=False, accumulation=1, loss_scaling=None, phases=PHASES, width=WIDTH, batch=BATCH, streamed=False
):
    torch.manual_seed(0)
    model = Phased(phases, width)
    strategy = _strategy(liveness, parallel, phases)
    opts = poptorch.Options().showCompilationProgressBar(False).setExecutionStrategy(strategy)
    if streamed:  # the weights in streaming memory
        opts.TensorLocations.setWeightLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
    opts.Training.gradientAccumulation(accumulation)
    scaling = {} if loss_scaling is None else {"loss_scaling": loss_scaling}
    trained = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1, **scaling))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    losses = [trained(x, y)[1].detach().clone() for _ in range(2)]
    program = trained.profile.programs["train" if accumulation == 1 else "accumulate"]
    params = [p.detach().clone() for p in trained.parameters()]
    trained.destroy()
    return losses, params, program


@pytest.mark.parametrize(
    "liveness", [poptorch.Liveness.OffChipAfterFwdNoOverlap, poptorch.Liveness.OffChipAfterEachPhase]
)
def test_off_chip_liveness_trains_alike_with_less_tile_memory_and_more_cycles(monkeypatch, liveness):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    live = _train(poptorch.Liveness.AlwaysLive)
    off = _train(liveness)
    torch.testing.assert_close(off[0], live[0])
    torch.testing.assert_close(off[1], live[1])
    assert off[2]["memory_max_tile_bytes"] < live[2]["memory_max_tile_bytes"]
    assert off[2]["total_cycles"] > live[2]["total_cycles"]
    assert any(s["name"].startswith("remote store") for s in off[2]["steps"])
    assert not any(s["name"].startswith("remote") for s in live[2]["steps"])


def _stores(program):
    return sum(s["name"].startswith("remote store") for s in program["steps"])


def test_off_chip_after_each_phase_also_parks_values_passed_between_phases(monkeypatch):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    after_fwd = _train(poptorch.Liveness.OffChipAfterFwd)[2]
    each_phase = _train(poptorch.Liveness.OffChipAfterEachPhase)[2]
    assert _stores(each_phase) > _stores(after_fwd)
    # Each weight's update runs in the phase of its gradient, so no gradient crosses a phase to be parked.
    assert each_phase["memory_max_tile_bytes"] <= after_fwd["memory_max_tile_bytes"]
    assert each_phase["total_cycles"] > after_fwd["total_cycles"]


def test_updates_in_their_gradients_phase_run_as_soon_as_the_weight_is_read_for_the_last_time(monkeypatch):
    """Each update runs in its gradient's phase right after its weight's last reader, so its gradient dies at
    once instead of living to the end of the phase (whose end it used to wait for): the peak is no higher
    than with the updates left unplaced, and the numbers are the same."""
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    placed = _train(poptorch.Liveness.OffChipAfterEachPhase)
    monkeypatch.setattr(poptorch._blocks, "update_placements", lambda grads, strategy: {})
    unplaced = _train(poptorch.Liveness.OffChipAfterEachPhase)
    torch.testing.assert_close(placed[:2], unplaced[:2])
    assert placed[2]["memory_max_tile_bytes"] <= unplaced[2]["memory_max_tile_bytes"]
    assert placed[2]["total_cycles"] < unplaced[2]["total_cycles"]  # no update phase loads the weights again


@pytest.mark.parametrize("accumulation, loss_scaling", [(1, None), (2, None), (1, 4.0)])
def test_gradients_are_not_parked_as_each_update_runs_in_its_gradients_phase(monkeypatch, accumulation, loss_scaling):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    after_fwd = _train(poptorch.Liveness.OffChipAfterFwd, accumulation=accumulation, loss_scaling=loss_scaling)
    each_phase = _train(poptorch.Liveness.OffChipAfterEachPhase, accumulation=accumulation, loss_scaling=loss_scaling)
    torch.testing.assert_close(each_phase[:2], after_fwd[:2])
    # Only the values passed from one backward phase to the next are parked on top of the forward pass's:
    # each weight's update (or gradient accumulation) reads its gradient in the phase that produced it.
    assert _stores(each_phase[2]) - _stores(after_fwd[2]) == PHASES - 1


def test_liveness_keys_the_executable_cache():
    def key(liveness):
        strategy = poptorch.SerialPhasedExecution(poptorch.Phase("0")).setTensorsLiveness(liveness)
        return poptorch._cache.key({}, poptorch.Options().setExecutionStrategy(strategy))

    assert key(poptorch.Liveness.AlwaysLive) != key(poptorch.Liveness.OffChipAfterFwd)
    # The two move the same tensors, but the overlap holds them longer on the tiles.
    assert key(poptorch.Liveness.OffChipAfterFwd) != key(poptorch.Liveness.OffChipAfterFwdNoOverlap)
    assert key(poptorch.Liveness.OffChipAfterFwd) != key(poptorch.Liveness.OffChipAfterEachPhase)


def test_parallel_phases_send_tensors_off_chip_after_the_forward_pass(monkeypatch):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    live = _train(poptorch.Liveness.AlwaysLive, parallel=True)
    off = _train(poptorch.Liveness.OffChipAfterFwd, parallel=True)
    torch.testing.assert_close(off[:2], live[:2])
    assert off[2]["memory_max_tile_bytes"] < live[2]["memory_max_tile_bytes"]
    assert _stores(off[2]) > 0 == _stores(live[2])


def _streamed_weights(separate):
    """Loss and weights after one step, checked against eager, and {weight: loads} of serial phases on IPU 0
    with the weights in streaming memory, with or without a separate backward phase."""
    torch.manual_seed(0)
    model, eager = Phased(), Phased()
    eager.load_state_dict(model.state_dict())
    strategy = _strategy(poptorch.Liveness.AlwaysLive).useSeparateBackwardPhase(separate)
    opts = poptorch.Options().showCompilationProgressBar(False).setExecutionStrategy(strategy)
    opts.TensorLocations.setWeightLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    trained = train_one_step_like_eager(model, eager, opts, x, y)
    steps = trained.profile.programs["train"]["steps"]
    names = [name for name, _ in model.named_parameters() if name.endswith("weight")]
    return {name: sum(s["name"] == f"remote load {name}" for s in steps) for name in names}, trained


def test_a_separate_backward_phase_loads_the_last_phase_weights_again(monkeypatch):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    shared, shared_model = _streamed_weights(False)
    separate, separate_model = _streamed_weights(True)
    last = {f"layers.{i}.weight" for i in (2 * PHASES - 2, 2 * PHASES - 1)}
    # A weight's update runs in the backward phase of its gradient and reuses the weight loaded there. The last
    # phase runs the end of the forward pass and the start of the backward pass: one load of its weights for
    # both passes and the update, unless the backward pass has phases of its own (loaded again there).
    assert shared == {name: 1 if name in last else 2 for name in shared}
    assert separate == dict.fromkeys(shared, 2)
    assert (
        separate_model.profile.programs["train"]["total_cycles"]
        > shared_model.profile.programs["train"]["total_cycles"]
    )
    # Off-chip liveness always starts the backward pass in a new phase, as PopTorch leaves a gap of phases.
    assert not poptorch._blocks.shares_last_phase(_strategy(poptorch.Liveness.OffChipAfterFwd))
    keys = {
        poptorch._cache.key(
            {},
            poptorch.Options().setExecutionStrategy(
                _strategy(poptorch.Liveness.AlwaysLive).useSeparateBackwardPhase(s)
            ),
        )
        for s in (False, True)
    }
    assert len(keys) == 2


def _overlaps(intervals, lane):
    """Whether a streaming-memory transfer on ``lane``'s IPU runs while that IPU's compute tiles compute."""
    moved = [e for e in intervals if e.get("transfer") == "streaming memory" and lane not in e["lanes"]]
    computed = [e for e in intervals if lane in e["lanes"] and "transfer" not in e]
    return any(a["start"] < b["end"] and b["start"] < a["end"] for a in moved for b in computed)


def test_off_chip_after_fwd_overlaps_transfers_with_compute_and_no_overlap_does_not(monkeypatch):
    """PopTorch: OffChipAfterFwdNoOverlap is OffChipAfterFwd without overlapping the loads and stores with the
    phases, more memory-efficient at the cost of delayed computation. Six phases, so that parking the
    activations saves more than holding two phases' transfers at once costs."""
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    runs = {
        liveness: _train(liveness, phases=6)
        for liveness in (
            poptorch.Liveness.AlwaysLive,
            poptorch.Liveness.OffChipAfterFwd,
            poptorch.Liveness.OffChipAfterFwdNoOverlap,
        )
    }
    live, overlapped, serial = runs.values()
    for losses, params, _ in (overlapped, serial):
        torch.testing.assert_close(losses, live[0])
        torch.testing.assert_close(params, live[1])
    cycles = {liveness: run[2]["run_timeline"]["makespan"] for liveness, run in runs.items()}
    assert cycles[poptorch.Liveness.AlwaysLive] < cycles[poptorch.Liveness.OffChipAfterFwd]
    assert cycles[poptorch.Liveness.OffChipAfterFwd] < cycles[poptorch.Liveness.OffChipAfterFwdNoOverlap]
    # The same steps either way but loads (OffChipAfterFwd keeps a value read in neighbouring phases on chip);
    # only OffChipAfterFwd's transfers run beside the compute, on the streaming lane alone.
    steps = [[s["name"] for s in run[2]["steps"] if not s["name"].startswith("remote load")] for run in runs.values()]
    assert steps[1] == steps[2]
    lane = "replica 0 IPU 0 compute"
    assert _overlaps(overlapped[2]["run_timeline"]["intervals"], lane)
    assert not any(
        e.get("transfer") == "streaming memory" and lane not in e["lanes"]
        for e in serial[2]["run_timeline"]["intervals"]
    )
    # The tiles hold a phase's prefetched loads beside the phase before: the allocator places those bytes.
    peak = {liveness: run[2]["memory_max_tile_bytes"] for liveness, run in runs.items()}
    assert peak[poptorch.Liveness.OffChipAfterFwdNoOverlap] < peak[poptorch.Liveness.OffChipAfterFwd]
    assert peak[poptorch.Liveness.OffChipAfterFwd] < peak[poptorch.Liveness.AlwaysLive]


def test_off_chip_after_fwd_refuses_a_tile_the_overlap_takes_over_its_memory(monkeypatch):
    # Six phases peak at about 180 KB of a tile with OffChipAfterFwd, 132 KB with OffChipAfterFwdNoOverlap.
    tight = popsim.Target.small(num_tiles=4, tile_bytes=160 * 1024)
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: tight)
    with pytest.raises(poptorch.Error, match=r"out of memory on .*\.OffChipAfterFwdNoOverlap does not overlap"):
        _train(poptorch.Liveness.OffChipAfterFwd, phases=6)
    _train(poptorch.Liveness.OffChipAfterFwdNoOverlap, phases=6)


def test_off_chip_after_fwd_holds_no_more_than_always_live_with_activations_parked(monkeypatch):
    """Three phases of narrow layers on a large batch (activations dominate): each parked activation is held,
    stored and loaded back within its AlwaysLive lifetime (from its forward producer to its last backward reader),
    loaded once per phase for all its readers there, and off chip from the end of the phase after its store to the
    start of the phase before its load (the peak, in the first backward phase, holds none of phase 0's), so with
    the transfers overlapping the neighbouring phases the tiles hold less than AlwaysLive's (the overlap used to
    be counted on top of the allocator's peak and exceed it)."""
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    runs = {
        liveness: _train(liveness)
        for liveness in (
            poptorch.Liveness.AlwaysLive,
            poptorch.Liveness.OffChipAfterFwdNoOverlap,
            poptorch.Liveness.OffChipAfterFwd,
        )
    }
    live, _, overlapped = runs.values()
    torch.testing.assert_close(overlapped[:2], live[:2])
    peak = [run[2]["memory_max_tile_bytes"] for run in runs.values()]
    assert peak[1] < peak[2] < peak[0]
    # One load of each parked value per phase and pass, for all its readers there.
    loads = [(s["stage"], s["role"], s["name"]) for s in overlapped[2]["steps"] if s["name"].startswith("remote load")]
    assert loads and len(loads) == len(set(loads))


def test_off_chip_after_fwd_with_streamed_weights_holds_fewer_weights_than_always_live(monkeypatch):
    """Six phases of wide layers on a small batch (the weights dominate), the weights in streaming memory under
    the off-chip settings: at any point the overlap holds the weights of at most three phases (a phase's own, the
    next one's being loaded and the previous one's being stored back), AlwaysLive all six phases' weights all the
    time. Without overlap a phase's weights are held only while it runs."""
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    runs = {
        liveness: _train(liveness, phases=6, width=128, batch=16, streamed=liveness != poptorch.Liveness.AlwaysLive)
        for liveness in (
            poptorch.Liveness.AlwaysLive,
            poptorch.Liveness.OffChipAfterFwdNoOverlap,
            poptorch.Liveness.OffChipAfterFwd,
        )
    }
    live, serial, overlapped = runs.values()
    for run in (serial, overlapped):
        torch.testing.assert_close(run[:2], live[:2])
    assert any(s["name"] == "remote load layers.0.weight" for s in overlapped[2]["steps"])
    peak = [run[2]["memory_max_tile_bytes"] for run in runs.values()]
    assert peak[1] < peak[2] < peak[0]


def _eager_losses(phases=PHASES, steps=2):
    """The losses of ``_train``'s steps in eager PyTorch."""
    torch.manual_seed(0)
    model = Phased(phases, WIDTH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    losses = []
    for _ in range(steps):
        losses.append(eager_step(model, optimizer, x, y))
    return losses, [p.detach() for p in model.parameters()]


def _streaming_cycles(program):
    return sum(s["cycles"] for s in program["steps"] if s.get("transfer") == "streaming memory")


def test_off_chip_after_fwd_keeps_a_value_read_in_neighbouring_backward_phases_on_chip(monkeypatch):
    """PopART keeps a tensor live into the adjacent execution phase instead of loading it again, and PopTorch
    numbers OffChipAfterFwd's phases adjacently: each phase's output, read by its own backward phase and the
    next one's (the weight gradient of the layer it feeds), is loaded once, in the earlier of the two, and held
    on chip through both, where loading it in each held both copies at once under the overlap (each a phase's
    prefetch beside the phase before). Fewer loads, fewer streaming cycles, a lower peak; the eager numbers."""
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    kept = _train(poptorch.Liveness.OffChipAfterFwd)
    monkeypatch.setattr(poptorch._streaming, "activation_spill", lambda options: popsim.remote.Spill("backward"))
    reloaded = _train(poptorch.Liveness.OffChipAfterFwd)
    eager = _eager_losses()
    for run in (kept, reloaded):
        torch.testing.assert_close(run[0], eager[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(run[1], eager[1], rtol=1e-4, atol=1e-5)
    loads = [[s["name"] for s in run[2]["steps"] if s["name"].startswith("remote load")] for run in (kept, reloaded)]
    assert len(set(loads[0])) == len(loads[0])  # no parked value loaded twice
    assert len(loads[1]) - len(loads[0]) == PHASES - 1  # every phase's output but the last one's
    assert _streaming_cycles(kept[2]) < _streaming_cycles(reloaded[2])
    assert kept[2]["run_timeline"]["makespan"] <= reloaded[2]["run_timeline"]["makespan"]
    assert kept[2]["memory_max_tile_bytes"] < reloaded[2]["memory_max_tile_bytes"]


def test_off_chip_after_fwd_no_overlap_loads_a_value_again_in_each_phase(monkeypatch):
    """PopTorch spaces OffChipAfterFwdNoOverlap's phases apart, so no two are adjacent: a value read in two
    backward phases is loaded in each (the least tile memory), as before."""
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    serial = _train(poptorch.Liveness.OffChipAfterFwdNoOverlap)[2]
    overlapped = _train(poptorch.Liveness.OffChipAfterFwd)[2]
    loads = [[s["name"] for s in run["steps"] if s["name"].startswith("remote load")] for run in (serial, overlapped)]
    assert len(loads[0]) - len(loads[1]) == PHASES - 1
    assert len(set(loads[0])) < len(loads[0])


def test_parallel_phases_load_a_value_read_in_neighbouring_phases_on_each_ipu(monkeypatch):
    """Parallel phases alternate between IPUs, so neighbouring phases are on different IPUs (PopART's adjacent
    phase is the one before on the same IPUs): a value read in two neighbouring backward phases is loaded on
    each IPU, once per phase."""
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    steps = _train(poptorch.Liveness.OffChipAfterFwd, parallel=True, phases=4)[2]["steps"]
    loads = [(s["stage"], s["ipu"], s["name"]) for s in steps if s["name"].startswith("remote load")]
    assert len(set(loads)) == len(loads)
    twice = {name for _, _, name in loads if sum(n == name for _, _, n in loads) == 2}
    assert len(twice) == 4 - 1  # the output of every phase but the last
    for name in twice:
        (a, ipu_a), (b, ipu_b) = [(stage, ipu) for stage, ipu, n in loads if n == name]
        assert abs(a - b) == 1 and ipu_a != ipu_b


def test_parallel_phases_store_a_value_on_its_ipu_in_its_phase(monkeypatch):
    """A phase's output is read next by the following phase, on the other IPU: its store runs on the IPU that
    holds it, in its own phase (as PopART stores in the producer's phase), not with the reader."""
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: ROOMY)
    steps = _train(poptorch.Liveness.OffChipAfterFwd, parallel=True, phases=4)[2]["steps"]
    stores = [s for s in steps if s["name"].startswith("remote store tanh")]
    stores.sort(key=lambda s: int(s["name"].rpartition("%")[2]))  # in order of the tanh producing each
    assert len(stores) == 2 * 4
    for i, store in enumerate(stores):  # two tanh layers per phase, phases alternating between IPUs 0 and 1
        assert (store["stage"], store["ipu"], store["role"]) == (i // 2, i // 2 % 2, "forward")
