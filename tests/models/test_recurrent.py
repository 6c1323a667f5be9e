"""LSTM and GRU sequence classifiers: inference equals eager; 3 SGD and 3 AdamW training steps equal eager
step by step."""

import pytest
from equivalence import check_inference, check_training
from zoo import RECURRENT, build


@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_inference_equals_eager(name):
    case = build(name)
    check_inference(case.model, *case.inference_call())


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_training_equals_eager(name, optimizer):
    case = build(name)
    check_training(case.model, optimizer, case.loss_of, case.args, case.kwargs)
