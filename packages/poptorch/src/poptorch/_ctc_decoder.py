"""``poptorch.ctc_beam_search_decoder``: the most likely label sequences of a CTC model's log-probabilities,
by prefix beam search (the decoder PopLibs validates against TensorFlow's).

Each beam is a label prefix (repeats merged, blanks removed) scored by the log-probability of all the
alignments that collapse to it, kept apart for alignments ending in a blank and in a label, so a repeated
label only extends a prefix across a blank. After every time step the ``beam_width`` best prefixes survive.
The search is data-dependent pruning, which the simulated IPU's tiles do not model: in a model captured
for the IPU it runs as a host callback (the device streams the log-probabilities and lengths to the host
and the three results back).
"""

import collections
import functools
import math

import numpy as np
import torch

from poptorch._executor_api import isRunningOnIpu
from poptorch._host_io_ops import CPU
from poptorch.errors import Error

_NEG_INF = -math.inf


def _check_int(name, value, low, high=None):
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise Error(f"ctc_beam_search_decoder: {name} must be an integer {bound}, got {value!r}")


def _logaddexp(a, b):
    """log(exp(a) + exp(b)) of two Python floats (NumPy's scalar call costs more than the search itself)."""
    if a < b:
        a, b = b, a
    return a if b == _NEG_INF else a + math.log1p(math.exp(b - a))


def _step(beams, log_probs, blank, beam_width):
    """Extend every beam by one time step's log-probabilities; keep the ``beam_width`` best prefixes."""
    grown = collections.defaultdict(lambda: [_NEG_INF, _NEG_INF])  # prefix -> [ends in blank, ends in label]
    for prefix, (p_blank, p_label) in beams.items():
        total = _logaddexp(p_blank, p_label)
        stay = grown[prefix]
        stay[0] = _logaddexp(stay[0], total + log_probs[blank])
        last = prefix[-1] if prefix else None
        for label, log_p in enumerate(log_probs):
            if label == blank:
                continue
            extended = grown[prefix + (label,)]
            if label == last:
                extended[1] = _logaddexp(extended[1], p_blank + log_p)  # a repeat needs a blank between
                stay[1] = _logaddexp(stay[1], p_label + log_p)  # the repeat merges into the last label
            else:
                extended[1] = _logaddexp(extended[1], total + log_p)
    return dict(_best(grown, beam_width))


def _best(beams, count):
    """The ``count`` most likely prefixes, most likely first (ties broken by the shorter, smaller prefix)."""
    scored = sorted(beams.items(), key=lambda item: (-_logaddexp(*item[1]), len(item[0]), item[0]))
    return scored[:count]


def _decode(log_probs, blank, beam_width, top_paths):
    beams = {(): (0.0, _NEG_INF)}
    for step in log_probs.tolist():
        beams = _step(beams, step, blank, beam_width)
    return [(_logaddexp(*scores), prefix) for prefix, scores in _best(beams, top_paths)]


def ctc_beam_search_decoder(probs, lengths, blank=0, beam_width=100, top_paths=1):
    """The ``top_paths`` most likely label sequences of each batch item by CTC prefix beam search.

    ``probs``: log-probabilities of shape ``[input_length, batch_size, num_classes]``; ``lengths``: the
    number of valid time steps of each batch item, shape ``[batch_size]``. Returns three tensors: the paths'
    log-probabilities ``[batch_size, top_paths]`` (``probs``' dtype), their lengths ``[batch_size,
    top_paths]`` and the decoded paths ``[batch_size, top_paths, input_length]`` (int32, 0 past each path's
    length; a path that does not exist, when fewer prefixes than ``top_paths`` are possible, has
    log-probability -inf and length 0). Inside a model captured for the IPU (inference) it is a host
    callback: the search runs on the host between the device's transfers."""
    for name, value in (("probs", probs), ("lengths", lengths)):
        if not isinstance(value, torch.Tensor):
            raise Error(
                f"ctc_beam_search_decoder: {name} must be a torch.tensor argument. {type(value)} is not supported."
            )
    _check_arguments(probs, lengths, blank, beam_width, top_paths)
    if isRunningOnIpu():
        return tuple(_host_decoder(blank, beam_width, top_paths)(probs, lengths))
    return _decode_batch(probs, lengths, blank, beam_width, top_paths)


@functools.cache
def _host_decoder(blank, beam_width, top_paths):
    """The host callback decoding with these settings (one per distinct setting, kept for the process)."""
    return CPU(
        functools.partial(_decode_batch, blank=blank, beam_width=beam_width, top_paths=top_paths),
        "ctc_beam_search_decoder",
    )


def _check_arguments(probs, lengths, blank, beam_width, top_paths):
    """Raise unless the shapes, dtypes and settings are valid (the lengths' values are checked on decoding)."""
    if probs.dim() != 3 or not probs.is_floating_point():
        raise Error(
            f"ctc_beam_search_decoder: probs must be a float [input_length, batch_size, num_classes] tensor, "
            f"got {probs.dtype} of shape {tuple(probs.shape)}"
        )
    _, batch_size, num_classes = probs.shape
    if lengths.shape != (batch_size,) or lengths.is_floating_point() or lengths.is_complex():
        raise Error(
            f"ctc_beam_search_decoder: lengths must be an integer tensor of shape [{batch_size}], got "
            f"{lengths.dtype} of shape {tuple(lengths.shape)}"
        )
    _check_int("blank", blank, 0, num_classes - 1)
    _check_int("beam_width", beam_width, 1)
    _check_int("top_paths", top_paths, 1, beam_width)


def _decode_batch(probs, lengths, blank, beam_width, top_paths):
    input_length, batch_size, _ = probs.shape
    steps = lengths.tolist()
    if any(not 0 <= s <= input_length for s in steps):
        raise Error(f"ctc_beam_search_decoder: lengths must be from 0 to input_length ({input_length}), got {steps}")
    log_probs = probs.detach().to(torch.float64).numpy()
    scores = np.full((batch_size, top_paths), _NEG_INF)
    path_lengths = np.zeros((batch_size, top_paths), np.int32)
    paths = np.zeros((batch_size, top_paths, input_length), np.int32)
    for b, length in enumerate(steps):
        for k, (score, prefix) in enumerate(_decode(log_probs[:length, b], blank, beam_width, top_paths)):
            scores[b, k], path_lengths[b, k] = score, len(prefix)
            paths[b, k, : len(prefix)] = prefix
    return (
        torch.from_numpy(scores).to(probs.dtype),
        torch.from_numpy(path_lengths),
        torch.from_numpy(paths),
    )
