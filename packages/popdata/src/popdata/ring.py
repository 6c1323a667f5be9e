"""The shared-memory ring buffer between the accessor's worker process (producer) and the consumer.

The consumer allocates a small control block before starting the worker; the worker allocates the slots
once it has seen the first batch (their shapes and dtypes come from it) and sends them over a pipe. Torch
shares these tensors through file descriptors whose /dev/shm names are unlinked at once, so nothing can
leak there. Each slot holds one batch: one tensor per leaf, filled along dim 0 up to ``lengths[slot, leaf]``.

Slot ownership passes through ``state``: EMPTY slots belong to the producer, every other state to the
consumer. Each written slot carries the epoch it belongs to in ``tag`` so the consumer can drop data of an
epoch it abandoned.
"""

import torch

EMPTY, DATA, END = 0, 1, 2
# Control block layout: [want, stop, state[0..n), tag[0..n)].
WANT, STOP, _HEADER = 0, 1, 2


class Control:
    """The control block: requested epoch, stop flag, and per-slot state and epoch tag."""

    def __init__(self, buffer_size, tensor=None):
        self.buffer_size = buffer_size
        if tensor is None:
            tensor = torch.zeros(_HEADER + 2 * buffer_size, dtype=torch.int64).share_memory_()
            tensor[WANT] = -1
        self.tensor = tensor
        self.values = tensor.numpy()

    def __reduce__(self):
        return (Control, (self.buffer_size, self.tensor))

    @property
    def want(self):
        return int(self.values[WANT])

    @want.setter
    def want(self, epoch):
        self.values[WANT] = epoch

    @property
    def stopping(self):
        return bool(self.values[STOP])

    def stop(self):
        self.values[STOP] = 1

    def state(self, slot):
        return int(self.values[_HEADER + slot])

    def tag(self, slot):
        return int(self.values[_HEADER + self.buffer_size + slot])

    def publish(self, slot, state, epoch):
        """Hand ``slot`` to the consumer: the tag is written before the state that releases it."""
        self.values[_HEADER + self.buffer_size + slot] = epoch
        self.values[_HEADER + slot] = state

    def release(self, slot):
        """Hand ``slot`` back to the producer."""
        self.values[_HEADER + slot] = EMPTY


class Slots:
    """``buffer_size`` sets of shared tensors shaped like one batch (dim 0 = ``capacity`` when rebatching)."""

    def __init__(self, spec, buffers, lengths):
        self.spec = spec
        self.buffers = buffers
        self.lengths = lengths
        self.length_values = lengths.numpy()

    @classmethod
    def allocate(cls, spec, example, buffer_size, capacity=None):
        """Slots for batches like the list of tensors ``example``; ``capacity`` overrides every dim 0."""
        buffers = []
        for _ in range(buffer_size):
            slot = []
            for tensor in example:
                shape = tensor.shape if capacity is None else (capacity, *tensor.shape[1:])
                slot.append(torch.empty(shape, dtype=tensor.dtype).share_memory_())
            buffers.append(slot)
        lengths = torch.zeros((buffer_size, len(example)), dtype=torch.int64).share_memory_()
        return cls(spec, buffers, lengths)

    def __reduce__(self):
        return (Slots, (self.spec, self.buffers, self.lengths))

    def views(self, slot):
        """The filled part of each tensor of ``slot`` (a 0-d tensor has length -1 and is returned whole)."""
        out = []
        for tensor, length in zip(self.buffers[slot], self.length_values[slot]):
            out.append(tensor if length < 0 else tensor[: int(length)])
        return out
