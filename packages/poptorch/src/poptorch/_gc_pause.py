"""Python's cyclic garbage collector paused while a model compiles.

Compiling builds many objects that live on (torch.export's graphs, popir graphs, tile plans); each batch of
survivors sets off collections that walk every object the process holds, torch's and transformers' included:
about a tenth of a 2-layer BERT-tiny's compile. Collection resumes when the compile ends, and the next
collection frees whatever cycles the compile left.
"""

import functools
import gc


def paused(function):
    """``function`` run with the collector off, then on again (if it was on) however it ends."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        if not gc.isenabled():
            return function(*args, **kwargs)
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            gc.enable()

    return run
