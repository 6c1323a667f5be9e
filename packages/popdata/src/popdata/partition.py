"""Dataset and sampler adapters the DataLoader builds on (torch.utils.data does the actual work)."""

import torch
from torch.utils.data import Sampler

from .tree import pack


class ProcessShareSampler(Sampler):
    """The indices of a map-style dataset that process ``process_id`` of ``num_processes`` loads, as PopTorch
    splits a dataset between processes: one contiguous block per process, in process order.

    With ``drop_last`` every process gets the same whole number of combined batches (``step`` samples each)
    and the samples left over are skipped; otherwise the samples are spread as evenly as possible (the first
    processes get one more). With ``seed`` (shuffling) the whole dataset is permuted each epoch by a
    generator seeded once, identically in every process, and each process reads its block of that
    permutation; the blocks shift by the left-over count every other epoch so that every sample gets used.
    """

    def __init__(self, length, process_id, num_processes, step, drop_last, seed=None):
        if drop_last:
            share = step * (length // (step * num_processes))
            self.offset, self.length = process_id * share, share
            self.leftovers = length - share * num_processes
        else:
            shares = [length // num_processes + (p < length % num_processes) for p in range(num_processes)]
            self.offset, self.length = sum(shares[:process_id]), shares[process_id]
            self.leftovers = 0
        self.dataset_length = length
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.epoch = 0

    def __iter__(self):
        start = self.offset
        if self.generator is None:
            order = range(self.dataset_length)
        else:
            order = torch.randperm(self.dataset_length, generator=self.generator).tolist()
            start += self.leftovers * (self.epoch % 2)
            self.epoch += 1
        return iter(order[start : start + self.length])

    def __len__(self):
        return self.length


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
