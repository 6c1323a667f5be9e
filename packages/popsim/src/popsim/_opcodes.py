"""The engine's instruction format, declared once.

Every number the planners, the program builder, the cost model and the Cython engine share is declared here:
vertex kinds, the sub-ops of each kind, dtype codes, phase kinds, the columns of instruction, exchange and
stream rows, and the layout of a fused expression (EXPR) program. Building popsim generates
``_opcodes_enums.pxd`` (``cdef enum`` blocks) from this module, so the engine's numbers are these; nothing
else spells them as literals. This module imports nothing, so the build can read it before popsim exists.

Names appended to a table get the next number; the engine implements a sub-op by its generated name
(``U_<NAME>``, ``B_<NAME>``, ``R_<NAME>``, ``G_<NAME>``, ``S_DEFAULT``), and a consistency test fails when a
declared sub-op has no codelet or a codelet computes another op than its name says.
"""

# Vertex kinds (an instruction row's OP column). 0 is no kind, so a zeroed row traps.
KIND_NAMES = (
    "UNARY", "BINARY", "WHERE", "REDUCE", "MATMUL", "RNG", "COPY", "GATHER", "SCATTER_ADD", "FILL", "EXPR", "CONV"
)  # fmt: skip
KINDS = {name: code for code, name in enumerate(KIND_NAMES, start=1)}
UNARY, BINARY, WHERE, REDUCE, MATMUL, RNG, COPY, GATHER, SCATTER_ADD, FILL, EXPR, CONV = (KINDS[n] for n in KIND_NAMES)

# Element types in tile memory (the DTA/DTB/DTOUT columns; popir dtype names).
DTYPE_CODES = {"float32": 0, "float16": 1, "int32": 2, "bool": 3}

UNARY_OPS = {
    name: i
    for i, name in enumerate(
        (
            "copy",
            "neg",
            "exp",
            "log",
            "sqrt",
            "rsqrt",
            "tanh",
            "sigmoid",
            "erf",
            "abs",
            "sin",
            "cos",
            "relu",
            "sign",
            "logical_not",
            "cast",
            "acos",
            "acosh",
            "asin",
            "asinh",
            "atan",
            "atanh",
            "cosh",
            "sinh",
            "tan",
            "ceil",
            "floor",
            "round",
            "expm1",
            "log1p",
            "bitwise_not",
        )
    )
}
BINARY_OPS = {
    name: i
    for i, name in enumerate(
        (
            "add",
            "sub",
            "mul",
            "div",
            "pow",
            "maximum",
            "minimum",
            "eq",
            "ne",
            "lt",
            "le",
            "gt",
            "ge",
            "logical_and",
            "logical_or",
            "atan2",
            "remainder",
            "bitwise_and",
            "bitwise_or",
            "bitwise_xor",
        )
    )
}
# Binary ops with a float32 path of their own (no trip through doubles); an all-float32 fused expression of
# only these runs on floats directly.
BINARY_FLOAT32_OPS = ("add", "sub", "mul", "div")
REDUCE_OPS = {"sum": 0, "max": 1, "min": 2, "prod": 3}
# GATHER / SCATTER_ADD: whether the vertex counts its out-of-range indices into the run's error, or a check
# vertex beside it counts the user's own indices instead.
GATHER_MODES = {"count_bad": 0, "checked_elsewhere": 1}
SINGLE = {"default": 0}  # kinds with one codelet

SUB_OPS = {
    UNARY: UNARY_OPS,
    BINARY: BINARY_OPS,
    WHERE: SINGLE,
    REDUCE: REDUCE_OPS,
    MATMUL: SINGLE,
    RNG: SINGLE,
    COPY: SINGLE,
    GATHER: GATHER_MODES,
    SCATTER_ADD: GATHER_MODES,
    FILL: SINGLE,
    EXPR: SINGLE,
    CONV: SINGLE,
}
# Prefix of each table's generated enum names.
SUB_OP_PREFIXES = {"U": UNARY_OPS, "B": BINARY_OPS, "R": REDUCE_OPS, "G": GATHER_MODES, "S": SINGLE}

# Columns of one instruction row (a vertex, or a row of an EXPR program).
ROW_COLUMNS = ("op", "sub", "n", "a", "b", "c", "out", "dta", "dtb", "dtout", "p0", "p1", "p2")
COL = {name: i for i, name in enumerate(ROW_COLUMNS)}
NCOLS = len(ROW_COLUMNS)
# Field address columns; the dtype column of a field (elementwise, reduce, matmul, gather vertices).
FIELD_COLUMNS = {"a": COL["a"], "b": COL["b"], "c": COL["c"], "out": COL["out"]}
DTYPE_COLUMNS = {"a": COL["dta"], "b": COL["dtb"], "out": COL["dtout"]}

# What each kind reads and writes: its fields (the first of ``required`` .. all required), and which row
# column holds each of its integer parameters. ``fparam`` is FILL's value only.
VERTEX_FIELDS = {
    UNARY: ("a", "out"),
    BINARY: ("a", "b", "out"),
    WHERE: ("a", "b", "c", "out"),
    REDUCE: ("a", "out"),
    MATMUL: ("a", "b", "out"),
    RNG: ("a", "out"),
    COPY: ("a", "out"),
    GATHER: ("a", "b", "out"),
    SCATTER_ADD: ("a", "b", "c", "out"),
    FILL: ("out",),
    EXPR: ("out", "a", "b", "c", "d", "e", "f"),
    CONV: ("a", "b", "c", "out"),
}
VERTEX_PARAMS = {
    UNARY: {"scalars": "p0", "period": "p1", "phase": "p2"},
    BINARY: {"scalars": "p0", "period": "p1", "phase": "p2"},
    WHERE: {"scalars": "p0", "period": "p1", "phase": "p2"},
    REDUCE: {"rows": "p0", "group": "p1"},
    MATMUL: {"m": "p0", "k": "p1"},
    RNG: {"first": "p0"},
    COPY: {},
    GATHER: {"rows": "p0", "inner": "p1", "size": "p2"},
    SCATTER_ADD: {"rows": "p0", "inner": "p1", "size": "p2"},
    FILL: {},
    EXPR: {"period": "p1", "phase": "p2"},  # its P0 is the table row of its program, set when flattened
    CONV: {"patch": "p0", "weights": "p1", "taps": "p2"},
}


# Per-kind vertex builders: each names its kind's fields and parameters, so a caller never spells a kind, a
# sub-op number or a field letter. ``add`` is a DeviceGraph's ``add_vertex`` (one vertex: ``tile``, ``n`` and
# Regions) or ``add_vertices`` (a batch: tiles, n per vertex and Regions, parameters per vertex or one);
# the builders only pass through, so the DeviceGraph checks everything as before.
def elementwise(add, cs, codelet, tile, n, cycles, *, operands, out, scalars=0, period=0, phase=0):
    """UNARY / BINARY / WHERE by ``codelet`` (a UNARY_OPS or BINARY_OPS name, or "where"): out = codelet(
    *operands) over n elements; ``scalars`` is the operands' forms mask (see OPERAND FORMS below), ``period``
    and ``phase`` those of its repeating operands. WHERE's operands are (condition, value if true, value if
    false)."""
    if codelet == "where":
        kind, sub = WHERE, SINGLE["default"]
    elif codelet in BINARY_OPS:
        kind, sub = BINARY, BINARY_OPS[codelet]
    else:
        kind, sub = UNARY, UNARY_OPS[codelet]
    fields = dict(zip("abc", operands)) | {"out": out}
    return add(cs, kind, sub, tile, n, fields, cycles, scalars=scalars, period=period, phase=phase)


def expression(add, cs, tile, n, cycles, *, leaves, out, program, period=0, phase=0):
    """EXPR: the fused elementwise ``program`` (EXPR_HEADER and EXPR_OP_ROW rows) over up to
    len(EXPR_FIELDS) ``leaves``, its result into out; ``period`` and ``phase`` are those of the leaves the
    program's forms mask marks as repeating (see OPERAND FORMS below)."""
    fields = {"out": out} | dict(zip(EXPR_FIELDS, leaves))
    return add(cs, EXPR, SINGLE["default"], tile, n, fields, cycles, program=program, period=period, phase=phase)


def reduce(add, cs, op, tile, n, cycles, *, source, out, rows, group):
    """REDUCE by ``op`` (a REDUCE_OPS name): out[r] = op over ``group`` consecutive source elements, for each
    of ``rows`` rows."""
    return add(cs, REDUCE, REDUCE_OPS[op], tile, n, {"a": source, "out": out}, cycles, rows=rows, group=group)


def matmul(add, cs, tile, n, cycles, *, lhs, rhs, out, m, k):
    """MATMUL: out (m, n) = lhs (m, k) @ rhs (k, n), a partial in float32 (or float16) out."""
    return add(cs, MATMUL, SINGLE["default"], tile, n, {"a": lhs, "b": rhs, "out": out}, cycles, m=m, k=k)


def random(add, cs, tile, n, cycles, *, seed, out, first):
    """RNG: out[i] = the uniform draw of flat position first + i under the two int32 ``seed`` words."""
    return add(cs, RNG, SINGLE["default"], tile, n, {"a": seed, "out": out}, cycles, first=first)


def copy(add, cs, tile, n, cycles, *, source, out):
    """COPY: n elements of source into out, bytes as they are."""
    return add(cs, COPY, SINGLE["default"], tile, n, {"a": source, "out": out}, cycles)


def fill(add, cs, tile, n, cycles, *, out, value):
    """FILL: n elements of out set to ``value``."""
    return add(cs, FILL, SINGLE["default"], tile, n, {"out": out}, cycles, fparam=value)


def gather(add, cs, tile, n, cycles, *, table, indices, out, rows, inner, size, checked_elsewhere=False):
    """GATHER: out (rows, n, inner) = table (rows, size, inner)[:, indices, :]; an out-of-range index gives
    zeros and is counted into the run's error unless ``checked_elsewhere`` (a check vertex beside this one
    counts the user's own indices)."""
    fields = {"a": table, "b": indices, "out": out}
    sub = GATHER_MODES["checked_elsewhere" if checked_elsewhere else "count_bad"]
    return add(cs, GATHER, sub, tile, n, fields, cycles, rows=rows, inner=inner, size=size)


def scatter_add(add, cs, tile, n, cycles, *, table, indices, updates, out, rows, inner, size, checked_elsewhere=False):
    """SCATTER_ADD: out (rows, size, inner) += updates (rows, n, inner) at ``indices``; ``table`` is the
    region the indices address (as GATHER's). Out-of-range indices are dropped and counted as GATHER's are."""
    fields = {"a": table, "b": indices, "c": updates, "out": out}
    sub = GATHER_MODES["checked_elsewhere" if checked_elsewhere else "count_bad"]
    return add(cs, SCATTER_ADD, sub, tile, n, fields, cycles, rows=rows, inner=inner, size=size)


def conv(add, cs, tile, n, cycles, *, patch, weights, geometry, out, patch_size, weights_size, taps):
    """CONV: a direct convolution over an input patch already on the tile. ``geometry`` is CONV_GEOMETRY
    (int32) of the patch (batch, channels, rows, cols), the weights (out_channels, channels, kernel_rows,
    kernel_cols) and the output block (batch, out_channels, out_rows, out_cols = n elements); ``patch_size``
    and ``weights_size`` are the element counts of those fields and ``taps`` is channels * kernel_rows *
    kernel_cols (the row's own copy of the sizes, which the engine checks the geometry against). Output
    (y, x) at kernel tap (i, j) reads patch row first_row + y * stride_rows + i * dilation_rows (likewise
    columns), with patch row r at row r * in_dilation_rows; a position outside the patch or between its spaced
    rows is zero, which the vertex supplies without reading."""
    fields = {"a": patch, "b": weights, "c": geometry, "out": out}
    sizes = {"patch": patch_size, "weights": weights_size, "taps": taps}
    return add(cs, CONV, SINGLE["default"], tile, n, fields, cycles, **sizes)


# Every kind's builder (a test checks each kind has one).
BUILDERS = {
    UNARY: elementwise,
    BINARY: elementwise,
    WHERE: elementwise,
    REDUCE: reduce,
    MATMUL: matmul,
    RNG: random,
    COPY: copy,
    GATHER: gather,
    SCATTER_ADD: scatter_add,
    FILL: fill,
    EXPR: expression,
    CONV: conv,
}

# OPERAND FORMS. Elementwise vertices (UNARY, BINARY, WHERE) read each operand field in one of three forms,
# set by their ``scalars`` parameter (a mask): bit i set when field i (a, b, c) holds one element the vertex
# broadcasts over all n (as popops' BroadcastScalar vertices do), so the exchange moves one element per tile;
# bit REPEAT_SHIFT + i set when field i *repeats*: it holds ``period`` elements and output element j reads its
# element (phase + j) % period (popops' BroadcastVectorInner: a [C] operand over a contiguous stretch of an
# [N, C] output, one vertex whatever N, its state fixed: pointer, period and phase); bit HELD_SHIFT + i set
# when field i is *held*: output element j reads its element (phase + j) // period, which it holds ceil((phase
# + n) / period) of (popops' BroadcastVectorOuter: a [N, 1] row statistic over [N, C] rows). Otherwise field
# i holds n elements. All repeating and held operands of a vertex share its ``period`` and ``phase`` (0 <=
# phase < period). An EXPR program's header has the same mask for its leaves a..f; its vertices carry period
# and phase.
REPEAT_SHIFT = 8
HELD_SHIFT = 16
# Words of vertex state a vertex with a repeating or held operand adds (its period and phase).
REPEAT_STATE_WORDS = 2

# A fused elementwise vertex (EXPR) reads at most len(EXPR_FIELDS) leaves and runs at most EXPR_MAX_OPS ops,
# each into its own register. Its row's P0 is the table row of its program (the program's scalars mask is in
# the program's header, not the vertex). The leaves' addresses sit in EXPR_LEAF_COLUMNS. The program is a
# header row then one row per op, both NCOLS wide.
EXPR_FIELDS = "abcdef"
EXPR_LEAF_COLUMNS = tuple(COL[c] for c in ("a", "b", "c", "dta", "dtb", "dtout"))
EXPR_MAX_OPS = 10
EXPR_REGS = len(EXPR_FIELDS) + EXPR_MAX_OPS
EXPR_HEADER = ("leaves", "ops", "result", "out_dt", "leaf_dt", None, None, None, None, None, "scalars", "float32")
EXPR_OP_ROW = ("kind", "sub", "dst", "src", None, None, "dt", "integer")
EXPR_HEAD = {name: i for i, name in enumerate(EXPR_HEADER) if name}
EXPR_OP = {name: i for i, name in enumerate(EXPR_OP_ROW) if name}
EXPR_SRCS = 3  # an op reads registers src, src + 1 and src + 2 of its row (a, b, c)
EXPR_SCALARS, EXPR_FLOAT32 = EXPR_HEAD["scalars"], EXPR_HEAD["float32"]

# A CONV vertex's geometry (its int32 field c, vertex state on its tile), in this order. in_dilation spaces the
# patch's elements apart (zeros between them, as a strided conv's input gradient reads its output gradient);
# first_row/first_col are in those spaced coordinates and may be negative (the first window starts in the
# padding).
CONV_GEOMETRY = (
    "batch", "channels", "rows", "cols", "out_channels", "out_rows", "out_cols", "kernel_rows", "kernel_cols",
    "stride_rows", "stride_cols", "dilation_rows", "dilation_cols", "in_dilation_rows", "in_dilation_cols",
    "first_row", "first_col",
)  # fmt: skip
CONV_GEOM = {name: i for i, name in enumerate(CONV_GEOMETRY)}

# Phase kinds (a phase row is (kind, a, b, c); see program.py).
PHASE_NAMES = (
    "COMPUTE", "EXCHANGE", "BRANCH_IF_ZERO", "JUMP", "LOOP_INIT", "LOOP_BACK", "SYNC", "STREAM", "HOST_CALL", "RUNS"
)  # fmt: skip
PHASES = {name: code for code, name in enumerate(PHASE_NAMES)}
PHASE_COLUMNS = ("kind", "a", "b", "c")
PHASE_COL = {name: i for i, name in enumerate(PHASE_COLUMNS)}
PHASE_COLS = len(PHASE_COLUMNS)

# Columns of an exchange row (see copy_run), of a host stream's table row and of a stream row.
COPY_COLUMNS = ("src", "dst", "count", "stride", "itemsize", "reps", "outer")
# A compact exchange row (see copy_single): one repetition of a copy row, its element size the RUNS phase's.
RUN_COLUMNS = ("src", "dst", "count", "stride")
STREAM_COLUMNS = ("to_device", "host", "capacity", "cursor", "slice")
STREAM_ROW_COLUMNS = ("offset", "arena", "nbytes")


def enums():
    """(enum block name, {C name: value}) of every number above, for the generated ``_opcodes_enums.pxd``."""
    blocks = [
        ("kinds", {f"K_{n}": c for n, c in KINDS.items()} | {"K_END": len(KINDS) + 1}),
        ("dtypes", {f"DT_{n.upper()}": c for n, c in DTYPE_CODES.items()}),
        ("columns", {f"C_{n.upper()}": c for n, c in COL.items()} | {"NCOLS": NCOLS}),
        ("expr_header", {f"X_{n.upper()}": c for n, c in EXPR_HEAD.items()}),
        ("expr_op", {f"O_{n.upper()}": c for n, c in EXPR_OP.items()}),
        ("expr_limits", {"EXPR_LEAVES": len(EXPR_FIELDS), "EXPR_MAX_OPS": EXPR_MAX_OPS, "EXPR_REGS": EXPR_REGS}),
        ("expr_srcs", {"EXPR_SRCS": EXPR_SRCS}),
        ("operand_forms", {"REPEAT_SHIFT": REPEAT_SHIFT, "HELD_SHIFT": HELD_SHIFT}),
        ("conv_geometry", _columns("CG", CONV_GEOMETRY, "CG_LEN")),
        ("phases", {f"PH_{n}": c for n, c in PHASES.items()}),
        ("phase_columns", _columns("PC", PHASE_COLUMNS, "PHASE_COLS")),
        ("copy_columns", _columns("CP", COPY_COLUMNS, "COPY_COLS")),
        ("run_columns", _columns("RN", RUN_COLUMNS, "RUN_COLS")),
        ("stream_columns", _columns("ST", STREAM_COLUMNS, "ST_COLS")),
        ("stream_rows", _columns("SR", STREAM_ROW_COLUMNS, "SR_COLS")),
    ]
    for prefix, table in SUB_OP_PREFIXES.items():
        names = {f"{prefix}_{n.upper()}": c for n, c in table.items()}
        blocks.append((f"{prefix}_ops", names | {f"{prefix}_END": len(table)}))
    return blocks


def _columns(prefix, names, count):
    return {f"{prefix}_{n.upper()}": i for i, n in enumerate(names)} | {count: len(names)}


def generated_files():
    """{file name: text} that setup.py writes beside this module: the enums as a .pxd every engine module
    cimports, and ``compiled_enums()`` (included by each engine module) reporting them as compiled."""
    lines = ["# Generated from _opcodes.py by setup.py: edit _opcodes.py, not this file.", ""]
    everything = []
    for name, values in enums():
        lines.append(f"cdef enum:  # {name}")
        lines += [f"    {key} = {value}" for key, value in values.items()]
        lines.append("")
        everything += values
    report = [lines[0], "", "def compiled_enums():", '    """{name: value} of the enums as compiled."""']
    report.append("    return {" + ", ".join(f'"{k}": {k}' for k in everything) + "}")
    return {"_opcodes_enums.pxd": "\n".join(lines), "_opcodes_report.pxi": "\n".join(report) + "\n"}
