"""Enumerations of the popdata API (names and members as in PopTorch)."""

import enum


class DataLoaderMode(enum.IntEnum):
    """How a :class:`popdata.DataLoader` loads its data.

    - ``Sync``: batches are loaded when the loop asks for them (by torch workers if ``num_workers > 0``).
    - ``Async``: a background process runs the loader and prefetches combined batches into shared memory.
    - ``AsyncRebatched``: like ``Async``, but torch workers load small batches (size 1 or
      ``rebatched_worker_size``) that the background process assembles into combined batches, so iterable
      datasets lose no samples per worker.
    """

    Sync = 0
    Async = 1
    AsyncRebatched = 2


class SharingStrategy(enum.IntEnum):
    """How the dataset reaches the :class:`popdata.AsynchronousDataAccessor` process.

    - ``SharedMemory``: pickled into a shared-memory block that the process reads (fast, size limited).
    - ``FileSystem``: pickled into a temporary file that the process reads (slower, no size limit).
    - ``Fork``: the process is forked and inherits the dataset (no pickling; unsafe if the caller runs threads
      that hold locks).
    - ``ForkServer``: pickled to a process forked from a clean server process (safe with threads).

    Every strategy but ``Fork`` needs a picklable dataset.
    """

    SharedMemory = 0
    FileSystem = 1
    Fork = 2
    ForkServer = 3
