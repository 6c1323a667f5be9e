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


def _images(size):
    return torch.randn(BATCH, 3, size, size, generator=torch.Generator().manual_seed(0))


def resnet18():
    return Case(ResNet18(), (_images(16), torch.tensor([1, 2])), loss_of=_second)


def unet():
    mask = (torch.rand(BATCH, 1, 8, 8, generator=torch.Generator().manual_seed(1)) > 0.5).float()
    return Case(UNet(), (_images(8), mask), loss_of=_second)


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
CONVOLUTIONAL = {"resnet18": resnet18, "unet": unet}
RECURRENT = {"lstm": lstm, "gru": gru}
ZOO = {**HUGGING_FACE, **CONVOLUTIONAL, **RECURRENT}


def build(name):
    """A fresh ``Case`` of zoo model ``name``, its weights drawn from a fixed seed."""
    torch.manual_seed(0)
    return ZOO[name]()
