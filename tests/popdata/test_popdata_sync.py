"""Sync-mode DataLoader: combined batches, leftovers, batch samplers, partitioning, iterable datasets."""

import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from popdata_datasets import Indexed, Stream
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

import popdata

batching = st.fixed_dictionaries(
    {
        "device_iterations": st.integers(1, 3),
        "replication_factor": st.integers(1, 2),
        "gradient_accumulation": st.integers(1, 3),
    }
)


def indices(loader):
    return [[int(i) for i in batch[1]] for batch in loader]


@given(length=st.integers(0, 60), batch_size=st.integers(1, 4), opts=batching, drop_last=st.booleans())
def test_combined_batches_match_torch(length, batch_size, opts, drop_last):
    options = popdata.BatchingOptions(**opts)
    combined = batch_size * opts["device_iterations"] * opts["replication_factor"] * opts["gradient_accumulation"]
    loader = popdata.DataLoader(options, Indexed(length), batch_size=batch_size, drop_last=drop_last)
    reference = torch.utils.data.DataLoader(Indexed(length), batch_size=combined, drop_last=drop_last)

    got = indices(loader)
    assert loader.combinedBatchSize == combined
    assert got == indices(reference)
    assert len(loader) == len(got) == (length // combined if drop_last else -(-length // combined))
    assert all(len(batch) == combined for batch in got[: length // combined])
    # Leftovers: dropped, or one short last batch.
    leftover = length % combined
    if leftover and not drop_last:
        assert len(got[-1]) == leftover
    assert sum(map(len, got)) == (length - leftover if drop_last else length)


@given(length=st.integers(1, 40), batch_size=st.integers(1, 3), opts=batching, seed=st.integers(0, 2**16))
def test_shuffle_delivers_each_sample_once(length, batch_size, opts, seed):
    loader = popdata.DataLoader(
        popdata.BatchingOptions(**opts),
        Indexed(length),
        batch_size=batch_size,
        shuffle=True,
        drop_last=False,
        generator=torch.Generator().manual_seed(seed),
    )
    assert sorted(i for batch in indices(loader) for i in batch) == list(range(length))


def test_partial_last_batch_logs_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="popdata"):
        popdata.DataLoader(popdata.BatchingOptions(device_iterations=2), Indexed(7), batch_size=2, drop_last=False)
    assert "not divisible by the combined batch size (4)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="popdata"):
        popdata.DataLoader(popdata.BatchingOptions(device_iterations=2), Indexed(8), batch_size=2, drop_last=False)
    assert caplog.text == ""


@given(length=st.integers(0, 40), size=st.integers(1, 4), steps=st.integers(1, 4), drop_last=st.booleans())
def test_batch_sampler_batches_are_concatenated(length, size, steps, drop_last):
    sampler = BatchSampler(SequentialSampler(range(length)), batch_size=size, drop_last=False)
    loader = popdata.DataLoader(
        popdata.BatchingOptions(gradient_accumulation=steps),
        Indexed(length),
        batch_sampler=sampler,
        drop_last=drop_last,
    )
    groups = list(sampler)
    expected = [sum(groups[i : i + steps], []) for i in range(0, len(groups), steps)]
    if drop_last and len(groups) % steps:
        expected.pop()
    assert indices(loader) == expected
    assert len(loader) == len(expected)
    assert loader.combinedBatchSize == size * steps


def test_batch_sampler_excludes_batch_size_and_shuffle():
    sampler = BatchSampler(SequentialSampler(range(8)), batch_size=2, drop_last=False)
    for kwargs in ({"batch_size": 2}, {"shuffle": True}):
        with pytest.raises(ValueError, match="batch_sampler excludes"):
            popdata.DataLoader(popdata.BatchingOptions(), Indexed(8), batch_sampler=sampler, **kwargs)


def _shares(length, processes, **kwargs):
    """Every process's indices (one epoch) for a dataset of ``length`` samples."""
    shares = []
    for process in range(processes):
        opts = popdata.BatchingOptions(process_id=process, num_processes=processes, random_seed=5)
        loader = popdata.DataLoader(opts, Indexed(length), **kwargs)
        shares.append([i for batch in indices(loader) for i in batch])
    return shares


@given(length=st.integers(0, 50), processes=st.integers(1, 4), batch_size=st.integers(1, 3))
def test_processes_get_poptorchs_blocks_of_whole_combined_batches(length, processes, batch_size):
    # PopTorch: every process gets the same number of whole combined batches, in consecutive blocks.
    opts = {"batch_size": batch_size, "drop_last": True}
    share = batch_size * (length // (batch_size * processes))
    assert _shares(length, processes, **opts) == [list(range(p * share, (p + 1) * share)) for p in range(processes)]


@given(length=st.integers(0, 50), processes=st.integers(1, 4), batch_size=st.integers(1, 3))
def test_without_drop_last_processes_share_every_sample(length, processes, batch_size):
    # PopTorch spreads the samples evenly; the first processes get one more.
    shares = _shares(length, processes, batch_size=batch_size, drop_last=False)
    assert [i for share in shares for i in share] == list(range(length))
    expected = [length // processes + (p < length % processes) for p in range(processes)]
    assert [len(share) for share in shares] == expected


def test_shuffle_with_several_processes_needs_a_seed_and_shuffles_the_whole_dataset():
    with pytest.raises(ValueError, match="random_seed"):
        popdata.DataLoader(popdata.BatchingOptions(num_processes=2), Indexed(8), shuffle=True)
    options = [popdata.BatchingOptions(process_id=p, num_processes=2, random_seed=5) for p in range(2)]
    loaders = [popdata.DataLoader(opts, Indexed(42), batch_size=4, shuffle=True) for opts in options]
    epochs = [[[i for batch in indices(loader) for i in batch] for loader in loaders] for _ in range(3)]
    for first, second in epochs:
        # Disjoint blocks of one global permutation: 20 samples each (five combined batches of 4).
        assert len(first) == len(second) == 20 and not set(first) & set(second)
    # The permutation spans the whole dataset (a process's samples change between epochs), and the blocks
    # shift by the 2 left-over samples every other epoch so that they are used too.
    assert set(epochs[0][0]) != set(epochs[1][0])
    generator = torch.Generator().manual_seed(5)
    permutations = [torch.randperm(42, generator=generator).tolist() for _ in range(2)]
    assert epochs[0][1] == permutations[0][20:40]
    assert epochs[1][1] == permutations[1][22:42]


def test_a_sampler_cannot_be_split_between_processes_automatically():
    with pytest.raises(ValueError, match="sampler"):
        popdata.DataLoader(popdata.BatchingOptions(num_processes=2), Indexed(8), sampler=SequentialSampler(range(8)))


def test_iterable_dataset_needs_manual_partitioning_with_several_processes():
    with pytest.raises(ValueError, match="IterableDataset"):
        popdata.DataLoader(popdata.BatchingOptions(num_processes=2), Stream(8))
    loader = popdata.DataLoader(
        popdata.BatchingOptions(num_processes=2), Stream(8), auto_distributed_partitioning=False, batch_size=4
    )
    assert [batch.tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@given(length=st.integers(0, 30), batch_size=st.integers(1, 3), opts=batching, drop_last=st.booleans())
def test_iterable_dataset_matches_torch(length, batch_size, opts, drop_last):
    combined = batch_size * opts["device_iterations"] * opts["replication_factor"] * opts["gradient_accumulation"]
    options = popdata.BatchingOptions(**opts)
    loader = popdata.DataLoader(options, Stream(length), batch_size=batch_size, drop_last=drop_last)
    reference = torch.utils.data.DataLoader(Stream(length), batch_size=combined, drop_last=drop_last)
    assert [b.tolist() for b in loader] == [b.tolist() for b in reference]
    assert len(loader) == len(reference)


def test_torch_arguments_pass_through():
    loader = popdata.DataLoader(
        popdata.BatchingOptions(device_iterations=2),
        Indexed(8),
        batch_size=2,
        sampler=RandomSampler(range(8), generator=torch.Generator().manual_seed(0)),
        collate_fn=lambda samples: [int(s[1]) for s in samples],
    )
    batches = list(loader)
    assert [len(b) for b in batches] == [4, 4]
    assert sorted(sum(batches, [])) == list(range(8))


def test_mode_specific_arguments_are_checked():
    with pytest.raises(ValueError, match="rebatched_worker_size"):
        popdata.DataLoader(popdata.BatchingOptions(), Indexed(8), rebatched_worker_size=2)
    with pytest.raises(ValueError, match="async_options"):
        popdata.DataLoader(popdata.BatchingOptions(), Indexed(8), async_options={"buffer_size": 2})
    with pytest.raises(ValueError, match="rebatched_worker_size must be in"):
        popdata.DataLoader(
            popdata.BatchingOptions(),
            Indexed(8),
            batch_size=2,
            mode=popdata.DataLoaderMode.AsyncRebatched,
            rebatched_worker_size=3,
        )
