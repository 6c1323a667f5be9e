"""``Options.relaxOptimizerAttributesChecks``: PopTorch reports the attributes an optimizer given to
``setOptimizer()`` gained after the model was compiled (on the optimizer, or a key of one of its parameter
groups), which the compiled update rule does not read: a warning each, once, or with the relaxed checks a
DEBUG message."""

from poptorch._logging import logger

UNEXPECTED = "Ignoring unexpected optimizer attribute in {}: {}"
UNEXPECTED_GROUP = "Ignoring unexpected group {} attribute in {}: {}"


def _attributes(optimizer):
    return {name for name in vars(optimizer) if not name.startswith("_")}


class AttributeChecks:
    """The attributes of the optimizer a model was compiled with, and the unexpected ones reported since."""

    def __init__(self, optimizer, relax):
        self._known = _attributes(optimizer)
        self._known_groups = [set(group) for group in optimizer.param_groups]
        self._relax = relax
        self._reported = set()

    def check(self, optimizer):
        """Report each attribute ``optimizer`` has beyond those known at compilation, once."""
        kind = type(optimizer).__name__
        unexpected = [UNEXPECTED.format(kind, name) for name in sorted(_attributes(optimizer) - self._known)]
        for index, group in enumerate(optimizer.param_groups):
            known = self._known_groups[index] if index < len(self._known_groups) else set()
            unexpected += [UNEXPECTED_GROUP.format(index, kind, key) for key in sorted(set(group) - known)]
        for message in unexpected:
            if message not in self._reported:
                self._reported.add(message)
                (logger.debug if self._relax else logger.warning)(message)
