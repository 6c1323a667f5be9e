"""``poptorch.experimental``: PopTorch's function-level IPU regions, ``IPUContext`` (a function compiled
for the IPU on its first call) and ``IPUScope`` (a ``with`` block recording ops as they run)."""

import functools

import torch
import torch.utils._pytree as pytree

from poptorch.enums import Compiler
from poptorch.errors import Error
from poptorch.options import Options, not_modelled


def _check_compiler(compiler):
    if compiler == Compiler.MLIR:
        raise not_modelled(
            "Compiler.MLIR",
            "the simulator has no MLIR compiler (hasMlirSupportOnPlatform() is False); pass "
            "compiler=poptorch.enums.Compiler.PopART",
        )
    if not isinstance(compiler, Compiler):
        raise Error(f"compiler must be a poptorch.enums.Compiler, got {compiler!r}")


class _Function(torch.nn.Module):
    """A function run as an inference model; its results flattened to a tuple of tensors."""

    def __init__(self, func):
        super().__init__()
        self.func = func

    def forward(self, *args, **kwargs):
        outputs = [leaf for leaf in pytree.tree_leaves(self.func(*args, **kwargs)) if isinstance(leaf, torch.Tensor)]
        if not outputs:
            raise TypeError("A function marked with IPUContext must return one or more tensors.")
        return tuple(outputs)


class _IPUContext:
    def __init__(self, func, compiler, options):
        functools.update_wrapper(self, func)
        _check_compiler(compiler)
        if options is not None and not isinstance(options, Options):
            raise Error(f"Invalid type: 'options' is of type {type(options)} (Expected poptorch.Options)")
        self._func = func
        self._options = options
        self._model = None

    def __call__(self, *args, **kwargs):
        if self._model is None:
            import poptorch  # the package is fully imported by the time a function is called

            self._model = poptorch.inferenceModel(_Function(self._func), self._options)
        outputs = list(self._model(*args, **kwargs))
        return outputs[0] if len(outputs) == 1 else outputs


def IPUContext(func=None, *, parameters_and_buffers=None, compiler=Compiler.MLIR, options=None):  # noqa: N802
    """Compile ``func`` for the IPU on its first call (as an inference model) and run it there on each call;
    as a decorator with or without keyword arguments. A single result is returned as a tensor, several as a
    list, as PopTorch does. Tensors ``func`` reads from its closure (``parameters_and_buffers``) are compiled
    in with their values at that first call, as PopTorch uploads them once. ``compiler`` defaults to MLIR,
    which the simulator does not have: pass ``compiler=poptorch.enums.Compiler.PopART``."""
    if parameters_and_buffers is not None:
        named = dict(parameters_and_buffers)  # a dict or named_parameters()'s pairs
        if not all(isinstance(t, torch.Tensor) for t in named.values()):
            raise Error("IPUContext's parameters_and_buffers must map names to tensors")
    if func is None:
        return lambda f: _IPUContext(f, compiler, options)
    return _IPUContext(func, compiler, options)


class IPUScope:
    """``with IPUScope(inputs) as ipu:`` records the ops run in the block by dispatching them to the IPU.
    The simulator captures whole functions with torch.export instead: refused, use ``IPUContext``."""

    def __init__(self, inputs, parameters_and_buffers=None, options=None, compile_using=Compiler.PopART):
        raise not_modelled(
            "poptorch.experimental.IPUScope",
            "ops are captured from whole functions, not recorded as a block runs; move the block into a "
            "function decorated with poptorch.experimental.IPUContext(compiler=poptorch.enums.Compiler.PopART)",
        )
