"""popdata: PopTorch's batching DataLoader and AsynchronousDataAccessor, built on torch.utils.data.

popdata imports neither popir nor popsim: it only needs an options object exposing the batching protocol.

Batching protocol (read once by ``DataLoader(options, ...)``; see :mod:`popdata.options`):

===========================  ============================================================================
``device_iterations``        int >= 1
``replication_factor``       int >= 1
``gradient_accumulation``    int >= 1 (or ``options.Training.gradient_accumulation``)
``random_seed``              int or None; needed to shuffle when the dataset is split over processes
``process_id``               int in [0, num_processes) (or ``options.Distributed.processId``); default 0
``num_processes``            int >= 1 (or ``options.Distributed.numProcesses``); default 1
``_freeze()``                optional; called once by the DataLoader, the object then refuses changes
===========================  ============================================================================

:class:`BatchingOptions` is a small dataclass implementing it, so popdata works without poptorch.
A combined batch holds ``batch_size * device_iterations * replication_factor * gradient_accumulation`` samples.
"""

from importlib.metadata import version as _version

from .accessor import AsynchronousDataAccessor, WorkerError
from .enums import DataLoaderMode, SharingStrategy
from .loader import DataLoader
from .options import Batching, BatchingOptions, read_batching

__version__ = _version("popdata")

__all__ = [
    "AsynchronousDataAccessor",
    "Batching",
    "BatchingOptions",
    "DataLoader",
    "DataLoaderMode",
    "SharingStrategy",
    "WorkerError",
    "read_batching",
]
