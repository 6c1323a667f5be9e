"""PopTorch ops about host transfers and host code in the middle of a model: ``set_overlap_for_input`` /
``set_overlap_for_output``, ``CPU`` host callbacks, ``MultiConv`` and ``ctc_beam_search_decoder``.

Each runs as PopTorch's does on the CPU. Captured for the simulated IPU, what the simulator models is real
(``OverlapMode.NoOverlap`` marks nothing), and the rest is refused with an error saying it is not modelled,
never accepted and ignored.
"""

import torch

from poptorch._executor_api import isRunningOnIpu
from poptorch.enums import MultiConvPlanType, OverlapMode
from poptorch.errors import Error
from poptorch.options import not_modelled


def _overlap(name, tensors, mode):
    if not isinstance(mode, OverlapMode):
        raise Error(f"{name}: mode must be a poptorch.OverlapMode, got {mode!r}")
    leaves = torch.utils._pytree.tree_leaves(tensors)
    bad = next((leaf for leaf in leaves if not isinstance(leaf, torch.Tensor)), None)
    if bad is not None:
        raise Error(f"You may only set overlap for torch.tensor values. {type(bad)} is not supported.")
    if mode is not OverlapMode.NoOverlap and isRunningOnIpu():
        raise not_modelled(
            f"{name}(..., {mode})",
            "the simulated IPU reserves no I/O tiles, so host transfers never overlap compute; use "
            "OverlapMode.NoOverlap or remove the call",
        )
    return tensors


def set_overlap_for_input(input_tensors, mode):
    """Mark model inputs (a tensor or any tuple / list / dict of them) for host transfers that overlap
    compute, and return them; use the returned tensors. Only ``OverlapMode.NoOverlap`` is modelled."""
    return _overlap("set_overlap_for_input", input_tensors, mode)


def set_overlap_for_output(output_tensors, mode):
    """Mark model outputs for host transfers that overlap compute, and return them; only
    ``OverlapMode.NoOverlap`` is modelled."""
    return _overlap("set_overlap_for_output", output_tensors, mode)


class CPU:
    """Run ``layer_to_call`` on the host in the middle of a model (PopTorch: inference only). On the CPU the
    call goes straight through; captured for the simulated IPU it is refused, as the simulator does not
    stream values to a host callback in the middle of a program."""

    def __init__(self, layer_to_call, ID):  # noqa: N803 - PopTorch's argument name
        if not callable(layer_to_call):
            raise Error(f"poptorch.CPU needs a callable to run on the host, got {type(layer_to_call).__name__}")
        if isinstance(layer_to_call, torch.nn.Module):
            layer_to_call.requires_grad_(False)
        self._layer_to_call = layer_to_call
        self._ID = ID

    def __call__(self, *args, **kwargs):
        if isRunningOnIpu():
            raise not_modelled(
                f"poptorch.CPU({self._ID!r})",
                "host callbacks in the middle of a program are not simulated; run the host code before or "
                "after the model's call",
            )
        return self._layer_to_call(*args, **kwargs)


class MultiConv:
    """PopTorch plans the convolutions created inside ``with poptorch.MultiConv():`` together, to run in
    parallel. On the CPU the scope changes nothing; captured for the simulated IPU it is refused, as the
    simulator's convolution planner plans each convolution alone."""

    def __init__(self):
        self._settings = {}

    def _set(self, name, value):
        self._settings[name] = value
        return self

    def availableMemoryProportions(self, value):  # noqa: N802 - PopTorch's names below
        """The temporary-memory share of each convolution (one float, or one per convolution)."""
        return self._set("availableMemoryProportions", value)

    def partialsTypes(self, value):  # noqa: N802
        """The partials type of each convolution."""
        return self._set("partialsTypes", value)

    def planType(self, value):  # noqa: N802
        """A ``poptorch.MultiConvPlanType``."""
        if not isinstance(value, MultiConvPlanType):
            raise Error(f"MultiConv.planType takes a poptorch.MultiConvPlanType, got {value!r}")
        return self._set("planType", value)

    def perConvReservedTiles(self, value):  # noqa: N802
        """Tiles reserved for each convolution."""
        return self._set("perConvReservedTiles", value)

    def cycleBackOff(self, value):  # noqa: N802
        """The planner's cycle back-off."""
        return self._set("cycleBackOff", value)

    def enableConvDithering(self, value):  # noqa: N802
        """Dither the tile placement of each convolution."""
        return self._set("enableConvDithering", value)

    def __enter__(self):
        if isRunningOnIpu():
            raise not_modelled(
                "poptorch.MultiConv",
                "the simulator plans every convolution alone; remove the MultiConv scope (the convolutions "
                "compute the same values without it)",
            )
        return self

    def __exit__(self, *exc):
        return False


def ctc_beam_search_decoder(probs, lengths, blank=0, beam_width=100, top_paths=1):
    """PopTorch's CTC beam search decoder. Refused: the simulator has no beam search (the beams' data-
    dependent pruning), on the CPU as on the simulated IPU, where PopTorch has no CPU version either."""
    for name, value in (("probs", probs), ("lengths", lengths)):
        if not isinstance(value, torch.Tensor):
            raise Error(
                f"ctc_beam_search_decoder: {name} must be a torch.tensor argument. {type(value)} is not supported."
            )
    raise not_modelled(
        "poptorch.ctc_beam_search_decoder",
        "decode on the host from the model's log-probabilities (e.g. a greedy argmax decode, or a beam search library)",
    )
