"""Ctrl-C during a long device call: finish the optimizer step under way, then stop with the host consistent."""

import contextlib
import signal
import threading


@contextlib.contextmanager
def deferred_keyboard_interrupt():
    """Within the block, a SIGINT is remembered instead of raised; yields a function saying whether one came.

    Only when Python's default SIGINT handler is installed and this is the main thread (the only thread that
    may install handlers); otherwise KeyboardInterrupt is raised as usual and the caller's cleanup applies.
    """
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield lambda: False
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield lambda: bool(received)
    finally:
        signal.signal(signal.SIGINT, previous)
