"""Temporary stand-in for ``popsim.compile`` (over popir's interpreter) until popsim provides it.

Delete this file as soon as ``popsim.compile`` exists: it is only installed when popsim lacks it.
"""

import numpy as np
import pytest

import popir
import popsim


class _Profile:
    def to_json(self, path):
        with open(path, "w") as f:
            f.write("{}")

    def summary(self):
        return "interpreter stand-in"


class _Executable:
    def __init__(self, graphs):
        self.graphs = graphs if isinstance(graphs, dict) else {"main": graphs}
        self.variables = {}
        for graph in self.graphs.values():
            for v in graph.inputs:
                if v.kind != "input":
                    self.variables.setdefault(v.name, np.zeros(v.shape, dtype=v.dtype.numpy))
        self.profile = _Profile()
        self.last_run_cycles = None

    def read_variable(self, name):
        return self.variables[name].copy()

    def write_variable(self, name, array):
        self.variables[name] = np.array(array, dtype=self.variables[name].dtype).reshape(self.variables[name].shape)

    def run(self, feeds, program=None):
        graph = self.graphs[program] if program else next(iter(self.graphs.values()))
        all_feeds = dict(feeds)
        for v in graph.inputs:
            if v.kind != "input":
                all_feeds[v.name] = self.variables[v.name]
        outputs, state = popir.interpreter.step(graph, all_feeds)
        self.variables.update(state)
        self.last_run_cycles = 1000
        return outputs


if not hasattr(popsim, "compile"):

    class OutOfMemoryError(Exception):
        pass

    class UnsupportedOpError(Exception):
        pass

    @pytest.fixture(autouse=True)
    def _popsim_stand_in(monkeypatch):
        monkeypatch.setattr(popsim, "compile", lambda graphs, **kwargs: _Executable(graphs), raising=False)
        monkeypatch.setattr(popsim, "OutOfMemoryError", OutOfMemoryError, raising=False)
        monkeypatch.setattr(popsim, "UnsupportedOpError", UnsupportedOpError, raising=False)
