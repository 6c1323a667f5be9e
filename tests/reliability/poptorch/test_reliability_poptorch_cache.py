"""Catalogue: a poisoned, damaged or unusable executable cache. Each entry loads only for its own key and
model; anything else is removed and recompiled with one warning, and the model's results stay right."""

import hashlib
import logging
import os
import pickle

import pytest
import torch

import popir
import popsim
import poptorch
from poptorch import _cache, _logging

recovered = pytest.mark.outcome("recovered")
right = pytest.mark.outcome("right result")


def _tiny_executable(value):
    g = popir.Graph("g")
    x = g.add_input("x", (2,), "float32")
    g.output("y", x + float(value))
    return popsim.compile(g, popsim.Target.small(num_tiles=2))


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


@recovered
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


@recovered
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


@recovered
def test_another_models_executable_under_this_key_is_refused(tmp_path, warnings_logged):
    _activation_model(torch.nn.ReLU(), tmp_path)
    (entry,) = [tmp_path / p for p in _entries(tmp_path)]
    key = entry.name[: -len(_cache._SUFFIX)]
    _cache.ExecutableCache(str(tmp_path)).store(key, _tiny_executable(5))
    _activation_model(torch.nn.ReLU(), tmp_path)
    assert any("not those of this model" in w for w in warnings_logged)


@recovered
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


@recovered
def test_an_unusable_cache_directory_still_runs_the_model_with_one_warning(tmp_path, warnings_logged):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for _ in range(2):
        _activation_model(torch.nn.ReLU(), blocker / "cache")
    assert len(warnings_logged) == 1 and str(blocker / "cache") in warnings_logged[0]


@recovered
@pytest.mark.parametrize("damage", ["truncated", "empty", "flipped_byte", "old_format"])
def test_a_damaged_entry_is_removed_and_recompiled(tmp_path, warnings_logged, damage):
    _activation_model(torch.nn.ReLU(), tmp_path)
    (entry,) = [tmp_path / p for p in _entries(tmp_path)]
    good = entry.read_bytes()
    damaged = {
        "truncated": good[: len(good) // 2],
        "empty": b"",
        "flipped_byte": good[:-7] + bytes([good[-7] ^ 1]) + good[-6:],
        "old_format": b"POPTORCH-EXE-1\n" + good,
    }[damage]
    entry.write_bytes(damaged)
    _activation_model(torch.nn.ReLU(), tmp_path)
    assert len(warnings_logged) == 1 and "Removing executable cache entry" in warnings_logged[0]
    assert entry.read_bytes() == good


@recovered
def test_a_directory_in_place_of_an_entry(tmp_path, warnings_logged):
    _activation_model(torch.nn.ReLU(), tmp_path)
    (entry,) = [tmp_path / p for p in _entries(tmp_path)]
    entry.unlink()
    entry.mkdir()
    _activation_model(torch.nn.ReLU(), tmp_path)
    assert len(warnings_logged) == 1 and str(tmp_path) in warnings_logged[0]


@right
def test_an_entry_written_by_another_process_is_loaded_without_compiling(tmp_path, monkeypatch):
    _activation_model(torch.nn.Sigmoid(), tmp_path)
    from poptorch import _device

    monkeypatch.setattr(_device, "compile_programs", lambda *a, **k: pytest.fail("compiled despite a cache hit"))
    assert _activation_model(torch.nn.Sigmoid(), tmp_path).isLoadedFromCache()
