"""Each example runs end to end on a tiny setting, through the simulated IPU."""

import gzip
import json
import pathlib
import runpy

import numpy as np
import pytest
import torch

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def example(name):
    return runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name=name)


def test_train_digits_reports_and_reuses_the_cache(tmp_path, capsys):
    main = example("train_digits")["main"]
    argv = ["--epochs", "1", "--max-steps", "3", "--cache-dir", str(tmp_path / "cache")]
    first = main([*argv, "--profile-dir", str(tmp_path / "first")])
    second = main([*argv, "--profile-dir", str(tmp_path / "second")])
    out = capsys.readouterr().out

    assert first["steps"] == second["steps"] == 3
    assert not first["loaded_from_cache"] and second["loaded_from_cache"]
    assert "compilation skipped" in out and "Held-out accuracy" in out
    assert 0.0 <= first["accuracy"] <= 100.0
    profile = json.loads(pathlib.Path(first["profile_path"]).read_text())
    train = profile["programs"]["train"]
    assert profile["target"] == "ipu2"
    assert train["total_cycles"] == sum(train[f"{k}_cycles"] for k in ("compute", "exchange", "sync", "host"))
    for line in ("cycles per training step", "samples/s", "compute", "exchange", "sync", "peak", "on tile"):
        assert line in out
    report = pathlib.Path(first["report_path"])
    assert out.strip().splitlines()[-1] == f"Profile report (open in a browser): {second['report_path'].resolve()}"
    assert report.parent == tmp_path / "first" and 'id="heatmap-chart"' in report.read_text()


def write_idx(path, array, code):
    header = bytes([0, 0, code, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.tobytes())


def test_fashion_mnist_reader_reads_idx_files(tmp_path):
    data = example("digits_data")
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 6), ("t10k", 3)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), 0x08)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n, dtype=np.uint8), 0x08)
    train, test = data["load_fashion_mnist"](tmp_path)
    assert len(train) == 6 and len(test) == 3
    image, label = train[4]
    assert tuple(image.shape) == (1, 28, 28) and int(label) == 4

    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="not an IDX file"):
        data["read_idx"](bad)


def test_bias_learning_lowers_the_learning_rate_and_matches_eager_adamw():
    namespace = example("bias_learning")
    result = namespace["main"]([])
    assert result["lowered_at"] is not None and result["loss_average"] < 0.35

    # setOptimizer keeps the device-resident AdamW state and only changes the learning rate.
    model = namespace["BiasModel"]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step, (x, target) in enumerate(namespace["batches"](100)):
        if step == result["lowered_at"] + 1:
            optimizer.param_groups[0]["lr"] = 0.005
        optimizer.zero_grad()
        model(x, target)[1].backward()
        optimizer.step()
    assert result["bias"] == pytest.approx(float(model.bias.detach()), abs=1e-5)
    assert abs(result["bias"] + 0.3) < 0.1


def test_inference_only_matches_cpu():
    assert example("inference_only")["main"]([]) < 1e-5


def test_gradient_accumulation_matches_one_cpu_step_on_the_whole_batch():
    assert example("gradient_accumulation")["main"]([]) < 1e-5


def test_the_readme_usage_example_runs(capsys):
    readme = (EXAMPLES.parent / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert out.startswith("loss ") and "popsim profile on ipu2" in out


def test_train_digits_runs_on_two_processes_under_torchrun(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = EXAMPLES / "train_digits.py"
    argv = ["--epochs", "1", "--max-steps", "3", "--batch-size", "8", "--cache-dir", str(tmp_path / "cache")]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    command = [*launcher, str(script)]
    run = subprocess.run(
        [*command, *argv, "--profile-dir", str(tmp_path)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # Both processes trained the same 3 steps of their own data; process 0 alone evaluates and reports.
    assert run.stdout.count("Held-out accuracy") == 1
    assert "Host wall time for 3 simulated training steps" in run.stdout
