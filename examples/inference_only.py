"""Inference only: a small MLP on the simulated IPU, several device iterations per call.

With ``deviceIterations(4)`` one call consumes 4 micro-batches and returns all their outputs
(``OutputMode.All``, the inference default), matching the CPU model row for row.
"""

import argparse

import torch
import torch.nn as nn

import poptorch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch", type=int, default=8)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4), nn.Softmax(dim=1))
    model.eval()
    opts = poptorch.Options().deviceIterations(4)
    ipu_model = poptorch.inferenceModel(model, opts)

    x = torch.randn(args.micro_batch * 4, 16)
    on_ipu = ipu_model(x)
    with torch.no_grad():
        on_cpu = model(x)
    max_diff = float((on_ipu - on_cpu).abs().max())
    print(f"output {tuple(on_ipu.shape)}, largest difference from the CPU model {max_diff:.2e}")
    return max_diff


if __name__ == "__main__":
    main()
