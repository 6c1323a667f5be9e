"""Host streams of phased runs on the call's timeline: each input streams in just before the first phase that
reads it and each output out just after the phase that makes it, on the host link and that phase's IPU; a run
whose streams cannot overlap other work keeps its cycles, and a later phase's IPU works while an output made
by an earlier phase streams out."""

import copy

import pytest
import torch
from sgd_step import train_one_step_like_eager

import poptorch

WIDTH, BATCH = 6, 4


class TwoPhases(torch.nn.Module):
    """Phase 0 reads ``x`` and ``y``, makes ``early`` (returned) and feeds phase 1."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, y):
        with poptorch.Block("0"):
            h = torch.tanh(self.first(x))
            early = h * y
        with poptorch.Block("1"):
            out = torch.tanh(self.second(h))
        return early, out


class TwoPhasesWithLoss(TwoPhases):
    """``early`` and a loss made in phase 1."""

    def forward(self, x, y):
        early, out = super().forward(x, y)
        with poptorch.Block("1"):
            return early, torch.nn.functional.mse_loss(out, x)


def _options(parallel):
    """Phases 0 and 1 on IPU 0 (serial) or on IPUs 0 and 1 (parallel)."""
    phases = (poptorch.Phase("0"), poptorch.Phase("1"))
    strategy = poptorch.ParallelPhasedExecution(*phases) if parallel else poptorch.SerialPhasedExecution(*phases)
    for p in range(2):
        strategy.phase(p).ipus(p if parallel else 0)
    return poptorch.Options().showCompilationProgressBar(False).logCycleCount(True).setExecutionStrategy(strategy)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def _run(parallel):
    """Outputs against eager's; the cycle count, the program's own cycles and the call's timeline."""
    torch.manual_seed(0)
    model = TwoPhases()
    inference = poptorch.inferenceModel(model, _options(parallel))
    x, y = _inputs()
    for got, want in zip(inference(x, y), model(x, y), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    program = inference.profile.programs["inference"]
    cycles = inference.cycleCount()
    inference.destroy()
    return cycles, program["total_cycles"], program["run_timeline"]


def _pieces(timeline):
    """The streams by tensor and each phase's work intervals by phase."""
    streams = {e["tensor"]: e for e in timeline["intervals"] if e.get("transfer") == "host transfer"}
    work = {}
    for e in timeline["intervals"]:
        if "phase" in e and "stream" not in e:
            work.setdefault(e["phase"], []).append(e)
    return streams, work


@pytest.mark.parametrize("parallel", [False, True])
def test_each_stream_sits_beside_the_phase_that_reads_or_makes_it(parallel):
    cycles, run_cycles, timeline = _run(parallel)
    streams, work = _pieces(timeline)
    assert sorted(streams) == ["output_0", "output_1", "x", "y"]
    start = {p: min(e["start"] for e in pieces) for p, pieces in work.items()}
    end = {p: max(e["end"] for e in pieces) for p, pieces in work.items()}
    ipu = {p: pieces[0]["ipu"] for p, pieces in work.items()}
    for name, phase in (("x", 0), ("y", 0), ("output_0", 0), ("output_1", 1)):
        e = streams[name]
        assert (e["phase"], e["ipu"]) == (phase, ipu[phase])
        assert set(e["lanes"]) == {"replica 0 host link", f"replica 0 IPU {ipu[phase]} compute"}
        assert e["end"] <= start[phase] if e["stream"] == "in" else e["start"] >= end[phase]
    assert streams["x"]["end"] == streams["y"]["start"] and streams["y"]["end"] == start[0]
    assert streams["output_0"]["start"] == end[0]
    if not parallel:  # one IPU: nothing overlaps, so the run keeps the program's cycles
        assert cycles == timeline["makespan"] == run_cycles


def test_a_later_phase_s_ipu_works_while_an_earlier_output_streams_out():
    cycles, run_cycles, timeline = _run(parallel=True)
    # Before, every stream held both IPUs after the phases: the call took the program's cycles.
    assert cycles == timeline["makespan"] < run_cycles
    streams, work = _pieces(timeline)
    early = streams["output_0"]
    assert any(w["start"] < early["end"] and early["start"] < w["end"] for w in work[1])


def test_a_training_step_streams_an_early_output_while_the_next_phase_computes():
    torch.manual_seed(0)
    model = TwoPhasesWithLoss()
    trained = train_one_step_like_eager(model, copy.deepcopy(model), _options(True), *_inputs())
    program = trained.profile.programs["train"]
    assert trained.cycleCount() == program["run_timeline"]["makespan"] < program["total_cycles"]
    streams, work = _pieces(program["run_timeline"])
    early = streams["output_0"]
    assert (early["phase"], early["pass"], early["ipu"]) == (0, "forward", 0)
    later = [w for w in work[1] if w["pass"] == "forward"]
    assert any(w["start"] < early["end"] and early["start"] < w["end"] for w in later)
    trained.destroy()
