"""Zoo models split over several simulated IPUs the way PopTorch users split them: layers wrapped with
``BeginBlock`` after construction (embeddings on IPU 0, the head on the last IPU), pipelined with gradient
accumulation, sharded, in phases or replicated, with recomputation checkpoints at layer outputs. Each trains
for 3 calls equal to eager PyTorch (gradients accumulated over the same micro-batches) and to the same model
on one IPU, call by call: the loss, every parameter and every buffer; the profile shows work on every IPU.
Also: GPT-2's LM head tied to its token embedding on another IPU, dropout's masks wherever it runs, a split
model's inferenceModel after training, and a model out of tile memory on one IPU that trains on two.

The simulated IPUs are small (16 tiles) so each case compiles and runs in seconds."""

import copy
from dataclasses import dataclass

import pytest
import torch
from equivalence import OPTIMIZERS, STEPS, TOLERANCE
from zoo import BERT_LIKE, CLASSES, SEQ, VOCAB, build

import popsim
import poptorch

pytest.importorskip("transformers")

MICRO = 2  # micro-batch size
SMALL = popsim.Target.small(num_tiles=16)


@pytest.fixture(autouse=True)
def small_ipus(monkeypatch):
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: SMALL)


@dataclass
class Run:
    """What one training call left behind: the loss it returned and the weights after it."""

    loss: torch.Tensor
    parameters: dict
    buffers: dict


def _snapshot(model, loss):
    return Run(
        loss.detach().clone(),
        {n: p.detach().clone() for n, p in model.named_parameters()},
        {n: b.detach().clone() for n, b in model.named_buffers()},
    )


def _micro_batches(batch, count):
    """``batch`` ({name: tensor} of count x MICRO rows) as ``count`` micro-batches, in order."""
    return [{k: v[i * MICRO : (i + 1) * MICRO] for k, v in batch.items()} for i in range(count)]


def train_eager(model, optimizer, loss_of, batches, accumulation, iterations):
    """Eager torch as PopTorch trains: each call runs ``iterations`` optimizer steps, each on the mean gradient
    of ``accumulation`` micro-batches; the call's loss is its last micro-batch's, before the last update."""
    model.train()
    opt = OPTIMIZERS[optimizer](model.parameters())
    runs = []
    for batch in batches:
        micro = iter(_micro_batches(batch, accumulation * iterations))
        for _ in range(iterations):
            opt.zero_grad()
            for _ in range(accumulation):
                loss = loss_of(model(**next(micro)))
                (loss / accumulation).backward()
            opt.step()
        runs.append(_snapshot(model, loss))
    return runs


def train_on_ipus(model, optimizer, loss_of, batches, opts, inspect=None):
    """trainingModel with ``opts`` called once per batch; its runs. ``inspect(executor)`` runs after the last
    call, before the executor is destroyed."""
    trained = poptorch.trainingModel(model, opts, OPTIMIZERS[optimizer](model.parameters()))
    try:
        runs = [_snapshot(model, loss_of(trained(**batch))) for batch in batches]
        if inspect is not None:
            inspect(trained)
    finally:
        trained.destroy()
    return runs


def assert_same_runs(got, expected, optimizer, what):
    rtol, atol = TOLERANCE[optimizer]
    for call, (run, ref) in enumerate(zip(got, expected, strict=True)):
        assert run.parameters.keys() == ref.parameters.keys() and run.buffers.keys() == ref.buffers.keys()
        pairs = [("loss", run.loss, ref.loss)]
        pairs += [(f"parameter {n}", p, ref.parameters[n]) for n, p in run.parameters.items()]
        pairs += [(f"buffer {n}", b, ref.buffers[n]) for n, b in run.buffers.items()]
        for name, actual, expect in pairs:
            message = f"{what}, {name} after call {call}"
            torch.testing.assert_close(actual, expect, rtol=rtol, atol=atol, msg=lambda m, s=message: f"{s}: {m}")


def assert_every_ipu_works(trained, ipus):
    """The profile places steps on each of the ``ipus`` IPUs, and each IPU's tiles compute."""
    program = trained.profile.programs["accumulate"]
    assert {s["ipu"] for s in program["steps"] if "ipu" in s} == set(range(ipus))
    busy = [c > 0 for c in program["tile_compute_cycles"]]
    tiles = len(busy) // ipus
    assert len(busy) == tiles * ipus and all(any(busy[i * tiles : (i + 1) * tiles]) for i in range(ipus))


# -- the models' combined batches (distinct micro-batches, so a micro-batch trained twice or skipped fails) --
def _generator(call):
    return torch.Generator().manual_seed(100 + call)


def _text(rows, call):
    g = _generator(call)
    ids = torch.randint(3, VOCAB, (rows, SEQ), generator=g)
    # Each sequence has its own length (1 to SEQ tokens), so a micro-batch read with another's mask fails.
    lengths = torch.randint(1, SEQ + 1, (rows, 1), generator=g)
    mask = (torch.arange(SEQ) < lengths).long()
    return ids, mask, g


def bert_batch(rows, call):
    ids, mask, g = _text(rows, call)
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, CLASSES, (rows,), generator=g)}


def gpt2_batch(rows, call):
    ids, _, _ = _text(rows, call)
    return {"input_ids": ids, "labels": ids}


def resnet_batch(rows, call):
    g = _generator(call)
    return {"x": torch.randn(rows, 3, 16, 16, generator=g), "labels": torch.randint(0, CLASSES, (rows,), generator=g)}


def unet_batch(rows, call):
    g = _generator(call)
    target = (torch.rand(rows, 1, 8, 8, generator=g) > 0.5).float()
    return {"x": torch.randn(rows, 3, 8, 8, generator=g), "target": target}


# -- how users split each model ---------------------------------------------------------------------------------
def _layer_ipu(i, count, ipus):
    """The IPU of layer ``i`` of ``count``: spread over the IPUs between the embeddings' (IPU 0) and the
    head's (the last), or over both of 2 IPUs."""
    if ipus > 2:
        return 1 + i * (ipus - 2) // count
    return i * ipus // count


def split_bert(model, ipus):
    """Embeddings on IPU 0, the encoder layers spread over the IPUs in between, pooler and classifier last."""
    bert = model.bert
    bert.embeddings = poptorch.BeginBlock(bert.embeddings, "embeddings", ipu_id=0)
    layers = bert.encoder.layer
    for i, layer in enumerate(layers):
        layers[i] = poptorch.BeginBlock(layer, f"layer{i}", ipu_id=_layer_ipu(i, len(layers), ipus))
    bert.pooler = poptorch.BeginBlock(bert.pooler, "pooler", ipu_id=ipus - 1)


def checkpoint_layer_outputs(layers):
    """A recomputation checkpoint at each layer's output, as PopTorch users put it with a forward hook."""
    for layer in layers:
        layer.register_forward_hook(lambda module, inputs, output: poptorch.recomputationCheckpoint(output))


def _options(accumulation, iterations=1, strategy=None):
    opts = poptorch.Options().deviceIterations(iterations)
    opts.Training.gradientAccumulation(accumulation)
    if strategy is not None:
        opts.setExecutionStrategy(strategy)
    return opts


_REFERENCES = {}


@dataclass
class Setup:
    """A zoo model, its combined batch, its split over IPUs and the options of the multi-IPU run."""

    name: str
    batch: object
    split: object
    accumulation: int
    iterations: int = 1
    optimizer: str = "sgd"

    def batches(self):
        rows = MICRO * self.accumulation * self.iterations
        return [self.batch(rows, call) for call in range(STEPS)]

    def fresh(self):
        case = build(self.name)
        return case.model, case.loss_of

    def reference(self):
        """The eager runs and the single-IPU runs of the unsplit model (computed once per test module: setups
        that differ only in their split share them)."""
        key = (self.name, self.batch, self.accumulation, self.iterations, self.optimizer)
        if key not in _REFERENCES:
            model, loss_of = self.fresh()
            ga, di = self.accumulation, self.iterations
            eager = train_eager(copy.deepcopy(model), self.optimizer, loss_of, self.batches(), ga, di)
            _REFERENCES[key] = eager, train_on_ipus(model, self.optimizer, loss_of, self.batches(), _options(ga, di))
        return _REFERENCES[key]

    def check(self, ipus, opts, inspect=None):
        """Trains the model split over ``ipus`` IPUs with ``opts``: equal to eager and to one IPU, every IPU
        busy; ``inspect(executor)`` checks more before it is destroyed."""
        eager, single = self.reference()
        model, loss_of = self.fresh()
        self.split(model, ipus)

        def inspect_all(trained):
            assert_every_ipu_works(trained, ipus)
            if inspect is not None:
                inspect(trained)

        runs = train_on_ipus(model, self.optimizer, loss_of, self.batches(), opts, inspect_all)
        assert_same_runs(runs, eager, self.optimizer, f"{self.name} on {ipus} IPUs against eager")
        assert_same_runs(runs, single, self.optimizer, f"{self.name} on {ipus} IPUs against one IPU")


BERT = Setup("bert", bert_batch, split_bert, accumulation=8)


@pytest.mark.parametrize("ipus", [2, 4])
def test_bert_pipelined_trains_as_eager_and_as_on_one_ipu(ipus):
    def pipelined(trained):
        stages = trained.profile.programs["accumulate"]["schedule"]["stages"]
        assert sorted(s["ipu"] for s in stages.values()) == list(range(ipus))

    BERT.check(ipus, _options(BERT.accumulation), pipelined)


def test_bert_pipelined_over_4_ipus_returns_every_micro_batchs_outputs_in_order():
    """OutputMode.All: the last stage's logits and losses of the 8 micro-batches in flight come back in the
    order of the batch, each from the weights before the step's update."""
    model, loss_of = BERT.fresh()
    eager = copy.deepcopy(model)
    split_bert(model, 4)
    opts = _options(BERT.accumulation).outputMode(poptorch.OutputMode.All)
    batch = BERT.batches()[0]
    trained = poptorch.trainingModel(model, opts, OPTIMIZERS["sgd"](model.parameters()))
    try:
        out = trained(**batch)
    finally:
        trained.destroy()
    with torch.no_grad():
        expected = [eager(**micro) for micro in _micro_batches(batch, BERT.accumulation)]
    rtol, atol = TOLERANCE["sgd"]
    torch.testing.assert_close(out.logits, torch.cat([e.logits for e in expected]), rtol=rtol, atol=atol)
    torch.testing.assert_close(out.loss, torch.stack([loss_of(e) for e in expected]), rtol=rtol, atol=atol)


def split_gpt2(model, ipus):
    """The token and position embeddings on IPU 0, the decoder layers spread over the IPUs, the LM head (its
    weight is the token embedding's: tied) on the last IPU."""
    transformer = model.transformer
    transformer.wte = poptorch.BeginBlock(transformer.wte, "embeddings", ipu_id=0)
    layers = transformer.h
    for i, layer in enumerate(layers):
        layers[i] = poptorch.BeginBlock(layer, f"layer{i}", ipu_id=_layer_ipu(i, len(layers), ipus))
    model.lm_head = poptorch.BeginBlock(model.lm_head, "lm_head", ipu_id=ipus - 1)


GPT2 = Setup("gpt2", gpt2_batch, split_gpt2, accumulation=10)


@pytest.mark.parametrize("ipus", [2, 4])
def test_gpt2_with_its_tied_lm_head_on_the_last_ipu_trains_as_eager(ipus):
    """As in PopART, the tied weight lives once, on the IPU of its first reader (the embedding's, IPU 0), and
    crosses to the head's IPU by an inter-IPU copy; both readers' gradients train it."""

    def tied(trained):
        assert trained.lm_head.weight is trained.transformer.wte.weight
        tiles = trained._exe._vars["transformer.wte.weight"].mapping.tiles
        assert tiles.max() < SMALL.num_tiles  # IPU 0's tiles only

    GPT2.check(ipus, _options(GPT2.accumulation), inspect=tied)


def split_gpt2_head_with_embeddings(model, ipus):
    """The split Hugging Face's optimum-graphcore uses for GPT-2: the LM head back on IPU 0 beside the token
    embedding it is tied to, the layers on the other IPUs (stages numbered in the order they run)."""
    transformer = model.transformer
    transformer.wte = poptorch.BeginBlock(transformer.wte, "embeddings", ipu_id=0)
    layers = transformer.h
    for i, layer in enumerate(layers):
        layers[i] = poptorch.BeginBlock(layer, f"layer{i}", ipu_id=1 + i * (ipus - 1) // len(layers))
    model.lm_head = poptorch.BeginBlock(model.lm_head, "lm_head", ipu_id=0)


def test_gpt2_with_its_lm_head_back_on_ipu_0_trains_as_eager():
    setup = Setup("gpt2", gpt2_batch, split_gpt2_head_with_embeddings, GPT2.accumulation)
    strategy = poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)

    def last_stage_on_ipu_0(trained):
        stages = trained.profile.programs["accumulate"]["schedule"]["stages"]
        ipus = [s["ipu"] for _, s in sorted(stages.items(), key=lambda item: int(item[0]))]
        assert ipus[-1] == 0 and 1 in ipus

    setup.check(2, _options(setup.accumulation, strategy=strategy), inspect=last_stage_on_ipu_0)


def split_resnet(model, ipus):
    """The stem and the first stages on IPU 0, the later stages (their BatchNorm statistics too) and the head
    on the last IPU."""
    stages = model.stages
    for i in range(1, ipus):
        at = i * len(stages) // ipus
        stages[at] = poptorch.BeginBlock(stages[at], f"stages{at}", ipu_id=i)


# One call of GA micro-batches: BatchNorm over micro-batches of 2 small images amplifies rounding so much that
# float32 eager itself drifts from float64 eager by ~1e-3 within 6 steps.
RESNET = Setup("resnet18", resnet_batch, split_resnet, accumulation=4)


@pytest.mark.parametrize("strategy", [poptorch.ShardedExecution, poptorch.PipelinedExecution])
def test_resnet_over_two_ipus_trains_as_eager_with_its_batchnorm_statistics(strategy):
    def scheduled(trained):
        assert ("schedule" in trained.profile.programs["accumulate"]) == (strategy is poptorch.PipelinedExecution)

    RESNET.check(2, _options(RESNET.accumulation, strategy=strategy()), inspect=scheduled)


def split_unet(model, ipus):
    """The encoder on IPU 0, the bottom and the decoder on IPU 1: both skip connections cross the IPUs."""
    model.bottom = poptorch.BeginBlock(model.bottom, "bottom", ipu_id=1)


def test_unet_pipelined_with_its_skip_connections_across_ipus_trains_as_eager_with_adamw():
    setup = Setup("unet", unet_batch, split_unet, accumulation=4, optimizer="adamw")
    setup.check(2, _options(setup.accumulation))


RECOMPUTE_PIPELINE = 3  # popart.RecomputationType.Pipeline


def _split_and_checkpoint(model, ipus):
    split_bert(model, ipus)
    checkpoint_layer_outputs(model.bert.encoder.layer)


def _backward_steps(trained):
    """(module, op) of the accumulate program's backward-pass steps, recomputed forward ops included."""
    origins = [s.get("origin") or {} for s in trained.profile.programs["accumulate"]["steps"]]
    return {(o.get("module") or "", o["op"]) for o in origins if o.get("role") == "backward"}


def test_bert_pipelined_with_recomputation_checkpoints_at_layer_outputs_trains_as_eager():
    setup = Setup("bert", bert_batch, _split_and_checkpoint, BERT.accumulation)
    opts = _options(setup.accumulation).setAvailableMemoryProportion({"IPU0": 0.3, "IPU1": 0.3})
    opts._Popart.set("autoRecomputation", RECOMPUTE_PIPELINE)

    def recomputes(trained):
        # The backward pass runs forward ops again: the embedding lookup and the attention's exponentials
        # (their own gradients need neither).
        backward = _backward_steps(trained)
        assert ("bert.embeddings.word_embeddings", "gather") in backward
        assert ("bert.encoder.layer.0.attention.self", "exp") in backward

    setup.check(2, opts, recomputes)


def _bert_with_dropout():
    torch.manual_seed(0)
    transformers = pytest.importorskip("transformers")
    config = {**BERT_LIKE, "hidden_dropout_prob": 0.2, "attention_probs_dropout_prob": 0.2}
    return transformers.BertForSequenceClassification(transformers.BertConfig(**config, num_labels=CLASSES))


def test_bert_with_dropout_draws_the_same_masks_split_and_recomputed_as_on_one_ipu():
    """The IPU's random numbers are not torch's, but they do not depend on where an op runs: a dropout
    recomputed in the backward pass, or run on another IPU, draws the mask its forward pass drew (two
    optimizer steps per call: each draws fresh masks alike)."""
    batches = [bert_batch(MICRO * BERT.accumulation, call) for call in range(2)]

    def train(ipus):
        model = _bert_with_dropout()
        opts = _options(BERT.accumulation // 2, iterations=2).randomSeed(7).outputMode(poptorch.OutputMode.All)
        if ipus > 1:
            _split_and_checkpoint(model, ipus)
            opts._Popart.set("autoRecomputation", RECOMPUTE_PIPELINE)
        return train_on_ipus(model, "sgd", lambda out: out.loss, batches, opts)

    one = train(1)
    assert_same_runs(train(2), one, "sgd", "BERT with dropout on 2 IPUs against one IPU")
    # Dropout did drop: the first micro-batch's loss (before any update) is not eager's without dropout.
    assert one[0].loss.shape == (BERT.accumulation,)
    model = _bert_with_dropout().eval()
    with torch.no_grad():
        without = model(**_micro_batches(batches[0], 1)[0]).loss
    assert not torch.allclose(one[0].loss[0], without, rtol=1e-3, atol=1e-4)


def test_bert_pipelined_inference_sees_the_pipelined_training_and_equals_eager():
    """Train then validate, as users do: an inferenceModel of the split model (pipelined over device
    iterations) shares the trainingModel's weights, so after one training call its logits are eager's with
    eager's weights after that call."""
    eager, _ = BERT.reference()
    model, _ = BERT.fresh()
    split_bert(model, 2)
    trained = poptorch.trainingModel(model, _options(BERT.accumulation), OPTIMIZERS["sgd"](model.parameters()))
    validation = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
    inputs = {k: v for k, v in bert_batch(MICRO * 2, STEPS).items() if k != "labels"}
    try:
        trained(**BERT.batches()[0])
        logits = validation(**inputs).logits
        stages = validation.profile.programs["inference"]["schedule"]["stages"]
        assert sorted(s["ipu"] for s in stages.values()) == [0, 1]
    finally:
        trained.destroy()
        validation.destroy()
    reference, _ = BERT.fresh()
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            parameter.copy_(eager[0].parameters[name])
        expected = reference.eval()(**inputs).logits
    torch.testing.assert_close(logits, expected, rtol=TOLERANCE["inference"][0], atol=TOLERANCE["inference"][1])


def test_bert_pipelined_over_2_ipus_and_replicated_twice_trains_as_eager():
    """2 replicas x gradient accumulation 4 reduce the mean gradient of the same 8 micro-batches as one
    replica accumulating 8: the weights equal eager's and the one-IPU run's (the profile shows one replica's
    2 IPUs); each replica returns its last micro-batch's loss, the second replica's being eager's last."""
    eager, single = BERT.reference()
    model, loss_of = BERT.fresh()
    split_bert(model, 2)
    opts = _options(BERT.accumulation // 2).replicationFactor(2)
    runs = train_on_ipus(model, BERT.optimizer, loss_of, BERT.batches(), opts, lambda t: assert_every_ipu_works(t, 2))
    assert all(run.loss.shape == (2,) for run in runs)
    last = [Run(run.loss[-1], run.parameters, run.buffers) for run in runs]
    assert_same_runs(last, eager, BERT.optimizer, "replicated BERT on 2 IPUs against eager")
    assert_same_runs(last, single, BERT.optimizer, "replicated BERT on 2 IPUs against one IPU")


def test_bert_in_serial_phases_trains_as_eager():
    strategy = poptorch.SerialPhasedExecution(
        poptorch.Phase("embeddings", "layer0"), poptorch.Phase("layer1", "pooler")
    )
    BERT.check(2, _options(BERT.accumulation, strategy=strategy))


def test_bert_out_of_tile_memory_on_one_ipu_trains_split_over_two_with_recomputation(monkeypatch):
    # IPUs of 4 tiles x 90 KiB: BERT's weights, their gradient accumulators and its activations overflow one
    # IPU's tiles (by ~20%); split over two they fit once each stage recomputes its activations instead of
    # stashing them for the micro-batches in flight (~10% over without, ~10% under with recomputation).
    eager, _ = BERT.reference()  # on the 16-tile IPUs, before the small ones replace them
    tight = popsim.Target.small(num_tiles=4, tile_bytes=90 * 1024)
    monkeypatch.setattr(poptorch._device, "target_of", lambda options: tight)

    def train(split, recomputation=0, inspect=None):
        model, loss_of = BERT.fresh()
        split(model, 2)
        opts = _options(BERT.accumulation)
        opts._Popart.set("autoRecomputation", recomputation)
        return train_on_ipus(model, BERT.optimizer, loss_of, BERT.batches(), opts, inspect)

    with pytest.raises(poptorch.Error, match="Out of memory on the simulated IPU: out of memory on tile"):
        train(lambda model, ipus: None)
    with pytest.raises(poptorch.Error, match="a pipeline of 2 stages keeps up to 3 micro-batches in flight"):
        train(split_bert)

    def fits(trained):
        assert trained.profile.programs["accumulate"]["memory_max_tile_bytes"] <= tight.tile_bytes

    runs = train(_split_and_checkpoint, RECOMPUTE_PIPELINE, fits)
    assert_same_runs(runs, eager, BERT.optimizer, "BERT on 2 small IPUs against eager")


def test_bert_pipelined_clips_gradients_by_their_global_norm_over_both_ipus():
    """poptorch.optim.SGD(max_grad_norm=...) clips by the norm of every gradient, wherever its stage runs,
    as torch.nn.utils.clip_grad_norm_ does on the whole model."""
    max_norm, lr = 0.05, 0.05
    model, loss_of = BERT.fresh()
    eager = copy.deepcopy(model)
    split_bert(model, 2)
    trained = poptorch.trainingModel(
        model, _options(BERT.accumulation), poptorch.optim.SGD(model.parameters(), lr=lr, max_grad_norm=max_norm)
    )
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=lr)
    runs, expected = [], []
    try:
        for batch in BERT.batches()[:2]:
            runs.append(_snapshot(model, loss_of(trained(**batch))))
            eager_optimizer.zero_grad()
            for micro in _micro_batches(batch, BERT.accumulation):
                loss = loss_of(eager(**micro))
                (loss / BERT.accumulation).backward()
            assert torch.nn.utils.clip_grad_norm_(eager.parameters(), max_norm) > 2 * max_norm  # it does clip
            eager_optimizer.step()
            expected.append(_snapshot(eager, loss))
    finally:
        trained.destroy()
    assert_same_runs(runs, expected, "sgd", "clipped BERT on 2 IPUs against eager")
