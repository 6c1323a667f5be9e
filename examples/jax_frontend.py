"""A second frontend: JAX programs (jaxprs) translated to popir and run on the simulated IPU, without torch.

``translate(fn, *example_args)`` traces ``fn`` with ``jax.make_jaxpr`` and rebuilds its jaxpr as a popir
graph, one popir op (or a few) per JAX primitive. The demo trains a JAX MLP: the whole SGD step
(forward, ``jax.grad`` backward and the update) is one jaxpr, its parameters become popsim device variables
updated in place, and every step is checked against JAX itself.

    python examples/jax_frontend.py

JAX's semantics are mapped onto popir's documented ones (docs/ops.md): ``lax.div`` of integers truncates
and ``lax.rem`` takes the dividend's sign, where popir's ``div`` floors and ``remainder`` takes the
divisor's sign. Primitives without a translation are all listed before anything is built.
"""

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np

import popir
import popsim
from popir import ops

_UNARY = {
    "neg": ops.neg,
    "exp": ops.exp,
    "log": ops.log,
    "tanh": ops.tanh,
    "logistic": ops.sigmoid,
    "sqrt": ops.sqrt,
    "rsqrt": ops.rsqrt,
    "abs": ops.abs,
    "sign": ops.sign,
    "sin": ops.sin,
    "cos": ops.cos,
    "log1p": ops.log1p,
    "expm1": ops.expm1,
    "erf": ops.erf,
    "floor": ops.floor,
    "ceil": ops.ceil,
    "not": ops.logical_not,
}
_BINARY = {
    "add": ops.add,
    "add_any": ops.add,
    "sub": ops.sub,
    "mul": ops.mul,
    "max": ops.maximum,
    "min": ops.minimum,
    "pow": ops.pow,
    "atan2": ops.atan2,
    "eq": ops.eq,
    "ne": ops.ne,
    "lt": ops.lt,
    "le": ops.le,
    "gt": ops.gt,
    "ge": ops.ge,
    "and": ops.logical_and,
    "or": ops.logical_or,
}
# Primitives whose body is another jaxpr, inlined: the parameter holding it.
_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
}


def _dtype(aval):
    return popir.as_dtype(np.dtype(aval.dtype).name)


def _div(a, b):
    """lax.div: integers truncate toward zero (popir's div floors)."""
    q = ops.div(a, b)
    if a.dtype != popir.DType.int32:
        return q
    inexact = ops.ne(q * b, a)
    signs_differ = ops.ne(ops.lt(a, a.graph.constant(np.int32(0))), ops.lt(b, b.graph.constant(np.int32(0))))
    return ops.where(ops.logical_and(inexact, signs_differ), q + a.graph.constant(np.int32(1)), q)


def _rem(a, b):
    """lax.rem: the result takes the dividend's sign (popir's remainder takes the divisor's)."""
    r = ops.remainder(a, b)
    zero = a.graph.constant(np.zeros((), a.dtype.numpy))
    wrong = ops.logical_and(ops.ne(r, zero), ops.ne(ops.lt(r, zero), ops.lt(a, zero)))
    return ops.where(wrong, r - b, r)


def _dot_general(lhs, rhs, dimension_numbers, **_):
    """A dot_general without batch dimensions: free axes of lhs, then of rhs (a transposed 2-D matmul)."""
    (lc, rc), (lb, rb) = dimension_numbers
    if lb or rb:
        raise NotImplementedError("dot_general with batch dimensions")
    lf = [i for i in range(len(lhs.shape)) if i not in lc]
    rf = [i for i in range(len(rhs.shape)) if i not in rc]

    def as_matrix(x, first, second):
        rows, cols = (int(np.prod([x.shape[i] for i in axes], dtype=np.int64)) for axes in (first, second))
        perm = tuple(first) + tuple(second)
        x = ops.transpose(x, perm=perm) if perm != tuple(range(len(x.shape))) else x
        return ops.reshape(x, shape=(rows, cols)) if x.shape != (rows, cols) else x

    product = ops.matmul(as_matrix(lhs, lf, lc), as_matrix(rhs, rc, rf))
    shape = tuple(lhs.shape[i] for i in lf) + tuple(rhs.shape[i] for i in rf)
    return ops.reshape(product, shape=shape) if product.shape != shape else product


def _broadcast_in_dim(x, shape, broadcast_dimensions, **_):
    kept = [1] * len(shape)
    for axis, dim in zip(broadcast_dimensions, x.shape):
        kept[axis] = dim
    x = ops.reshape(x, shape=tuple(kept)) if tuple(kept) != x.shape else x
    return ops.broadcast_to(x, shape=tuple(shape)) if tuple(shape) != x.shape else x


def _integer_pow(x, y):
    if y == 0:
        return ops.broadcast_to(x.graph.constant(np.ones((), x.dtype.numpy)), shape=x.shape)
    result = x
    for _ in range(abs(y) - 1):
        result = result * x
    return result if y > 0 else x.graph.constant(np.ones((), x.dtype.numpy)) / result


def _select_n(which, *cases):
    if len(cases) != 2 or which.dtype != popir.DType.bool:
        raise NotImplementedError("select_n with an integer selector")
    return ops.where(which, cases[1], cases[0])


def _iota(aval, dimension):
    shape = tuple(aval.shape)
    index = np.arange(shape[dimension]).reshape([-1 if i == dimension else 1 for i in range(len(shape))])
    return np.broadcast_to(index, shape).astype(np.dtype(aval.dtype))


def _primitives(jaxpr):
    """Every primitive name used by ``jaxpr``, nested calls included."""
    names = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _CALLS:
            names |= _primitives(eqn.params[_CALLS[name]].jaxpr)
        else:
            names.add(name)
    return names


# The other primitives: rule(graph, params, output aval, popir inputs) -> popir Value.
_RULES = {
    "div": lambda g, p, out, args: _div(*args),
    "rem": lambda g, p, out, args: _rem(*args),
    "integer_pow": lambda g, p, out, args: _integer_pow(args[0], p["y"]),
    "square": lambda g, p, out, args: args[0] * args[0],
    "dot_general": lambda g, p, out, args: _dot_general(*args, **p),
    "broadcast_in_dim": lambda g, p, out, args: _broadcast_in_dim(args[0], p["shape"], p["broadcast_dimensions"]),
    "reshape": lambda g, p, out, args: ops.reshape(args[0], shape=tuple(out.shape)),
    "squeeze": lambda g, p, out, args: ops.reshape(args[0], shape=tuple(out.shape)),
    "expand_dims": lambda g, p, out, args: ops.reshape(args[0], shape=tuple(out.shape)),
    "transpose": lambda g, p, out, args: ops.transpose(args[0], perm=tuple(p["permutation"])),
    "reduce_sum": lambda g, p, out, args: ops.reduce_sum(args[0], axes=tuple(p["axes"]), keepdims=False),
    "reduce_max": lambda g, p, out, args: ops.reduce_max(args[0], axes=tuple(p["axes"]), keepdims=False),
    "reduce_min": lambda g, p, out, args: ops.reduce_min(args[0], axes=tuple(p["axes"]), keepdims=False),
    "argmax": lambda g, p, out, args: ops.argmax(args[0], axis=p["axes"][0], keepdims=False),
    "convert_element_type": lambda g, p, out, args: ops.cast(args[0], dtype=_dtype(out)),
    "select_n": lambda g, p, out, args: _select_n(*args),
    "stop_gradient": lambda g, p, out, args: ops.stop_gradient(args[0]),
    "copy": lambda g, p, out, args: args[0],
    "copy_p": lambda g, p, out, args: args[0],
    "iota": lambda g, p, out, args: g.constant(_iota(out, p["dimension"])),
}
_SUPPORTED = set(_UNARY) | set(_BINARY) | set(_RULES)


def _rule(graph, eqn, args):
    """popir Value for one jaxpr equation with popir inputs ``args``, added to ``graph``."""
    name = eqn.primitive.name
    if name in _UNARY:
        return _UNARY[name](*args)
    if name in _BINARY:
        return _BINARY[name](*args)
    return _RULES[name](graph, eqn.params, eqn.outvars[0].aval, args)


def _emit(graph, jaxpr, consts, args):
    """Append the equations of ``jaxpr`` (inputs ``args``, constants ``consts``) to ``graph``; its outputs."""
    env = {}

    def read(atom):
        if isinstance(atom, jax_core.Literal):
            return graph.constant(np.asarray(atom.val, np.dtype(atom.aval.dtype)))
        return env[atom]

    for var, value in zip(jaxpr.constvars, consts):
        env[var] = graph.constant(np.asarray(value))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        inputs = [read(v) for v in eqn.invars]
        if name in _CALLS:
            inner = eqn.params[_CALLS[name]]
            results = _emit(graph, inner.jaxpr, inner.consts, inputs)
        else:
            results = [_rule(graph, eqn, inputs)]
        env.update(zip(eqn.outvars, results))
    return [read(v) for v in jaxpr.outvars]


def translate(fn, *example_args, kinds=None, name="jax"):
    """(popir Graph, its input Values, its output Values) of ``fn`` traced at ``example_args`` (arrays or
    pytrees of arrays). ``kinds`` gives each flattened argument's popir input kind (default "input")."""
    closed = jax.make_jaxpr(fn)(*example_args)
    missing = sorted(_primitives(closed.jaxpr) - _SUPPORTED)
    if missing:
        raise NotImplementedError(f"no popir translation for JAX primitive(s): {', '.join(missing)}")
    graph = popir.Graph(name)
    kinds = kinds or ["input"] * len(closed.jaxpr.invars)
    inputs = [
        graph.add_input(f"arg{i}", tuple(v.aval.shape), _dtype(v.aval), kind=kind)
        for i, (v, kind) in enumerate(zip(closed.jaxpr.invars, kinds))
    ]
    return graph, inputs, _emit(graph, closed.jaxpr, closed.consts, inputs)


# -- the demo: a JAX MLP trained on popsim, step by step against JAX -------------------------------------------
LEARNING_RATE = 0.1


def init_params(key, sizes=(16, 32, 4)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        (jax.random.normal(k, (m, n), jnp.float32) / np.sqrt(m), jnp.zeros((n,), jnp.float32))
        for k, m, n in zip(keys, sizes[:-1], sizes[1:])
    ]


def loss_fn(params, x, labels):
    h = x
    for i, (w, b) in enumerate(params):
        h = h @ w + b
        if i < len(params) - 1:
            h = jnp.tanh(h)
    log_probs = jax.nn.log_softmax(h)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, h.shape[-1]) * log_probs, axis=-1))


def sgd_step(params, x, labels):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, labels)
    return loss, jax.tree_util.tree_map(lambda p, g: p - LEARNING_RATE * g, params, grads)


def compile_step(params, x, labels, target):
    """The SGD step as one popsim program: parameters are device variables updated in place."""
    flat, _ = jax.tree_util.tree_flatten(params)
    kinds = ["parameter"] * len(flat) + ["input", "input"]
    graph, inputs, outputs = translate(sgd_step, params, x, labels, kinds=kinds, name="sgd_step")
    graph.output("loss", outputs[0])
    for state, value in zip(inputs[: len(flat)], outputs[1:]):
        graph.update(state, value)
    exe = popsim.compile(graph, target)
    for state, value in zip(inputs, flat):
        exe.write_variable(state.name, np.asarray(value))
    return exe, [v.name for v in inputs]


def train(steps=10, batch=32, seed=0, target=None):
    """Train on popsim and in JAX side by side; returns per step (popsim loss, JAX loss, largest parameter
    difference)."""
    key_params, key_data = jax.random.split(jax.random.PRNGKey(seed))
    params = init_params(key_params)
    x = np.asarray(jax.random.normal(key_data, (batch, 16), jnp.float32))
    labels = np.asarray((x[:, 0] > 0).astype(np.int32) + 2 * (x[:, 1] > 0).astype(np.int32))
    exe, names = compile_step(params, x, labels, target or popsim.Target.small(num_tiles=32))
    step = jax.jit(sgd_step)
    history = []
    for _ in range(steps):
        device_loss = float(exe.run({names[-2]: x, names[-1]: labels})["loss"])
        jax_loss, params = step(params, x, labels)
        flat = jax.tree_util.tree_leaves(params)
        worst = max(float(np.max(np.abs(exe.read_variable(n) - np.asarray(p)))) for n, p in zip(names, flat))
        history.append((device_loss, float(jax_loss), worst))
    return history


if __name__ == "__main__":
    for i, (ours, theirs, diff) in enumerate(train()):
        print(f"step {i}: loss popsim {ours:.6f}  JAX {theirs:.6f}  largest parameter difference {diff:.1e}")
