"""``import poptorch.eager``: PopTorch 3's eager mode (ops on ``device="ipu"`` tensors run one at a time).
The simulator runs whole captured models only, so importing this module is refused."""

from poptorch.options import not_modelled

raise not_modelled(
    "PopTorch's eager mode (import poptorch.eager)",
    "the simulator runs whole models captured by poptorch.inferenceModel / trainingModel; wrap the code in a "
    "torch.nn.Module and call it through one of them",
)
