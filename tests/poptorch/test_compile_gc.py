"""The garbage collector is off while a model compiles and as it was before once the compile ends."""

import gc

import pytest
import torch

import poptorch
from poptorch import _device


def _compile_seeing_the_collector(monkeypatch, fail=False):
    seen = []
    compile_programs = _device.compile_programs

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        if fail:
            raise poptorch.Error("a compile error")
        return compile_programs(*args, **kwargs)

    monkeypatch.setattr(_device, "compile_programs", spy)
    model = poptorch.inferenceModel(torch.nn.Linear(3, 2))
    try:
        model(torch.ones(1, 3))
    finally:
        model.destroy()
    return seen


def test_the_collector_is_off_while_compiling_and_on_again_after(monkeypatch):
    assert gc.isenabled()
    assert _compile_seeing_the_collector(monkeypatch) == [False]
    assert gc.isenabled()


def test_the_collector_is_on_again_after_a_compile_error(monkeypatch):
    with pytest.raises(poptorch.Error, match="a compile error"):
        _compile_seeing_the_collector(monkeypatch, fail=True)
    assert gc.isenabled()


def test_a_collector_the_user_turned_off_stays_off(monkeypatch):
    gc.disable()
    try:
        assert _compile_seeing_the_collector(monkeypatch) == [False]
        assert not gc.isenabled()
    finally:
        gc.enable()
