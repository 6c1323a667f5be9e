"""The per-kind vertex builders of _opcodes: one per kind, each giving its kind, sub-op, fields and
parameters as the instruction format declares them, and a vertex built with one runs."""

import inspect

import numpy as np
import pytest

import popsim
from popir import DType
from popsim import _opcodes as oc

TARGET = popsim.Target.small(num_tiles=2)
N = 6


class _Recorder:
    """Stands in for DeviceGraph.add_vertex: keeps what a builder passes."""

    def __call__(self, cs, kind, sub, tile, n, fields, cycles, **params):
        self.kind, self.sub, self.fields, self.params = kind, sub, fields, params


def _call(builder, **overrides):
    """``builder`` called with a recorder and a placeholder for every field and parameter it names."""
    recorder = _Recorder()
    named = inspect.signature(builder).parameters
    args = {name: overrides.get(name, name) for name, p in named.items() if p.kind == p.KEYWORD_ONLY}
    args.pop("scalars", None)
    args.pop("checked_elsewhere", None)
    if "operands" in args:
        args["operands"] = overrides.get("operands", ["a"])
    if "leaves" in args:
        args["leaves"] = ["a", "b"]
    positional = [overrides["op"]] if "op" in overrides else []
    builder(recorder, "cs", *positional, 0, N, 1, **args)
    return recorder


CALLS = {
    oc.UNARY: {"op": "neg", "operands": ["a"]},
    oc.BINARY: {"op": "add", "operands": ["a", "b"]},
    oc.WHERE: {"op": "where", "operands": ["c", "a", "b"]},
    oc.REDUCE: {"op": "max"},
}


def test_every_kind_has_a_builder():
    assert set(oc.BUILDERS) == set(oc.KINDS.values())


@pytest.mark.parametrize("kind", sorted(oc.KINDS.values()), ids=oc.KIND_NAMES)
def test_a_builder_gives_its_kind_and_the_declared_fields_and_parameters(kind):
    overrides = CALLS.get(kind, {})
    got = _call(oc.BUILDERS[kind], **overrides)
    assert got.kind == kind
    expected_sub = oc.SUB_OPS[kind].get(overrides.get("op"), 0)
    assert got.sub == expected_sub
    assert set(got.fields) <= set(oc.VERTEX_FIELDS[kind]) and "out" in got.fields
    assert set(got.params) - {"fparam", "program"} == set(oc.VERTEX_PARAMS[kind])


def test_gather_and_scatter_add_choose_who_counts_bad_indices():
    for builder in (oc.gather, oc.scatter_add):
        counted = _call(builder)
        assert counted.sub == oc.GATHER_MODES["count_bad"]
        recorder = _Recorder()
        fields = {name: name for name in ("table", "indices", "updates", "out")}
        if builder is oc.gather:
            del fields["updates"]
        builder(recorder, "cs", 0, N, 1, **fields, rows=1, inner=1, size=N, checked_elsewhere=True)
        assert recorder.sub == oc.GATHER_MODES["checked_elsewhere"]


def test_vertices_built_by_name_run():
    dg = popsim.DeviceGraph(TARGET)
    here = popsim.TileMapping.on_tiles([N], [0])
    table = dg.add_tensor((N,), DType.float32, here, "table", "constant", np.arange(N, dtype=np.float32) * 10)
    idx = dg.add_tensor((N,), DType.int32, here, "idx", "constant", np.array([5, 0, 3, 3, 1, 2], np.int32))
    picked = dg.add_tensor((N,), DType.float32, here, "picked")
    doubled = dg.add_tensor((N,), DType.float32, here, "doubled")
    cs = dg.add_compute_set("gather")
    region = {"table": table.region(0, N), "indices": idx.region(0, N), "out": picked.region(0, N)}
    oc.gather(dg.add_vertex, cs, 0, N, 1, **region, rows=1, inner=1, size=N)
    add = dg.add_compute_set("add")
    operands = [picked.region(0, N), picked.region(0, N)]
    oc.elementwise(dg.add_vertex, add, "add", 0, N, 1, operands=operands, out=doubled.region(0, N))
    out = popsim.compile_device_graph(dg, outputs={"doubled": doubled}).run()["doubled"]
    np.testing.assert_array_equal(out, 2 * (np.arange(N) * 10)[[5, 0, 3, 3, 1, 2]])
