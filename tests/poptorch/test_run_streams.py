"""Host streams of single-IPU and sharded runs on the call's timeline: each input streams in just before the
first stage that reads it and each output out just after the stage that makes it, on the host link and that
stage's IPU; a run whose streams cannot overlap other work keeps its cycles, and another IPU's work goes on
while an output made early streams out."""

import torch

import poptorch

RUNS = 3


class Blocks(torch.nn.Module):
    """Four layers; ``early`` returns an output made by the second layer too."""

    def __init__(self, early=False):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(4))
        self.early = early

    def forward(self, x):
        outputs = []
        for i, block in enumerate(self.blocks):
            x = torch.tanh(block(x))
            if self.early and i == 1:
                outputs.append(x * 2)
        return (*outputs, x)


def _run(ipus, early=False):
    torch.manual_seed(0)
    model = Blocks(early)
    opts = poptorch.Options().logCycleCount(True).deviceIterations(RUNS)
    if ipus > 1:
        for i, block in enumerate(model.blocks):
            poptorch.BeginBlock(block, f"b{i}", ipu_id=i * ipus // 4)
        opts.setExecutionStrategy(poptorch.ShardedExecution())
    inference = poptorch.inferenceModel(model, opts)
    x = torch.randn(RUNS * 2, 6, generator=torch.Generator().manual_seed(1))
    outputs = inference(x)
    expected = model(x)
    for got, want in zip(outputs if early else [outputs], expected if early else [expected], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    return inference, inference.profile.programs["inference"]["run_timeline"]


def _streams(timeline):
    return [e for e in timeline["intervals"] if e.get("transfer") == "host transfer"]


def test_a_single_ipu_run_streams_its_input_first_and_its_output_last():
    model, timeline = _run(1)
    assert model.cycleCount() == timeline["makespan"] == sum(model._run_cycles)
    runs = [[e for e in timeline["intervals"] if e["device_iteration"] == d] for d in range(RUNS)]
    for run in runs:
        streamed = {e["tensor"]: e for e in _streams({"intervals": run})}
        assert sorted(streamed) == ["output_0", "x"]
        assert streamed["x"] == run[0] and streamed["x"]["stream"] == "in"
        assert streamed["output_0"]["stream"] == "out"
        assert streamed["output_0"]["start"] == max(e["end"] for e in run if "transfer" not in e)
        assert all("replica 0 host link" in e["lanes"] for e in streamed.values())


def test_sharded_streams_sit_on_the_ipu_of_their_stage_and_keep_the_cycles():
    model, timeline = _run(2)
    # The input feeds stage 0 on IPU 0, the output leaves stage 1 on IPU 1: nothing can overlap.
    assert model.cycleCount() == timeline["makespan"] == sum(model._run_cycles)
    streams = _streams(timeline)
    assert len(streams) == 2 * RUNS
    for e in streams:
        stage = 0 if e["tensor"] == "x" else 1
        assert (e["stage"], e["ipu"], e["pass"]) == (stage, stage, "forward")
        assert set(e["lanes"]) == {f"replica 0 IPU {stage} compute", "replica 0 host link"}
        work = [
            w
            for w in timeline["intervals"]
            if w.get("stage") == stage and "transfer" not in w and w["device_iteration"] == e["device_iteration"]
        ]
        assert e["end"] <= work[0]["start"] if stage == 0 else e["start"] >= work[-1]["end"]


def test_ipu_1_works_while_an_output_made_on_ipu_0_streams_out():
    model, timeline = _run(2, early=True)
    # Before, the run's streams held every IPU at its end: the call took the sum of its runs' cycles.
    assert model.cycleCount() == timeline["makespan"] < sum(model._run_cycles)
    early = [e for e in _streams(timeline) if e["ipu"] == 0 and e["stream"] == "out"]
    assert len(early) == RUNS
    on_ipu_1 = [e for e in timeline["intervals"] if e.get("ipu") == 1 and "transfer" not in e]
    for e in early:
        assert any(w["start"] < e["end"] and e["start"] < w["end"] for w in on_ipu_1)
