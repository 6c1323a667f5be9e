"""poptorch.experimental.IPUContext / IPUScope and poptorch.enums.Compiler."""

import pytest
import torch

import poptorch
from poptorch.enums import Compiler


def test_ipu_context_runs_a_function_on_the_device_as_eager():
    weight = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))
    opts = poptorch.Options().showCompilationProgressBar(False)

    @poptorch.experimental.IPUContext(compiler=Compiler.PopART, parameters_and_buffers={"w": weight}, options=opts)
    def affine_and_sum(x, y):
        return x @ weight + y, (x * 2).sum()

    for seed in (1, 2):
        generator = torch.Generator().manual_seed(seed)
        x, y = torch.randn(2, 3, generator=generator), torch.randn(2, 3, generator=generator)
        outputs = affine_and_sum(x, y)
        assert isinstance(outputs, list) and len(outputs) == 2  # several results come back as a list
        torch.testing.assert_close(outputs[0], x @ weight + y)
        torch.testing.assert_close(outputs[1], (x * 2).sum())
    assert affine_and_sum.__name__ == "affine_and_sum"

    single = poptorch.experimental.IPUContext(lambda x: x.relu(), compiler=Compiler.PopART, options=opts)
    x = torch.randn(4)
    torch.testing.assert_close(single(x), x.relu())  # one result comes back as a tensor


def test_ipu_context_refuses_what_it_cannot_run():
    with pytest.raises(poptorch.Error, match="Compiler.MLIR is not modelled"):
        poptorch.experimental.IPUContext(lambda x: x)  # MLIR is PopTorch's default
    with pytest.raises(poptorch.Error, match="must map names to tensors"):
        poptorch.experimental.IPUContext(lambda x: x, compiler=Compiler.PopART, parameters_and_buffers={"w": 1})
    no_tensor = poptorch.experimental.IPUContext(
        lambda x: None, compiler=Compiler.PopART, options=poptorch.Options().showCompilationProgressBar(False)
    )
    with pytest.raises(Exception, match="must return one or more tensors"):
        no_tensor(torch.ones(2))
    with pytest.raises(poptorch.Error, match="IPUScope is not modelled"):
        poptorch.experimental.IPUScope([torch.ones(2)])
