"""Options.useIpuId on the simulated IPU-POD16: its gc-info device table and PopTorch's checks when the
model attaches to the chosen device."""

import logging

import pytest
import torch
from regressor import quiet_options

import poptorch
from poptorch import _device_ids


class TwoIpus(torch.nn.Module):
    """Two linear layers, the second on IPU 1."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)
        poptorch.BeginBlock(self.second, ipu_id=1)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def _sharded(ipu_id):
    return quiet_options().setExecutionStrategy(poptorch.ShardedExecution()).useIpuId(ipu_id)


def _runs_like_eager(model, opts):
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    torch.testing.assert_close(poptorch.inferenceModel(model, opts)(x), model(x))


@pytest.mark.parametrize(
    ("ipu_id", "first_ipu", "num_ipus"),
    [(0, 0, 1), (15, 15, 1), (16, 0, 2), (23, 14, 2), (24, 0, 4), (25, 4, 4), (27, 12, 4), (28, 0, 8), (29, 8, 8)]
    + [(30, 0, 16)],
)
def test_device_ids_number_single_ipus_then_groups_of_2_4_8_and_16(ipu_id, first_ipu, num_ipus):
    assert poptorch.Options().useIpuId(ipu_id).ipu_id == ipu_id
    assert _device_ids.device(ipu_id) == _device_ids.Device(ipu_id, first_ipu, num_ipus)
    assert len(_device_ids.DEVICES) == 31


@pytest.mark.parametrize("ipu_id", [31, -1])
def test_an_id_beyond_the_table_is_refused_naming_the_valid_ids(ipu_id):
    with pytest.raises(poptorch.Error, match=f"No such device set id: '{ipu_id}'.*device ids are 0 to 30"):
        poptorch.Options().useIpuId(ipu_id)
    with pytest.raises(poptorch.Error, match="useIpuId takes an integer device id"):
        poptorch.Options().useIpuId("1")


@pytest.mark.parametrize(
    ("model", "replicas", "ipu_id", "message"),
    [
        (TwoIpus, 1, 3, r"used IPUs = 2 \* 1 = 2 device Ids but the user provided 1 \(device 3 \(IPU 3\)"),
        (lambda: torch.nn.Linear(4, 3), 4, 17, r"used IPUs = 1 \* 4 = 4 device Ids but the user provided 2"),
    ],
)
def test_a_device_with_fewer_ipus_than_the_replicas_need_is_refused(model, replicas, ipu_id, message):
    opts = _sharded(ipu_id).replicationFactor(replicas)
    poptorch_model = poptorch.inferenceModel(model(), opts)
    with pytest.raises(poptorch.Error, match=f"Expected at least replication factor \\* {message}"):
        poptorch_model(torch.randn(2 * replicas, 4))


def test_a_device_of_the_models_ipus_runs_it(caplog):
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        _runs_like_eager(TwoIpus(), _sharded(19))
    assert "some of them will not be used" not in caplog.text


def test_a_larger_device_runs_the_model_and_warns_that_ipus_are_unused(caplog):
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        _runs_like_eager(TwoIpus(), _sharded(24))
    assert "= 2 * 1 = 2 device Ids but the device selected has 4 IPUs which means some of them will not be used" in (
        caplog.text
    )


def test_the_ipu_model_ignores_the_id_and_an_offline_target_refuses_it(caplog):
    with caplog.at_level(logging.WARNING, logger="poptorch"):
        _runs_like_eager(TwoIpus(), _sharded(0).useIpuModel(True))
    assert "useIpuId(0) has no effect with the IPU model" in caplog.text
    offline = poptorch.inferenceModel(TwoIpus(), _sharded(16).useOfflineIpuTarget())
    with pytest.raises(poptorch.Error, match="Offline compilation targeting a specific id not supported"):
        offline.compile(torch.randn(2, 4))
