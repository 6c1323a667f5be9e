"""The one exception type popir raises for malformed graphs, ops and serialized bytes."""


class IRError(ValueError):
    """A graph, an op application or serialized bytes are invalid; the message names the cause."""
