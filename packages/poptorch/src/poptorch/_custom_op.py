"""``poptorch.custom_op``: PopTorch's call of a user-defined op, here a popir primitive the user registered
(``popir.defop``: shape rule, NumPy reference, VJP) with its popsim lowering (``popsim.register_lowering``).

On the CPU the op runs its NumPy reference through popir's interpreter; captured for the device it is one
node of the popir graph, compiled by the user's lowering and differentiated by its VJP.
"""

import json

import numpy as np
import torch

import popir
from poptorch.errors import Error


def _attribute_text(attributes):
    """The attributes as JSON (the custom op's schema carries strings), checked as PopTorch checks them."""
    attributes = dict(attributes or {})
    for key, value in attributes.items():
        if not isinstance(key, str):
            raise Error("custom_op: all attribute keys must be strings.")
        if not isinstance(value, float | int | str | list | tuple):
            raise Error("custom_op: attribute values must be floats, ints, strings or a list/tuple of them.")
        if isinstance(value, list | tuple) and len({type(v) for v in value}) > 1:
            raise Error(f"custom_op: the types in the list/tuple attribute {key!r} must all be the same.")
    return json.dumps(attributes, sort_keys=True)


def attributes_of(text):
    """The popir attributes of a custom op call (lists become tuples, as popir attributes are)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(text).items()}


def popir_op(name, domain):
    """Check that the popir primitive ``name`` exists, naming the fix when it does not."""
    if name not in popir.registry.all_ops():
        raise Error(
            f"custom_op {name!r} (domain {domain!r}): no popir op of that name is registered. Define it with "
            f"popir.defop({name!r}, infer=..., ref=..., vjp=...) and give popsim its kernel with "
            f"@popsim.register_lowering({name!r}) before calling the model."
        )
    return name


@torch.library.custom_op("poptorch::custom_operation", mutates_args=())
def _custom_operation(
    inputs: list[torch.Tensor],
    name: str,
    domain: str,
    domain_version: int,
    attributes: str,
    example_outputs: list[torch.Tensor],
) -> list[torch.Tensor]:
    graph = popir.Graph(name)
    values = [
        graph.add_input(f"in{i}", tuple(t.shape), str(t.dtype).replace("torch.", "")) for i, t in enumerate(inputs)
    ]
    outs = graph.apply(popir_op(name, domain), values, attributes_of(attributes))
    for i, out in enumerate(outs):
        graph.output(f"out{i}", out)
    feeds = {f"in{i}": t.detach().numpy() for i, t in enumerate(inputs)}
    result = popir.interpreter.run(graph, feeds)
    return [torch.from_numpy(np.array(result[f"out{i}"])) for i in range(len(outs))]


@_custom_operation.register_fake
def _custom_operation_fake(inputs, name, domain, domain_version, attributes, example_outputs):
    return [torch.empty_like(t) for t in example_outputs]


def custom_op(inputs, name, domain, domain_version, example_outputs, attributes=None):
    """Apply the user's op ``name`` (a popir primitive registered with ``popir.defop`` and lowered with
    ``popsim.register_lowering``) to the tuple of tensors ``inputs``. ``example_outputs`` give the outputs'
    shapes and dtypes (their values do not matter); ``attributes`` (str keys; float, int, str or list
    values) are the op's attributes. Returns the list of outputs."""
    inputs, example_outputs = list(inputs), list(example_outputs)
    if not all(isinstance(t, torch.Tensor) for t in inputs + example_outputs):
        raise Error("custom_op: inputs and example_outputs must be tensors")
    popir_op(name, domain)
    return _custom_operation(inputs, name, domain, int(domain_version), _attribute_text(attributes), example_outputs)
