"""Training on several processes joined by torch.distributed (gloo on localhost): 2 processes x 2 replicas
match eager PyTorch on the combined batch step by step, and a process that stops fails the others."""

import os
import socket
import subprocess
import sys

import distributed_worker as worker
import pytest
import torch
from test_automatic_loss_scaling import HalfNet, _reference_accumulated

import poptorch

PROCESSES = 2
# Generous for two compilations on a shared machine; a hang would otherwise stall CI.
RUN_TIMEOUT = 240


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp_path, mode, timeout_seconds, reduction="post"):
    port = _free_port()
    processes = []
    for rank in range(PROCESSES):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(PROCESSES), LOCAL_RANK=str(rank))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), POPTORCH_DISTRIBUTED_TIMEOUT=str(timeout_seconds))
        command = [sys.executable, worker.__file__, str(tmp_path / f"rank{rank}.pt"), mode, reduction]
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return processes


def _finish(processes):
    """(return code, stdout, stderr) of each process, waited for in rank order; none outlives the test."""
    results = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=RUN_TIMEOUT)
            results.append((process.returncode, out, err))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def _launch(tmp_path, mode, timeout_seconds, reduction="post"):
    return _finish(_start(tmp_path, mode, timeout_seconds, reduction))


def _eager(steps, summed):
    """Process 0's initial model trained in eager PyTorch on the combined batch of every process (with
    ``summed``, on the sum of the replicas' gradients instead of their mean)."""
    model, optimizer = worker.make_model(seed=0)
    x, labels = worker.global_batches(PROCESSES)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        _, loss = model(x[step], labels[step])
        (loss * PROCESSES * worker.REPLICAS if summed else loss).backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), model.state_dict()


@pytest.mark.parametrize("reduction", sorted(worker.REDUCTIONS))
def test_two_processes_of_two_replicas_match_eager_on_the_combined_batch(tmp_path, reduction):
    _check_matches_eager(tmp_path, "train", reduction)


def test_optimizer_state_sharded_over_the_replicas_of_both_processes_matches_eager(tmp_path):
    _check_matches_eager(tmp_path, "sharded", "post")


def _check_matches_eager(tmp_path, mode, reduction):
    results = _launch(tmp_path, mode, timeout_seconds=120, reduction=reduction)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    runs = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(PROCESSES)]
    expected_losses, expected_state = _eager(worker.STEPS, summed=reduction == "sum")
    # Each process returns its replicas' losses per step; their mean is the combined batch's loss.
    losses = torch.cat([run["losses"] for run in runs], dim=1).mean(dim=1)
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-6)
    for run in runs:
        for name, value in expected_state.items():
            torch.testing.assert_close(run["state"][name], value, rtol=1e-5, atol=1e-6)
    for name in expected_state:
        assert torch.equal(runs[0]["state"][name], runs[1]["state"][name]), name


def _eager_grouped():
    """GroupedModel trained in eager PyTorch from process 0's model and optimizer state: replica r (of
    every process) runs its groups' weights; a grouped weight's gradient is the mean over its group."""
    model, optimizer = worker.make_grouped(seed=0)
    x, y = worker.grouped_inputs(PROCESSES)
    replicas = PROCESSES * worker.REPLICAS
    x, y = x.reshape(worker.STEPS, replicas, -1, worker.FEATURES), y.reshape(worker.STEPS, replicas, -1)
    losses = []
    for step in range(worker.STEPS):
        optimizer.zero_grad()
        per_replica = torch.stack(
            [
                torch.nn.functional.mse_loss(
                    x[step, r] @ model.across[r % 2] + x[step, r] @ model.within[r // 2] + model.bias, y[step, r]
                )
                for r in range(replicas)
            ]
        )
        model.across.grad, model.within.grad = torch.autograd.grad(
            per_replica.sum() * worker.GroupedModel.GROUPS / replicas, [model.across, model.within], retain_graph=True
        )
        (model.bias.grad,) = torch.autograd.grad(per_replica.mean(), [model.bias])
        optimizer.step()
        losses.append(per_replica.detach())
    return torch.stack(losses), model, optimizer


@pytest.mark.parametrize("reduction", ["post", "running"])
def test_parameters_grouped_across_processes_and_process_0s_state_reach_every_process(tmp_path, reduction):
    results = _launch(tmp_path, "grouped", timeout_seconds=120, reduction=reduction)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    runs = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(PROCESSES)]
    expected_losses, model, optimizer = _eager_grouped()
    torch.testing.assert_close(torch.cat([run["losses"] for run in runs], dim=1), expected_losses)
    for run in runs:
        for name, param in model.named_parameters():
            torch.testing.assert_close(run["state"][name], param.detach(), rtol=1e-5, atol=1e-6)
            momentum = optimizer.state[param]["momentum_buffer"]
            torch.testing.assert_close(run["momentum"][name], momentum, rtol=1e-5, atol=1e-6)
    # Inference: each process's replicas ran process 0's Linear on their own samples.
    torch.manual_seed(10)
    linear = torch.nn.Linear(worker.FEATURES, 3)
    x, _ = worker.grouped_inputs(PROCESSES)
    torch.testing.assert_close(torch.cat([run["outputs"] for run in runs]), linear(x[0]).detach())


def test_automatic_loss_scaling_sums_the_counts_of_every_process(tmp_path):
    """Only process 1's last replica overflows, and the scale halves on both processes, as the eager rule does
    on the combined batch (scale sequence and weights)."""
    results = _launch(tmp_path, "loss_scaling", timeout_seconds=120)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    runs = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(PROCESSES)]
    torch.manual_seed(0)
    model = HalfNet(worker.ALS_GAIN)
    expected = _reference_accumulated(model, worker.loss_scaling_chunks(PROCESSES), worker.ALS_SCALE, worker.STEPS)
    assert expected[0] == worker.ALS_SCALE / 2
    for run in runs:
        assert run["scales"] == expected
        for name, value in model.state_dict().items():
            torch.testing.assert_close(run["state"][name], value, rtol=2e-3, atol=2e-3)


def test_a_process_that_stops_makes_the_others_fail_clearly(tmp_path):
    results = _launch(tmp_path, "die", timeout_seconds=20)
    (code, _, err), (dead, _, _) = results
    assert dead == 3
    assert code != 0
    assert "poptorch.errors.Error" in err
    assert "with the other processes failed (process 0 of 2)" in err, err[-3000:]


def test_a_process_without_a_rendezvous_address_is_told_how_to_launch(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    opts = poptorch.Options().showCompilationProgressBar(False)
    opts.Distributed.configureProcessId(1, 2)
    model, optimizer = worker.make_model(seed=0)
    training = poptorch.trainingModel(model, opts, optimizer)
    with pytest.raises(poptorch.Error, match="MASTER_ADDR and MASTER_PORT not set. Launch with torchrun"):
        training(torch.randn(2, worker.FEATURES), torch.tensor([0, 1]))


def test_a_process_that_stalls_makes_the_others_fail_after_the_timeout(tmp_path):
    processes = _start(tmp_path, "stall", timeout_seconds=10)
    first, stalled = processes
    try:
        _, err = first.communicate(timeout=RUN_TIMEOUT)
        # Process 0 gave up at the 10 s timeout while process 1 still sleeps.
        assert first.returncode != 0 and stalled.poll() is None
    finally:
        stalled.kill()
        _finish(processes)
    assert "with the other processes failed (process 0 of 2)" in err, err[-3000:]
    assert "POPTORCH_DISTRIBUTED_TIMEOUT" in err
