"""Async and AsyncRebatched DataLoaders deliver what torch delivers, as combined batches."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from popdata_datasets import Indexed, Stream, alive, descendants, shm_entries, wait_until

import popdata
from popdata import DataLoaderMode

ASYNC_MODES = [DataLoaderMode.Async, DataLoaderMode.AsyncRebatched]


def flat(batches):
    return sorted(i for batch in batches for i in batch)


@pytest.mark.parametrize("mode", list(DataLoaderMode))
@settings(max_examples=4)
@given(
    length=st.integers(0, 40),
    batch_size=st.integers(1, 3),
    device_iterations=st.integers(1, 3),
    replication_factor=st.integers(1, 2),
    gradient_accumulation=st.integers(1, 2),
    drop_last=st.booleans(),
    num_workers=st.integers(0, 1),
)
def test_every_mode_delivers_torchs_samples_as_combined_batches(
    mode, length, batch_size, device_iterations, replication_factor, gradient_accumulation, drop_last, num_workers
):
    opts = popdata.BatchingOptions(device_iterations, replication_factor, gradient_accumulation)
    combined = batch_size * opts.device_iterations * opts.replication_factor * opts.gradient_accumulation
    loader = popdata.DataLoader(
        opts, Indexed(length), batch_size=batch_size, drop_last=drop_last, num_workers=num_workers, mode=mode
    )
    reference = [b[1].tolist() for b in torch.utils.data.DataLoader(Indexed(length), combined, drop_last=drop_last)]
    try:
        for _ in range(2):
            got = [(b[0].clone(), b[1].tolist()) for b in loader]
            assert [ids for _, ids in got] == reference
            assert all(torch.equal(x, torch.tensor([[i, -i] for i in ids], dtype=torch.float32)) for x, ids in got)
            assert len(loader) == len(got)
            assert all(len(ids) == combined for ids in reference[: length // combined])
    finally:
        loader.terminate()


@pytest.mark.parametrize("worker_size", [1, 3])
def test_rebatching_loses_nothing_per_worker_of_an_iterable_dataset(worker_size):
    opts = popdata.BatchingOptions(device_iterations=2)
    # Stream(22) gives each of 2 workers 11 samples: torch batches of 4 drop 3 per worker.
    sync = popdata.DataLoader(opts, Stream(22), batch_size=2, num_workers=2)
    assert flat(b.tolist() for b in sync) == sorted(set(range(22)) - {8, 9, 10, 19, 20, 21})
    for drop_last, expected in ((True, 20), (False, 22)):
        loader = popdata.DataLoader(
            popdata.BatchingOptions(device_iterations=2),
            Stream(22),
            batch_size=2,
            num_workers=2,
            drop_last=drop_last,
            mode=DataLoaderMode.AsyncRebatched,
            rebatched_worker_size=worker_size,
        )
        try:
            batches = [b.tolist() for b in loader]
            assert [len(b) for b in batches][:5] == [4] * 5
            assert len(flat(batches)) == expected == sum(map(len, batches))
            assert set(flat(batches)) <= set(range(22))
            assert len(loader) == len(batches)
        finally:
            loader.terminate()


@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_async_modes_with_two_workers_and_shuffle(mode):
    opts = popdata.BatchingOptions(gradient_accumulation=2)
    loader = popdata.DataLoader(
        opts, Indexed(30), batch_size=3, shuffle=True, num_workers=2, drop_last=False, mode=mode
    )
    try:
        epochs = [[b[1].tolist() for b in loader] for _ in range(2)]
        for epoch in epochs:
            assert [len(b) for b in epoch] == [6] * 5
            assert flat(epoch) == list(range(30))
        assert epochs[0] != epochs[1]
    finally:
        loader.terminate()


def test_async_batches_live_in_shared_memory():
    loader = popdata.DataLoader(popdata.BatchingOptions(), Indexed(6), batch_size=2, mode=DataLoaderMode.Async)
    try:
        batch = next(iter(loader))
        assert batch[0].is_shared() and batch[1].is_shared()
        kept = batch[1].clone()
        assert not kept.is_shared() and kept.tolist() == [0, 1]
    finally:
        loader.terminate()


def test_async_options_reach_the_accessor():
    loader = popdata.DataLoader(
        popdata.BatchingOptions(),
        Indexed(8),
        batch_size=2,
        mode=DataLoaderMode.Async,
        async_options={
            "buffer_size": 1,
            "load_indefinitely": False,
            "early_preload": True,
            "sharing_strategy": popdata.SharingStrategy.FileSystem,
        },
    )
    try:
        assert [[b[1].tolist() for b in loader] for _ in range(2)] == [[[0, 1], [2, 3], [4, 5], [6, 7]]] * 2
    finally:
        loader.terminate()


@pytest.mark.parametrize("mode", list(DataLoaderMode))
def test_same_sampler_same_epochs_as_torch(mode):
    def run(make, epochs=3):
        out = []
        for _ in range(epochs):
            out.append([b[1].tolist() for b in make])
        return out

    opts = popdata.BatchingOptions(device_iterations=2, gradient_accumulation=2)
    loader = popdata.DataLoader(
        opts,
        Indexed(27),
        batch_size=2,
        shuffle=True,
        drop_last=False,
        mode=mode,
        generator=torch.Generator().manual_seed(11),
    )
    reference = torch.utils.data.DataLoader(
        Indexed(27), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(11)
    )
    try:
        assert run(loader) == run(reference)
    finally:
        loader.terminate()


def test_persistent_workers_shut_down_with_the_accessor():
    loader = popdata.DataLoader(
        popdata.BatchingOptions(),
        Indexed(40),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        mode=DataLoaderMode.Async,
    )
    try:
        for epoch in range(3):
            for count, batch in enumerate(loader):
                last = batch[1].tolist()
                if epoch == 1 and count == 3:
                    break
            assert last == ([6, 7] if epoch == 1 else [38, 39])
        worker = loader._accessor._process.pid
        pids = [worker, *descendants(worker)]
        assert len(pids) == 3  # the accessor's process and its 2 persistent torch workers
    finally:
        loader.terminate()
    assert wait_until(lambda: not any(alive(pid) for pid in pids))
    assert shm_entries(pids) == set()
