"""The executable cache: a second process skips compilation, corrupt entries recompile, LRU eviction."""

import hashlib
import logging
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import poptorch
from poptorch import _cache, _logging

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import poptorch
    from poptorch import _device

    compiled = []
    real = _device.compile_programs
    _device.compile_programs = lambda *a, **k: compiled.append(1) or real(*a, **k)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    opts = poptorch.Options().showCompilationProgressBar(False).enableExecutableCaching(sys.argv[1])
    out = poptorch.inferenceModel(model, opts)(torch.ones(2, 3))
    assert torch.allclose(out, model(torch.ones(2, 3)), atol=1e-6)
    print(len(compiled))
    """
)


def _run(cache_dir):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(cache_dir)], capture_output=True, text=True, check=True)
    return int(result.stdout.strip().splitlines()[-1])


def test_second_process_skips_compilation(tmp_path):
    assert _run(tmp_path) == 1
    entries = [p for p in os.listdir(tmp_path) if p.endswith(".popexe")]
    assert len(entries) == 1
    # The second process loads the compiled executable: neither the popir passes nor popsim's lowering run.
    assert _run(tmp_path) == 0


def _model_call(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opts = poptorch.Options().showCompilationProgressBar(False).enableExecutableCaching(str(tmp_path))
    out = poptorch.inferenceModel(model, opts)(torch.ones(2, 3))
    torch.testing.assert_close(out, model(torch.ones(2, 3)))


def test_corrupt_entry_is_recompiled(tmp_path):
    _model_call(tmp_path)
    (entry,) = [tmp_path / p for p in os.listdir(tmp_path) if p.endswith(".popexe")]
    data = bytearray(entry.read_bytes())
    data[-10] ^= 0xFF
    entry.write_bytes(bytes(data))
    _model_call(tmp_path)
    entry.write_bytes(b"garbage")
    _model_call(tmp_path)
    assert entry.read_bytes().startswith(_cache._MAGIC)


def test_key_depends_on_graph_and_compile_options():
    import popir

    g = popir.Graph("g")
    x = g.add_input("x", (2,), "float32")
    g.output("y", x + 1.0)
    base = poptorch.Options()
    assert _cache.key({"p": g}, base) == _cache.key({"p": g}, poptorch.Options())
    assert _cache.key({"p": g}, base) != _cache.key({"p": g}, poptorch.Options().replicationFactor(2))
    assert _cache.key({"p": g}, base) != _cache.key({"q": g}, base)


def _tiny_executable(value):
    import popir
    import popsim

    g = popir.Graph("g")
    x = g.add_input("x", (2,), "float32")
    g.output("y", x + float(value))
    return popsim.compile(g, popsim.Target.small(num_tiles=2))


def _added(exe):
    return float(exe.run({"x": np.zeros(2, np.float32)})["y"][0])


def test_lru_eviction(tmp_path):
    probe = _cache.ExecutableCache(str(tmp_path / "probe"))
    probe.store("x", _tiny_executable(3))  # x + 0 would optimise away and make a smaller entry
    entry_bytes = os.path.getsize(tmp_path / "probe" / ("x" + _cache._SUFFIX))
    cache = _cache.ExecutableCache(str(tmp_path / "cache"), max_bytes=2 * entry_bytes + 1)
    cache.store("a", _tiny_executable(1))
    cache.store("b", _tiny_executable(2))
    for name, age in (("a", 300), ("b", 200)):
        when = os.path.getmtime(tmp_path / "cache" / (name + _cache._SUFFIX)) - age
        os.utime(tmp_path / "cache" / (name + _cache._SUFFIX), (when, when))
    assert _added(cache.load("a")) == 1  # a hit refreshes "a", so "b" is now the least recently used
    cache.store("c", _tiny_executable(3))
    assert sorted(os.listdir(tmp_path / "cache")) == ["a" + _cache._SUFFIX, "c" + _cache._SUFFIX]


@pytest.mark.parametrize("env", [True, False])
def test_cache_dir_from_environment(tmp_path, monkeypatch, env):
    if env:
        monkeypatch.setenv("POPTORCH_CACHE_DIR", str(tmp_path))
        opts = poptorch.Options()
    else:
        opts = poptorch.Options().enableExecutableCaching(str(tmp_path))
    assert _cache.ExecutableCache.open(opts).directory == str(tmp_path)
    assert _cache.ExecutableCache.open(poptorch.Options().enableExecutableCaching(None)) is None


@pytest.fixture
def warnings_logged():
    """The messages the poptorch logger emits at WARNING or above during the test."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    _logging.logger.addHandler(handler)
    yield records
    _logging.logger.removeHandler(handler)


def _activation_model(activation, cache_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), activation)
    opts = poptorch.Options().showCompilationProgressBar(False).enableExecutableCaching(str(cache_dir))
    x = torch.linspace(-3, 3, 6).reshape(2, 3)
    wrapped = poptorch.inferenceModel(model, opts)
    torch.testing.assert_close(wrapped(x), model(x))
    return wrapped


def _entries(cache_dir):
    return sorted(p for p in os.listdir(cache_dir) if p.endswith(_cache._SUFFIX))


def test_swapped_entries_are_refused_and_recompiled(tmp_path, warnings_logged):
    _activation_model(torch.nn.ReLU(), tmp_path)
    relu_entry = _entries(tmp_path)
    _activation_model(torch.nn.Sigmoid(), tmp_path)
    (sigmoid_entry,) = set(_entries(tmp_path)) - set(relu_entry)
    (a, b) = (tmp_path / relu_entry[0], tmp_path / sigmoid_entry)
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    for _ in range(2):  # the second round loads the recompiled, correct entries
        _activation_model(torch.nn.ReLU(), tmp_path)
        _activation_model(torch.nn.Sigmoid(), tmp_path)
    assert len([w for w in warnings_logged if "another key" in w]) == 2
    assert a.read_bytes() == data_a and b.read_bytes() == data_b


def test_valid_checksum_around_foreign_content_is_removed_once(tmp_path, warnings_logged):
    _activation_model(torch.nn.ReLU(), tmp_path)
    (entry,) = [tmp_path / p for p in _entries(tmp_path)]
    good = entry.read_bytes()
    key = entry.name[: -len(_cache._SUFFIX)]
    body = b"POPSIM-EXECUTABLE-1\n" + b"0" * 64 + b"\nnot an executable"
    entry.write_bytes(_cache._MAGIC + key.encode() + b"\n" + _cache._digest(key, body) + b"\n" + body)
    _activation_model(torch.nn.ReLU(), tmp_path)
    _activation_model(torch.nn.ReLU(), tmp_path)
    assert len(warnings_logged) == 1 and "Removing executable cache entry" in warnings_logged[0]
    assert entry.read_bytes() == good


def test_another_models_executable_under_this_key_is_refused(tmp_path, warnings_logged):
    _activation_model(torch.nn.ReLU(), tmp_path)
    (entry,) = [tmp_path / p for p in _entries(tmp_path)]
    key = entry.name[: -len(_cache._SUFFIX)]
    _cache.ExecutableCache(str(tmp_path)).store(key, _tiny_executable(5))
    _activation_model(torch.nn.ReLU(), tmp_path)
    assert any("not those of this model" in w for w in warnings_logged)


def test_a_crafted_pickle_entry_runs_no_code(tmp_path):
    _activation_model(torch.nn.ReLU(), tmp_path)
    (entry,) = [tmp_path / p for p in _entries(tmp_path)]
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Touch(str(marker)))
    entry.write_bytes(b"POPTORCH-EXE-1\n" + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
    _activation_model(torch.nn.ReLU(), tmp_path)
    assert not marker.exists()


class _Touch:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_an_unusable_cache_directory_still_runs_the_model_with_one_warning(tmp_path, warnings_logged):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for _ in range(2):
        _activation_model(torch.nn.ReLU(), blocker / "cache")
    assert len(warnings_logged) == 1 and str(blocker / "cache") in warnings_logged[0]


def test_cache_max_bytes_that_is_not_a_number_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("POPTORCH_CACHE_MAX_BYTES", "abc")
    with pytest.raises(poptorch.Error, match="POPTORCH_CACHE_MAX_BYTES must be a positive whole number.*'abc'"):
        _activation_model(torch.nn.ReLU(), tmp_path)
