"""Opcode and sub-op numbers shared by the planners and the Cython engine (one place per number)."""

NCOLS = 12  # columns of one instruction row (C_OP .. C_P1 in _kernels.pxd)

# Instruction kinds (column C_OP).
UNARY, BINARY, WHERE, REDUCE, MATMUL, RNG, COPY, GATHER, SCATTER_ADD, FILL, EXPR = range(1, 12)

# Element types in tile memory (columns C_DTA/C_DTB/C_DTOUT).
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
REDUCE_OPS = {"sum": 0, "max": 1, "min": 2, "prod": 3}

# Elementwise vertices (UNARY, BINARY, WHERE): bit i of P0 is set when field i (a, b, c) holds one element the
# vertex broadcasts over all n (as popops' BroadcastScalar vertices do), so the exchange moves one element per
# tile. An EXPR program's header has the same mask for its leaves a..f.

# A fused elementwise vertex (EXPR) reads at most this many leaf fields (a..f) and runs at most this many
# ops, each into its own register (see run_expression in _kernels.pyx). Its program's header row holds the
# leaf count, op count, result register, output dtype, the leaf dtypes (columns 4-9), the scalar leaves mask
# and whether it is all float32 add/sub/mul/div; then one row per op: kind, sub, dst, src0, src1, src2, dtype,
# integer operands.
EXPR_FIELDS = "abcdef"
EXPR_MAX_OPS = 10
EXPR_SCALARS, EXPR_FLOAT32 = 10, 11
