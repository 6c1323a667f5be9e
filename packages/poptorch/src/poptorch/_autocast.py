"""``poptorch.autocast``: PopTorch's automatic-casting regions."""

import contextlib

from poptorch.options import not_modelled


class autocast(contextlib.ContextDecorator):  # noqa: N801 - PopTorch's name
    """``with poptorch.autocast():`` (or as a decorator) casts the matmuls and convolutions inside to half
    by PopTorch's policy. The simulator does not rewrite dtypes, so an enabled region is refused; a region
    with ``enabled=False`` (no autocasting inside, which is what the simulator always does) works."""

    def __init__(self, enabled=True):
        if not isinstance(enabled, bool):
            raise ValueError("autocast's enabled must be set to either True or False")
        if enabled:
            raise not_modelled(
                "poptorch.autocast()",
                "the simulator runs each op in its inputs' dtypes; cast the layers or tensors to half yourself "
                "(module.half(), x.half())",
            )
        self.enabled = enabled

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
