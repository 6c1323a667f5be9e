"""The op registry: every primitive is defined once with its shape rule, NumPy reference and VJP.

``defop`` registers a primitive and returns the Python function that applies it to values, so an op
module reads like a table: the rule, the reference and the gradient of each primitive side by side.
"""

from collections.abc import Callable
from dataclasses import dataclass

from popir.errors import IRError


@dataclass(frozen=True)
class OpDef:
    """A primitive.

    infer(*input_types, **attrs) -> TensorType or tuple of them; raises IRError on bad input.
    ref(*arrays, **attrs) -> ndarray or tuple: the NumPy reference the interpreter runs.
    vjp(inputs, outputs, cotangents, **attrs) -> one Value or None per input; emits popir nodes.
    differentiable=False marks ops with no gradient (integer results, comparisons, RNG bits, stop_gradient):
    autodiff sends no cotangent through them.
    """

    name: str
    infer: Callable
    ref: Callable
    vjp: Callable | None = None
    differentiable: bool = True
    doc: str = ""


_REGISTRY: dict = {}


def defop(name, *, infer, ref, vjp=None, differentiable=True, doc=""):
    """Register primitive ``name`` and return a function applying it: ``fn(*values, **attrs)``."""
    if name in _REGISTRY:
        raise IRError(f"op {name!r} is registered twice")
    if differentiable and vjp is None:
        raise IRError(f"op {name!r} is differentiable but has no vjp")
    opdef = OpDef(name, infer, ref, vjp, differentiable, doc)
    _REGISTRY[name] = opdef

    def apply(*inputs, **attrs):
        from popir.graph import graph_of

        outputs = graph_of(inputs).apply(name, inputs, attrs)
        return outputs[0] if len(outputs) == 1 else outputs

    apply.__name__ = name
    apply.__doc__ = doc or f"Apply the popir primitive {name!r}."
    apply.opdef = opdef
    return apply


def get_op(name):
    """The OpDef registered under ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise IRError(f"unknown op {name!r}") from None


def all_ops():
    """All registered primitives, by name."""
    return dict(_REGISTRY)
