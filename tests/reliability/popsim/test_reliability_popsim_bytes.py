"""Catalogue (popsim, no torch): Executable.to_bytes / from_bytes. A round trip runs alike; damaged,
truncated, crafted or pickled bytes are a popsim.Error (never a crash, never code run)."""

import hashlib
import io
import json
import pickle

import numpy as np
import pytest

import popir
import popsim
from popir import ops
from popsim import _executable_format as fmt
from popsim import _opcodes as oc

FEEDS = {"x": np.linspace(-2, 2, 24, dtype=np.float32).reshape(4, 6)}


def _graph():
    """A parameter, a matmul (exchange rows), a fused elementwise chain (an EXPR program) and a reduction."""
    g = popir.Graph("g")
    x = g.add_input("x", (4, 6), "float32")
    w = g.add_input("w", (6, 5), "float32", kind="parameter")
    y = ops.matmul(x, w)
    g.output("y", ops.reduce_sum(ops.tanh(y * 2.0 + 1.0) * y, axes=(1,), keepdims=False))
    return g


@pytest.fixture(scope="module")
def exe():
    exe = popsim.compile(_graph(), popsim.Target.small())
    exe.write_variable("w", np.arange(30, dtype=np.float32).reshape(6, 5) / 30)
    return exe


def _split(data):
    payload = data[len(fmt.MAGIC) + 65 :]
    with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    return json.loads(arrays.pop(fmt.HEADER).tobytes()), arrays


def _signed(header, arrays, allow_pickle=False):
    """Bytes with a valid checksum around ``header`` and ``arrays``: what a crafted entry looks like."""
    buffer = io.BytesIO()
    text = json.dumps(header).encode()
    np.savez(buffer, allow_pickle=allow_pickle, **{fmt.HEADER: np.frombuffer(text, np.uint8)}, **arrays)
    payload = buffer.getvalue()
    return fmt.MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


@pytest.mark.outcome("right result")
def test_round_trip_runs_alike_with_its_variables(exe):
    clone = popsim.Executable.from_bytes(exe.to_bytes())
    np.testing.assert_array_equal(clone.read_variable("w"), exe.read_variable("w"))
    np.testing.assert_array_equal(clone.run(FEEDS)["y"], exe.run(FEEDS)["y"])
    assert clone.to_bytes() == exe.to_bytes()


@pytest.mark.outcome("right result")
def test_the_format_holds_no_pickle(exe):
    data = exe.to_bytes()
    assert b"\x80\x04" not in data[: len(fmt.MAGIC)]
    header, arrays = _split(data)
    assert all(a.dtype != object for a in arrays.values())
    assert header["format"] == fmt.FORMAT_VERSION


@pytest.mark.outcome("clear error")
def test_every_damaged_byte_is_detected(exe):
    data = exe.to_bytes()
    positions = np.random.default_rng(0).choice(len(data), 60, replace=False)
    for at in [0, len(fmt.MAGIC), len(fmt.MAGIC) + 64, *positions.tolist()]:
        damaged = bytearray(data)
        damaged[at] ^= 0x41
        with pytest.raises(popsim.Error):
            popsim.Executable.from_bytes(bytes(damaged))


@pytest.mark.outcome("clear error")
@pytest.mark.parametrize("keep", [0, 5, 40, 200, -100, -1])
def test_truncated_bytes_are_an_error(exe, keep):
    data = exe.to_bytes()
    with pytest.raises(popsim.Error, match="not a popsim executable|corrupt"):
        popsim.Executable.from_bytes(data[:keep])


def _crafted(exe, change):
    header, arrays = _split(exe.to_bytes())
    change(header, arrays)
    return _signed(header, arrays)


def _table(header, arrays, name):
    return arrays[header["programs"]["g"]["flat"][name]["array"]]


def _runs_phase(header, arrays):
    """The first RUNS phase's row (a Copy's compact rows)."""
    phases = _table(header, arrays, "phases")
    return phases[np.flatnonzero(phases[:, 0] == oc.PHASES["RUNS"])[0]]


CRAFTED = {
    "operand beyond the arena": lambda h, a: _table(h, a, "instructions").__setitem__((0, 6), 1 << 40),
    "negative operand": lambda h, a: _table(h, a, "instructions").__setitem__((0, 3), -8),
    "unknown vertex kind": lambda h, a: _table(h, a, "instructions").__setitem__((0, 0), 99),
    "exchange row writes outside": lambda h, a: _table(h, a, "copies").__setitem__((0, 1), 2**31 - 10),
    "exchange row reads outside": lambda h, a: _table(h, a, "copies").__setitem__((0, 3), 2**20),
    "compact row writes outside": lambda h, a: _table(h, a, "runs").__setitem__((0, 1), 2**31 - 10),
    "compact row reads outside": lambda h, a: _table(h, a, "runs").__setitem__((0, 3), 2**20),
    "compact rows of an unknown element size": lambda h, a: _runs_phase(h, a).__setitem__(3, 3),
    "compact rows beyond their table": lambda h, a: _runs_phase(h, a).__setitem__(2, 10**6),
    "phase beyond its rows": lambda h, a: _table(h, a, "phases").__setitem__((0, 2), 10**6),
    "unknown phase kind": lambda h, a: _table(h, a, "phases").__setitem__((0, 0), 42),
    "table of the wrong dtype": lambda h, a: a.__setitem__(
        h["programs"]["g"]["flat"]["phases"]["array"], _table(h, a, "phases").astype(np.float64)
    ),
    "variable block outside the arena": lambda h, a: a[h["variables"]["w"]["blocks"][1]].__setitem__(0, 1 << 40),
    "variable value of another shape": lambda h, a: a.__setitem__(
        h["variables"]["w"]["value"], np.zeros(3, np.float32)
    ),
    "missing array": lambda h, a: a.pop(h["variables"]["w"]["value"]),
    "arena larger than 2 GiB": lambda h, a: h["arena"].__setitem__(1, 1 << 40),
    "unknown dtype": lambda h, a: h["variables"]["w"].__setitem__("dtype", "complex128"),
    "another format version": lambda h, a: h.__setitem__("format", 99),
    "unknown target field": lambda h, a: h["target"].__setitem__("warp_drive", 1),
    "missing table": lambda h, a: h["programs"]["g"]["flat"].pop("copies"),
}


@pytest.mark.outcome("clear error")
@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_bytes_with_a_valid_checksum_are_an_error(exe, case):
    with pytest.raises(popsim.Error, match="not a valid popsim executable|format"):
        popsim.Executable.from_bytes(_crafted(exe, CRAFTED[case]))


class _Explodes:
    def __reduce__(self):
        return (exec, ("raise SystemExit('pickle ran')",))


@pytest.mark.outcome("clear error")
def test_a_pickled_object_inside_is_refused_without_running_it(exe):
    header, arrays = _split(exe.to_bytes())
    arrays[header["variables"]["w"]["value"]] = np.array([_Explodes()], dtype=object)
    with pytest.raises(popsim.Error, match="not a valid popsim executable"):
        popsim.Executable.from_bytes(_signed(header, arrays, allow_pickle=True))


@pytest.mark.outcome("clear error")
def test_a_deeply_nested_header_is_an_error():
    text = ("[" * 100_000 + "]" * 100_000).encode()
    buffer = io.BytesIO()
    np.savez(buffer, **{fmt.HEADER: np.frombuffer(text, np.uint8)})
    payload = buffer.getvalue()
    data = fmt.MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
    with pytest.raises(popsim.Error, match="not a valid popsim executable"):
        popsim.Executable.from_bytes(data)


@pytest.mark.outcome("clear error")
def test_an_executable_refuses_to_pickle(exe):
    with pytest.raises(TypeError, match="to_bytes"):
        pickle.dumps(exe)
