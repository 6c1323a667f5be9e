"""The flagship demo: the PopTorch porting tutorial's CNN, trained on a simulated IPU.

Handwritten digits bundled with scikit-learn (upsampled to 28x28) stand in for Fashion-MNIST, so nothing
is downloaded; ``--data-dir`` reads local Fashion-MNIST IDX files instead. After training it reports
held-out accuracy and what the simulated Mk2 IPU did: cycles per step, estimated time and throughput,
the compute / exchange / sync split and tile memory, and ends with the path of the HTML profile report
(where the cycles and bytes went, by layer and source line). A second run reuses the executable cache.

Data parallel on several processes: ``torchrun --nproc_per_node=2 examples/train_digits.py --batch-size 8``
trains on two processes (each with ``--replicas`` simulated replicas) that share gradients through
torch.distributed; each loads its own block of the shuffled dataset, and process 0 reports.

Differences from the tutorial: ``LogSoftmax`` normalises over the classes (``dim=1``); the tutorial's
``dim=0`` normalises over the batch, which is a bug in the tutorial.
"""

import argparse
import pathlib
import time

import numpy as np
import torch
import torch.nn as nn
from digits_data import load_digits_28, load_fashion_mnist
from tqdm import tqdm

import poptorch


class ClassificationModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 5, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(5, 12, 5)
        self.norm = nn.GroupNorm(3, 12)
        self.fc1 = nn.Linear(972, 100)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(100, 10)
        self.log_softmax = nn.LogSoftmax(dim=1)

    def forward(self, x):
        x = self.pool(self.relu(self.conv1(x)))
        x = self.norm(self.relu(self.conv2(x)))
        x = torch.flatten(x, start_dim=1)
        x = self.relu(self.fc1(x))
        x = self.log_softmax(self.fc2(x))
        return x


class ModelWithLoss(nn.Module):
    def __init__(self, model, criterion):
        super().__init__()
        self.model = model
        self.criterion = criterion

    def forward(self, x, labels=None):
        output = self.model(x)
        if labels is not None:
            loss = self.criterion(output, labels)
            return output, loss
        return output


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--data-dir", help="a folder with Fashion-MNIST IDX files (default: bundled digits)")
    parser.add_argument("--cache-dir", default=".poptorch_cache", help="executable cache folder")
    parser.add_argument("--profile-dir", default="profiles", help="where the profile JSON is written")
    parser.add_argument("--max-steps", type=int, default=None, help="stop each epoch after this many steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=1, help="replicas per process (replicationFactor)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    train_set, test_set = load_fashion_mnist(args.data_dir) if args.data_dir else load_digits_28(seed=args.seed)

    opts = poptorch.Options().randomSeed(args.seed).enableExecutableCaching(args.cache_dir)
    opts.replicationFactor(args.replicas)
    train_loader = poptorch.DataLoader(opts, train_set, batch_size=args.batch_size, shuffle=True)

    model = ModelWithLoss(ClassificationModel(), nn.NLLLoss())
    model.train()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    training_model = poptorch.trainingModel(model, options=opts, optimizer=optimizer)

    start = time.perf_counter()
    steps = 0
    for epoch in range(1, args.epochs + 1):
        bar = tqdm(train_loader, desc=f"[Epoch {epoch:02d}]", total=_epoch_len(train_loader, args.max_steps))
        for i, (data, labels) in enumerate(bar):
            if args.max_steps is not None and i >= args.max_steps:
                break
            _, loss = training_model(data, labels)
            bar.set_postfix(Loss=f"{float(loss.mean()):.3f}")  # one loss per replica
            steps += 1
    train_seconds = time.perf_counter() - start
    from_cache = training_model.isLoadedFromCache()
    profile = training_model.profile
    profile_dir = pathlib.Path(args.profile_dir)
    profile_dir.mkdir(parents=True, exist_ok=True)
    profile_path = profile_dir / "training_profile.json"
    profile.to_json(profile_path)
    report_path = profile.save_html(
        profile_dir / "training_report.html", title="Tutorial CNN training", samples_per_run=args.batch_size
    )
    training_model.detachFromDevice()
    if opts.Distributed.processId != 0:
        return {"steps": steps}  # every process holds the same weights: process 0 evaluates and reports

    model.eval()
    eval_opts = poptorch.Options()
    eval_opts.Distributed.disable()  # process 0 evaluates alone: no other process joins its weight broadcast
    inference_model = poptorch.inferenceModel(model, options=eval_opts)
    images, labels = test_set.tensors
    correct = 0
    for start_row in range(0, len(labels), args.batch_size):
        batch = images[start_row : start_row + args.batch_size]
        if len(batch) < args.batch_size:  # the compiled executable has a fixed micro-batch
            batch = torch.cat([batch, batch.new_zeros((args.batch_size - len(batch), *batch.shape[1:]))])
        predictions = inference_model(batch).argmax(dim=1)[: len(labels[start_row : start_row + args.batch_size])]
        correct += int((predictions == labels[start_row : start_row + args.batch_size]).sum())
    accuracy = 100.0 * correct / len(labels)

    print(f"\nHeld-out accuracy: {accuracy:.2f}% ({correct}/{len(labels)} test images)")
    print(f"Host wall time for {steps} simulated training steps: {train_seconds:.1f} s")
    print(report(profile, args.batch_size))
    print(f"Profile JSON: {profile_path}")
    if from_cache:
        print(f"Executable cache: loaded the compiled training model from {args.cache_dir} (compilation skipped)")
    else:
        print(f"Executable cache: compiled and stored in {args.cache_dir}; the next run loads it from there")
    # Last, so it is the line left on screen: the interactive report of where the cycles and bytes went.
    print(f"Profile report (open in a browser): {report_path.resolve()}")
    return {
        "accuracy": accuracy,
        "loaded_from_cache": from_cache,
        "profile_path": profile_path,
        "report_path": report_path,
        "steps": steps,
    }


def report(profile, batch_size):
    """What the simulated IPU did for one training step: the fused ``train`` program, or with replicas,
    accumulation or several processes, one micro-batch's ``accumulate`` and the optimizer's ``apply``."""
    programs = [profile.programs[n] for n in ("train", "accumulate", "apply") if n in profile.programs]
    p = {k: sum(q[k] for q in programs) for k in ("total_cycles", "seconds")}
    p.update({f"{k}_cycles": sum(q[f"{k}_cycles"] for q in programs) for k in ("compute", "exchange", "sync", "host")})
    p["memory"] = programs[0]["memory"]
    total = p["total_cycles"]
    used = sum(np.asarray(p["memory"][kind]) for kind in ("tensors", "vertex_state", "code"))
    fullest = int(used.argmax())
    tile_bytes = profile.target.tile_bytes

    def share(kind):
        return f"{p[kind + '_cycles']:,} ({100.0 * p[kind + '_cycles'] / total:.0f}%)"

    lines = []
    if profile.replication:
        r = profile.replication
        samples, seconds = batch_size * r["replicas"], r["step_cycles"] / profile.target.clock_hz
        lines.append(
            f"{r['replicas']} replicas in parallel: {r['step_cycles']:,} cycles per step of {samples} images,"
            f" {samples / seconds:,.0f} samples/s; the gradient all-reduce is {100 * r['all_reduce_share']:.1f}%"
        )
    return "\n".join(
        lines
        + [
            f"Simulated {profile.target.name}{', one replica' if lines else ''}: {total:,} cycles per training step"
            f" of {batch_size} images",
            f"  estimated {p['seconds'] * 1e6:.1f} us per step on one IPU at {profile.target.clock_hz / 1e9:.3f} GHz,"
            f" {batch_size / p['seconds']:,.0f} samples/s",
            f"  compute {share('compute')}, exchange {share('exchange')}, sync {share('sync')}, host {share('host')}",
            f"  tile memory: peak {int(used[fullest]):,} of {tile_bytes:,} bytes on tile {fullest};"
            f" {int(used.sum()):,} bytes over {int((used > 0).sum())} tiles",
        ]
    )


def _epoch_len(loader, max_steps):
    return len(loader) if max_steps is None else min(len(loader), max_steps)


if __name__ == "__main__":
    main()
