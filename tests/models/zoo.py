"""The model zoo: every model tests/models checks against eager PyTorch and bench/models.py times.

``ZOO[name]()`` builds a fresh model with seeded random weights and its inputs as a ``Case``. Configs are
tiny (hidden 32, 2 layers, sequence 8, batch 2) and built in code: nothing is downloaded. Dropout is off in
every Hugging Face config: the IPU's random numbers are not torch's, so dropout could not match eager.
The Hugging Face models need ``transformers``, imported only when one of them is built.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

BATCH, SEQ, VOCAB, HIDDEN, LAYERS, HEADS, FFN, CLASSES = 2, 8, 64, 32, 2, 2, 64, 3


@dataclass
class Case:
    """A model, the call that trains it (``args`` / ``kwargs``, labels included), how to find the loss in
    its output, and the names of the keyword arguments an inference call leaves out."""

    model: nn.Module
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    loss_of: object = lambda out: out.loss
    inference_drops: tuple = ()

    def inference_call(self):
        """(args, kwargs) of an inference call: the training call without its labels."""
        if not self.kwargs:
            return self.args[:1], {}
        return self.args, {k: v for k, v in self.kwargs.items() if k not in self.inference_drops}


def _transformers():
    import transformers

    return transformers


BERT_LIKE = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "intermediate_size": FFN,
    "max_position_embeddings": SEQ + 4,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}


def _ids(seed=0):
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _padding_mask():
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 3 :] = 0
    return mask


def _text_kwargs(labels):
    """The keyword call of a Hugging Face text model: token ids, a padding mask and the labels."""
    return {"input_ids": _ids(), "attention_mask": _padding_mask(), "labels": labels}


def bert():
    model = _transformers().BertForSequenceClassification(_transformers().BertConfig(**BERT_LIKE, num_labels=CLASSES))
    kwargs = _text_kwargs(torch.tensor([0, 2]))
    return Case(model, kwargs=kwargs, inference_drops=("labels",))


def gpt2():
    config = _transformers().GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_positions=SEQ + 4,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    ids = _ids()
    return Case(
        _transformers().GPT2LMHeadModel(config), kwargs={"input_ids": ids, "labels": ids}, inference_drops=("labels",)
    )


def distilbert():
    config = _transformers().DistilBertConfig(
        vocab_size=VOCAB,
        dim=HIDDEN,
        n_layers=LAYERS,
        n_heads=HEADS,
        hidden_dim=FFN,
        max_position_embeddings=SEQ + 4,
        dropout=0.0,
        attention_dropout=0.0,
    )
    labels = _ids(1)
    labels[:, ::2] = -100  # only some positions are masked-LM targets
    kwargs = _text_kwargs(labels)
    return Case(_transformers().DistilBertForMaskedLM(config), kwargs=kwargs, inference_drops=("labels",))


def roberta():
    config = _transformers().RobertaConfig(**BERT_LIKE, num_labels=CLASSES, pad_token_id=1)
    labels = torch.randint(0, 3, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    kwargs = _text_kwargs(labels)
    return Case(_transformers().RobertaForTokenClassification(config), kwargs=kwargs, inference_drops=("labels",))


def t5():
    config = _transformers().T5Config(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=HIDDEN // HEADS,
        d_ff=FFN,
        num_layers=LAYERS,
        num_heads=HEADS,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    labels = torch.randint(1, VOCAB, (BATCH, SEQ - 2), generator=torch.Generator().manual_seed(3))
    kwargs = _text_kwargs(labels)
    # The decoder reads its inputs from the labels, so inference keeps them.
    return Case(_transformers().T5ForConditionalGeneration(config), kwargs=kwargs)


def vit():
    config = _transformers().ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=CLASSES,
    )
    pixels = torch.randn(BATCH, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    kwargs = {"pixel_values": pixels, "labels": torch.tensor([1, 2])}
    return Case(_transformers().ViTForImageClassification(config), kwargs=kwargs, inference_drops=("labels",))


def swin():
    """Shifted-window attention (a roll, window partitions, a relative position bias table) and patch merging;
    its pooler averages tokens through adaptive pooling of a transposed tensor (a strided view)."""
    config = _transformers().SwinConfig(
        image_size=16,
        patch_size=2,
        num_channels=3,
        embed_dim=8,
        depths=[2, 1],
        num_heads=[2, 2],
        window_size=4,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0,
        num_labels=CLASSES,
    )
    kwargs = {"pixel_values": _images(16), "labels": torch.tensor([1, 2])}
    return Case(_transformers().SwinForImageClassification(config), kwargs=kwargs, inference_drops=("labels",))


KV_HEADS = 2  # the decoder-only models' grouped-query attention: 4 query heads share 2 key/value heads
DECODER_LIKE = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": FFN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 2 * KV_HEADS,
    "num_key_value_heads": KV_HEADS,
    "max_position_embeddings": SEQ + 4,
    "attention_dropout": 0.0,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def _causal_lm(model):
    """A causal LM case: it predicts its own (padded) token ids."""
    ids = _ids()
    kwargs = {"input_ids": ids, "attention_mask": _padding_mask(), "labels": ids}
    return Case(model, kwargs=kwargs, inference_drops=("labels",))


def llama():
    """RMSNorm, rotary position embeddings, a SiLU-gated MLP and grouped-query attention."""
    return _causal_lm(_transformers().LlamaForCausalLM(_transformers().LlamaConfig(**DECODER_LIKE)))


def qwen2():
    """Llama's layout with query/key/value biases; its second layer attends through a sliding window."""
    config = _transformers().Qwen2Config(
        **DECODER_LIKE, use_sliding_window=True, sliding_window=SEQ // 2, max_window_layers=1
    )
    return _causal_lm(_transformers().Qwen2ForCausalLM(config))


def mixtral():
    """A sparse mixture of experts: a router's top 2 of 4 SiLU-gated experts per token. The experts run as
    batched matmuls over expert matrices gathered per token (fixed shapes); the default grouped one calls
    torch.histc and a transformers custom op, which poptorch lists as unsupported operations."""
    config = _transformers().MixtralConfig(
        **DECODER_LIKE, num_local_experts=4, num_experts_per_tok=2, experts_implementation="batched_mm"
    )
    return _causal_lm(_transformers().MixtralForCausalLM(config))


def albert():
    """One transformer layer's weights shared by all three layers: the same module is called three times."""
    config = _transformers().AlbertConfig(
        **{**BERT_LIKE, "num_hidden_layers": 3},
        embedding_size=HIDDEN // 2,
        num_hidden_groups=1,
        classifier_dropout_prob=0.0,
        num_labels=CLASSES,
    )
    kwargs = _text_kwargs(torch.tensor([0, 2]))
    return Case(_transformers().AlbertForSequenceClassification(config), kwargs=kwargs, inference_drops=("labels",))


def electra():
    """ELECTRA's discriminator: factorised embeddings projected to the hidden size, a per-token binary loss.
    No padding mask: with one, the model drops padded tokens by boolean indexing (a value-dependent shape,
    which poptorch refuses)."""
    config = _transformers().ElectraConfig(**BERT_LIKE, embedding_size=HIDDEN // 2)
    kwargs = {"input_ids": _ids(), "labels": _ids(1) % 2}
    return Case(_transformers().ElectraForPreTraining(config), kwargs=kwargs, inference_drops=("labels",))


def deberta_v2():
    """Disentangled relative attention (content-to-position and position-to-content) over log buckets.
    The problem type is set: left unset, the loss drops negative labels by a value-dependent gather."""
    config = _transformers().DebertaV2Config(
        **BERT_LIKE,
        relative_attention=True,
        position_buckets=SEQ // 2,
        max_relative_positions=SEQ,
        pos_att_type=["p2c", "c2p"],
        num_labels=CLASSES,
        problem_type="single_label_classification",
    )
    kwargs = _text_kwargs(torch.tensor([1, 0]))
    return Case(_transformers().DebertaV2ForSequenceClassification(config), kwargs=kwargs, inference_drops=("labels",))


def bart():
    """An encoder-decoder whose encoder, decoder and LM head share one embedding matrix."""
    config = _transformers().BartConfig(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN,
        max_position_embeddings=SEQ + 4,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        tie_word_embeddings=True,
    )
    labels = torch.randint(3, VOCAB, (BATCH, SEQ - 2), generator=torch.Generator().manual_seed(3))
    # The decoder reads its inputs from the labels, so inference keeps them.
    return Case(_transformers().BartForConditionalGeneration(config), kwargs=_text_kwargs(labels))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18's layout (a stem, four stages of two basic blocks, global pooling) at a tiny width."""

    def __init__(self, width=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        stages, cin = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2**i
            stages += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, CLASSES)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        logits = self.fc(F.adaptive_avg_pool2d(self.stages(self.stem(x)), 1).flatten(1))
        return logits if labels is None else (logits, self.loss(logits, labels))


def _double_conv(cin, cout):
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1)
    )


class UNet(nn.Module):
    """Two down and two up levels; the decoder upsamples bilinearly and concatenates the encoder's skips."""

    def __init__(self, width=4):
        super().__init__()
        self.down1 = _double_conv(3, width)
        self.down2 = _double_conv(width, 2 * width)
        self.bottom = _double_conv(2 * width, 4 * width)
        self.up2 = _double_conv(6 * width, 2 * width)
        self.up1 = _double_conv(3 * width, width)
        self.head = nn.Conv2d(width, 1, 1)

    def forward(self, x, target=None):
        d1 = self.down1(x)
        d2 = self.down2(F.max_pool2d(d1, 2))
        b = self.bottom(F.max_pool2d(d2, 2))
        u2 = self.up2(torch.cat([F.interpolate(b, scale_factor=2, mode="bilinear", align_corners=False), d2], 1))
        u1 = self.up1(torch.cat([F.interpolate(u2, size=d1.shape[2:], mode="bilinear", align_corners=True), d1], 1))
        out = self.head(u1)
        return out if target is None else (out, F.binary_cross_entropy_with_logits(out, target))


class ChannelsLayerNorm(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (ConvNeXt's downsampling norm)."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """A 7x7 depthwise conv, LayerNorm over channels, a GELU MLP as 1x1 linears, a layer scale, a residual."""

    def __init__(self, dim):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.expand = nn.Linear(dim, 4 * dim)
        self.project = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.project(F.gelu(self.expand(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """ConvNeXt's layout at a tiny width: a 4x4 patchify stem, two stages joined by a norm and a 2x2 conv."""

    def __init__(self, dims=(8, 16)):
        super().__init__()
        layers = [nn.Conv2d(3, dims[0], 4, stride=4), ChannelsLayerNorm(dims[0], eps=1e-6), ConvNeXtBlock(dims[0])]
        for cin, cout in zip(dims, dims[1:]):
            layers += [ChannelsLayerNorm(cin, eps=1e-6), nn.Conv2d(cin, cout, 2, stride=2), ConvNeXtBlock(cout)]
        self.features = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(dims[-1])
        self.fc = nn.Linear(dims[-1], CLASSES)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        logits = self.fc(self.norm(self.features(x).mean((2, 3))))
        return logits if labels is None else (logits, self.loss(logits, labels))


class InvertedResidual(nn.Module):
    """MobileNetV2's block: a 1x1 expansion, a 3x3 depthwise conv, a linear 1x1 projection, ReLU6."""

    def __init__(self, cin, cout, stride, expand=2):
        super().__init__()
        mid = cin * expand
        self.residual = stride == 1 and cin == cout
        self.block = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU6(),
            nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False),
            nn.BatchNorm2d(mid),
            nn.ReLU6(),
            nn.Conv2d(mid, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )

    def forward(self, x):
        y = self.block(x)
        return x + y if self.residual else y


class MobileNetV2(nn.Module):
    """MobileNetV2's layout at a tiny width: a strided stem, three inverted residuals, global pooling."""

    def __init__(self, width=8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU6())
        self.blocks = nn.Sequential(
            InvertedResidual(width, width, 1),
            InvertedResidual(width, 2 * width, 2),
            InvertedResidual(2 * width, 2 * width, 1),
        )
        self.fc = nn.Linear(2 * width, CLASSES)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        logits = self.fc(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))
        return logits if labels is None else (logits, self.loss(logits, labels))


def _images(size):
    return torch.randn(BATCH, 3, size, size, generator=torch.Generator().manual_seed(0))


def resnet18():
    return Case(ResNet18(), (_images(16), torch.tensor([1, 2])), loss_of=_second)


def unet():
    mask = (torch.rand(BATCH, 1, 8, 8, generator=torch.Generator().manual_seed(1)) > 0.5).float()
    return Case(UNet(), (_images(8), mask), loss_of=_second)


def convnext():
    return Case(ConvNeXt(), (_images(16), torch.tensor([1, 2])), loss_of=_second)


def mobilenet_v2():
    return Case(MobileNetV2(), (_images(16), torch.tensor([1, 2])), loss_of=_second)


FEATURES = 6  # per time step of the recurrent models' sequences


class RecurrentClassifier(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn = cell(FEATURES, HIDDEN, num_layers=LAYERS, batch_first=True)
        self.fc = nn.Linear(HIDDEN, CLASSES)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        out, _ = self.rnn(x)
        logits = self.fc(out[:, -1])
        return logits if labels is None else (logits, self.loss(logits, labels))


def _recurrent(cell):
    x = torch.randn(BATCH, SEQ, FEATURES, generator=torch.Generator().manual_seed(5))
    return Case(RecurrentClassifier(cell), (x, torch.tensor([0, 2])), loss_of=_second)


def lstm():
    return _recurrent(nn.LSTM)


def gru():
    return _recurrent(nn.GRU)


def _second(out):
    return out[1]


HUGGING_FACE = {"bert": bert, "gpt2": gpt2, "distilbert": distilbert, "roberta": roberta, "t5": t5, "vit": vit}
HUGGING_FACE |= {
    "swin": swin,
    "llama": llama,
    "qwen2": qwen2,
    "mixtral": mixtral,
    "albert": albert,
    "electra": electra,
    "deberta_v2": deberta_v2,
    "bart": bart,
}
CONVOLUTIONAL = {"resnet18": resnet18, "unet": unet, "convnext": convnext, "mobilenet_v2": mobilenet_v2}
RECURRENT = {"lstm": lstm, "gru": gru}
ZOO = {**HUGGING_FACE, **CONVOLUTIONAL, **RECURRENT}


def build(name):
    """A fresh ``Case`` of zoo model ``name``, its weights drawn from a fixed seed."""
    torch.manual_seed(0)
    return ZOO[name]()
