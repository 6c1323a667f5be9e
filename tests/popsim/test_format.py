"""The instruction format is declared once (_opcodes.py) and every place agrees with it: the compiled engine
modules, each sub-op's codelet, the cost model and the lowering table. Mutating the declaration on one side
(two sub-ops swapped, a column moved) makes the check fail."""

import pathlib
import re

import numpy as np
import pytest

import popir
import popsim
from popir import DType
from popsim import _codelets, _exchange, _kernels, cost, lowerings
from popsim import _opcodes as oc

ENGINE_MODULES = (_codelets, _exchange, _kernels)
TARGET = popsim.Target.small(num_tiles=2)
N = 8


def format_disagreements(declared, compiled):
    """Names whose value differs between the declaration's enums and a module's compiled ones."""
    flat = {name: value for _, values in declared for name, value in values.items()}
    return sorted(name for name in flat.keys() | compiled.keys() if flat.get(name) != compiled.get(name))


@pytest.mark.parametrize("module", ENGINE_MODULES, ids=lambda m: m.__name__)
def test_every_engine_module_is_compiled_with_the_declared_format(module):
    assert format_disagreements(oc.enums(), module.compiled_enums()) == []


def test_swapping_two_sub_ops_in_the_declaration_fails_the_check(monkeypatch):
    names = list(oc.UNARY_OPS)
    i, j = names.index("atan"), names.index("atanh")
    names[i], names[j] = names[j], names[i]
    monkeypatch.setattr(oc, "UNARY_OPS", {name: k for k, name in enumerate(names)})
    monkeypatch.setitem(oc.SUB_OP_PREFIXES, "U", oc.UNARY_OPS)
    assert format_disagreements(oc.enums(), _codelets.compiled_enums()) == ["U_ATAN", "U_ATANH"]


def test_moving_a_column_in_the_declaration_fails_the_check(monkeypatch):
    columns = list(oc.ROW_COLUMNS)
    columns.insert(3, columns.pop(columns.index("p2")))
    monkeypatch.setattr(oc, "COL", {name: i for i, name in enumerate(columns)})
    wrong = format_disagreements(oc.enums(), _kernels.compiled_enums())
    assert wrong == ["C_A", "C_B", "C_C", "C_DTA", "C_DTB", "C_DTOUT", "C_OUT", "C_P0", "C_P1", "C_P2"]


def test_sub_op_tables_number_their_entries_densely():
    for kind, table in oc.SUB_OPS.items():
        assert sorted(table.values()) == list(range(len(table))), oc.KIND_NAMES[kind - 1]
    assert set(oc.VERTEX_FIELDS) == set(oc.VERTEX_PARAMS) == set(oc.SUB_OPS) == set(oc.KINDS.values())
    assert all(col in oc.COL for params in oc.VERTEX_PARAMS.values() for col in params.values())
    assert oc.EXPR_REGS >= len(oc.EXPR_FIELDS) + oc.EXPR_MAX_OPS


def test_the_cost_model_and_the_lowering_table_cover_every_sub_op():
    for name in [*oc.UNARY_OPS, *oc.BINARY_OPS]:
        assert name in cost.CYCLES_PER_VECTOR, name
    internal = {"copy", "cast", "bitwise_not"}
    for name in [*oc.UNARY_OPS, *oc.BINARY_OPS]:
        assert name in internal or name in lowerings.LOWERINGS, name


def test_the_engine_sources_spell_no_format_number():
    """Kinds, sub-ops, dtypes and phases are compared by name in the engine, never by a bare literal."""
    package = pathlib.Path(_kernels.__file__).parent
    bare = re.compile(r"\b(op|kind|sub|dt\w*)\s*[=!]=\s*\d|\b(row|ph|o|prog|stream|r)\[\d")
    for path in sorted(package.glob("*.p[yx][xd]")):
        hits = [line for line in path.read_text().splitlines() if bare.search(line)]
        assert hits == [], path.name


# -- every declared sub-op's codelet computes the popir op of its name ----------------------------------------
_FLOAT = np.linspace(0.15, 0.85, N).astype(np.float32)
_SPECIAL = {"acosh": _FLOAT + 1, "round": np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.4, -0.6], np.float32)}
_INTEGER = {"bitwise_not", "bitwise_and", "bitwise_or", "bitwise_xor"}
_LOGICAL = {"logical_not", "logical_and", "logical_or"}


def _operand(name, which):
    if name in _INTEGER:
        return np.array([5, -3, 0, 7, 12, -9, 1, 2], np.int32) * (which + 1)
    if name in _LOGICAL:
        return np.array([1, 0, 1, 0, 1, 1, 0, 0], bool) ^ bool(which)
    if which:
        return np.linspace(1.7, 0.3, N).astype(np.float32)
    return _SPECIAL.get(name, _FLOAT)


def _run_vertex(kind, name, operands, out_dtype):
    dg = popsim.DeviceGraph(TARGET)
    here = popsim.TileMapping.on_tiles([N], [0])
    ins = [
        dg.add_tensor((N,), popir.as_dtype(x.dtype.name), here, f"x{i}", "constant", x) for i, x in enumerate(operands)
    ]
    out = dg.add_tensor((N,), out_dtype, here, "out")
    cs = dg.add_compute_set(name)
    fields = {"out": out.region(0, N), **{f: t.region(0, N) for f, t in zip("ab", ins)}}
    dg.add_vertex(cs, kind, name, 0, N, fields, 1)
    return popsim.compile_device_graph(dg, outputs={"out": out}).run()["out"]


@pytest.mark.parametrize("name", [n for n in oc.UNARY_OPS if n not in ("copy", "cast")])
def test_each_unary_codelet_computes_its_op(name):
    x = _operand(name, 0)
    expected = popir.get_op(name).ref(x)
    got = _run_vertex("unary", name, [x], popir.as_dtype(expected.dtype.name))
    np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("name", list(oc.BINARY_OPS))
def test_each_binary_codelet_computes_its_op(name):
    a, b = _operand(name, 0), _operand(name, 1)
    expected = np.asarray(popir.get_op(name).ref(a, b))
    got = _run_vertex("binary", name, [a, b], popir.as_dtype(expected.dtype.name))
    np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=name)


# -- the engine traps what it does not know -------------------------------------------------------------------
def _raw_run(row):
    """Run one hand-made instruction row on a tiny arena, bypassing every build-time check."""
    arena = popsim.TileArena(1, 256)
    phases = np.array([[oc.PHASES["COMPUTE"], 0, 1, 0]], np.int64)
    table = np.array([row], np.int64)
    empty = np.zeros((0, oc.NCOLS), np.int64)
    return _kernels.run_program(
        arena,
        phases,
        np.zeros(1, np.int64),
        table,
        np.zeros(1),
        np.zeros((0, len(oc.COPY_COLUMNS)), np.int32),
        np.zeros(0, np.int64),
        empty[:, :3],
        np.zeros((1, len(oc.STREAM_COLUMNS)), np.int64),
        np.zeros(0, np.uint8),
    )


def _row(kind, sub):
    row = [0] * oc.NCOLS
    row[oc.COL["op"]], row[oc.COL["sub"]], row[oc.COL["n"]] = kind, sub, 4
    row[oc.COL["out"]] = 64
    return row


@pytest.mark.parametrize(
    "kind, sub",
    [(99, 0), (0, 0), (oc.UNARY, len(oc.UNARY_OPS)), (oc.BINARY, 99), (oc.REDUCE, 7), (oc.FILL, 1), (oc.GATHER, 2)],
)
def test_the_engine_traps_unknown_kinds_and_sub_ops(kind, sub):
    bad, _, _, trap, _ = _raw_run(_row(kind, sub))
    assert trap == 0 and bad == 0


def test_a_known_row_does_not_trap():
    assert _raw_run(_row(oc.FILL, 0))[3] == -1


def test_add_vertex_takes_kinds_and_sub_ops_by_name():
    dg = popsim.DeviceGraph(TARGET)
    t = dg.add_tensor((N,), DType.float32, popsim.TileMapping.on_tiles([N], [1]))
    cs = dg.add_compute_set("neg")
    v = dg.add_vertex(cs, "UNARY", "neg", 1, N, {"a": t.region(0, N), "out": t.region(0, N)}, 1)
    assert (v.kind, v.sub) == (oc.UNARY, oc.UNARY_OPS["neg"])


def test_a_run_that_traps_is_an_error_naming_the_row():
    g = popir.Graph("g")
    x = g.add_input("x", (N,), "float32")
    g.output("y", popir.ops.exp(x))
    exe = popsim.compile(g, TARGET)
    flat = exe._programs["g"][0]
    table = flat.instructions.copy()
    table[0, oc.COL["sub"]] = len(oc.UNARY_OPS)  # a sub-op no codelet implements, past the build-time checks
    flat.instructions = table
    expected = rf"trapped instruction row 0 \(kind {oc.UNARY}, sub-op {len(oc.UNARY_OPS)}\)"
    with pytest.raises(popsim.EngineFault, match=expected):
        exe.run({"x": np.ones(N, np.float32)})
