"""The batching protocol: what a DataLoader reads from its options object, and a minimal implementation.

An options object is anything exposing these attributes (read once, when the DataLoader is built):

- ``device_iterations`` (int >= 1)
- ``replication_factor`` (int >= 1)
- optionally ``input_replication_factor``: replicas with distinct inputs (replicas grouped to share their
  inputs load one micro-batch per group); defaults to ``replication_factor``
- ``gradient_accumulation`` (int >= 1), or ``Training.gradient_accumulation``
- ``random_seed`` (int or None): seeds shuffling when the dataset is split across several processes
- ``process_id`` and ``num_processes`` (ints), or ``Distributed.processId`` and ``Distributed.numProcesses``
- optionally ``_freeze()``: called once; afterwards the object must refuse changes

The nested spellings let ``poptorch.Options`` satisfy the protocol as it is.
"""

import dataclasses

_MISSING = object()


@dataclasses.dataclass
class BatchingOptions:
    """The smallest options object a :class:`popdata.DataLoader` accepts (use it without poptorch).

    The combined batch a loader yields holds ``batch_size * device_iterations * replication_factor *
    gradient_accumulation`` samples. The object freezes when a DataLoader takes it.
    """

    device_iterations: int = 1
    replication_factor: int = 1
    gradient_accumulation: int = 1
    random_seed: int | None = None
    process_id: int = 0
    num_processes: int = 1
    _frozen: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        read_batching(self)

    def __setattr__(self, name, value):
        if getattr(self, "_frozen", False):
            raise AttributeError(f"BatchingOptions are frozen (used by a DataLoader): cannot set {name}")
        super().__setattr__(name, value)

    def _freeze(self):
        object.__setattr__(self, "_frozen", True)
        return self


@dataclasses.dataclass(frozen=True)
class Batching:
    """The batching facts read from an options object (see the module docstring)."""

    device_iterations: int
    replication_factor: int
    gradient_accumulation: int
    random_seed: int | None
    process_id: int
    num_processes: int
    input_replication_factor: int

    @property
    def steps_per_batch(self):
        """Micro-batches in one combined batch: device_iterations x input_replication_factor x
        gradient_accumulation."""
        return self.device_iterations * self.input_replication_factor * self.gradient_accumulation


def _read(options, name, nested=None, default=_MISSING):
    """``options.<name>``, else the dotted ``nested`` path (e.g. ``"Training.gradient_accumulation"``)."""
    value = getattr(options, name, _MISSING)
    if value is _MISSING and nested is not None:
        value = options
        for part in nested.split("."):
            value = getattr(value, part, _MISSING)
    if value is _MISSING:
        value = default
    if value is _MISSING:
        raise TypeError(f"{type(options).__name__} is not a batching options object: it has no {name!r}")
    return value


def read_batching(options):
    """Read and validate the batching protocol from ``options``; returns a :class:`Batching`."""
    batching = Batching(
        device_iterations=_read(options, "device_iterations"),
        replication_factor=_read(options, "replication_factor"),
        gradient_accumulation=_read(options, "gradient_accumulation", "Training.gradient_accumulation"),
        random_seed=_read(options, "random_seed", default=None),
        process_id=_read(options, "process_id", "Distributed.processId", 0),
        num_processes=_read(options, "num_processes", "Distributed.numProcesses", 1),
        input_replication_factor=_read(options, "input_replication_factor", default=None)
        or _read(options, "replication_factor"),
    )
    for name in (
        "device_iterations",
        "replication_factor",
        "gradient_accumulation",
        "num_processes",
        "input_replication_factor",
    ):
        value = getattr(batching, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not 0 <= batching.process_id < batching.num_processes:
        raise ValueError(f"process_id must be in [0, {batching.num_processes}), got {batching.process_id!r}")
    return batching


def freeze(options):
    """Freeze ``options`` if it offers the ``_freeze()`` hook."""
    hook = getattr(options, "_freeze", None)
    if callable(hook):
        hook()
