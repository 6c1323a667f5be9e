"""popir primitives and composite ops. Importing this package registers every primitive."""

from popir.ops.base import (
    add,
    broadcast_to,
    constant,
    div,
    exp,
    mul,
    neg,
    reduce_sum,
    reshape,
    sub,
    sum_to,
)

__all__ = [
    "add",
    "broadcast_to",
    "constant",
    "div",
    "exp",
    "mul",
    "neg",
    "reduce_sum",
    "reshape",
    "sub",
    "sum_to",
]
