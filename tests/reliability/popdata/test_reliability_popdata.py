"""Catalogue (popdata): abandoned, reused, failing and misconfigured loaders. Each case asserts the clear error
or the right batches; the catalogue's fixture checks that no worker process or shared memory is left."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from popdata_datasets import Crashing, Failing, Indexed, Strings, alive, shm_entries, wait_until

import popdata
from popdata import DataLoaderMode, WorkerError

error = pytest.mark.outcome("clear error")
right = pytest.mark.outcome("right result")
ASYNC = DataLoaderMode.Async


def _loader(dataset, mode=ASYNC, **kwargs):
    return popdata.DataLoader(popdata.BatchingOptions(), dataset, batch_size=2, mode=mode, **kwargs)


def _ids(batches):
    return [b[1].tolist() for b in batches]


ABANDONED = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {helpers!r})
    import popdata
    from popdata_datasets import Indexed, descendants
    pids = set()
    for _ in range(30):
        loader = popdata.DataLoader(popdata.BatchingOptions(), Indexed(100), batch_size=2, num_workers=1,
                                    mode=popdata.DataLoaderMode.Async)
        next(iter(loader))
        pids.update(descendants())
    print(" ".join(map(str, sorted(pids))), flush=True)
    """
)


@right
def test_thirty_abandoned_async_loaders_exit_without_tracebacks_or_leftovers():
    helpers = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "popdata")
    run = subprocess.run(
        [sys.executable, "-c", ABANDONED.format(helpers=os.path.abspath(helpers))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "AssertionError" not in run.stderr, run.stderr[-3000:]
    pids = [int(pid) for pid in run.stdout.split()]
    assert len(pids) >= 30
    assert wait_until(lambda: not any(alive(pid) for pid in pids)), [pid for pid in pids if alive(pid)]
    assert shm_entries(pids) == set()


@error
def test_a_second_iter_supersedes_the_first_iterator_with_a_clear_error():
    loader = _loader(Indexed(8))
    try:
        first = iter(loader)
        assert _ids([next(first)]) == [[0, 1]]
        second = iter(loader)
        with pytest.raises(RuntimeError, match="superseded.*one iterator at a time.*second loader"):
            next(first)
        assert _ids(second) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    finally:
        loader.terminate()


@right
def test_leaving_a_loop_early_then_looping_again_restarts_the_epoch():
    loader = _loader(Indexed(8))
    try:
        for _ in loader:
            break
        assert _ids(loader) == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert _ids(loader) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    finally:
        loader.terminate()


@right
def test_two_sync_iterators_are_independent():
    loader = _loader(Indexed(6), mode=DataLoaderMode.Sync)
    first, second = iter(loader), iter(loader)
    assert _ids([next(first)]) == [[0, 1]]
    assert _ids(second) == [[0, 1], [2, 3], [4, 5]]
    assert _ids(first) == [[2, 3], [4, 5]]


@error
def test_a_failing_sample_reaches_the_consumer_with_its_cause():
    loader = _loader(Failing(10, bad=5))
    try:
        with pytest.raises(WorkerError, match="sample 5 is corrupt"):
            list(loader)
    finally:
        loader.terminate()


@error
@pytest.mark.parametrize("code", [None, 3], ids=["sigkill", "exit_3"])
def test_a_worker_that_dies_is_an_error_not_a_hang(code):
    loader = _loader(Crashing(10, bad=3, code=code))
    try:
        with pytest.raises(WorkerError, match="died unexpectedly|failed"):
            list(loader)
    finally:
        loader.terminate()


@error
def test_strings_cannot_go_through_shared_memory():
    loader = _loader(Strings())
    try:
        with pytest.raises(WorkerError):
            list(loader)
    finally:
        loader.terminate()


@error
def test_next_after_terminate():
    loader = _loader(Indexed(8))
    iterator = iter(loader)
    next(iterator)
    loader.terminate()
    loader.terminate()  # idempotent
    with pytest.raises(RuntimeError, match="terminated"):
        next(iterator)


BAD_LOADERS = {
    "batch_sampler_and_batch_size": (
        lambda: popdata.DataLoader(popdata.BatchingOptions(), Indexed(8), batch_size=2, batch_sampler=[[0, 1], [2, 3]]),
        ValueError,
        "batch_sampler excludes batch_size",
    ),
    "rebatched_worker_size_too_large": (
        lambda: _loader(Indexed(8), mode=DataLoaderMode.AsyncRebatched, rebatched_worker_size=5),
        ValueError,
        r"rebatched_worker_size must be in \[1, 2\]",
    ),
    "buffer_size_zero": (
        lambda: _loader(Indexed(8), async_options={"buffer_size": 0}),
        ValueError,
        "buffer_size must be a positive integer",
    ),
    "device_iterations_zero": (
        lambda: popdata.DataLoader(popdata.BatchingOptions(device_iterations=0), Indexed(8)),
        ValueError,
        "device_iterations must be a positive integer",
    ),
    "not_an_options_object": (lambda: popdata.DataLoader(object(), Indexed(8)), TypeError, "not a batching options"),
}


@error
@pytest.mark.parametrize("case", sorted(BAD_LOADERS))
def test_bad_loader_arguments(case):
    build, exception, message = BAD_LOADERS[case]
    with pytest.raises(exception, match=message):
        build()


@error
def test_options_used_by_a_loader_are_frozen():
    options = popdata.BatchingOptions()
    popdata.DataLoader(options, Indexed(8), batch_size=2)
    with pytest.raises(AttributeError, match="frozen"):
        options.device_iterations = 2


@right
def test_a_partial_last_batch_is_kept_when_asked():
    loader = popdata.DataLoader(popdata.BatchingOptions(), Indexed(5), batch_size=2, drop_last=False)
    assert _ids(loader) == [[0, 1], [2, 3], [4]]


@right
def test_a_dataset_shorter_than_one_combined_batch_gives_no_batches():
    loader = popdata.DataLoader(popdata.BatchingOptions(device_iterations=4), Indexed(7), batch_size=2)
    assert len(loader) == 0 and list(loader) == []


@right
def test_async_batches_equal_sync_batches():
    torch.manual_seed(0)
    sync = [b[0] for b in _loader(Indexed(12), mode=DataLoaderMode.Sync)]
    loader = _loader(Indexed(12))
    try:
        for expected, got in zip(sync, [b[0].clone() for b in loader], strict=True):
            torch.testing.assert_close(got, expected)
    finally:
        loader.terminate()
