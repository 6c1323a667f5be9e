"""Dataset and sampler adapters the DataLoader builds on (torch.utils.data does the actual work)."""

import torch
from torch.utils.data import Sampler, Subset

from .tree import pack


def process_subset(dataset, process_id, num_processes):
    """Process ``process_id``'s contiguous share of a map-style ``dataset``.

    Every process gets ``len(dataset) // num_processes`` samples so that all run the same number of steps;
    the remainder is left out.
    """
    share = len(dataset) // num_processes
    return Subset(dataset, range(process_id * share, (process_id + 1) * share))


class CombinedBatchSampler(Sampler):
    """Concatenates every ``steps`` consecutive batches of ``batch_sampler`` into one combined batch.

    A last group of fewer than ``steps`` batches is dropped if ``drop_last``, else yielded as it is.
    """

    def __init__(self, batch_sampler, steps, drop_last):
        self.batch_sampler = batch_sampler
        self.steps = steps
        self.drop_last = drop_last

    def __iter__(self):
        combined, count = [], 0
        for batch in self.batch_sampler:
            combined.extend(batch)
            count += 1
            if count == self.steps:
                yield combined
                combined, count = [], 0
        if count and not self.drop_last:
            yield combined

    def __len__(self):
        batches = len(self.batch_sampler)
        return batches // self.steps if self.drop_last else -(-batches // self.steps)


class WorkerBatches:
    """The batches of ``loader`` as plain torch would load them (what an accessor's worker iterates).

    ``drop_last`` is the combined-batch ``drop_last`` the accessor applies when it rebatches.
    """

    def __init__(self, loader, drop_last):
        self.loader = loader
        self.drop_last = drop_last

    def __iter__(self):
        return torch.utils.data.DataLoader.__iter__(self.loader)

    def __len__(self):
        return len(self.loader)

    def close(self):
        """Shut persistent torch workers down (daemonic workers killed at exit could leave /dev/shm files)."""
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


class PackedCollate:
    """Wraps a collate_fn so that torch workers send its batches by value (see tree.PackedTensor)."""

    def __init__(self, collate_fn):
        self.collate_fn = collate_fn

    def __call__(self, samples):
        return pack(self.collate_fn(samples))
