"""Bytes and rows the simulated IPU exchanges in one training step, by copy kind, for the encoder layer, the
tutorial CNN, BERT-tiny and the small ResNet of bench/models.py (issue 17's rule: identical operands reach a tile once).

For every Copy of the training program: the bytes that cross tiles, the bytes copied on their own tile, the
engine's copy rows, and the *repeats*: bytes of a source element that one Copy delivers to a destination tile
it already reached in that Copy (the operand reuse a tile could have made instead). Prints a table by copy
name (its kind: matmul-lhs, conv-patch, reduce-gather...) and the largest copies.

    python bench/exchange_volume.py [--model encoder|tutorial-cnn|bert-tiny|small-resnet] [--top 8]
"""

import argparse
import collections
import sys

import numpy as np
import torch

import poptorch
from popsim import program as popsim_program

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from models import COMPILE_MODELS, LR  # noqa: E402

MB = 1e6
MODELS = ("encoder", "tutorial-cnn", "bert-tiny", "small-resnet")


def copy_volume(flattener, step, rows):
    """(bytes across tiles, bytes on their own tile, repeated bytes, zero-padding bytes across tiles, rows)
    of one flattened Copy."""
    isz = step.dst.itemsize
    sources = [flattener._addresses(s) for s in step.srcs]
    src_tile = np.concatenate([tile for _, tile in sources])[step.index]
    # A block's zero padding reads a one-element constant: counted apart from the operand's own elements.
    padding = np.concatenate([np.full(s.size, s.size == 1 and s.category == "constant") for s in step.srcs])
    padding = padding[step.index]
    m = step.dst.storage.mapping
    dst_tile = np.repeat(m.tiles, m.stops - m.starts)
    if step.dst_elements is not None:  # a copy into some elements only (a pad's interior)
        dst_tile = dst_tile[step.dst_elements]
    if step.dst.storage is not step.dst:
        raise NotImplementedError("a Copy into an alias: count it from its storage's view")
    elements = popsim_program._storage_elements(step)
    remote = src_tile != dst_tile
    pairs = elements[remote & ~padding] * flattener.target.num_tiles + dst_tile[remote & ~padding]
    repeats = pairs.size - np.unique(pairs).size
    volume = (remote.sum(), (~remote).sum(), repeats, (remote & padding).sum())
    return np.array([*(int(v) * isz for v in volume), rows], np.int64)


def record_copies():
    """Wrap the flattener's copy so that each Copy of each program flattened is recorded; returns the list
    of (program's flattener, copy name, volume)."""
    seen = []
    original = popsim_program._Flattener.copy

    def copy(self, step):
        before = self.ncopies
        totals = original(self, step)
        if step.dst.size:
            op = getattr(step.origin, "op", "?")
            what = f"{step.name} ({op}) {step.dst.shape}<-{[x.shape for x in step.srcs]}"
            seen.append((id(self), what, copy_volume(self, step, self.ncopies - before)))
        return totals

    popsim_program._Flattener.copy = copy
    return seen


def measure(name):
    """The recorded copies of the training program of model ``name``, its step's cycles, the exchange cycles
    of its compiled programs and the busiest tile's peak tensor bytes."""
    seen = record_copies()
    torch.manual_seed(0)
    model, args = COMPILE_MODELS[name]()
    options = poptorch.Options().showCompilationProgressBar(False).logCycleCount(True)
    training = poptorch.trainingModel(model.train(), options, torch.optim.SGD(model.parameters(), lr=LR))
    training(*args)
    cycles = training.cycleCount()
    # The busiest tile's peak of tensor bytes over the compiled programs.
    programs = training._exe.profile.programs.values()
    peak = max(max(p["memory"]["tensors"]) for p in programs)
    exchange = sum(p["exchange_cycles"] for p in programs)
    # The training program is the flattened program with the most copies.
    by_program = collections.defaultdict(list)
    for program, kind, volume in seen:
        by_program[program].append((kind, volume))
    copies = max(by_program.values(), key=len)
    training.detachFromDevice()
    return copies, cycles, exchange, peak


def report(name, top):
    copies, cycles, exchange, peak = measure(name)
    kinds = collections.defaultdict(lambda: np.zeros(5, np.int64))
    for kind, volume in copies:
        kinds[kind.split(" ")[0]] += volume
    total = sum(kinds.values())
    print(
        f"== {name}: {total[0] / MB:.2f} MB across tiles, {total[1] / MB:.2f} MB on-tile, {total[2] / MB:.2f} MB "
        f"repeated, {total[3] / MB:.2f} MB padding, {total[4]:,} rows, {cycles:,} cycles ({exchange:,} exchange "
        f"cycles over the programs), tile peak {peak:,} B"
    )
    print(f"{'copy kind':<28} {'MB across':>10} {'MB on-tile':>10} {'MB repeat':>10} {'MB pad':>10} {'rows':>10}")
    for kind, v in sorted(kinds.items(), key=lambda kv: -kv[1][0] - kv[1][1])[:top]:
        print(f"{kind:<28} " + " ".join(f"{b / MB:10.2f}" for b in v[:4]) + f" {v[4]:10,}")
    print("largest copies:")
    for kind, v in sorted(copies, key=lambda c: -c[1][0])[:top]:
        print(f"  {kind:<70} " + " ".join(f"{b / MB:10.2f}" for b in v[:4]) + f" {v[4]:10,}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, action="append", help="default: every model")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    for name in args.model or MODELS:
        report(name, args.top)


if __name__ == "__main__":
    main()
