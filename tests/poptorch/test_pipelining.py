"""Models split over several simulated IPUs: sharded and pipelined training equal the single-IPU run and eager
torch step by step; the profile says which IPU did what; a pipelined step takes fewer cycles than a sharded one."""

import copy

import pytest
import torch

import popsim
import poptorch

GA = 8
MICRO = 2
STEPS = 3


class FourBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(4))

    def forward(self, x, target):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x, torch.nn.functional.mse_loss(x, target)


def _data():
    g = torch.Generator().manual_seed(1)
    shape = (STEPS, GA * MICRO, 6)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _fresh():
    torch.manual_seed(0)
    return FourBlocks()


def _eager(model, xs, ys):
    """Eager torch: one SGD step per combined batch (the mean over micro-batches is the mean over the batch);
    outputs of the step's last micro-batch before the update."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    results = []
    for x, y in zip(xs, ys):
        with torch.no_grad():
            last = model(x[-MICRO:], y[-MICRO:])
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
        results.append((last[0], last[1], [p.detach().clone() for p in model.parameters()]))
    return results


def _on_ipus(model, ipus, strategy, xs, ys, annotate=True):
    if annotate:
        for i, block in enumerate(model.blocks):
            poptorch.BeginBlock(block, f"b{i}", ipu_id=i * ipus // 4)
    opts = poptorch.Options().logCycleCount(True)
    opts.Training.gradientAccumulation(GA)
    if strategy is not None:
        opts.setExecutionStrategy(strategy)
    trained = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    results = []
    for x, y in zip(xs, ys):
        out, loss = trained(x, y)
        results.append((out, loss, [p.detach().clone() for p in trained.parameters()]))
    return trained, results


def _assert_same(got, expected):
    for (out, loss, weights), (e_out, e_loss, e_weights) in zip(got, expected, strict=True):
        torch.testing.assert_close(out, e_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loss, e_loss, rtol=1e-5, atol=1e-6)
        for w, e in zip(weights, e_weights, strict=True):
            torch.testing.assert_close(w, e, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def reference():
    xs, ys = _data()
    single = _on_ipus(_fresh(), 1, None, xs, ys, annotate=False)
    return xs, ys, _eager(_fresh(), xs, ys), single


@pytest.mark.parametrize("ipus", [1, 2, 4])
@pytest.mark.parametrize("strategy", [poptorch.ShardedExecution, poptorch.PipelinedExecution])
def test_four_blocks_train_as_on_one_ipu_and_as_eager(reference, ipus, strategy):
    xs, ys, eager, (single_model, single) = reference
    trained, results = _on_ipus(_fresh(), ipus, strategy(), xs, ys)
    _assert_same(results, eager)
    _assert_same(results, single)
    program = trained.profile.programs["accumulate"]
    placed = {s["ipu"] for s in program["steps"] if "ipu" in s}
    assert placed == set(range(ipus))
    busy = [c > 0 for c in program["tile_compute_cycles"]]
    tiles = len(busy) // ipus
    assert len(busy) == tiles * ipus and all(any(busy[i * tiles : (i + 1) * tiles]) for i in range(ipus))


def test_a_pipelined_step_takes_fewer_cycles_than_a_sharded_one(reference):
    xs, ys, *_ = reference
    sharded, _ = _on_ipus(_fresh(), 4, poptorch.ShardedExecution(), xs[:1], ys[:1])
    pipelined, _ = _on_ipus(_fresh(), 4, poptorch.PipelinedExecution(), xs[:1], ys[:1])
    assert pipelined.cycleCount() < sharded.cycleCount()
    schedule = pipelined.profile.programs["accumulate"]["schedule"]
    assert [s["ipu"] for s in schedule["stages"].values()] == [0, 1, 2, 3]
    assert schedule["ramp_up_cycles"] > 0 and schedule["ramp_down_cycles"] > 0
    pipeline = schedule["ramp_up_cycles"] + schedule["main_cycles"] + schedule["ramp_down_cycles"]
    assert pipeline + GA * schedule["outside_stages_cycles"] == schedule["total_cycles"]
    # Every IPU waits somewhere in the step (the bubbles), the first and last the longest.
    idle = schedule["bubble_cycles"]
    assert min(idle.values()) > 0 and max(idle.values()) in (idle[0], idle[3])
    assert "schedule" not in sharded.profile.programs["accumulate"]
    # The cycle count is the call's timeline: each IPU's compute tiles are a lane, and the stages of different
    # micro-batches on different IPUs run at the same time.
    timeline = pipelined.profile.programs["accumulate"]["run_timeline"]
    assert pipelined.cycleCount() == timeline["makespan"]
    assert {f"replica 0 IPU {i} compute" for i in range(4)} <= set(timeline["lanes"])
    staged = [e for e in timeline["intervals"] if "stage" in e]
    assert any(
        a["lanes"] != b["lanes"] and a["start"] < b["end"] and b["start"] < a["end"] for a in staged for b in staged
    )
    # The stages' activations and gradients cross on the IPU-Links between neighbouring IPUs, micro-batch by
    # micro-batch, in the pipeline cycle after the one that made them.
    copies = [e for e in timeline["intervals"] if e.get("transfer") == "inter-IPU copy"]
    links = {lane for e in copies for lane in e["lanes"] if "IPU-Link" in lane}
    assert links == {f"replica 0 IPU-Link {a}->{b}" for a, b in [(0, 1), (1, 2), (2, 3), (3, 2), (2, 1), (1, 0)]}
    assert {e["micro_batch"] for e in copies} == set(range(GA))
    # Each micro-batch's host streams run in the pipeline cycles of the passes that use them, on the host link:
    # x into IPU 0 before the first stage's forward, the target (read by the loss) into IPU 3 and the outputs
    # out of it around the last stage's forward. Nothing is left outside the stages: the gradients accumulate
    # in each stage's backward pass.
    assert schedule["outside_stages_cycles"] == 0
    passes = {
        (e["stage"], e["pass"], e["micro_batch"]): e
        for e in timeline["intervals"]
        if "stage" in e and "transfer" not in e
    }
    streams = [e for e in timeline["intervals"] if e.get("transfer") == "host transfer"]
    assert len(streams) == 4 * GA and all("replica 0 host link" in e["lanes"] for e in streams)
    for e in streams:
        computed = passes[(e["stage"], e["pass"], e["micro_batch"])]
        assert e["pass"] == "forward" and e["ipu"] == (0 if e["tensor"] == "x" else 3)
        assert e["pipeline_cycle"] == computed["pipeline_cycle"] == e["micro_batch"] + e["stage"]
        inward = e["tensor"] in ("x", "target")
        assert e["stream"] == ("in" if inward else "out")
        assert e["end"] <= computed["start"] if inward else e["start"] >= computed["end"]
    # Sharded: each stage on its IPU's lane, nothing overlapping.
    timeline = sharded.profile.programs["accumulate"]["run_timeline"]
    assert sharded.cycleCount() == timeline["makespan"]
    assert {e["ipu"] for e in timeline["intervals"] if "stage" in e} == {0, 1, 2, 3}
    spans = sorted((e["start"], e["end"]) for e in timeline["intervals"])
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_blocks_are_the_default_pipeline_and_copy_pickle_and_print():
    model = _fresh()
    for i, block in enumerate(model.blocks):
        poptorch.BeginBlock(block, ipu_id=i // 2)
    import pickle

    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        hooks = [h for b in clone.blocks for h in b._forward_pre_hooks.values()]
        assert [repr(h) for h in hooks] == [f"BeginBlock(user_id=None, ipu_id={i // 2})" for i in range(4)]
    assert "Linear" in str(model)
    xs, ys = _data()
    trained, _ = _on_ipus(model, 2, None, xs[:1], ys[:1], annotate=False)
    assert "schedule" in trained.profile.programs["accumulate"]
    graph = trained._programs.graphs["accumulate"]
    assert {n.placement for n in graph.nodes if n.placement is not None} == {(0, 0), (1, 1)}


class TanhStack(torch.nn.Module):
    """``depth`` tanh layers of ``width`` features, trained to a target by MSE."""

    def __init__(self, width, depth):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x, target):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x, torch.nn.functional.mse_loss(x, target)


def test_a_model_out_of_tile_memory_on_one_ipu_trains_on_two(monkeypatch):
    # IPUs of 4 tiles x 48 KiB: the weights, their accumulators and the activations of four 64 x 64 layers
    # overflow one IPU's tiles; split in two they fit.
    small = popsim.Target.small(num_tiles=4, tile_bytes=48 * 1024)
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: small)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(GA * MICRO, 64, generator=g), torch.randn(GA * MICRO, 64, generator=g)

    def train(ipus):
        torch.manual_seed(0)
        model = TanhStack(64, 4)
        if ipus > 1:
            for i, block in enumerate(model.blocks):
                poptorch.BeginBlock(block, ipu_id=i * ipus // 4)
        opts = poptorch.Options()
        opts.Training.gradientAccumulation(GA)
        trained = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
        return trained, trained(x, y)

    with pytest.raises(poptorch.Error, match="Out of memory on the simulated IPU: out of memory on tile"):
        train(1)
    trained, (out, loss) = train(2)
    torch.manual_seed(0)
    eager = _eager(TanhStack(64, 4), x[None], y[None])
    _assert_same([(out, loss, [p.detach().clone() for p in trained.parameters()])], eager)
    assert trained.profile.programs["accumulate"]["memory_max_tile_bytes"] <= small.tile_bytes


def test_a_pipeline_stashes_the_activations_of_micro_batches_in_flight(monkeypatch):
    small = popsim.Target.small(num_tiles=4, tile_bytes=128 * 1024)
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: small)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(GA * 256, 32, generator=g), torch.randn(GA * 256, 32, generator=g)

    def train(strategy, recomputation=0):
        torch.manual_seed(0)
        model = TanhStack(32, 8)  # eight narrow layers on a large micro-batch: activations dominate
        for i in range(4):
            poptorch.BeginBlock(model.blocks[2 * i], ipu_id=i)
        opts = poptorch.Options().setExecutionStrategy(strategy)
        opts.Training.gradientAccumulation(GA)
        opts._Popart.set("autoRecomputation", recomputation)
        trained = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
        trained(x, y)
        return [p.detach().clone() for p in trained.parameters()]

    sharded = train(poptorch.ShardedExecution())
    # Stage 0 holds 7 micro-batches between their forward and backward passes: its activations overflow.
    with pytest.raises(poptorch.Error, match="a pipeline of 4 stages keeps up to 7 micro-batches in flight"):
        train(poptorch.PipelinedExecution())
    # Recomputing from each stage's inputs stashes only those: the pipeline fits and trains as sharded.
    torch.testing.assert_close(train(poptorch.PipelinedExecution(), recomputation=3), sharded)


def test_an_executable_saved_pipelined_does_not_serve_a_sharded_run(tmp_path):
    """The strategy is part of the executable's key: a pipelined step's saved profile (its schedule) must not
    be reused by a sharded run of the same blocks."""
    xs, ys = _data()
    trained, _ = _on_ipus(_fresh(), 2, poptorch.PipelinedExecution(), xs[:1], ys[:1])
    assert "schedule" in trained.profile.programs["accumulate"]
    path = str(tmp_path / "pipelined.poptorch")
    trained.save(path)
    trained.destroy()
    reloaded = poptorch.load(path)
    reloaded(xs[1], ys[1])
    assert "schedule" in reloaded.profile.programs["accumulate"]
    reloaded.destroy()
    with pytest.raises(poptorch.Error, match="other compile options"):
        poptorch.load(path, lambda opts: opts.setExecutionStrategy(poptorch.ShardedExecution()))
