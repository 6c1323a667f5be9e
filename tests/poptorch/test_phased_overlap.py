"""Phased execution's cycle count: within a phase, stages on different IPUs that do not read each other's
values run at the same time (the phase costs its critical path), dependent ones in order; the phases' timeline
is in the profile and the numbers are those of eager PyTorch."""

import pytest
import torch

import poptorch

WIDTH, BATCH = 8, 4


class Branches(torch.nn.Module):
    """Blocks A and B both read the input (independent branches, or a chain when ``chain``); C adds them."""

    def __init__(self, chain=False):
        super().__init__()
        self.chain = chain
        self.a, self.b = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, y):
        with poptorch.Block("A"):
            u = torch.relu(self.a(x))
        with poptorch.Block("B"):
            v = torch.relu(self.b(u if self.chain else x))
        with poptorch.Block("C"):
            out = u + v
            return out, torch.nn.functional.mse_loss(out, y)


def _phased():
    strategy = poptorch.SerialPhasedExecution(poptorch.Phase(poptorch.Stage("A"), poptorch.Stage("B")), "C")
    strategy.phase(0).ipus(0, 1)
    strategy.phase(1).ipus(0)
    return strategy


def _sharded():
    return poptorch.ShardedExecution(poptorch.Stage("A").ipu(0), poptorch.Stage("B").ipu(1), poptorch.Stage("C").ipu(0))


def _run(strategy, chain=False, training=False):
    """Outputs (eager's alongside) and cycles of one call, and the program's profile."""
    torch.manual_seed(0)
    model = Branches(chain)
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(BATCH, WIDTH, generator=g), torch.rand(BATCH, WIDTH, generator=g)
    expected = model(x, y)
    opts = poptorch.Options().showCompilationProgressBar(False).logCycleCount(True).setExecutionStrategy(strategy)
    if training:
        executor = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.0))
    else:
        executor = poptorch.inferenceModel(model, opts)
    out = executor(x, y)
    program = executor.profile.programs["train" if training else "inference"]
    cycles = executor.cycleCount()
    executor.destroy()
    return out, expected, cycles, program


def test_independent_stages_of_a_phase_run_at_the_same_time():
    out, expected, cycles, program = _run(_phased())
    torch.testing.assert_close(out, expected)
    _, _, sharded_cycles, _ = _run(_sharded())
    phases = program["phases"]
    assert cycles == phases["total_cycles"] < phases["serial_cycles"]
    assert cycles < sharded_cycles
    # x streams into both IPUs of phase 0 before it, y into phase 1 once phase 0 is done.
    streamed = {e["tensor"]: e for e in program["run_timeline"]["intervals"] if e.get("stream") == "in"}
    first = {e["ipu"]: e for e in phases["timeline"] if e["phase"] == 0}
    assert first[0]["start"] == first[1]["start"] == streamed["x"]["end"]  # the profile shows the overlap
    later = [e for e in phases["timeline"] if e["phase"] == 1]
    assert streamed["y"]["start"] == max(e["end"] for e in first.values())
    assert later and min(e["start"] for e in later) == streamed["y"]["end"]
    # The call's timeline places the same phases on each IPU's lane.
    pieces = [e for e in program["run_timeline"]["intervals"] if "phase" in e and "stream" not in e]
    for entry in phases["timeline"]:
        key = (entry["phase"], entry["pass"], entry["ipu"])
        mine = [e for e in pieces if (e["phase"], e["pass"], e["ipu"]) == key]
        assert (min(e["start"] for e in mine), max(e["end"] for e in mine)) == (entry["start"], entry["end"])
    # Phase 1 on IPU 0 copies B's result from IPU 1 over the IPU-Link from IPU 1 to IPU 0.
    assert any("replica 0 IPU-Link 1->0" in e["lanes"] for e in pieces if e["phase"] == 1)
    assert program["run_timeline"]["makespan"] == cycles


def test_a_dependent_chain_in_a_phase_runs_in_order():
    out, expected, cycles, program = _run(_phased(), chain=True)
    torch.testing.assert_close(out, expected)
    phases = program["phases"]
    assert cycles == phases["total_cycles"] == phases["serial_cycles"]
    first = {e["ipu"]: e for e in phases["timeline"] if e["phase"] == 0}
    assert first[1]["start"] == first[0]["end"]


def test_training_overlaps_the_independent_stages_forward_and_backward():
    out, expected, cycles, program = _run(_phased(), training=True)
    torch.testing.assert_close(out[1], expected[1])
    phases = program["phases"]
    _, _, sharded_cycles, _ = _run(_sharded(), training=True)
    assert phases["total_cycles"] < phases["serial_cycles"]
    assert cycles < sharded_cycles
    backward = {e["ipu"]: e for e in phases["timeline"] if e["phase"] == 0 and e["pass"] == "backward"}
    assert backward[0]["start"] == backward[1]["start"]


def test_parallel_phases_alternate_between_even_and_odd_ipus():
    strategy = poptorch.ParallelPhasedExecution(poptorch.Phase(poptorch.Stage("A"), poptorch.Stage("B")), "C")
    strategy.phase(0).ipus(0, 1)  # phase 0 on odd IPU 1
    strategy.phase(1).ipus(1)
    with pytest.raises(poptorch.Error, match="even phases must run on even IPUs and odd phases on odd IPUs"):
        _run(strategy)
