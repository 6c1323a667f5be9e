"""Catalogue (popir, no torch): any change to serialized bytes is refused (constant data included), deep
nesting is an IRError, verify matches values by identity, and bad graph building names the cause."""

import hashlib
import json
import struct

import numpy as np
import pytest

import popir
from popir import ops, serialize


def _graph_with_constant():
    g = popir.Graph("g")
    x = g.add_input("x", (2, 3), "float32")
    c = g.constant(np.arange(6, dtype=np.float32).reshape(2, 3))
    g.output("y", ops.exp(x * c) + 1.0)
    return g


def _signed(header, blobs=b""):
    """Bytes with a correct checksum around ``header``: what a crafted buffer looks like."""
    text = json.dumps(header).encode()
    body = serialize.MAGIC + struct.pack("<Q", len(text)) + text + blobs
    return body + hashlib.sha256(body).digest()


@pytest.mark.outcome("clear error")
def test_every_single_byte_change_is_refused():
    data = _graph_with_constant().to_bytes()
    for at in range(len(data)):
        changed = bytearray(data)
        changed[at] ^= 0x01
        with pytest.raises(popir.IRError, match="corrupt"):
            popir.Graph.from_bytes(bytes(changed))


@pytest.mark.outcome("clear error")
def test_changed_constant_data_is_refused():
    g = _graph_with_constant()
    data = bytearray(g.to_bytes())
    constant = np.arange(6, dtype=np.float32).tobytes()
    at = bytes(data).index(constant)
    data[at : at + 4] = np.float32(7).tobytes()
    with pytest.raises(popir.IRError, match="checksum"):
        popir.Graph.from_bytes(bytes(data))


@pytest.mark.outcome("clear error")
@pytest.mark.parametrize("keep", [0, 8, 16, -33, -1])
def test_truncated_bytes_are_refused(keep):
    with pytest.raises(popir.IRError, match="corrupt"):
        popir.Graph.from_bytes(_graph_with_constant().to_bytes()[:keep])


@pytest.mark.outcome("clear error")
def test_a_deeply_nested_header_is_an_irerror_not_a_recursion_error():
    text = b"[" * 100_000 + b"]" * 100_000
    body = serialize.MAGIC + struct.pack("<Q", len(text)) + text
    with pytest.raises(popir.IRError, match="nests too deeply"):
        popir.Graph.from_bytes(body + hashlib.sha256(body).digest())


@pytest.mark.outcome("clear error")
def test_a_deeply_nested_attribute_is_an_irerror():
    g = popir.Graph("g")
    x = g.add_input("x", (2,), "float32")
    g.output("y", ops.exp(x))
    header = json.loads(g.to_bytes()[16:-32].decode())
    header["nodes"][0]["attrs"]["deep"] = "DEEP"
    # Shallow enough for the JSON reader, too deep for decoding the attribute's nested tuples.
    depth = 600
    text = json.dumps(header).replace('"DEEP"', '{"tuple":[' * depth + "0" + "]}" * depth).encode()
    body = serialize.MAGIC + struct.pack("<Q", len(text)) + text
    with pytest.raises(popir.IRError, match="corrupt"):
        popir.Graph.from_bytes(body + hashlib.sha256(body).digest())


@pytest.mark.outcome("clear error")
def test_a_header_of_the_wrong_types_is_an_irerror():
    for header in ({}, [], {"blobs": "x"}, {"blobs": [], "name": "g", "inputs": [], "nodes": [{"attrs": []}]}):
        with pytest.raises(popir.IRError, match="corrupt"):
            popir.Graph.from_bytes(_signed(header))


@pytest.mark.outcome("right result")
def test_round_trip_still_equal():
    g = _graph_with_constant()
    assert popir.Graph.from_bytes(g.to_bytes()).to_bytes() == g.to_bytes()


@pytest.mark.outcome("clear error")
def test_verify_rejects_an_output_of_another_graph_with_the_same_id():
    g, other = popir.Graph("g"), popir.Graph("other")
    g.output("y", ops.exp(g.add_input("x", (2,), "float32")))
    foreign = ops.exp(other.add_input("x", (2,), "float32"))
    assert foreign.id == g.outputs["y"].id
    g.outputs["z"] = foreign
    with pytest.raises(popir.IRError, match="output 'z'.*another graph"):
        g.verify()


@pytest.mark.outcome("clear error")
def test_verify_rejects_a_node_reading_another_graphs_value():
    g, other = popir.Graph("g"), popir.Graph("other")
    x = g.add_input("x", (2,), "float32")
    g.output("y", ops.exp(x))
    g.nodes[0].inputs[0] = other.add_input("x", (2,), "float32")
    with pytest.raises(popir.IRError, match="another graph"):
        g.verify()


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda g, x: g.add_input("x", (2,), "float32"), "graph input 'x' is defined twice"),
        (lambda g, x: g.add_input("n", (-1, 3), "float32"), r"shape \[-1, 3\] has a negative dimension"),
        (lambda g, x: g.add_input("c", (1,), "complex64"), "dtype complex64 is not supported on the device"),
        (lambda g, x: g.add_input("k", (1,), "float32", kind="weights"), "input kind must be one of"),
        (lambda g, x: g.apply("no_such_op", (x,), {}), "unknown op 'no_such_op'"),
        (lambda g, x: ops.matmul(x, x), r"matmul\(.*contraction sizes differ"),
        (lambda g, x: ops.reshape(x, shape=(5,)), r"cannot reshape \[2, 3\] \(6 elements\) to \[5\]"),
        (lambda g, x: ops.reduce_sum(x, axes=(5,), keepdims=False), "axis 5 is out of range for rank 2"),
        (lambda g, x: g.output("y", 3), "output 'y' must be a Value of this graph"),
        (lambda g, x: x + popir.Graph("other").add_input("y", (2, 3), "float32"), "is not a Value of this graph"),
        (lambda g, x: g.update(x, x), "only parameters, buffers and optimizer state can be updated"),
        (lambda g, x: g.constant(np.array([object()])), "dtype object is not supported on the device"),
    ],
    ids=[
        "duplicate_input",
        "negative_dimension",
        "unsupported_dtype",
        "unknown_input_kind",
        "unknown_op",
        "matmul_mismatch",
        "bad_reshape",
        "axis_out_of_range",
        "output_not_a_value",
        "value_of_another_graph",
        "update_of_an_input",
        "object_constant",
    ],
)
@pytest.mark.outcome("clear error")
def test_bad_graph_building_is_an_irerror(build, message):
    g = popir.Graph("g")
    x = g.add_input("x", (2, 3), "float32")
    with pytest.raises(popir.IRError, match=message):
        build(g, x)
    g.output("ok", ops.exp(x))
    g.verify()


@pytest.mark.outcome("clear error")
@pytest.mark.parametrize(
    "feeds, message",
    [({}, "no value fed for graph input 'x'"), ({"x": np.zeros((3, 2))}, r"expected shape \(2, 3\), got \(3, 2\)")],
    ids=["missing_feed", "wrong_shape"],
)
def test_bad_interpreter_feeds(feeds, message):
    g = popir.Graph("g")
    g.output("y", ops.exp(g.add_input("x", (2, 3), "float32")))
    with pytest.raises(popir.IRError, match=message):
        popir.interpreter.run(g, feeds)


@pytest.mark.outcome("clear error")
def test_from_bytes_of_something_else():
    for data in ("text", None, 12):
        with pytest.raises(popir.IRError, match="corrupt popir graph bytes"):
            popir.Graph.from_bytes(data)
