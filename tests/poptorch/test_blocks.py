"""PopTorch's multi-IPU annotations: blocks, stages and strategies place each op of the captured model on a
pipeline stage and IPU, with PopTorch's errors; outside the device they change nothing."""

import pytest
import torch

import poptorch


class Network(torch.nn.Module):
    """The seed's pipeline_simple.py model, annotated inside forward (its second form)."""

    def __init__(self):
        super().__init__()
        self.layer1 = torch.nn.Linear(5, 10)
        self.layer2 = torch.nn.Linear(10, 5)
        self.layer3 = torch.nn.Linear(5, 5)
        self.layer4 = torch.nn.Linear(5, 5)
        self.act = torch.nn.ReLU()
        self.softmax = torch.nn.Softmax(dim=1)

    def forward(self, x):
        # Implicitly layers are on IPU 0 until a with IPU annotation is encountered.
        x = self.act(self.layer1(x))
        with poptorch.IPU(1):
            x = self.act(self.layer2(x))
        with poptorch.IPU(2):
            x = self.act(self.layer3(x))
            x = self.act(self.layer4(x))
        with poptorch.IPU(3):
            x = self.softmax(x)
        return x


def _placements(executor, program):
    graph = executor._programs.graphs[program]
    return [n.placement for n in graph.nodes if n.op != "constant"]


def _infer(model, x, opts=None):
    opts = opts or poptorch.Options().deviceIterations(4)
    executor = poptorch.inferenceModel(model, opts)
    return executor, executor(x)


def test_the_seed_pipeline_annotated_inside_the_model_runs_on_four_ipus():
    torch.manual_seed(0)
    model = Network()
    x = torch.rand((4, 5))
    executor, out = _infer(model, x)
    torch.testing.assert_close(out, model(x))
    placements = _placements(executor, "inference")
    assert sorted(set(placements)) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    # Data flows through the IPUs in order: the first node is on IPU 0, the last on IPU 3.
    assert placements[0] == (0, 0) and placements[-1] == (3, 3)


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(5, 8)
        self.layer = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(6))

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layer:
            x = torch.relu(layer(x))
        return x


def test_the_seed_pipeline_wrapping_existing_layers_runs():
    torch.manual_seed(0)
    model = Stack()
    # As the seed does with BERT's encoder layers: everything before layer[0] on IPU 0, then 1, 2, 3.
    model.layer[0] = poptorch.IPU(1, model.layer[0])
    model.layer[2] = poptorch.IPU(2, model.layer[2])
    model.layer[4] = poptorch.IPU(3, model.layer[4])
    x = torch.rand((4, 5))
    executor, out = _infer(model, x)
    torch.testing.assert_close(out, model(x))
    assert sorted(set(_placements(executor, "inference"))) == [(0, 0), (1, 1), (2, 2), (3, 3)]


class Blocks(torch.nn.Module):
    """Blocks from the user guide's forms: Block.useAutoId, ``with Block``, Block.start and BlockFunction."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(4, 4) for _ in range(3))

    @poptorch.BlockFunction("C", ipu_id=1)
    def tail(self, x):
        return self.c(x)

    def forward(self, x):
        poptorch.Block.useAutoId()
        with poptorch.Block(ipu_id=0):  # user_id "0"
            x = self.a(x)
        poptorch.Block.start("B", ipu_id=1)
        x = torch.relu(self.b(x))
        return self.tail(x)


def test_blocks_in_every_form_with_sharded_stages_given_by_user_id():
    torch.manual_seed(0)
    model = Blocks()
    x = torch.rand((2, 4))
    strategy = poptorch.ShardedExecution(poptorch.Stage("0"), poptorch.Stage("B", "C").ipu(1))
    executor, out = _infer(model, x, poptorch.Options().setExecutionStrategy(strategy))
    torch.testing.assert_close(out, model(x))
    assert sorted(set(_placements(executor, "inference"))) == [(0, 0), (1, 1)]
    assert strategy.stage("C").blocks == ("B", "C")


def test_annotations_do_nothing_outside_the_device_and_remove_blocks_unplaces():
    torch.manual_seed(0)
    model = Stack()
    poptorch.BeginBlock(model.layer[3], ipu_id=1)
    x = torch.rand((2, 5))
    plain = model(x)  # eager: no device, no effect
    poptorch.removeBlocks(model)
    assert not any(m._forward_pre_hooks for m in model.modules())
    executor, out = _infer(model, x, poptorch.Options())
    torch.testing.assert_close(out, plain)
    assert set(_placements(executor, "inference")) == {None}


def test_set_execution_strategy_accepts_only_strategies():
    opts = poptorch.Options()
    for bad in ("pipelined", poptorch.AutoStage.SameAsIpu, poptorch.Stage("A"), None, 1):
        with pytest.raises(poptorch.Error, match="setExecutionStrategy takes an execution strategy"):
            opts.setExecutionStrategy(bad)
    for good in (
        poptorch.PipelinedExecution(),
        poptorch.ShardedExecution(poptorch.AutoStage.AutoIncrement),
        poptorch.SerialPhasedExecution(poptorch.Phase("A")),
        poptorch.ParallelPhasedExecution([poptorch.Stage("A")]),
    ):
        assert opts.setExecutionStrategy(good) is opts
    assert "executionStrategy=ParallelPhasedExecution(Stage('A', stage=-1, ipu=None))" in repr(opts)
    assert repr(poptorch.PipelinedExecution()) == "PipelinedExecution(AutoStage.SameAsIpu)"


def test_annotation_errors_are_poptorchs():
    with pytest.raises(poptorch.Error, match="module is not an instance of torch.nn.Module or function."):
        poptorch.BeginBlock(3)
    layer = poptorch.BeginBlock(torch.nn.Linear(2, 2), ipu_id=0)
    with pytest.raises(poptorch.Error, match="module has already been assigned to a block."):
        poptorch.BeginBlock(layer, ipu_id=1)
    with pytest.raises(poptorch.Error, match="ipu_id 64 is beyond the device"):
        poptorch.Block(ipu_id=64)
    with pytest.raises(poptorch.Error, match="positive integer"):
        poptorch.BeginBlock(torch.nn.Linear(2, 2), ipu_id=-1)
    with pytest.raises(poptorch.Error, match="A associated with more than one stage"):
        poptorch.PipelinedExecution("A", poptorch.Stage("B", "A"))
    with pytest.raises(poptorch.Error, match="Phase contains 1 stages but you provided 2 ipus"):
        poptorch.Phase("A").ipus(0, 1)
    wrapped = poptorch.BeginBlock(lambda t: t * 2, ipu_id=1)
    assert torch.equal(wrapped(torch.ones(2)), torch.full((2,), 2.0))


def _staged(*ipus):
    """Linear layers, the i-th beginning a block on IPU ``ipus[i]``."""
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in ipus))
    for layer, ipu in zip(model, ipus):
        poptorch.BeginBlock(layer, ipu_id=ipu)
    return model


def _compile(model, opts, training=False):
    x = torch.rand((opts.device_iterations * opts.Training.gradient_accumulation * 2, 4))
    if training:
        executor = poptorch.trainingModel(_WithLoss(model), opts)
        executor.compile(x, torch.rand_like(x))
    else:
        executor = poptorch.inferenceModel(model, opts)
        executor.compile(x)
    return executor


class _WithLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        out = self.model(x)
        return out, torch.nn.functional.mse_loss(out, y)


def test_pipeline_errors_at_compile_time():
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.Error, match=r"gradientAccumulation\(2\) is too small for a pipeline of 2 stages"):
        _compile(_staged(0, 1), opts, training=True)
    with pytest.raises(poptorch.Error, match=r"deviceIterations\(1\) is too small for a pipeline of 2 stages"):
        _compile(_staged(0, 1), poptorch.Options())
    with pytest.raises(poptorch.Error, match="Pipeline stages out of order"):
        _compile(_staged(0, 1, 0), poptorch.Options().deviceIterations(4))
    with pytest.raises(poptorch.Error, match="uses 3 IPUs, but a device has a power of two IPUs"):
        _compile(_staged(0, 1, 2), poptorch.Options().deviceIterations(4))
    unnamed = torch.nn.Sequential(torch.nn.Linear(4, 4))
    poptorch.BeginBlock(unnamed[0])
    with pytest.raises(poptorch.Error, match="SameAsIpu was selected but no IPU was specified for block 0"):
        _compile(unnamed, poptorch.Options())
    strategy = poptorch.PipelinedExecution("A")
    with pytest.raises(poptorch.Error, match=r"Unknown Block '0' list of expected Blocks: \['A'\]"):
        _compile(_staged(0), poptorch.Options().setExecutionStrategy(strategy))
    late = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    poptorch.BeginBlock(late[1], "A", ipu_id=1)
    both = poptorch.PipelinedExecution(poptorch.Stage("A"))
    with pytest.raises(poptorch.Error, match=r"Pipeline stage 0 runs on IPUs \[0, 1\]"):
        _compile(late, poptorch.Options().setExecutionStrategy(both))


class _OpAfterBlock(torch.nn.Module):
    """PopTorch's missing-block case: an op after a ``with Block`` ended, before any other block (or, with
    ``Block.start``, an op in the block begun last)."""

    def __init__(self, scoped):
        super().__init__()
        self.scoped = scoped

    def forward(self, x):
        poptorch.Block.useAutoId()
        if self.scoped:
            with poptorch.Block(ipu_id=0):
                x = x * 4
        else:
            poptorch.Block.start(ipu_id=0)
            x = x * 4
        return x * 4


def test_an_op_after_a_with_block_ended_has_no_active_block():
    opts = poptorch.Options().deviceIterations(2)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    with pytest.raises(poptorch.Error, match="No active Block for aten.mul.Tensor.*block '0' ended") as info:
        _compile(_OpAfterBlock(scoped=True), opts)
    assert "return x * 4" in info.value.location
    # Block.start (like BeginBlock) lasts until the next block begins: the same op runs in block "0".
    started, x = _OpAfterBlock(scoped=False), torch.rand(4, 4)
    executor, out = _infer(started, x, poptorch.Options().deviceIterations(2))
    torch.testing.assert_close(out, x * 16)
    assert set(_placements(executor, "inference")) == {(0, 0)}


def test_auto_stages_and_auto_rounding():
    # Example 3 of the user guide: non-consecutive stages on one IPU, numbered in order by AutoIncrement.
    opts = poptorch.Options().deviceIterations(4)
    opts.setExecutionStrategy(poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement))
    executor = _compile(_staged(0, 1, 0), opts)
    assert sorted(set(_placements(executor, "inference"))) == [(1, 0), (2, 1), (3, 0)]
    sharded = _compile(_staged(0, 1, 0), poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution()))
    assert sorted(set(_placements(sharded, "inference"))) == [(0, 0), (1, 1)]
    rounded = _compile(_staged(0, 1, 2), poptorch.Options().deviceIterations(4).autoRoundNumIPUs(True))
    assert rounded._exe.target.num_ipus == 4


class SixBlocks(torch.nn.Module):
    """The user guide's phased examples: six layers, each in its own block."""

    def __init__(self, names):
        super().__init__()
        self.names = names
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in names)

    def forward(self, x):
        poptorch.Block.useAutoId()
        for name, layer in zip(self.names, self.layers):
            with poptorch.Block(name):
                x = torch.relu(layer(x))
        return x


def _phased(names, strategy, *ipus):
    for phase, pair in enumerate(ipus):
        strategy.phase(phase).ipus(*pair)
    torch.manual_seed(0)
    model = SixBlocks(names)
    x = torch.rand((2, 4))
    executor, out = _infer(model, x, poptorch.Options().setExecutionStrategy(strategy))
    torch.testing.assert_close(out, model(x))
    return sorted(set(_placements(executor, "inference")))


def test_the_guides_phased_examples_run_each_phase_on_its_ipus():
    stages = [poptorch.Phase(poptorch.Stage(a), poptorch.Stage(b)) for a, b in (("A", "A2"), ("B", "B2"), ("C", "C2"))]
    serial = poptorch.SerialPhasedExecution(*stages)
    names = ["A", "A2", "B", "B2", "C", "C2"]
    assert _phased(names, serial, (0, 1), (0, 1), (0, 1)) == [(p, i) for p in range(3) for i in range(2)]
    parallel = poptorch.ParallelPhasedExecution(
        *(poptorch.Phase(poptorch.Stage(str(2 * p)), poptorch.Stage(str(2 * p + 1))) for p in range(3))
    )
    placed = _phased([None] * 6, parallel, (0, 2), (1, 3), (0, 2))
    assert placed == [(0, 0), (0, 2), (1, 1), (1, 3), (2, 0), (2, 2)]


class _Prelude(torch.nn.Module):
    """An op before the first block (as GPT-2's input_ids reshape), then linear layers, the i-th beginning a
    block on IPU ``ipus[i]``."""

    def __init__(self, *ipus):
        super().__init__()
        self.layers = _staged(*ipus)

    def forward(self, x):
        return self.layers(x * 2.0)


def _stages(executor, program):
    return sorted({stage for stage, _ in _placements(executor, program)})


@pytest.mark.parametrize(
    ("auto_stage", "ipus", "stages"),
    [
        # PopTorch numbers AutoIncrement blocks from stage 1: ops before the first block run in stage 0 on IPU 0
        # and PopART merges each stage into the one before it on the same IPU.
        (poptorch.AutoStage.AutoIncrement, (0, 1, 0), [0, 1, 2]),
        (poptorch.AutoStage.AutoIncrement, (0, 0, 1), [0, 1]),
        (poptorch.AutoStage.AutoIncrement, (1, 0), [0, 1, 2]),
        (poptorch.AutoStage.SameAsIpu, (0, 1), [0, 1]),
        (poptorch.AutoStage.SameAsIpu, (1,), [0, 1]),
    ],
)
def test_ops_before_the_first_block_join_a_first_block_on_ipu_0(auto_stage, ipus, stages):
    strategy = poptorch.PipelinedExecution(auto_stage)
    needed = 2 * len(stages) - 1  # pipelined training fills 2 x stages - 1 micro-batches
    opts = poptorch.Options().setExecutionStrategy(strategy).autoRoundNumIPUs(True)
    opts.Training.gradientAccumulation(needed - 1)
    with pytest.raises(poptorch.Error, match=rf"\({needed - 1}\) is too small for a pipeline of {len(stages)} stages"):
        _compile(_Prelude(*ipus), opts, training=True)
    torch.manual_seed(0)
    model = _Prelude(*ipus)
    opts = poptorch.Options().setExecutionStrategy(strategy).autoRoundNumIPUs(True)
    opts.Training.gradientAccumulation(needed)
    executor = _compile(model, opts, training=True)
    assert _stages(executor, "accumulate") == stages
    inference = _compile(_Prelude(*ipus), poptorch.Options().setExecutionStrategy(strategy).deviceIterations(4))
    assert _stages(inference, "inference") == stages
