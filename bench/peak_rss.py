"""Peak RSS (MiB) of a fresh process that trains one of ``models.py``'s compile-table models ``RSS_STEPS``
SGD steps, on the simulator (``sim``) or in eager PyTorch (``eager``).

The eager process never loads poptorch or popsim: stand-ins take their place so that the benchmark modules
defining the models import, and the figure is eager PyTorch's own (issue 17 compares the two).

    python bench/peak_rss.py {sim,eager} MODEL
"""

import resource
import sys
from unittest import mock

SIMULATOR = ("poptorch", "popsim", "popir", "popdata")


def main(side, name):
    if side == "eager":
        sys.modules.update({module: mock.MagicMock(name=module) for module in SIMULATOR})
    import models  # bench/ is the script's directory
    import torch

    torch.set_num_threads(models.threads())
    torch.manual_seed(0)
    model, args = models.COMPILE_MODELS[name]()
    optimizer = torch.optim.SGD(model.train().parameters(), lr=models.LR)
    if side == "eager":

        def step():
            optimizer.zero_grad()
            model(*args)[1].backward()
            optimizer.step()

    else:
        import poptorch

        training = poptorch.trainingModel(model, poptorch.Options().showCompilationProgressBar(False), optimizer)

        def step():
            training(*args)

    for _ in range(models.RSS_STEPS):
        step()
    if side == "eager" and "popsim._kernels" in sys.modules:
        raise RuntimeError("the eager process loaded the simulator")
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


if __name__ == "__main__":
    main(*sys.argv[1:])
