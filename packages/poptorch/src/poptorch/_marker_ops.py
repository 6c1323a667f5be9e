"""Identity marker ops: ``poptorch::<name>(Tensor x, <settings>) -> Tensor`` returns a copy of ``x`` and
carries its settings (the schema's other arguments) into the exported graph as one node, which capture
lowers to ``x`` itself after recording the settings on the graph (``set_available_memory``,
``set_conv_dithering``, ``set_conv_partials_type``, ``recomputation_checkpoint``, ``set_overlap``)."""

import torch


def _copy(x, *settings):
    return x.clone()


def _fake(x, *settings):
    return torch.empty_like(x)


def define_marker(name, settings=(), *, differentiable=True):
    """Define the torch custom op ``poptorch::name`` on a tensor and the arguments ``settings`` declares
    (schema declarations such as ``"float proportion"``), and return it. It runs (and exports) as a copy of
    its tensor; a ``differentiable`` marker passes the gradient straight through (the settings have none)."""
    schema = f"({', '.join(('Tensor x', *settings))}) -> Tensor"
    op = torch.library.custom_op(f"poptorch::{name}", _copy, mutates_args=(), schema=schema)
    op.register_fake(_fake)
    if differentiable:
        no_gradients = (None,) * len(settings)
        op.register_autograd(lambda ctx, grad: (grad, *no_gradients) if no_gradients else grad)
    return op
