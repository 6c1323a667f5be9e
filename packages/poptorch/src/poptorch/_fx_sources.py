"""torch.fx keeps the generated Python source of every GraphModule it compiles (for tracebacks into
generated code) in a private cache and in ``linecache``, for the life of the process. torch.export builds
about twenty GraphModules per capture, so every wrap / run / destroy cycle grew the process by ~30 KB of
source text that nothing reads again (bench/soak.py's slow RSS growth). A capture forgets the entries its
own GraphModules added once it is done: they only ever run during the capture, and a GraphModule's code
object does not need its cached source to run.
"""

import contextlib
import linecache

import torch.fx.graph_module


@contextlib.contextmanager
def forgotten_after():
    """Inside: the GraphModules torch.fx compiles keep their source; on leaving, it is dropped from
    torch.fx's cache and from ``linecache``. A no-op for a torch without that cache."""
    cache = getattr(getattr(torch.fx.graph_module, "_loader", None), "eval_cache", None)
    if not isinstance(cache, dict):
        yield
        return
    before = set(cache)
    try:
        yield
    finally:
        for key in [key for key in cache if key not in before]:
            del cache[key]
            linecache.cache.pop(key, None)
