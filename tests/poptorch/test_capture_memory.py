"""Wrapping, running and destroying models again and again leaves no per-capture state behind: torch.fx's
cache of generated source (and linecache) does not grow with each capture."""

import linecache

import torch
import torch.fx.graph_module

import poptorch


def _cycle():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    wrapped = poptorch.inferenceModel(model, poptorch.Options().showCompilationProgressBar(False))
    wrapped(torch.randn(2, 4))
    wrapped.destroy()


def test_captures_do_not_accumulate_generated_source():
    cache = torch.fx.graph_module._loader.eval_cache
    _cycle()
    sizes = len(cache), len(linecache.cache)
    for _ in range(2):
        _cycle()
    assert (len(cache), len(linecache.cache)) == sizes
