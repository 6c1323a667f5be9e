"""Overlapped host I/O: set_overlap_for_input / _output with OverlapAccumulationLoop or
OverlapDeviceIterationLoop, on I/O tiles reserved by TensorLocations.numIOTiles, as PopTorch documents."""

import pytest
import torch

import popsim
import poptorch

ACCUMULATION = poptorch.OverlapMode.OverlapAccumulationLoop
DEVICE_ITERATION = poptorch.OverlapMode.OverlapDeviceIterationLoop
DEVICE_ITERATIONS = 4


def _options(io_tiles=32, strategy=poptorch.ShardedExecution):
    opts = poptorch.Options().showCompilationProgressBar(False).deviceIterations(DEVICE_ITERATIONS).logCycleCount(True)
    if io_tiles:
        opts.TensorLocations.numIOTiles(io_tiles)
    if strategy is not None:
        opts.setExecutionStrategy(strategy())
    return opts


class _Streamer(torch.nn.Module):
    """Transfer-heavy: a large input and output, little compute."""

    def __init__(self, mode):
        super().__init__()
        self.mode = mode
        self.scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        if self.mode is not None:
            x = poptorch.set_overlap_for_input(x, self.mode)
        out = x * self.scale + 1.0
        return poptorch.set_overlap_for_output(out, self.mode) if self.mode is not None else out


def _run(mode, x):
    model = poptorch.inferenceModel(_Streamer(mode), _options())
    return model, model(x)


@pytest.mark.parametrize("mode", [ACCUMULATION, DEVICE_ITERATION])
def test_overlapped_io_gives_eager_numbers_in_fewer_cycles(mode):
    x = torch.randn(DEVICE_ITERATIONS * 2, 64, 64)
    serial, serial_out = _run(None, x)
    overlapped, out = _run(mode, x)
    torch.testing.assert_close(out, _Streamer(None)(x))
    torch.testing.assert_close(out, serial_out)
    assert overlapped.cycleCount() < serial.cycleCount()
    shown = overlapped.profile.programs["inference"]["io_overlap"]
    assert shown["io_tiles"] == 32
    assert {t["direction"] for t in shown["tensors"].values()} == {"input", "output"}
    assert all(t["mode"] == mode.name for t in shown["tensors"].values())
    assert shown["overlapped_cycles"] < shown["serial_cycles"]
    # The call's timeline: the marked transfers on the I/O tiles' lane, some while the compute tiles run.
    timeline = overlapped.profile.programs["inference"]["run_timeline"]
    assert overlapped.cycleCount() == timeline["makespan"]
    io = [e for e in timeline["intervals"] if e["lanes"] == ["replica 0 IPU 0 I/O tiles"]]
    runs = [e for e in timeline["intervals"] if "device_iteration" in e]
    assert {e["transfer"] for e in io} == {"load", "store"}
    assert {e["device_iteration"] for e in runs} == set(range(DEVICE_ITERATIONS))
    assert any(r["start"] < e["end"] and e["start"] < r["end"] for e in io for r in runs)
    # The I/O tiles hold the marked input and output, spread over them, within a tile's memory.
    held = overlapped.profile.programs["inference"]["io_tiles"]
    assert held["io_tiles"] == 32 and len(held["memory"]) == 32
    assert sum(held["memory"]) == sum(t["bytes"] for t in shown["tensors"].values()) == 2 * x[:2].numel() * 4
    assert max(held["memory"]) <= held["tile_bytes"] == popsim.Target.ipu2().tile_bytes
    # The I/O tiles hold no compute vertices: the model computes on the others.
    assert overlapped.profile.target.num_tiles == 1472 - 32


def test_accumulation_loop_overlaps_only_within_each_accumulation():
    x, y = torch.randn(DEVICE_ITERATIONS * 4, 32, 32), torch.randn(DEVICE_ITERATIONS * 4, 32, 32)

    class Trained(torch.nn.Module):
        def __init__(self, mode):
            super().__init__()
            self.mode = mode
            self.weight = torch.nn.Parameter(torch.ones(32))

        def forward(self, x, y):
            x = poptorch.set_overlap_for_input(x, self.mode)
            return torch.nn.functional.mse_loss(x * self.weight, y)

    cycles, weights = {}, {}
    for mode in (poptorch.OverlapMode.NoOverlap, ACCUMULATION, DEVICE_ITERATION):
        opts = _options()
        opts.Training.gradientAccumulation(2)
        model = Trained(mode)
        training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
        training(x, y)
        cycles[mode], weights[mode] = training.cycleCount(), model.weight.detach().clone()
    torch.testing.assert_close(weights[ACCUMULATION], weights[poptorch.OverlapMode.NoOverlap])
    torch.testing.assert_close(weights[DEVICE_ITERATION], weights[poptorch.OverlapMode.NoOverlap])
    # Preloading across device iterations hides the transfers at each accumulation loop's edges too.
    assert cycles[DEVICE_ITERATION] < cycles[ACCUMULATION] < cycles[poptorch.OverlapMode.NoOverlap]


def test_overlap_needs_io_tiles_and_a_sharded_or_phased_strategy():
    x = torch.randn(DEVICE_ITERATIONS, 3)
    pipelined = r"Overlapped IO is not supported with poptorch\.PipelinedExecution\. If you are using only one IPU"
    with pytest.raises(poptorch.Error, match=pipelined):
        poptorch.inferenceModel(_Streamer(ACCUMULATION), _options(strategy=None))(x)
    no_tiles = r"No IO tiles allocated\. You must allocate at least 32 IO tiles using poptorch\.Options\(\)"
    with pytest.raises(poptorch.Error, match=no_tiles):
        poptorch.inferenceModel(_Streamer(ACCUMULATION), _options(io_tiles=0))(x)


def test_marked_tensors_beyond_the_io_tiles_memory_are_out_of_memory():
    tile_bytes = popsim.Target.ipu2().tile_bytes
    rows = 32 * tile_bytes // (4 * 1024) + 1  # one float32 micro-batch just over 32 I/O tiles' memory
    opts = poptorch.Options().showCompilationProgressBar(False).setExecutionStrategy(poptorch.ShardedExecution())
    opts.TensorLocations.numIOTiles(32)
    total = 2 * rows * 1024 * 4  # the marked input and output
    needed = -(-total // tile_bytes)
    needed += needed % 2  # an even count, as numIOTiles takes
    message = (
        rf"Out of memory on the simulated IPU's I/O tiles: .* x \({rows * 1024 * 4:,} bytes\).* with "
        rf"TensorLocations\.numIOTiles\(32\)\. Reserve more I/O tiles \(numIOTiles\({needed}\)\)"
    )
    with pytest.raises(poptorch.Error, match=message):
        poptorch.inferenceModel(_Streamer(ACCUMULATION), opts)(torch.zeros(1, rows, 1024))


class _InputUsedTwice(torch.nn.Module):
    def forward(self, x):
        return x + 1, poptorch.set_overlap_for_input(x, ACCUMULATION)


class _NotAnInput(torch.nn.Module):
    def forward(self, x):
        y = x + 1
        return poptorch.set_overlap_for_input(y, ACCUMULATION)


class _ReturnedTwice(torch.nn.Module):
    def forward(self, x):
        y = poptorch.set_overlap_for_output(x + 1, ACCUMULATION)
        return y, y


class _NotAnOutput(torch.nn.Module):
    def forward(self, x):
        y = poptorch.set_overlap_for_output(x + 1, ACCUMULATION)
        return y.mean()


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (_InputUsedTwice(), r"set_overlap_for_input must be the only op applied to an input\. .* input x to"),
        (_NotAnInput(), r"set_overlap_for_input applied on a node which is not a tensor input to the model"),
        (_ReturnedTwice(), r"set_overlap_for_output cannot be used with a tensor that is returned twice"),
        (_NotAnOutput(), r"set_overlap_for_output applied on a node which is not a tensor output to the model"),
    ],
)
def test_misplaced_marks_are_refused_with_poptorchs_errors(model, message):
    with pytest.raises(poptorch.Error, match=message):
        poptorch.inferenceModel(model, _options())(torch.randn(DEVICE_ITERATIONS, 3))


class _OutputOnIpu(torch.nn.Module):
    """``h`` made on IPU 0, ``y`` (same shape) on IPU 1; the one named by ``marked`` streams through the I/O tiles."""

    def __init__(self, marked):
        super().__init__()
        self.marked = marked
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        with poptorch.Block("a", ipu_id=0):
            h = self.a(x)
            if self.marked == "h":
                h = poptorch.set_overlap_for_output(h, ACCUMULATION)
        with poptorch.Block("b", ipu_id=1):
            y = self.b(h)
            return h, poptorch.set_overlap_for_output(y, ACCUMULATION) if self.marked == "y" else y


def test_a_marked_output_made_on_another_ipu_pays_the_link_to_the_io_tiles():
    opts = poptorch.Options().showCompilationProgressBar(False).deviceIterations(DEVICE_ITERATIONS)
    opts.TensorLocations.numIOTiles(32)
    opts.setExecutionStrategy(poptorch.ShardedExecution(poptorch.AutoStage.SameAsIpu))
    x = torch.randn(DEVICE_ITERATIONS, 8)
    exchange, crossings, stores = {}, {}, {}
    for marked in ("h", "y"):
        torch.manual_seed(0)
        model = _OutputOnIpu(marked)
        executor = poptorch.inferenceModel(model, opts)
        for ours, eager in zip(executor(x), model(x)):
            torch.testing.assert_close(ours, eager)
        program = executor.profile.programs["inference"]
        exchange[marked] = program["io_overlap"]["io_exchange_cycles_per_run"]
        intervals = program["run_timeline"]["intervals"]
        crossings[marked] = [e for e in intervals if e.get("transfer") == "IPU-Link"]
        stores[marked] = [e for e in intervals if e.get("transfer") == "store"]
    # The I/O tiles' exchange with the compute tiles is the same; y's crossing is an interval of each run on the
    # IPU-Link from IPU 1 to the first IPU's I/O tiles, and each store of y waits for one.
    assert exchange["y"] == exchange["h"] and crossings["h"] == []
    assert len(crossings["y"]) == DEVICE_ITERATIONS
    for crossing in crossings["y"]:
        assert crossing["end"] > crossing["start"]
        assert set(crossing["lanes"]) == {
            "replica 0 IPU-Link 1->0",
            "replica 0 IPU 0 I/O tiles",
            "replica 0 IPU 1 compute",
        }
    assert len(stores["y"]) == DEVICE_ITERATIONS
    for crossing, store in zip(crossings["y"], sorted(stores["y"], key=lambda e: e["start"])):
        assert crossing["tensor"] == store["tensor"] and store["start"] >= crossing["end"]
