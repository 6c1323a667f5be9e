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
COMPILE_HEADER = f"{'model':<13} {'first CPU s':>11} {'first wall s':>12} {'CPU s':>7} {'wall s':>7}"
HEADER = f"{'model':<13} {'compile s':>9} {'step ms':>9} {'eager ms':>9} {'ratio':>7} {'peak RSS MiB':>12}"


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


def row(name):
    """Compile and time model ``name`` (of the zoo or the compile table); its table row."""
    torch.manual_seed(0)
    case = _case(name)
    model = case.model.train()
    eager = copy.deepcopy(model)
    eager_optimizer = torch.optim.SGD(eager.parameters(), lr=LR)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=LR))

    def sim_step():
        training(*case.args, **case.kwargs)

    def eager_step():
        eager_optimizer.zero_grad()
        case.loss_of(eager(*case.args, **case.kwargs)).backward()
        eager_optimizer.step()

    start = time.perf_counter()
    sim_step()
    compile_s = time.perf_counter() - start
    eager_step()
    sim, eager_times = [], []
    for _ in range(ROUNDS):  # alternating rounds: a slow spell of the machine hits both sides alike
        eager_times.append(_timed(eager_step))
        sim.append(_timed(sim_step))
    ratio = statistics.median(s / e for s, e in zip(sim, eager_times))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return (
        f"{name:<13} {compile_s:9.2f} {statistics.median(sim) * 1e3:9.2f} "
        f"{statistics.median(eager_times) * 1e3:9.2f} {ratio:7.2f} {rss:12.0f}"
    )


def main():
    torch.set_num_threads(int(os.environ.get("POPSIM_NUM_THREADS", os.cpu_count())))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted({*ZOO, *COMPILE_MODELS}), help="run this model only, here")
    parser.add_argument("--compile-model", choices=sorted(COMPILE_MODELS), help="one compile-table row, here")
    parser.add_argument("--compile-only", action="store_true", help="print the compile table only")
    args, _ = parser.parse_known_args()
    if args.model or args.compile_model:
        print(row(args.model) if args.model else compile_row(args.compile_model), flush=True)
        return 0
    print(COMPILE_HEADER, flush=True)
    failed = _each_in_a_process("--compile-model", COMPILE_MODELS)
    if not args.compile_only:
        print(HEADER, flush=True)
        failed += _each_in_a_process("--model", [*COMPILE_MODELS, *ZOO])
    return f"failed: {', '.join(failed)}" if failed else 0


if __name__ == "__main__":
    sys.exit(main())
