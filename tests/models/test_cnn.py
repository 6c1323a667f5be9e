"""Convolutional models (no torchvision): a ResNet-18-style classifier with BatchNorm and residual adds, and
a UNet with bilinear upsampling and skip concatenations. Inference equals eager; 3 SGD and 3 AdamW training
steps equal eager step by step (losses, parameters and BatchNorm statistics)."""

import pytest
from equivalence import check_inference, check_training
from zoo import CONVOLUTIONAL, build

NAMES = sorted(CONVOLUTIONAL)


@pytest.mark.parametrize("name", NAMES)
def test_inference_equals_eager(name):
    case = build(name)
    check_inference(case.model, *case.inference_call())


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", NAMES)
def test_training_equals_eager(name, optimizer):
    case = build(name)
    check_training(case.model, optimizer, case.loss_of, case.args, case.kwargs)
