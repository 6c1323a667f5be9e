"""AsynchronousDataAccessor: epochs, early termination, sharing strategies, failures and clean shutdown."""

import collections
import gc
import os
import signal
from multiprocessing import forkserver, resource_tracker

import pytest
import torch
from popdata_datasets import (
    Crashing,
    Failing,
    Indexed,
    Sleepy,
    Strings,
    alive,
    descendants,
    shm_entries,
    wait_until,
)

import popdata
from popdata import AsynchronousDataAccessor, SharingStrategy, WorkerError

Pair = collections.namedtuple("Pair", "x y")


def loader(dataset, batch_size=2, **kwargs):
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, **kwargs)


def ids(accessor):
    return [batch[1].tolist() for batch in accessor]


@pytest.fixture
def no_leftovers():
    """Fail if the test leaves a child process or a popdata/torch shared-memory file behind."""
    before = set(descendants())
    shm_before = shm_entries([os.getpid()])
    seen = set()

    def track():
        # multiprocessing's fork server and resource tracker (started by the non-Fork strategies) are meant
        # to outlive the test.
        helpers = {forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid}
        seen.update(set(descendants()) - helpers)

    yield track
    track()
    left = lambda: [pid for pid in seen - before if alive(pid)]  # noqa: E731
    assert wait_until(lambda: not left()), f"orphaned processes: {left()}"
    assert shm_entries([os.getpid(), *seen]) - shm_before == set()


@pytest.mark.parametrize("strategy", list(SharingStrategy))
def test_every_sharing_strategy_delivers_the_epochs(strategy, no_leftovers):
    accessor = AsynchronousDataAccessor(loader(Indexed(7)), sharing_strategy=strategy)
    no_leftovers()
    try:
        assert [ids(accessor) for _ in range(3)] == [[[0, 1], [2, 3], [4, 5], [6]]] * 3
        assert len(accessor) == 4
    finally:
        accessor.terminate()


@pytest.mark.parametrize("load_indefinitely", [True, False])
def test_leaving_an_epoch_early_restarts_the_dataset(load_indefinitely):
    accessor = AsynchronousDataAccessor(loader(Indexed(12)), buffer_size=2, load_indefinitely=load_indefinitely)
    try:
        for stop in (1, 3, 0, 6):
            for count, batch in enumerate(accessor):
                if count == stop:
                    break
                assert batch[1].tolist() == [2 * count, 2 * count + 1]
        assert ids(accessor) == [[2 * i, 2 * i + 1] for i in range(6)]
    finally:
        accessor.terminate()


def test_early_preload_starts_loading_before_the_first_iteration():
    lazy_data, eager_data = Sleepy(8), Sleepy(8)
    lazy = AsynchronousDataAccessor(loader(lazy_data), buffer_size=2)
    eager = AsynchronousDataAccessor(loader(eager_data), buffer_size=2, early_preload=True)
    try:
        # The eager worker fills its two slots (4 samples, plus at most one batch in hand) and waits.
        assert wait_until(lambda: int(eager_data.loads) >= 4)
        assert int(lazy_data.loads) == 0
        assert ids(lazy) == ids(eager) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    finally:
        lazy.terminate()
        eager.terminate()


def test_nested_batches_keep_their_structure():
    class Structured(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return {"pair": Pair(torch.tensor(index), [torch.full((2,), index)]), "scalar": torch.tensor(1.0)}

    accessor = AsynchronousDataAccessor(
        loader(Structured(), collate_fn=lambda s: s[0] if len(s) == 1 else None, batch_size=1)
    )
    try:
        # Batches are views of the ring: keep clones.
        batches = [
            {"pair": Pair(b["pair"].x.clone(), [b["pair"].y[0].clone()]), "scalar": b["scalar"]} for b in accessor
        ]
        assert [b["pair"].x.item() for b in batches] == [0, 1, 2, 3]
        assert isinstance(batches[0]["pair"], Pair) and isinstance(batches[0]["pair"].y, list)
        assert batches[2]["pair"].y[0].tolist() == [2, 2]
        assert batches[0]["scalar"].item() == 1.0
    finally:
        accessor.terminate()


def test_rebatching_assembles_combined_batches_and_respects_drop_last():
    class Batches:
        drop_last = False

        def __iter__(self):
            start = 0
            for size in (1, 3, 2, 5, 1):
                yield torch.arange(start, start + size)
                start += size

    accessor = AsynchronousDataAccessor(Batches(), rebatched_size=4)
    try:
        assert [b.tolist() for b in accessor] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    finally:
        accessor.terminate()
    Batches.drop_last = True
    Batches.__iter__.__defaults__ = None
    accessor = AsynchronousDataAccessor(Batches(), rebatched_size=5)
    try:
        assert [b.tolist() for b in accessor] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    finally:
        accessor.terminate()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataset_exception_surfaces_with_its_cause(num_workers, no_leftovers):
    accessor = AsynchronousDataAccessor(loader(Failing(10, bad=5), num_workers=num_workers))
    no_leftovers()
    batches = []
    with pytest.raises(WorkerError) as info:
        for batch in accessor:
            no_leftovers()
            batches.append(batch[1].tolist())
    assert batches == [[0, 1], [2, 3]]
    assert isinstance(info.value.__cause__, ValueError)
    assert "sample 5 is corrupt" in str(info.value)
    # The accessor stays failed and its process is gone.
    with pytest.raises(WorkerError):
        next(iter(accessor))


def test_unsupported_batches_are_a_clear_error():
    accessor = AsynchronousDataAccessor(loader(Strings()))
    with pytest.raises(WorkerError, match="found str") as info:
        list(accessor)
    assert isinstance(info.value.__cause__, TypeError)


def test_shape_changes_are_a_clear_error():
    class Growing:
        def __iter__(self):
            yield torch.zeros(2, 3)
            yield torch.zeros(2, 4)

    with pytest.raises(WorkerError, match="batches of one shape"):
        list(AsynchronousDataAccessor(Growing()))


@pytest.mark.parametrize(("num_workers", "code"), [(0, 3), (0, None), (1, None)])
def test_a_crashed_worker_surfaces(num_workers, code, no_leftovers):
    accessor = AsynchronousDataAccessor(loader(Crashing(10, bad=4, code=code), num_workers=num_workers))
    no_leftovers()
    with pytest.raises(WorkerError) as info:
        for _ in accessor:
            no_leftovers()
    if num_workers == 0:
        expected = "exit code 3" if code == 3 else f"exit code {-signal.SIGKILL}"
        assert expected in str(info.value)
    else:
        # Torch reports the dead worker (usually "killed by signal", or a reset connection to it).
        assert isinstance(info.value.__cause__, (RuntimeError, ConnectionError))


def test_killing_the_accessor_process_surfaces(no_leftovers):
    accessor = AsynchronousDataAccessor(loader(Indexed(100), num_workers=1), buffer_size=2)
    iterator = iter(accessor)
    next(iterator)
    no_leftovers()
    os.kill(accessor._process.pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match="died unexpectedly"):
        for _ in iterator:
            pass


def test_terminate_mid_epoch_leaves_nothing_behind(no_leftovers):
    accessor = AsynchronousDataAccessor(loader(Indexed(100), num_workers=2), buffer_size=3)
    assert next(iter(accessor))[1].tolist() == [0, 1]
    assert wait_until(lambda: len(descendants()) >= 3)
    no_leftovers()
    accessor.terminate()
    accessor.terminate()
    with pytest.raises(RuntimeError, match="terminated"):
        next(accessor)


def test_garbage_collection_stops_the_process(no_leftovers):
    loader_ = popdata.DataLoader(
        popdata.BatchingOptions(), Indexed(20), batch_size=2, num_workers=1, mode=popdata.DataLoaderMode.Async
    )
    next(iter(loader_))
    no_leftovers()
    pid = loader_._accessor._process.pid
    del loader_
    gc.collect()
    assert wait_until(lambda: not alive(pid))


def test_an_epoch_iterator_continues_where_it_stopped():
    accessor = AsynchronousDataAccessor(loader(Indexed(8)))
    try:
        iterator = iter(accessor)
        assert next(iterator)[1].tolist() == [0, 1]
        # A for loop over the same iterator continues the epoch (iter() of an epoch iterator is itself).
        assert [b[1].tolist() for b in iterator] == [[2, 3], [4, 5], [6, 7]]
        stale = iter(accessor)
        next(stale)
        fresh = iter(accessor)
        # The superseded iterator neither ends silently nor takes the new epoch's batches.
        with pytest.raises(RuntimeError, match="superseded.*one iterator at a time"):
            next(stale)
        assert [b[1].tolist() for b in fresh] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert list(fresh) == []
    finally:
        accessor.terminate()


def test_a_leaf_changing_rank_is_a_clear_error():
    class RankChange:
        def __iter__(self):
            yield torch.tensor(1.0)
            yield torch.zeros(3)

    with pytest.raises(WorkerError, match="batches of one shape"):
        list(AsynchronousDataAccessor(RankChange()))
