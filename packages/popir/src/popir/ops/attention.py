"""Attention composite: scaled dot-product attention (torch.nn.functional.scaled_dot_product_attention)."""

import math

import numpy as np

from popir.errors import IRError
from popir.ops.activations import dropout, softmax
from popir.ops.base import add, broadcast_to, full, reshape, zeros_like
from popir.ops.elementwise import eq, logical_and, where
from popir.ops.linalg import matmul
from popir.ops.movement import transpose
from popir.ops.reduction import reduce_max


def _swap_last(x):
    perm = tuple(range(x.ndim - 2)) + (x.ndim - 1, x.ndim - 2)
    return transpose(x, perm=perm)


def _repeat_heads(x, groups):
    """Each head of ``x`` (..., H, S, E) repeated ``groups`` times in place (torch's enable_gqa)."""
    *lead, h, s, e = x.shape
    spread = broadcast_to(reshape(x, shape=(*lead, h, 1, s, e)), shape=(*lead, h, groups, s, e))
    return reshape(spread, shape=(*lead, h * groups, s, e))


def scaled_dot_product_attention(
    q, k, v, mask=None, dropout_p=0.0, is_causal=False, scale=None, seed=None, enable_gqa=False
):
    """softmax(q k^T * scale + mask) v over (..., L, E) queries and (..., S, E) keys / (..., S, Ev) values.

    ``mask`` is boolean (True = attend) or additive, broadcastable to (..., L, S); ``is_causal`` keeps the
    lower triangle. A query row that may attend to nothing gives zeros, as torch does. ``dropout_p`` drops
    attention weights with random numbers drawn from ``seed``.
    """
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        if q.shape[-3] % k.shape[-3]:
            raise IRError(f"grouped-query attention needs query heads {q.shape[-3]} to be a multiple of {k.shape[-3]}")
        groups = q.shape[-3] // k.shape[-3]
        k, v = _repeat_heads(k, groups), _repeat_heads(v, groups)
    g = q.graph
    length, source = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = matmul(q, _swap_last(k)) * scale
    allowed = None
    if is_causal:
        allowed = g.constant(np.tril(np.ones((length, source), dtype=bool)))
    if mask is not None and mask.dtype == "bool":
        allowed = mask if allowed is None else logical_and(allowed, mask)
    elif mask is not None:
        scores = add(scores, mask)
    neg_inf = full(g, (), -math.inf, scores.dtype)
    if allowed is not None:
        scores = where(broadcast_to(allowed, shape=scores.shape), scores, broadcast_to(neg_inf, shape=scores.shape))
    # Rows with nothing to attend to: softmax over zeros (finite values and gradients), then zeroed.
    empty = eq(reduce_max(scores, axes=(-1,), keepdims=True), neg_inf)
    empty = broadcast_to(empty, shape=scores.shape)
    weights = softmax(where(empty, zeros_like(scores), scores), axis=-1)
    weights = where(empty, zeros_like(weights), weights)
    if dropout_p > 0.0:
        if seed is None:
            raise IRError("attention dropout needs a random seed")
        weights = dropout(weights, dropout_p, seed)
    return matmul(weights, v)
