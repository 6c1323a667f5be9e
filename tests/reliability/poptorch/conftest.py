"""Process-wide singletons that the first compile creates lazily (tqdm's monitor thread and write lock) are
created once before the catalogue's state snapshots, so they are not taken for leftovers of a case."""

import pytest
import torch

import poptorch


@pytest.fixture(scope="session", autouse=True)
def _process_wide_singletons():
    model = poptorch.inferenceModel(torch.nn.Identity(), poptorch.Options())
    model(torch.ones(1))
    model.destroy()
