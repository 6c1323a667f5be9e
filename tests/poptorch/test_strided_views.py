"""``as_strided``: device tensors have no strides, so a strided view is modelled only when it reads its input
in row-major order (a reshape) -- as torch's adaptive pooling to size 1 of a channels-last-looking tensor
does (Swin's pooler) -- forward and gradient against eager; any other strided view is refused by name."""

import pytest
import torch
import torch.nn.functional as F
from op_check import check_forward, check_gradient

import poptorch

_G = torch.Generator().manual_seed(0)
SEQUENCE = torch.randn(2, 6, 4, generator=_G)  # (batch, tokens, channels)
IMAGE = torch.randn(2, 3, 4, 5, generator=_G)

IN_ORDER = {
    # Pooling the tokens of a (batch, tokens, channels) tensor seen as (batch, channels, tokens).
    "adaptive_avg_pool1d_of_transposed": (lambda t: F.adaptive_avg_pool1d(t.transpose(1, 2), 1), SEQUENCE),
    "adaptive_avg_pool2d_of_channels_last": (
        lambda t: F.adaptive_avg_pool2d(t.permute(0, 3, 1, 2), 1).flatten(1),
        IMAGE.permute(0, 2, 3, 1).contiguous(),
    ),
    "as_strided_reshape": (lambda t: (t * 2).as_strided((6, 20), (20, 1)), IMAGE),
}


@pytest.mark.parametrize("name", sorted(IN_ORDER))
def test_in_order_strided_view_matches_eager(name):
    fn, x = IN_ORDER[name]
    check_forward(fn, [x])
    check_gradient(fn, [x])


@pytest.mark.parametrize(
    "fn",
    [
        lambda t: (t * 2).as_strided((3, 2), (1, 1)),  # overlapping windows
        lambda t: (t * 2).as_strided((2, 2), (1, 2)),  # a transposed read
        lambda t: (t * 2).as_strided((4,), (1,), 2),  # an offset
    ],
    ids=["overlapping", "transposed", "offset"],
)
def test_out_of_order_strided_view_is_refused(fn):
    with pytest.raises(poptorch.Error, match=r"as_strided\(size=.* reads memory out of row-major order"):
        check_forward(fn, [torch.randn(8, generator=_G)])
