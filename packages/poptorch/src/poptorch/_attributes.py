"""``poptorch.Attribute``: PopART attributes attached to the ops created inside a ``with`` block."""

from poptorch.options import not_modelled


class Attribute:
    """PopTorch's ``with poptorch.Attribute(__outline={"layer": "Dense"}):`` sets PopART attributes (such as
    outlining hints) on the ops created inside it. The simulator has no PopART ops to carry them, so the
    block is refused rather than silently dropped."""

    def __init__(self, **attributes):
        names = ", ".join(sorted(attributes)) or "no attributes"
        raise not_modelled(
            f"poptorch.Attribute({names})",
            "the simulator has no PopART ops to attach attributes to; remove the `with poptorch.Attribute(...)` "
            "block (the ops inside it run the same without it)",
        )
