"""The model zoo (tests/models/zoo.py) on the simulated IPU against eager PyTorch, one model per process,
after issue 17's compile-time table.

The compile table: for the tutorial CNN (batch 16), one nn.TransformerEncoderLayer(128, 4, 256) (batch 8 x 64
tokens), the small ResNet of bench/conv_direct.py (batch 8 of 32x32) and a 2-layer BERT-tiny (hidden 128, 2
heads, FFN 512, vocabulary 1024, batch 2 x 64 tokens), the CPU and wall time of the training model's first
call (capture, compile and one step): the first in a fresh process, then the median of ``COMPILE_ROUNDS``
more, each of a fresh model (CPU time is the steadier figure on a shared machine).
``--compile-only`` prints just that table; ``--compile-model NAME`` one row of it, in this process.

For the compile table's models and every zoo model: compile time of the training model (first call), its step
time, the ratio to eager's training step (SGD) measured interleaved in one process (median of the per-round
ratios), and the peak RSS of the process that ran both. Eager torch gets as many threads as the simulator
(POPSIM_NUM_THREADS, default every core): on a busy machine torch's spinning worker threads otherwise slow
eager's small ops 50-fold.
``--model NAME`` runs one model and prints its row; without it every model
runs in a fresh process of its own, so each peak RSS is that model's.

Peak RSS against eager (issue 17: at most 2x), for the compile table's models: the peak RSS of a fresh
process that trains the model ``RSS_STEPS`` steps on the simulator, and of a fresh process doing the same in
eager PyTorch that never imports poptorch or popsim (``peak_rss.py``), and their ratio.

Inference rows (``--inference NAME``): the MLP 784-256-256-10 (batch 64) against eager, and the small ResNet
in float16 against the same model in float32, both on the simulator (host step time; issue 17: within 1.2x).
"""

import argparse
import copy
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

import torch

import poptorch

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent / "tests" / "models"), str(_HERE.parent / "examples"), str(_HERE)]
from compile_scaling import Encoder  # noqa: E402
from conv_direct import SmallResNet  # noqa: E402
from train_digits import ClassificationModel, ModelWithLoss  # noqa: E402
from zoo import ZOO, Case, build  # noqa: E402

ROUNDS = 7
STEPS_PER_ROUND = 3
LR = 0.01
COMPILE_ROUNDS = 3
RSS_STEPS = 5
COMPILE_HEADER = f"{'model':<13} {'first CPU s':>11} {'first wall s':>12} {'CPU s':>7} {'wall s':>7}"
HEADER = f"{'model':<13} {'compile s':>9} {'step ms':>9} {'eager ms':>9} {'ratio':>7} {'peak RSS MiB':>12}"
RSS_HEADER = f"{'model':<13} {'sim peak MiB':>12} {'eager peak MiB':>14} {'ratio':>7}"
INFERENCE_HEADER = f"{'inference':<13} {'compile s':>9} {'step ms':>9} {'against':<18} {'its ms':>9} {'ratio':>7}"


class BertTiny(torch.nn.Module):
    """BERT-tiny's shape (2 layers, hidden 128, 2 heads, FFN 512) classifying sequences; dropout off."""

    def __init__(self):
        super().__init__()
        import transformers

        config = transformers.BertConfig(
            vocab_size=1024,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=512,
            max_position_embeddings=128,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=2,
        )
        self.bert = transformers.BertForSequenceClassification(config)

    def forward(self, ids, labels):
        out = self.bert(input_ids=ids, labels=labels)
        return out.logits, out.loss


COMPILE_MODELS = {  # name -> (model, training call's arguments)
    "tutorial-cnn": lambda: (
        ModelWithLoss(ClassificationModel(), torch.nn.NLLLoss()),
        (torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))),
    ),
    "encoder": lambda: (Encoder(1), (torch.randn(8, 64, 128), torch.randn(8, 64, 128))),
    "small-resnet": lambda: (SmallResNet(), (torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))),
    "bert-tiny": lambda: (BertTiny(), (torch.randint(0, 1024, (2, 64)), torch.randint(0, 2, (2,)))),
}


def _first_call(name):
    """(CPU s, wall s) of the first call of a fresh training model ``name``."""
    torch.manual_seed(0)
    model, args = COMPILE_MODELS[name]()
    options = poptorch.Options().showCompilationProgressBar(False)
    training = poptorch.trainingModel(model.train(), options, torch.optim.SGD(model.parameters(), lr=LR))
    start, start_cpu = time.perf_counter(), time.process_time()
    training(*args)
    cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start
    training.detachFromDevice()
    return cpu, wall


def compile_row(name):
    """The compile-table row of model ``name``: its first call in this process, then the median of more."""
    first = _first_call(name)
    rest = [_first_call(name) for _ in range(COMPILE_ROUNDS)]
    cpu, wall = (statistics.median(r[i] for r in rest) for i in range(2))
    return f"{name:<13} {first[0]:11.2f} {first[1]:12.2f} {cpu:7.2f} {wall:7.2f}"


def _each_in_a_process(flag, names):
    """Run this script with ``flag NAME`` for every name; the names whose run failed."""
    return [n for n in names if subprocess.run([sys.executable, __file__, flag, n]).returncode]


def threads():
    """Eager torch's thread count: as many as the simulator's engine (POPSIM_NUM_THREADS, default every core)."""
    return int(os.environ.get("POPSIM_NUM_THREADS", os.cpu_count()))


def _timed(fn):
    start = time.perf_counter()
    for _ in range(STEPS_PER_ROUND):
        fn()
    return (time.perf_counter() - start) / STEPS_PER_ROUND


def _case(name):
    """The zoo's case ``name``, or a compile-table model as one (its output's second item is the loss)."""
    if name in ZOO:
        return build(name)
    model, args = COMPILE_MODELS[name]()
    return Case(model, args, loss_of=lambda out: out[1])


def training_steps(name, options):
    """(the training model, its step, eager's step) of model ``name``: SGD at ``LR`` on both, from the same
    weights; the first simulated step compiles."""
    torch.manual_seed(0)
    case = _case(name)
    model = case.model.train()
    eager = copy.deepcopy(model)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=LR)
    training = poptorch.trainingModel(model, options, torch.optim.SGD(model.parameters(), lr=LR))

    def sim_step():
        training(*case.args, **case.kwargs)

    def eager_step():
        eager_optimizer.zero_grad()
        case.loss_of(eager(*case.args, **case.kwargs)).backward()
        eager_optimizer.step()

    return training, sim_step, eager_step


def row(name):
    """Compile and time model ``name`` (of the zoo or the compile table); its table row."""
    training, sim_step, eager_step = training_steps(name, poptorch.Options())
    compile_s = _seconds(sim_step)
    sim, eager_ms, ratio = _interleaved(sim_step, eager_step)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return f"{name:<13} {compile_s:9.2f} {sim:9.2f} {eager_ms:9.2f} {ratio:7.2f} {rss:12.0f}"


def _seconds(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _interleaved(step, other):
    """(ms of ``step``, ms of ``other``, median of the per-round ratios), both warmed up first."""
    step()
    other()
    times, other_times = [], []
    for _ in range(ROUNDS):  # alternating rounds: a slow spell of the machine hits both sides alike
        other_times.append(_timed(other))
        times.append(_timed(step))
    ratio = statistics.median(s / o for s, o in zip(times, other_times))
    return statistics.median(times) * 1e3, statistics.median(other_times) * 1e3, ratio


def rss_row(name):
    """Peak RSS of training model ``name`` on the simulator and in eager PyTorch, each in a fresh process."""
    script = str(_HERE / "peak_rss.py")
    sim, eager = (float(subprocess.check_output([sys.executable, script, side, name])) for side in ("sim", "eager"))
    return f"{name:<13} {sim:12.0f} {eager:14.0f} {sim / eager:7.2f}"


def _mlp():
    """Issue 17's MLP 784-256-256-10 and a batch of 64."""
    layers = [torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 10)), torch.randn(64, 784)


def _small_resnet():
    """The small ResNet's layers (without its loss) and a batch of 8 of 32x32."""
    return SmallResNet().net, torch.randn(8, 3, 32, 32)


INFERENCE_MODELS = {"mlp": _mlp, "resnet-float16": _small_resnet}


def _inference(model, x):
    """(compile s, one inference step) of ``model`` on the simulator."""
    options = poptorch.Options().showCompilationProgressBar(False)
    inference = poptorch.inferenceModel(model.eval(), options)
    return _seconds(lambda: inference(x)), lambda: inference(x)


def inference_row(name):
    """The MLP's inference step against eager's; the small ResNet's in float16 against its own in float32."""
    torch.manual_seed(0)
    model, x = INFERENCE_MODELS[name]()
    if name == "mlp":
        against = "eager float32"
        compile_s, step = _inference(model, x)

        def other():
            with torch.no_grad():
                model(x)

    else:
        against = "simulator float32"
        compile_s, step = _inference(copy.deepcopy(model).half(), x.half())
        _, other = _inference(model, x)
    ms, other_ms, ratio = _interleaved(step, other)
    return f"{name:<13} {compile_s:9.2f} {ms:9.2f} {against:<18} {other_ms:9.2f} {ratio:7.2f}"


def main():
    torch.set_num_threads(threads())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted({*ZOO, *COMPILE_MODELS}), help="run this model only, here")
    parser.add_argument("--compile-model", choices=sorted(COMPILE_MODELS), help="one compile-table row, here")
    parser.add_argument("--compile-only", action="store_true", help="print the compile table only")
    parser.add_argument("--rss", choices=sorted(COMPILE_MODELS), help="one peak-RSS row (its own processes)")
    parser.add_argument("--inference", choices=sorted(INFERENCE_MODELS), help="one inference row, here")
    args, _ = parser.parse_known_args()
    one = {"model": row, "compile_model": compile_row, "rss": rss_row, "inference": inference_row}
    for option, make_row in one.items():
        if getattr(args, option):
            print(make_row(getattr(args, option)), flush=True)
            return 0
    print(COMPILE_HEADER, flush=True)
    failed = _each_in_a_process("--compile-model", COMPILE_MODELS)
    if not args.compile_only:
        print(HEADER, flush=True)
        failed += _each_in_a_process("--model", [*COMPILE_MODELS, *ZOO])
        print(RSS_HEADER, flush=True)
        failed += _each_in_a_process("--rss", COMPILE_MODELS)
        print(INFERENCE_HEADER, flush=True)
        failed += _each_in_a_process("--inference", INFERENCE_MODELS)
    return f"failed: {', '.join(failed)}" if failed else 0


if __name__ == "__main__":
    sys.exit(main())
