"""Checks that keep the engine inside tile memory: a vertex when it is built, a compiled program's tables
before they run (``check_program``, for programs that did not come from this process's builder, such as
ones loaded from bytes).

The engine itself does no bounds checks (its loops are the simulator's hot path), so everything it reads
is checked here, against the format _opcodes.py declares; every failure is a ``popsim.Error``.
"""

import numpy as np

from popir import as_dtype
from popsim import _opcodes as oc
from popsim.errors import Error

_DTYPE_NAMES = {code: name for name, code in oc.DTYPE_CODES.items()}
_KIND_NAMES = {code: name for name, code in oc.KINDS.items()}
_ELEMENTWISE = (oc.UNARY, oc.BINARY, oc.WHERE)
_INT32_MAX = 2**31 - 1
_HEAD, _OP = oc.EXPR_HEAD, oc.EXPR_OP  # columns of an EXPR program header and op rows
# Each kind's field and parameter names as sets, built once (check_vertices runs per batch).
_FIELD_SETS = {kind: frozenset(fields) for kind, fields in oc.VERTEX_FIELDS.items()}
_PARAM_SETS = {kind: frozenset(params) for kind, params in oc.VERTEX_PARAMS.items()}


def kind_code(kind):
    """The number of a vertex kind given by number or by name ("BINARY", "binary")."""
    if isinstance(kind, str) and kind.upper() in oc.KINDS:
        return oc.KINDS[kind.upper()]
    if isinstance(kind, int | np.integer) and int(kind) in _KIND_NAMES:
        return int(kind)
    raise Error(f"unknown vertex kind {kind!r}; kinds: {', '.join(oc.KIND_NAMES)}")


def sub_code(kind, sub):
    """The number of sub-op ``sub`` (a number or a name such as "add") of vertex kind ``kind``."""
    table = oc.SUB_OPS[kind]
    if isinstance(sub, str) and sub in table:
        return table[sub]
    if isinstance(sub, int | np.integer) and 0 <= int(sub) < len(table):
        return int(sub)
    raise Error(f"{_KIND_NAMES[kind]} vertex: unknown sub-op {sub!r}; sub-ops: {', '.join(table)}")


def check_vertices(kind, n, fields, params, fparam, program):
    """Raise a popsim.Error unless every vertex of a batch of ``kind`` (a number) reads and writes only inside
    its field ranges: known field names (each kind's fields are ``oc.VERTEX_FIELDS``), known parameters,
    sizes that match ``n`` and the parameters, and the dtypes its codelet handles. ``n`` and each parameter
    are int64 arrays (one entry per vertex), ``fields`` maps names to Regions; the error names the values of
    the first vertex that fails."""
    what = f"{_KIND_NAMES[kind]} vertex"
    allowed = oc.VERTEX_FIELDS[kind]
    unknown = sorted(fields.keys() - _FIELD_SETS[kind])
    if unknown:
        raise Error(f"{what}: unknown field(s) {unknown}; a {_KIND_NAMES[kind]} vertex has fields {list(allowed)}")
    names = _PARAM_SETS[kind]
    if params.keys() - names:
        raise Error(f"{what}: unknown parameter(s) {sorted(set(params) - names)}; it takes {sorted(names) or 'none'}")
    for name, values in params.items():
        ok = (values >= 0) & (values <= _INT32_MAX)
        _need(what, ok, f"parameters must be integers in 0..2**31-1, got {name}={{}}", values)
    if fparam and kind != oc.FILL:
        raise Error(f"{what}: only a FILL vertex takes fparam (its value); use the named parameters {sorted(names)}")
    if program is not None and kind != oc.EXPR:
        raise Error(f"{what}: only an EXPR vertex takes a program")
    _need(what, (n >= 0) & (n <= _INT32_MAX), "n must be a non-negative integer, got {}", n)
    required = allowed if kind != oc.EXPR else ("out",)
    missing = [f for f in required if f not in fields]
    if missing:
        raise Error(f"{what}: missing field(s) {missing}")
    sizes = {name: r.stops - r.starts for name, r in fields.items()}
    dtypes = {name: str(r.tensor.dtype) for name, r in fields.items()}
    _SHAPE_CHECKS[kind](what, n, sizes, dtypes, params, program)


def _need(what, ok, message, *values):
    """Raise a popsim.Error with ``message`` unless ``ok`` (a bool, or an array of one per vertex) holds
    everywhere; its ``{}`` take the first failing vertex's entries of ``values`` (per-vertex arrays or scalars)."""
    ok = np.asarray(ok)
    if ok.all():
        return
    i = int(np.argmin(ok)) if ok.ndim else 0
    picked = [int(v[i]) if np.ndim(v) else v for v in values]
    raise Error(f"{what}: {message.format(*picked) if values else message}")


def _elementwise_check(what, n, sizes, dtypes, params, program):
    operands = [f for f in "abc" if f in sizes]
    forms = _check_forms(what, params.get("scalars", 0), len(operands), n, params)
    _need(what, sizes["out"] == n, "field 'out' holds {} elements, n is {}", sizes["out"], n)
    for name, want in zip(operands, forms):
        _need(what, sizes[name] == want, f"field {name!r} holds {{}} elements, needs {{}}", sizes[name], want)
    if "c" in sizes:  # WHERE: a bool condition selects between b and c, which share out's dtype
        _need(what, dtypes["a"] == "bool", "the condition (field 'a') must be bool")
        same = dtypes["b"] == dtypes["c"] == dtypes["out"]
        _need(what, same, "b, c and out must share a dtype")


def _forms(mask):
    """(scalars, repeats, held): the three masks an operand-forms mask holds."""
    low = (1 << oc.REPEAT_SHIFT) - 1
    return mask & low, mask >> oc.REPEAT_SHIFT & low, mask >> oc.HELD_SHIFT


def _check_forms(what, mask, count, n, params):
    """The element count each of ``count`` operands must hold under the operand-forms ``mask`` (one element, a
    repeating ``period``, the runs a held operand spans, or n: _opcodes' OPERAND FORMS), after checking the
    mask and the period and phase."""
    scalars, repeats, held = _forms(mask)
    named = (scalars < (1 << count)) & (repeats < (1 << count)) & (held < (1 << count))
    _need(what, named, "scalars mask {} names absent operands", mask)
    _need(what, (scalars & repeats | scalars & held | repeats & held) == 0, "operands of two forms (mask {})", mask)
    period, phase = params.get("period", 0), params.get("phase", 0)
    ok = np.where(repeats | held > 0, (period >= 1) & (phase < period), (period == 0) & (phase == 0))
    message = "period {} and phase {} must satisfy 0 <= phase < period (both 0 without repeating operands)"
    _need(what, ok, message, period, phase)
    return [_form_count(mask, i, n, period, phase) for i in range(count)]


def _reduce_check(what, n, sizes, dtypes, params, program):
    rows, group = params.get("rows", 0), params.get("group", 0)
    out = sizes["out"]
    _need(what, (rows == n) & (n == out), "needs rows == n == the size of 'out' ({})", out)
    _need(what, group >= 1, "needs group >= 1 (the inputs reduced into each output)")
    want = rows * group
    _need(what, sizes["a"] == want, "field 'a' must hold rows * group = {} elements", want)


def _matmul_check(what, n, sizes, dtypes, params, program):
    m, k = params.get("m", 0), params.get("k", 0)
    for name, want in (("a", m * k), ("b", k * n), ("out", m * n)):
        message = f"field {name!r} must hold {{}} elements (m={{}}, k={{}}, n={{}})"
        _need(what, sizes[name] == want, message, want, m, k, n)
    _need(what, dtypes["a"] == dtypes["b"], "a and b must share a dtype")
    _need(what, dtypes["a"] in ("float32", "float16"), "a and b must be float32 or float16")
    _need(what, dtypes["out"] in ("float32", "float16"), "out (the partials) must be float32 or float16")


def _conv_check(what, n, sizes, dtypes, params, program):
    for name, param in (("a", "patch"), ("b", "weights")):
        want = params.get(param, 0)
        _need(what, sizes[name] == want, f"field {name!r} must hold {param} = {{}} elements", want)
    _need(what, params.get("taps", 0) >= 1, "needs taps >= 1")
    geometry = (sizes["c"] == len(oc.CONV_GEOMETRY)) & (dtypes["c"] == "int32")
    _need(what, geometry, f"field 'c' must be the {len(oc.CONV_GEOMETRY)} int32 geometry words")
    _need(what, sizes["out"] == n, "field 'out' must hold n = {} elements", n)
    _need(what, dtypes["a"] == dtypes["b"], "a and b must share a dtype")
    _need(what, dtypes["a"] in ("float32", "float16"), "a and b must be float32 or float16")
    _need(what, dtypes["out"] in ("float32", "float16"), "out (the partials) must be float32 or float16")


def _rng_check(what, n, sizes, dtypes, params, program):
    _need(what, (sizes["a"] == 2) & (dtypes["a"] == "int32"), "field 'a' must be the 2 int32 seed words")
    _need(what, sizes["out"] == n, "field 'out' must hold n = {} elements", n)
    _need(what, dtypes["out"] in ("float32", "float16"), "out must be float32 or float16")


def _copy_check(what, n, sizes, dtypes, params, program):
    _need(what, (sizes["a"] == n) & (sizes["out"] == n), "fields 'a' and 'out' must hold n = {} elements", n)
    _need(what, dtypes["a"] == dtypes["out"], "a and out must share a dtype")


def _gather_check(what, n, sizes, dtypes, params, program):
    rows, inner, size = params.get("rows", 0), params.get("inner", 0), params.get("size", 0)
    # Products of three parameters may pass int64: compare them as floats (exact below 2**53, where sizes lie).
    table, picked = np.float64(1) * rows * size * inner, np.float64(1) * rows * n * inner
    _need(what, (rows >= 1) & (size >= 1), "needs rows >= 1 and size >= 1 (the indexed axis)")
    _need(what, (dtypes["b"] == "int32") & (sizes["b"] == n), "field 'b' must be n = {} int32 indices", n)
    _need(what, dtypes["a"] == dtypes["out"], "a and out must share a dtype")
    if "c" in sizes:  # SCATTER_ADD: out (rows, size, inner) += c (rows, n, inner)
        _need(what, sizes["out"] >= table, "field 'out' must hold rows * size * inner elements")
        _need(what, sizes["c"] >= picked, "field 'c' must hold rows * n * inner elements")
        _need(what, dtypes["c"] == dtypes["out"], "c and out must share a dtype")
    else:
        _need(what, sizes["a"] >= table, "field 'a' must hold rows * size * inner elements")
        _need(what, sizes["out"] >= picked, "field 'out' must hold rows * n * inner elements")


def _fill_check(what, n, sizes, dtypes, params, program):
    _need(what, sizes["out"] == n, "field 'out' must hold n = {} elements", n)


def _expr_check(what, n, sizes, dtypes, params, program):
    _need(what, isinstance(program, np.ndarray) and program.ndim == 2, "needs its program (an int64 array)")
    header = program[0]
    leaves = [f for f in oc.EXPR_FIELDS if f in sizes]
    _need(what, leaves == list(oc.EXPR_FIELDS[: len(leaves)]), f"leaves must be the first fields of {oc.EXPR_FIELDS}")
    _need(what, header[_HEAD["leaves"]] == len(leaves), "its program's leaf count differs from its fields")
    check_expression(program, what)
    forms = _check_forms(what, header[_HEAD["scalars"]], len(leaves), n, params)
    for i, (name, want) in enumerate(zip(leaves, forms)):
        _need(what, sizes[name] == want, f"field {name!r} holds {{}} elements, needs {{}}", sizes[name], want)
        _need(what, oc.DTYPE_CODES[dtypes[name]] == header[_HEAD["leaf_dt"] + i], f"leaf {name!r} dtype")
    _need(what, sizes["out"] == n, "field 'out' must hold n = {} elements", n)
    _need(what, oc.DTYPE_CODES[dtypes["out"]] == header[_HEAD["out_dt"]], "out: dtype differs")


_SHAPE_CHECKS = {
    oc.UNARY: _elementwise_check,
    oc.BINARY: _elementwise_check,
    oc.WHERE: _elementwise_check,
    oc.REDUCE: _reduce_check,
    oc.MATMUL: _matmul_check,
    oc.RNG: _rng_check,
    oc.COPY: _copy_check,
    oc.GATHER: _gather_check,
    oc.SCATTER_ADD: _gather_check,
    oc.FILL: _fill_check,
    oc.EXPR: _expr_check,
    oc.CONV: _conv_check,
}


def check_expression(program, what="EXPR program"):
    """An EXPR program (header row, one row per op) that the engine can run within its registers."""
    program = np.asarray(program)
    _need(what, program.ndim == 2 and program.shape[1] == oc.NCOLS and len(program) >= 2, "malformed program rows")
    header = program[0]
    leaves, ops = int(header[_HEAD["leaves"]]), int(header[_HEAD["ops"]])
    _need(what, 0 <= leaves <= len(oc.EXPR_FIELDS) and 1 <= ops <= oc.EXPR_MAX_OPS, "too many leaves or ops")
    _need(what, len(program) == 1 + ops, f"program has {len(program) - 1} op rows for {ops} ops")
    _need(what, 0 <= header[_HEAD["result"]] < leaves + ops, "result register out of range")
    dtypes = [header[_HEAD["out_dt"]], *header[_HEAD["leaf_dt"] : _HEAD["leaf_dt"] + leaves]]
    _need(what, all(d in _DTYPE_NAMES for d in dtypes), "unknown dtype code")
    mask = header[_HEAD["scalars"]]
    _need(what, mask >= 0 and max(_forms(mask)) < (1 << leaves), "scalars mask names missing leaves")
    if header[_HEAD["float32"]]:
        fast = {oc.BINARY_OPS[name] for name in oc.BINARY_FLOAT32_OPS}
        _need(
            what,
            all(d == oc.DTYPE_CODES["float32"] for d in dtypes)
            and all(r[_OP["kind"]] == oc.BINARY and r[_OP["sub"]] in fast for r in program[1:])
            and all(r[_OP["dt"]] == oc.DTYPE_CODES["float32"] for r in program[1:]),
            "the float32 flag needs float32 leaves and only float32 " + "/".join(oc.BINARY_FLOAT32_OPS),
        )
    for j, row in enumerate(program[1:]):
        kind, sub = int(row[_OP["kind"]]), int(row[_OP["sub"]])
        _need(what, kind in _ELEMENTWISE, f"op {j}: kind {kind} is not UNARY, BINARY or WHERE")
        _need(what, 0 <= sub < len(oc.SUB_OPS[kind]), f"op {j}: unknown sub-op {sub}")
        _need(what, row[_OP["dst"]] == leaves + j, f"op {j} must write register {leaves + j}")
        srcs = row[_OP["src"] : _OP["src"] + oc.EXPR_SRCS]
        _need(what, all(0 <= r < leaves + j for r in srcs), f"op {j} reads a register not yet written")
        _need(what, row[_OP["dt"]] in _DTYPE_NAMES, f"op {j}: unknown dtype code")


# -- compiled tables ------------------------------------------------------------------------------------------
_ITEMSIZES = (1, 2, 4)  # the element sizes an exchange row may move
_MAX_ROW_VALUE = 2**40  # any count or offset beyond this is corrupt (and would overflow the extents below)


def _fail(message):
    raise Error(f"invalid compiled program: {message}")


def _itemsizes(codes):
    """Bytes per element of dtype codes (an array); unknown codes were rejected before."""
    sizes = np.zeros(max(oc.DTYPE_CODES.values()) + 1, np.int64)
    for name, code in oc.DTYPE_CODES.items():
        sizes[code] = as_dtype(name).itemsize
    return sizes[codes]


def _instruction_extents(table, rows):
    """(addresses, byte counts) of the up to 7 fields each instruction row in ``rows`` touches (count 0: unused).
    EXPR rows are checked (and their leaves measured) by _expression_extents."""
    r = table[rows]
    col = oc.COL
    kind, n, p0, p1, p2 = r[:, col["op"]], r[:, col["n"]], r[:, col["p0"]], r[:, col["p1"]], r[:, col["p2"]]
    # An EXPR row's dtype columns hold leaf addresses (its program holds the dtypes).
    isa, isb, iso = (_itemsizes(np.where(kind == oc.EXPR, 0, r[:, col[c]])) for c in ("dta", "dtb", "dtout"))
    addr = np.zeros((len(r), 7), np.int64)
    size = np.zeros((len(r), 7), np.int64)
    addr[:, :4] = r[:, [col["a"], col["b"], col["c"], col["out"]]]
    elementwise = np.isin(kind, _ELEMENTWISE)
    scalar = [_form_count(np.where(elementwise, p0, 0), i, n, p1, p2) for i in range(3)]
    for k, (a, b, c, out) in {
        oc.UNARY: (scalar[0] * isa, 0, 0, n * iso),
        oc.BINARY: (scalar[0] * isa, scalar[1] * isb, 0, n * iso),
        oc.WHERE: (scalar[0], scalar[1] * isb, scalar[2] * isb, n * iso),
        oc.REDUCE: (p0 * p1 * isa, 0, 0, p0 * iso),
        oc.MATMUL: (p0 * p1 * isa, p1 * n * isa, 0, p0 * n * iso),
        oc.RNG: (8, 0, 0, n * iso),
        oc.COPY: (n * iso, 0, 0, n * iso),
        oc.GATHER: (p0 * p2 * p1 * isa, n * 4, 0, p0 * n * p1 * isa),
        oc.SCATTER_ADD: (0, n * 4, p0 * n * p1 * isa, p0 * p2 * p1 * isa),
        oc.FILL: (0, 0, 0, n * iso),
        oc.CONV: (p0 * isa, p1 * isb, len(oc.CONV_GEOMETRY) * 4, n * iso),
    }.items():
        sel = kind == k
        for j, extent in enumerate((a, b, c, out)):
            size[sel, j] = np.broadcast_to(extent, len(r))[sel]
    return addr, size


def _form_count(mask, i, n, period, phase):
    """Elements operand ``i`` spans under the operand-forms ``mask`` (arrays or integers)."""
    held = -(-(phase + n) // np.maximum(period, 1))
    form = [mask >> i & 1, mask >> (oc.REPEAT_SHIFT + i) & 1, mask >> (oc.HELD_SHIFT + i) & 1]
    return np.select([f == 1 for f in form], [1, period, held], n)


def _expression_extents(table, row, addr, size):
    """Check the EXPR program row ``row`` points at and fill in its leaves' and output's extents."""
    col = oc.COL
    start = table[row, col["p0"]]
    if not 0 <= start < len(table):
        _fail(f"row {row}: EXPR program row {start} is outside the table")
    ops = table[start, _HEAD["ops"]]
    if not 1 <= ops <= oc.EXPR_MAX_OPS or start + 1 + ops > len(table):
        _fail(f"row {row}: EXPR program at row {start} is truncated")
    try:
        check_expression(table[start : start + 1 + ops], f"row {row} EXPR program")
    except Error as exc:
        _fail(str(exc))
    header, n = table[start], table[row, col["n"]]
    addr[:] = 0
    size[:] = 0
    addr[0], size[0] = table[row, col["out"]], n * _itemsizes(header[_HEAD["out_dt"]])
    for leaf in range(header[_HEAD["leaves"]]):
        count = _form_count(header[_HEAD["scalars"]], leaf, n, table[row, col["p1"]], table[row, col["p2"]])
        addr[1 + leaf] = table[row, oc.EXPR_LEAF_COLUMNS[leaf]]
        size[1 + leaf] = count * _itemsizes(header[_HEAD["leaf_dt"] + leaf])


def _check_instructions(table, rows, tile_bytes, num_tiles):
    col = oc.COL
    r = table[rows]
    kind, sub = r[:, col["op"]], r[:, col["sub"]]
    for k in np.unique(kind):
        if int(k) not in _KIND_NAMES:
            _fail(f"row {rows[kind == k][0]}: unknown vertex kind {int(k)}")
        subs = sub[kind == k]
        if subs.min() < 0 or subs.max() >= len(oc.SUB_OPS[int(k)]):
            _fail(f"a {_KIND_NAMES[int(k)]} row has unknown sub-op {int(subs.max())}")
    dts = r[:, [col["dta"], col["dtb"], col["dtout"]]]
    not_expr = kind != oc.EXPR
    if not np.isin(dts[not_expr], list(_DTYPE_NAMES)).all():
        _fail("a row has an unknown dtype code")
    values = r[:, [col["n"], col["p0"], col["p1"], col["p2"]]]
    if values.min(initial=0) < 0 or values.max(initial=0) > _INT32_MAX:
        _fail("a row has a negative or oversized count or parameter")
    addr, size = _instruction_extents(table, rows)
    for i in np.flatnonzero(~not_expr):
        _expression_extents(table, rows[i], addr[i], size[i])
    used = size > 0
    tile = np.where(used, addr // tile_bytes, -1)
    first = np.max(tile, axis=1, keepdims=True)
    inside = (addr >= 0) & (addr + size <= (tile + 1) * tile_bytes) & (tile < num_tiles) & (tile == first)
    bad = used & ~inside
    if bad.any():
        row = rows[np.flatnonzero(bad.any(axis=1))[0]]
        _fail(f"instruction row {row} reaches outside its tile's memory")


def _check_copies(copies, arena_bytes):
    c = copies.astype(np.int64)
    src, dst, count, stride, isz, reps, outer = (c[:, i] for i in range(len(oc.COPY_COLUMNS)))
    if len(c) and (count.min() < 1 or reps.min() < 1 or not np.isin(isz, _ITEMSIZES).all()):
        _fail("an exchange row has no elements or an unknown element size")
    low = src + np.minimum(0, (reps - 1) * outer) + np.minimum(0, (count - 1) * stride)
    high = src + np.maximum(0, (reps - 1) * outer) + np.maximum(0, (count - 1) * stride) + isz
    if len(c) and (
        low.min() < 0 or high.max() > arena_bytes or dst.min() < 0 or (dst + reps * count * isz).max() > arena_bytes
    ):
        _fail("an exchange row reaches outside tile memory")


def _runs_as_copies(flat, phases):
    """The compact rows of ``flat`` as the copy rows they stand for, with their RUNS phases' element sizes
    (a row no RUNS phase runs is checked with element size 1, one several run with the widest)."""
    runs = np.asarray(flat.runs, np.int64).reshape(-1, len(oc.RUN_COLUMNS))
    itemsize = np.ones(len(runs), np.int64)
    for kind, a, b, c in phases.tolist():
        if kind == oc.PHASES["RUNS"]:
            itemsize[a:b] = np.maximum(itemsize[a:b], c)  # the widest a row is run with
    rows = np.zeros((len(runs), len(oc.COPY_COLUMNS)), np.int64)
    for name in oc.RUN_COLUMNS:
        rows[:, oc.COPY_COLUMNS.index(name)] = runs[:, oc.RUN_COLUMNS.index(name)]
    rows[:, oc.COPY_COLUMNS.index("itemsize")], rows[:, oc.COPY_COLUMNS.index("reps")] = itemsize, 1
    return rows


def check_program(flat, num_tiles, tile_bytes, num_streams):
    """Raise a popsim.Error unless the engine can run ``flat`` (a program as program.flatten_program returns it)
    on an arena of ``num_tiles`` x ``tile_bytes`` with ``num_streams`` host streams without touching memory
    outside it: every phase, instruction row, EXPR program, exchange row and stream row is checked against
    the declared format. Call it on any program that was not just built here (one loaded from bytes)."""
    arena_bytes = num_tiles * tile_bytes
    phases, table = np.asarray(flat.phases), np.asarray(flat.instructions)
    if phases.ndim != 2 or phases.shape[1] != oc.PHASE_COLS or table.ndim != 2 or table.shape[1] != oc.NCOLS:
        _fail("tables of the wrong width")
    if len(flat.phase_cycles) != len(phases) or len(flat.fparams) != len(table):
        _fail("per-phase or per-row arrays of the wrong length")
    if np.abs(table).max(initial=0) > _MAX_ROW_VALUE or np.abs(phases).max(initial=0) > _MAX_ROW_VALUE:
        _fail("an oversized value in a table")
    compute = []
    for p, (kind, a, b, c) in enumerate(phases.tolist()):
        _check_phase(p, kind, a, b, c, flat, len(phases), len(table), arena_bytes, num_streams)
        if kind == oc.PHASES["COMPUTE"]:
            compute.append(np.arange(a, b))
    rows = np.unique(np.concatenate(compute)) if compute else np.zeros(0, np.int64)
    if len(rows):
        _check_instructions(table, rows, tile_bytes, num_tiles)
    _check_copies(np.asarray(flat.copies), arena_bytes)
    _check_copies(_runs_as_copies(flat, phases), arena_bytes)
    sr = np.asarray(flat.stream_rows, np.int64).reshape(-1, len(oc.STREAM_ROW_COLUMNS))
    if len(sr) and (sr.min() < 0 or (sr[:, 1] + sr[:, 2]).max() > arena_bytes):
        _fail("a stream row reaches outside tile memory")


def _check_phase(p, kind, a, b, c, flat, num_phases, num_rows, arena_bytes, num_streams):
    ph = oc.PHASES
    within = {
        ph["COMPUTE"]: 0 <= a <= b <= num_rows,
        ph["EXCHANGE"]: 0 <= a <= b <= len(flat.copies),
        ph["RUNS"]: 0 <= a <= b <= len(flat.runs) and c in _ITEMSIZES,
        ph["BRANCH_IF_ZERO"]: 0 <= a and 0 <= b and a + b <= arena_bytes and 0 <= c <= num_phases,
        ph["JUMP"]: 0 <= a <= num_phases,
        ph["LOOP_INIT"]: 0 <= a < flat.num_counters and b >= 0,
        ph["LOOP_BACK"]: 0 <= a < flat.num_counters and 0 <= b <= num_phases,
        ph["SYNC"]: True,
        ph["STREAM"]: 0 <= a < num_streams and 0 <= b <= c <= len(flat.stream_rows),
        ph["HOST_CALL"]: 0 <= a < len(getattr(flat, "host_calls", ())),
    }
    if kind not in within:
        _fail(f"phase {p} has unknown kind {kind}")
    if not within[kind]:
        _fail(f"phase {p} ({oc.PHASE_NAMES[kind]}) points outside its tables")
