"""DataLoader: torch.utils.data.DataLoader yielding PopTorch's combined batches."""

import logging

import torch
from torch.utils.data import IterableDataset, default_collate

from .accessor import AsynchronousDataAccessor
from .enums import DataLoaderMode
from .options import freeze, read_batching
from .partition import CombinedBatchSampler, PackedCollate, ProcessShareSampler, WorkerBatches

logger = logging.getLogger("popdata")


def _length(dataset):
    try:
        return len(dataset)
    except TypeError:
        return None


class DataLoader(torch.utils.data.DataLoader):
    """A torch DataLoader whose every batch feeds one run of the device: the combined batch.

    A combined batch holds ``combinedBatchSize = batch_size * device_iterations * replication_factor *
    gradient_accumulation`` samples (read from ``options``, see :mod:`popdata.options`; they freeze).

    Args:
        options: a batching options object (``poptorch.Options`` or :class:`popdata.BatchingOptions`).
        dataset: a map-style or iterable torch dataset.
        batch_size: the micro-batch size (samples per replica per step).
        shuffle: shuffle each epoch (map-style only). With several processes the whole dataset is shuffled
            and each process reads its block of the permutation; that needs ``random_seed`` so that every
            process draws the same permutation.
        num_workers: torch worker processes.
        drop_last: drop a last incomplete combined batch (default). Otherwise it is yielded short and a
            warning is logged.
        persistent_workers: keep torch workers between epochs (default: False).
        auto_distributed_partitioning: with several processes, give each one its contiguous block of a
            map-style dataset as PopTorch does (see :class:`popdata.partition.ProcessShareSampler`). Iterable
            datasets, samplers and batch samplers must partition themselves (pass False).
        mode: a :class:`popdata.DataLoaderMode`.
        async_options: keyword arguments of the :class:`popdata.AsynchronousDataAccessor` (Async modes).
        rebatched_worker_size: AsyncRebatched only: the batch size torch workers load (default 1, at most
            the combined batch size).
        batch_sampler: yields lists of indices; every ``device_iterations * replication_factor *
            gradient_accumulation`` of them are concatenated into a combined batch. Excludes ``batch_size``,
            ``shuffle`` and ``sampler``.
        **kwargs: other torch.utils.data.DataLoader arguments (collate_fn, worker_init_fn, sampler, ...).

    In Async modes the batches are views of shared memory, valid until the next batch: clone what you keep.
    """

    def __init__(
        self,
        options,
        dataset,
        batch_size=1,
        shuffle=None,
        num_workers=0,
        drop_last=True,
        persistent_workers=None,
        auto_distributed_partitioning=True,
        mode=DataLoaderMode.Sync,
        async_options=None,
        rebatched_worker_size=None,
        batch_sampler=None,
        **kwargs,
    ):
        batching = read_batching(options)
        mode = DataLoaderMode(mode)
        shuffle = bool(shuffle)
        iterable = isinstance(dataset, IterableDataset)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if rebatched_worker_size is not None and mode != DataLoaderMode.AsyncRebatched:
            raise ValueError("rebatched_worker_size is only used with DataLoaderMode.AsyncRebatched")
        if async_options is not None and mode == DataLoaderMode.Sync:
            raise ValueError("async_options are only used with the Async modes")
        steps = batching.steps_per_batch

        if batching.num_processes > 1 and auto_distributed_partitioning:
            if iterable:
                raise ValueError(
                    "auto_distributed_partitioning cannot split an IterableDataset: partition it in the dataset "
                    "(from the process id) and pass auto_distributed_partitioning=False"
                )
            if batch_sampler is not None:
                raise ValueError(
                    "auto_distributed_partitioning cannot split a batch_sampler's indices: partition them in "
                    "the sampler and pass auto_distributed_partitioning=False"
                )
            if kwargs.get("sampler") is not None:
                raise ValueError(
                    "auto_distributed_partitioning cannot split a sampler's indices: partition them in the "
                    "sampler and pass auto_distributed_partitioning=False"
                )
            if shuffle and batching.random_seed is None:
                raise ValueError(
                    "shuffle=True with several processes needs options.random_seed so that all processes shuffle alike"
                )
            kwargs["sampler"] = ProcessShareSampler(
                len(dataset),
                batching.process_id,
                batching.num_processes,
                batch_size * steps,
                drop_last,
                batching.random_seed if shuffle else None,
            )
            # The share sampler shuffles the whole dataset itself (torch's shuffle would only reorder a share).
            shuffle = False

        if batch_sampler is not None:
            if batch_size != 1 or shuffle or kwargs.get("sampler") is not None:
                raise ValueError("batch_sampler excludes batch_size, shuffle and sampler")
            if mode == DataLoaderMode.AsyncRebatched:
                raise ValueError("batch_sampler cannot be used with DataLoaderMode.AsyncRebatched")
            sampler_batch = getattr(batch_sampler, "batch_size", None)
            self._combined_batch_size = sampler_batch * steps if isinstance(sampler_batch, int) else None
            combined = CombinedBatchSampler(batch_sampler, steps, drop_last)
            torch_args = {"batch_sampler": combined}
            if not drop_last and _length(batch_sampler) is not None and len(batch_sampler) % steps:
                logger.warning(
                    "The batch_sampler's %d batches do not divide into combined batches of %d and drop_last=False:"
                    " the last combined batch holds %d of them.",
                    len(batch_sampler),
                    steps,
                    len(batch_sampler) % steps,
                )
        else:
            self._combined_batch_size = batch_size * steps
            worker_batch = self._combined_batch_size
            torch_drop_last = drop_last
            if mode == DataLoaderMode.AsyncRebatched:
                worker_batch = 1 if rebatched_worker_size is None else rebatched_worker_size
                if not isinstance(worker_batch, int) or not 1 <= worker_batch <= self._combined_batch_size:
                    raise ValueError(
                        f"rebatched_worker_size must be in [1, {self._combined_batch_size}] (the combined batch "
                        f"size), got {rebatched_worker_size!r}"
                    )
                # Workers hand over everything; the accessor applies drop_last to the combined batches.
                torch_drop_last = False
                if num_workers > 0:
                    kwargs["collate_fn"] = PackedCollate(kwargs.get("collate_fn") or default_collate)
                    # Keep a combined batch's worth of small batches in flight (torch's default is 2 per worker).
                    in_flight = -(-self._combined_batch_size // (worker_batch * num_workers))
                    kwargs.setdefault("prefetch_factor", max(2, in_flight))
            torch_args = {"batch_size": worker_batch, "shuffle": shuffle, "drop_last": torch_drop_last}
            share = kwargs.get("sampler")
            length = len(share) if isinstance(share, ProcessShareSampler) else _length(dataset)
            if not drop_last and not iterable and length is not None and length % self._combined_batch_size:
                logger.warning(
                    "The number of elements in the dataset (%d) is not divisible by the combined batch size "
                    "(%d) and drop_last=False: the last batch holds only %d elements.",
                    length,
                    self._combined_batch_size,
                    length % self._combined_batch_size,
                )

        freeze(options)
        self._options = options
        self._mode = mode
        self._drop_last = drop_last
        self._accessor = None
        super().__init__(
            dataset,
            num_workers=num_workers,
            persistent_workers=bool(persistent_workers) and num_workers > 0,
            **torch_args,
            **kwargs,
        )
        if mode != DataLoaderMode.Sync:
            rebatched = self._combined_batch_size if mode == DataLoaderMode.AsyncRebatched else None
            self._accessor = AsynchronousDataAccessor(
                WorkerBatches(self, drop_last), rebatched_size=rebatched, **(async_options or {})
            )

    @property
    def combinedBatchSize(self):
        """Samples per combined batch (None with a batch_sampler that has no integer ``batch_size``)."""
        return self._combined_batch_size

    @property
    def options(self):
        """The (frozen) options object this loader was built with."""
        return self._options

    @property
    def mode(self):
        """The :class:`popdata.DataLoaderMode`."""
        return self._mode

    def __len__(self):
        if self._mode != DataLoaderMode.AsyncRebatched:
            return super().__len__()
        share = self.sampler
        samples = len(share) if isinstance(share, ProcessShareSampler) else len(self.dataset)
        size = self._combined_batch_size
        return samples // size if self._drop_last else -(-samples // size)

    def __iter__(self):
        if self._accessor is not None:
            return iter(self._accessor)
        return super().__iter__()

    def terminate(self):
        """Stop the Async modes' background process (a no-op in Sync mode)."""
        if self._accessor is not None:
            self._accessor.terminate()

    def __getstate__(self):
        # The accessor (a live process) stays with the consumer; the worker only needs the torch side.
        state = self.__dict__.copy()
        state["_accessor"] = None
        return state
