"""Model outputs of any pytree, and warnings a user cannot act on shown once per process."""

import logging
import warnings

import torch

import poptorch
from poptorch import _capture


class Cache:
    """An object torch's pytree does not know (as a transformers Cache is)."""

    def __init__(self, tensor):
        self.tensor = tensor


class WithCache(torch.nn.Module):
    def forward(self, x):
        return {"logits": x * 2, "cache": Cache(x + 1), "steps": [x.sum(), 3]}


def test_unknown_objects_in_outputs_come_back_as_none_with_one_warning(monkeypatch):
    monkeypatch.setattr(_capture, "_SHOWN", set())
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    poptorch_logger = logging.getLogger("poptorch")
    poptorch_logger.addHandler(handler)
    try:
        x = torch.randn(2, 3)
        for _ in range(2):
            out = poptorch.inferenceModel(WithCache())(x)
    finally:
        poptorch_logger.removeHandler(handler)
    assert list(out) == ["logits", "cache", "steps"] and out["cache"] is None
    torch.testing.assert_close(out["logits"], x * 2)
    torch.testing.assert_close(out["steps"][0], x.sum())
    assert out["steps"][1] == 3
    messages = [r.getMessage() for r in records if "Cache" in r.getMessage()]
    assert len(messages) == 1 and "returns None in its place" in messages[0]


class LSTMClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(4, 6, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0][:, -1]


def test_export_warnings_about_the_model_show_once_per_process(monkeypatch):
    monkeypatch.setattr(_capture, "_SHOWN", set())
    x = torch.randn(2, 3, 4)
    model = LSTMClassifier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            executor = poptorch.inferenceModel(model)
            torch.testing.assert_close(executor(x), model(x), rtol=1e-5, atol=1e-5)
            executor.destroy()
    flat_weights = [w for w in caught if "assigned during export" in str(w.message)]
    assert len(flat_weights) == 1
