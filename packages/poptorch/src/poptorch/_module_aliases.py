"""Submodules registered under several names (``self.decode = self.encode``), made exportable.

torch.export lists such a module's parameters and buffers once per name, and its core-ATen decompositions
fail ("expected compiled_fn to be GraphModule") when the aliased module mutates a buffer, as BatchNorm does
in training. During capture, every registration after the first of a module that owns buffers is replaced
by an ``_Alias`` that calls the same module without registering it again, so each tensor has one name.
"""

import contextlib

import torch


class _Alias(torch.nn.Module):
    """Stands in for a second registration of ``target``: calls it and forwards attribute reads to it."""

    def __init__(self, target):
        super().__init__()
        object.__setattr__(self, "_target", target)  # not a submodule: its tensors stay listed once

    def forward(self, *args, **kwargs):
        return self._target(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_target"), name)

    def __getitem__(self, index):
        return self._target[index]

    def __iter__(self):
        return iter(self._target)

    def __len__(self):
        return len(self._target)


def _owns_buffers(module):
    return any(True for _ in torch.nn.Module.buffers(module))


@contextlib.contextmanager
def registered_once(model):
    """Within the block, each buffer-owning submodule of ``model`` is registered under its first name only
    (first in ``named_modules`` order, as torch names tensors); the model is restored on exit."""
    seen, replaced = set(), []

    def walk(module):
        for name, child in list(vars(module)["_modules"].items()):
            if child is None:
                continue
            if id(child) in seen:
                if _owns_buffers(child):
                    vars(module)["_modules"][name] = _Alias(child)
                    replaced.append((module, name, child))
                continue
            seen.add(id(child))
            walk(child)

    seen.add(id(model))
    walk(model)
    try:
        yield model
    finally:
        for module, name, child in replaced:
            vars(module)["_modules"][name] = child
