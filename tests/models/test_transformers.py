"""Hugging Face transformers models, unmodified, with tiny configs built in code and random weights (no
downloads): inference equals eager; 3 SGD and 3 AdamW training steps equal eager step by step."""

import pytest
from equivalence import check_inference, check_training
from zoo import BATCH, HUGGING_FACE, SEQ, VOCAB, build

import poptorch

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(HUGGING_FACE))
def test_inference_equals_eager(name):
    case = build(name)
    args, kwargs = case.inference_call()
    check_inference(case.model, args, kwargs)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", sorted(HUGGING_FACE))
def test_training_equals_eager(name, optimizer):
    case = build(name)
    check_training(case.model, optimizer, case.loss_of, case.args, case.kwargs)
    model = case.model
    if name == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight  # trained as one tensor, still tied
    if name == "bart":  # the encoder's, the decoder's and the LM head's embeddings: still one tensor
        shared = model.model.shared.weight
        assert model.lm_head.weight is shared and model.model.encoder.embed_tokens.weight is shared


def test_gpt2_default_config_returns_its_output_class_without_the_cache():
    case = build("gpt2")
    model = case.model
    assert model.config.use_cache and model.config._attn_implementation == "sdpa"
    executor = poptorch.inferenceModel(model.eval())
    out = executor(input_ids=case.kwargs["input_ids"])
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert out.logits.shape == (BATCH, SEQ, VOCAB) and out.past_key_values is None
