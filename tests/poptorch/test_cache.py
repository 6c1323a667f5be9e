"""The executable cache: a second process skips compilation, corrupt entries recompile, LRU eviction."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import poptorch
from poptorch import _cache

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


def test_key_depends_on_the_code_that_compiles(monkeypatch):
    """An executable built by other popsim / popir / poptorch code (a changed planner, same version number)
    is never loaded: the code's fingerprint is part of the key."""
    import popir

    g = popir.Graph("g")
    g.output("y", g.add_input("x", (2,), "float32") * 2.0)
    before = _cache.key({"p": g}, poptorch.Options())
    monkeypatch.setattr(_cache, "_installed_code", lambda: "another build")
    assert _cache.key({"p": g}, poptorch.Options()) != before


def test_code_fingerprint_follows_file_contents_and_names(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "planner.py").write_text("TILES = 4\n")
    (package / "notes.txt").write_text("not code")
    first = _cache.code_fingerprint([package])
    (package / "notes.txt").write_text("changed, still not code")
    assert _cache.code_fingerprint([package]) == first
    (package / "planner.py").write_text("TILES = 8\n")
    changed = _cache.code_fingerprint([package])
    assert changed != first
    (package / "planner.py").rename(package / "placement.py")
    assert _cache.code_fingerprint([package]) not in (first, changed)


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
