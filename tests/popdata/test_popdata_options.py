"""The batching protocol and BatchingOptions."""

import types

import pytest
import torch
from popdata_datasets import Indexed

import popdata


def test_batching_options_defaults_and_steps():
    opts = popdata.BatchingOptions(device_iterations=2, replication_factor=3, gradient_accumulation=4)
    batching = popdata.read_batching(opts)
    assert batching.steps_per_batch == 24
    assert (batching.process_id, batching.num_processes, batching.random_seed) == (0, 1, None)


@pytest.mark.parametrize(
    "kwargs",
    [{"device_iterations": 0}, {"replication_factor": -1}, {"gradient_accumulation": 1.5}, {"process_id": 2}],
)
def test_invalid_options_are_rejected(kwargs):
    with pytest.raises(ValueError):
        popdata.BatchingOptions(num_processes=2, **kwargs)


def test_options_freeze_when_a_dataloader_takes_them():
    opts = popdata.BatchingOptions(device_iterations=2)
    opts.replication_factor = 2
    loader = popdata.DataLoader(opts, Indexed(8))
    assert loader.options is opts
    with pytest.raises(AttributeError, match="frozen"):
        opts.device_iterations = 3


def test_nested_poptorch_style_options_satisfy_the_protocol():
    frozen = []
    opts = types.SimpleNamespace(
        device_iterations=2,
        replication_factor=1,
        random_seed=7,
        Training=types.SimpleNamespace(gradient_accumulation=3),
        Distributed=types.SimpleNamespace(processId=1, numProcesses=2),
        _freeze=lambda: frozen.append(True),
    )
    loader = popdata.DataLoader(opts, Indexed(24), batch_size=2)
    assert loader.combinedBatchSize == 12
    assert frozen == [True]
    # Process 1 of 2 owns the second block of whole combined batches: samples 12..23.
    assert [int(i) for batch in loader for i in batch[1]] == list(range(12, 24))


def test_an_object_without_the_protocol_is_a_type_error():
    with pytest.raises(TypeError, match="device_iterations"):
        popdata.DataLoader(object(), Indexed(4))


def test_loader_is_a_torch_dataloader():
    loader = popdata.DataLoader(popdata.BatchingOptions(), Indexed(4))
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert loader.mode == popdata.DataLoaderMode.Sync


def test_a_rejected_dataloader_leaves_the_options_unfrozen():
    opts = popdata.BatchingOptions()
    with pytest.raises(ValueError):
        popdata.DataLoader(opts, Indexed(4), batch_size=0)
    opts.device_iterations = 2
    assert opts.device_iterations == 2
