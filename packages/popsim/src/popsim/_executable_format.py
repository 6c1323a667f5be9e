"""The byte format of a compiled Executable: a checksum, a JSON header and NumPy arrays, nothing executable.

Layout: ``MAGIC``, the SHA-256 (hex) of the rest, a newline, then an uncompressed ``.npz`` whose member
``header`` is the UTF-8 JSON description and whose other members are the arrays the header names. Reading
uses ``allow_pickle=False``, so no byte of an entry can run code; every array is checked for dtype and shape,
and every byte offset for lying inside the tile arena, before the engine may see it, so a damaged or crafted
buffer is a ``popsim.Error`` rather than a crash.

The flattened programs are stored generically (every NumPy attribute as an array, every other attribute as
JSON), so a change of the engine's tables needs no change here beyond the checks of the tables it names.
"""

import dataclasses
import hashlib
import io
import json
import zipfile
from types import SimpleNamespace

import numpy as np

import popir
from popsim import _opcodes as oc
from popsim._arena import TileArena
from popsim.errors import Error
from popsim.profile import Profile
from popsim.target import Target
from popsim.validate import check_program

MAGIC = b"POPSIM-EXECUTABLE-1\n"
FORMAT_VERSION = 2  # 2: compact exchange rows (RUNS phases)
_DIGEST_HEX = 64
HEADER = "header"
# The engine's tables: name -> (dtype, columns or None for one dimension).
_TABLES = {
    "phases": (np.int64, oc.PHASE_COLS),
    "phase_cycles": (np.int64, None),
    "instructions": (np.int64, oc.NCOLS),
    "fparams": (np.float64, None),
    "copies": (np.int32, len(oc.COPY_COLUMNS)),
    "runs": (np.int32, len(oc.RUN_COLUMNS)),
    "stream_rows": (np.int64, len(oc.STREAM_ROW_COLUMNS)),
}


@dataclasses.dataclass(frozen=True)
class HostTensor:
    """What a loaded executable keeps of a device tensor: its shape, dtype and (for a constant) value."""

    shape: tuple
    dtype: popir.DType
    value: object = None

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def itemsize(self):
        return self.dtype.itemsize


def to_bytes(exe):
    """The bytes of ``exe``: its programs, tile plans, profile and the current values of its variables."""
    arrays = {}

    def array(value):
        name = f"a{len(arrays)}"
        arrays[name] = np.array(value, order="C")
        return name

    def spec(t):
        return {"shape": [int(d) for d in t.shape], "dtype": str(t.dtype)}

    def placed(t, blocks):
        return {**spec(t), "blocks": [array(b) for b in blocks]}

    programs = {}
    for name, (flat, feeds, outs, inputs, outputs) in exe._programs.items():
        tables = {k: ({"array": array(v)} if isinstance(v, np.ndarray) else {"json": v}) for k, v in vars(flat).items()}
        programs[name] = {
            "flat": tables,
            "inputs": {n: placed(t, feeds[n]) for n, t in inputs.items()},
            "outputs": {n: placed(t, outs[n]) for n, t in outputs.items()},
        }
    header = {
        "format": FORMAT_VERSION,
        "target": dataclasses.asdict(exe.target),
        "arena": [exe.arena.num_tiles, exe.arena.tile_bytes],
        "variables": {
            n: {
                **placed(t, exe._var_blocks[n]),
                "value": array(exe.read_variable(n)),
                **({"copies": [array(b) for b in exe._var_copies[n]]} if n in exe._var_copies else {}),
            }
            for n, t in exe._vars.items()
        },
        "constants": [
            {**placed(t, blocks), "value": array(np.asarray(t.value, t.dtype.numpy).reshape(t.shape))}
            for t, blocks in exe._constants
        ],
        "streams": {n: {**spec(s.tensor), "to_device": bool(s.to_device)} for n, s in exe._streams.items()},
        "programs": programs,
        "profile": exe.profile.programs,
    }
    buffer = io.BytesIO()
    text = json.dumps(header, default=_json_scalar, allow_nan=True).encode()
    np.savez(buffer, **{HEADER: np.frombuffer(text, np.uint8)}, **arrays)
    payload = buffer.getvalue()
    return MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def _json_scalar(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not part of an executable's description")


def from_bytes(cls, data, num_threads, max_arena_bytes):
    """An instance of ``cls`` (Executable) restored from ``to_bytes`` output; popsim.Error when the bytes are
    damaged, not an executable, or describe offsets outside the arena."""
    header, arrays = _unpack(data)
    try:
        return _restore(cls, header, _Arrays(arrays), num_threads, max_arena_bytes)
    except Error:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, popir.IRError) as exc:
        raise Error(f"not a valid popsim executable: malformed description ({type(exc).__name__}: {exc})") from None


def _unpack(data):
    if not isinstance(data, bytes | bytearray | memoryview):
        raise Error(f"Executable.from_bytes needs bytes (from Executable.to_bytes), got {type(data).__name__}")
    data = bytes(data)
    if not data.startswith(MAGIC):
        raise Error("not a popsim executable: the bytes do not start with the popsim executable tag")
    digest_end = len(MAGIC) + _DIGEST_HEX
    digest, payload = data[len(MAGIC) : digest_end], data[digest_end + 1 :]
    if data[digest_end : digest_end + 1] != b"\n" or hashlib.sha256(payload).hexdigest().encode() != digest:
        raise Error("corrupt popsim executable: its checksum does not match its contents (damaged or truncated)")
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        header = json.loads(arrays.pop(HEADER).tobytes().decode())
    except (zipfile.BadZipFile, ValueError, KeyError, OSError, EOFError, RecursionError) as exc:
        raise Error(f"not a valid popsim executable: unreadable contents ({exc})") from None
    version = header.get("format") if isinstance(header, dict) else None
    if version != FORMAT_VERSION:
        raise Error(f"popsim executable format {version!r} is not this version's ({FORMAT_VERSION})")
    return header, arrays


class _Arrays:
    """The stored arrays, handed out once each with their dtype and dimensions checked."""

    def __init__(self, arrays):
        self._arrays = arrays

    def get(self, name, dtype, ndim=None, what="array"):
        if name not in self._arrays:
            raise Error(f"not a valid popsim executable: {what} refers to a missing array {name!r}")
        a = self._arrays[name]
        if a.dtype != np.dtype(dtype) or (ndim is not None and a.ndim != ndim):
            raise Error(
                f"not a valid popsim executable: {what} is {a.dtype}{list(a.shape)}, expected {np.dtype(dtype)}"
            )
        return a


def _restore(cls, header, arrays, num_threads, max_arena_bytes):
    target = Target(**header["target"])
    num_tiles, tile_bytes = (int(x) for x in header["arena"])
    if num_tiles < target.num_tiles or not 0 < num_tiles * tile_bytes <= max_arena_bytes:
        raise Error(f"not a valid popsim executable: an arena of {num_tiles} x {tile_bytes} bytes for {target.name}")
    arena_bytes = num_tiles * tile_bytes
    exe = cls.__new__(cls)
    exe.target, exe.num_threads, exe.last_run_cycles, exe.last_write_cycles = target, num_threads, 0, 0
    exe.arena = TileArena(num_tiles, tile_bytes)
    exe._vars, exe._var_blocks, exe._var_copies, values = {}, {}, {}, {}
    for name, entry in header["variables"].items():
        exe._vars[name], exe._var_blocks[name] = _placed(entry, arrays, arena_bytes, f"variable {name!r}")
        if "copies" in entry:  # its copies on tiles, written with it
            copies = {**entry, "blocks": entry["copies"]}
            exe._var_copies[name] = _placed(copies, arrays, arena_bytes, f"copies of variable {name!r}")[1]
        values[name] = _value(entry, exe._vars[name], arrays, f"variable {name!r}")
    exe.variables = {n: popir.TensorType(t.shape, t.dtype) for n, t in exe._vars.items()}
    exe._constants = []
    for i, entry in enumerate(header["constants"]):
        t, blocks = _placed(entry, arrays, arena_bytes, f"constant {i}")
        exe._constants.append((HostTensor(t.shape, t.dtype, _value(entry, t, arrays, f"constant {i}")), blocks))
    exe._streams = {n: _Stream(_tensor(s), bool(s["to_device"])) for n, s in header["streams"].items()}
    exe._programs = {}
    for name, entry in header["programs"].items():
        flat = _flat(entry["flat"], arrays, (num_tiles, tile_bytes), exe._streams, f"program {name!r}")
        feeds, inputs, outs, outputs = {}, {}, {}, {}
        for n, e in entry["inputs"].items():
            inputs[n], feeds[n] = _placed(e, arrays, arena_bytes, f"input {n!r}")
        for n, e in entry["outputs"].items():
            outputs[n], outs[n] = _placed(e, arrays, arena_bytes, f"output {n!r}")
        exe._programs[name] = (flat, feeds, outs, inputs, outputs)
    exe.profile = Profile(target)
    exe.profile.programs = header["profile"]
    if set(exe.profile.programs) != set(exe._programs):
        raise Error("not a valid popsim executable: its profile and its programs differ")
    exe._write_constants()
    for name, value in values.items():
        exe.write_variable(name, value)
    return exe


@dataclasses.dataclass(frozen=True)
class _Stream:
    tensor: HostTensor
    to_device: bool


def _tensor(entry):
    shape = tuple(int(d) for d in entry["shape"])
    if any(d < 0 for d in shape):
        raise Error(f"not a valid popsim executable: negative dimension in {list(shape)}")
    return HostTensor(shape, popir.as_dtype(entry["dtype"]))


def _placed(entry, arrays, arena_bytes, what):
    """A tensor and its host blocks (host offsets, arena offsets, byte counts), checked against the arena."""
    t = _tensor(entry)
    host, arena, nbytes = (arrays.get(name, np.int64, 1, what) for name in entry["blocks"])
    if not host.shape == arena.shape == nbytes.shape:
        raise Error(f"not a valid popsim executable: {what} has block lists of different lengths")
    if len(nbytes) and (
        nbytes.min() < 0
        or host.min() < 0
        or (host + nbytes).max() > t.size * t.itemsize
        or arena.min() < 0
        or (arena + nbytes).max() > arena_bytes
    ):
        raise Error(f"not a valid popsim executable: {what} has blocks outside its tensor or the tile arena")
    return t, (host, arena, nbytes)


def _value(entry, t, arrays, what):
    value = arrays.get(entry["value"], t.dtype.numpy, None, what)
    if value.shape != t.shape:
        raise Error(f"not a valid popsim executable: {what} holds shape {list(value.shape)}, expected {list(t.shape)}")
    return value


def _flat(tables, arrays, arena, streams, what):
    """A flattened program's tables, each checked against the arena and the other tables."""
    attrs = {}
    for key, stored in tables.items():
        if "array" in stored:
            dtype, columns = _TABLES.get(key, (None, None))
            a = arrays._arrays.get(stored["array"])
            if a is None or (dtype is not None and a.dtype != dtype):
                raise Error(f"not a valid popsim executable: {what} table {key!r} is missing or mistyped")
            if columns is not None and (a.ndim != 2 or a.shape[1] != columns):
                raise Error(f"not a valid popsim executable: {what} table {key!r} has shape {list(a.shape)}")
            attrs[key] = a
        else:
            attrs[key] = stored["json"]
    missing = set(_TABLES) - set(attrs)
    if missing:
        raise Error(f"not a valid popsim executable: {what} lacks tables {sorted(missing)}")
    flat = SimpleNamespace(**attrs)
    if int(flat.num_counters) < 0 or not set(flat.stream_uses) <= set(streams):
        raise Error(f"not a valid popsim executable: {what} uses unknown loop counters or host streams")
    try:
        check_program(flat, *arena, len(streams))
    except Error as exc:
        raise Error(f"not a valid popsim executable: {what}: {exc}") from None
    return flat
