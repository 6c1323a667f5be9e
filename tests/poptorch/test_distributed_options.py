"""Options.Distributed: the process's place from torch.distributed or a launcher's environment, and the
DataLoader share it gives."""

import pytest
import torch

import poptorch

_LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
)


@pytest.fixture
def environ(monkeypatch):
    for variable in _LAUNCHER_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


def _place(opts):
    return opts.Distributed.processId, opts.Distributed.numProcesses, opts.Distributed.localProcessId


def test_a_lone_process_is_process_0_of_1(environ):
    assert _place(poptorch.Options()) == (0, 1, 0)


def test_mpi_variables_give_the_process(environ):
    environ.setenv("OMPI_COMM_WORLD_RANK", "2")
    environ.setenv("OMPI_COMM_WORLD_SIZE", "4")
    environ.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    assert _place(poptorch.Options()) == (2, 4, 0)


def test_torchrun_variables_give_the_process(environ):
    environ.setenv("RANK", "3")
    environ.setenv("WORLD_SIZE", "4")
    environ.setenv("LOCAL_RANK", "1")
    assert _place(poptorch.Options()) == (3, 4, 1)


def test_configure_process_id_overrides_the_environment(environ):
    environ.setenv("RANK", "1")
    environ.setenv("WORLD_SIZE", "2")
    opts = poptorch.Options().Distributed.configureProcessId(0, 3)
    assert (opts.processId, opts.numProcesses) == (0, 3)
    assert poptorch.Options().Distributed.disable().numProcesses == 1


def test_set_env_var_names_reads_other_variables(environ):
    environ.setenv("MY_SIZE", "5")
    environ.setenv("MY_ID", "4")
    opts = poptorch.Options().Distributed.setEnvVarNames("MY_SIZE", "MY_ID")
    assert (opts.processId, opts.numProcesses) == (4, 5)


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE must be an integer >= 1, got 'two'"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"},
            "disagree about this process",
        ),
    ],
)
def test_inconsistent_variables_are_errors(environ, variables, message):
    for variable, value in variables.items():
        environ.setenv(variable, value)
    with pytest.raises(poptorch.Error, match=message):
        poptorch.Options()


def test_an_initialised_process_group_gives_the_process(environ, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        environ.setenv("OMPI_COMM_WORLD_RANK", "1")
        environ.setenv("OMPI_COMM_WORLD_SIZE", "2")
        # The process group is the authority once initialised.
        assert _place(poptorch.Options()) == (0, 1, 0)
    finally:
        dist.destroy_process_group()


class _Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 26

    def __getitem__(self, index):
        return torch.tensor(index)


def test_each_process_loads_its_own_block_of_whole_combined_batches(environ):
    environ.setenv("OMPI_COMM_WORLD_SIZE", "3")
    seen = []
    for process in range(3):
        environ.setenv("OMPI_COMM_WORLD_RANK", str(process))
        opts = poptorch.Options().replicationFactor(2)
        loader = poptorch.DataLoader(opts, _Samples(), batch_size=2)
        seen.append([int(i) for batch in loader for i in batch])
    # Combined batches of 4; 26 samples make two per process and 2 samples are left over.
    assert seen == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]


def test_a_process_group_that_disagrees_with_the_options_is_an_error(environ, tmp_path):
    import torch.distributed as dist

    from poptorch import _distributed

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        opts = poptorch.Options()
        opts.Distributed.configureProcessId(0, 2)
        with pytest.raises(
            poptorch.Error, match="says process 0 of 2, but the torch.distributed process group is rank 0 of 1"
        ):
            _distributed.join(opts)
    finally:
        dist.destroy_process_group()


def test_the_asynchronous_loader_gives_a_process_the_same_share(environ):
    environ.setenv("OMPI_COMM_WORLD_SIZE", "2")
    environ.setenv("OMPI_COMM_WORLD_RANK", "1")
    shares = []
    for mode in (poptorch.DataLoaderMode.Sync, poptorch.DataLoaderMode.Async):
        opts = poptorch.Options().randomSeed(3)
        loader = poptorch.DataLoader(opts, _Samples(), batch_size=4, shuffle=True, mode=mode)
        try:
            shares.append([[int(i) for batch in loader for i in batch] for _ in range(2)])
        finally:
            loader.terminate()
    assert shares[0] == shares[1]
    assert len(shares[0][0]) == 12 and shares[0][0] != shares[0][1]
