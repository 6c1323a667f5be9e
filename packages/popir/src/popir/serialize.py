"""Deterministic binary serialization of graphs.

Layout: magic, a little-endian u64 header length, a canonical JSON header (sorted keys), the raw bytes
of constant attributes, each referenced from the header by offset, and the SHA-256 of everything before it:
a buffer changed anywhere (constant data included) is refused instead of read as another graph. Same graph,
same bytes.
"""

import hashlib
import json
import struct

import numpy as np

from popir.errors import IRError
from popir.graph import ANNOTATIONS, Graph, Node, TensorType

MAGIC = b"POPIR\x00\x02\x00"
_DIGEST_BYTES = 32


def to_bytes(graph):
    blobs = []

    def attr(value):
        if isinstance(value, np.ndarray):
            blob = np.ascontiguousarray(value).tobytes()
            blobs.append(blob)
            return {"array": [str(value.dtype), list(value.shape), len(blobs) - 1]}
        if isinstance(value, tuple):
            return {"tuple": [attr(v) for v in value]}
        return value

    header = {
        "name": graph.name,
        "inputs": [[v.id, v.name, v.kind, list(v.shape), v.dtype.value] for v in graph.inputs],
        "nodes": [
            {
                "op": n.op,
                "in": [v.id for v in n.inputs],
                "out": [[v.id, list(v.shape), v.dtype.value] for v in n.outputs],
                "attrs": {k: attr(v) for k, v in sorted(n.attrs.items())},
                **n.annotations(),
            }
            for n in graph.nodes
        ],
        "outputs": [[k, v.id] for k, v in graph.outputs.items()],
        "updates": [[s.id, v.id] for s, v in graph.updates.items()],
    }
    offsets, position = [], 0
    for blob in blobs:
        offsets.append([position, len(blob)])
        position += len(blob)
    header["blobs"] = offsets
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    body = MAGIC + struct.pack("<Q", len(text)) + text + b"".join(blobs)
    return body + hashlib.sha256(body).digest()


def from_bytes(data):
    try:
        return _decode(bytes(data))
    except IRError:
        raise
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, struct.error, UnicodeDecodeError) as exc:
        raise IRError(f"corrupt popir graph bytes: {type(exc).__name__}: {exc}") from None
    except RecursionError:
        raise IRError("corrupt popir graph bytes: the header nests too deeply") from None


def _decode(data):
    if not data.startswith(MAGIC):
        raise IRError("corrupt popir graph bytes: bad magic (not a popir graph or another version)")
    data, digest = data[:-_DIGEST_BYTES], data[-_DIGEST_BYTES:]
    if len(data) < len(MAGIC) or hashlib.sha256(data).digest() != digest:
        raise IRError("corrupt popir graph bytes: checksum mismatch (changed or truncated)")
    (length,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    if start + length > len(data):
        raise IRError("corrupt popir graph bytes: truncated header")
    header = json.loads(data[start : start + length].decode())
    payload = memoryview(data)[start + length :]
    if sum(size for _, size in header["blobs"]) != len(payload):
        raise IRError("corrupt popir graph bytes: constant data of the wrong length")
    blobs = []
    for offset, size in header["blobs"]:
        if offset < 0 or size < 0 or offset + size > len(payload):
            raise IRError("corrupt popir graph bytes: truncated constant data")
        blobs.append(payload[offset : offset + size])

    def attr(value):
        if isinstance(value, dict) and "array" in value:
            dtype, shape, index = value["array"]
            return np.frombuffer(blobs[index], dtype=np.dtype(dtype)).reshape(shape).copy()
        if isinstance(value, dict) and "tuple" in value:
            return tuple(attr(v) for v in value["tuple"])
        return value

    graph = Graph(header["name"])
    by_id = {}
    for vid, name, kind, shape, dtype in header["inputs"]:
        value = graph.add_input(name, shape, dtype, kind)
        by_id[vid] = value
    for entry in header["nodes"]:
        inputs = [by_id[i] for i in entry["in"]]
        annotations = {name: entry.get(name) for name in ANNOTATIONS}
        if annotations["placement"] is not None:
            annotations["placement"] = tuple(annotations["placement"])
        node = Node(entry["op"], inputs, {k: attr(v) for k, v in entry["attrs"].items()}, [], **annotations)
        for vid, shape, dtype in entry["out"]:
            by_id[vid] = graph._new_value(TensorType.of(shape, dtype), producer=node)
            node.outputs.append(by_id[vid])
        graph.nodes.append(node)
    for name, vid in header["outputs"]:
        graph.outputs[name] = by_id[vid]
    for sid, vid in header["updates"]:
        graph.updates[by_id[sid]] = by_id[vid]
    graph.verify()
    return graph
