"""F.interpolate / nn.Upsample in every mode on the simulated IPU, forward and gradient, against eager."""

import pytest
import torch
import torch.nn.functional as F
from op_check import check_forward, check_gradient

MODES = {1: ("nearest", "nearest-exact", "linear"), 2: ("nearest", "bilinear", "bicubic"), 3: ("nearest", "trilinear")}
CASES = [
    (spatial, mode, align_corners, resize)
    for spatial, modes in MODES.items()
    for mode in modes
    for align_corners in ((False, True) if mode in ("linear", "bilinear", "bicubic", "trilinear") else (None,))
    for resize in ("scale_factor", "size")
]


def _interpolate(spatial, mode, align_corners, resize):
    kwargs = {"mode": mode}
    if align_corners is not None:
        kwargs["align_corners"] = align_corners
    if resize == "scale_factor":
        kwargs["scale_factor"] = (2.0, 1.5, 0.75)[:spatial] if spatial > 1 else 2.5
    else:
        kwargs["size"] = (5, 2, 4)[:spatial]
    return lambda x: F.interpolate(x, **kwargs)


@pytest.mark.parametrize(("spatial", "mode", "align_corners", "resize"), CASES)
def test_interpolate_forward_and_gradient_match_eager(spatial, mode, align_corners, resize):
    torch.manual_seed(spatial)
    x = torch.randn((2, 2) + (4, 3, 4)[:spatial])
    fn = _interpolate(spatial, mode, align_corners, resize)
    check_forward(fn, [x])
    check_gradient(fn, [x])


def test_upsample_module_in_a_unet_style_decoder():
    up = torch.nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
    x = torch.randn(1, 3, 4, 4)
    check_forward(lambda t: torch.cat([up(t), up(t * 2)], dim=1), [x])
