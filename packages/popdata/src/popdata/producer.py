"""The accessor's worker process: iterate the dataset and fill the ring buffer (see ring.py)."""

import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback

import torch

from . import ring
from .tree import flatten


class _Abandon(Exception):
    """The consumer stopped, vanished or moved to a later epoch: drop the batch being written."""


def _die_with_parent():
    """Ask Linux to SIGTERM this process when its parent dies (best effort elsewhere)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def load_payload(payload):
    """The dataset, from what the consumer passed: the object itself or ``("file", path)`` of its pickle."""
    if isinstance(payload, tuple) and len(payload) == 2 and payload[0] == "file":
        with open(payload[1], "rb") as file:
            dataset = pickle.load(file)
        os.unlink(payload[1])
        return dataset
    return payload


class Producer:
    """Writes batches (or rebatched batches) of successive epochs into the ring until told to stop."""

    def __init__(self, dataset, control, conn, miss_sleep, load_indefinitely, rebatched_size):
        self.dataset = dataset
        self.control = control
        self.conn = conn
        self.miss_sleep = miss_sleep
        self.load_indefinitely = load_indefinitely
        self.rebatched_size = rebatched_size
        self.drop_last = bool(getattr(dataset, "drop_last", True))
        self.slots = None
        self.epoch = 0
        self.slot = 0
        self.fill = 0

    # -- flow control ---------------------------------------------------------------------------
    def _check(self):
        """Raise _Abandon if the consumer is gone, stopping, or asks for a later epoch than ours."""
        if self.control.stopping or self.conn.poll():
            raise SystemExit(0)
        if self.control.want > self.epoch:
            raise _Abandon

    def _acquire(self):
        """Wait until the producer owns the next slot."""
        while self.control.state(self.slot) != ring.EMPTY:
            self._check()
            time.sleep(self.miss_sleep)

    def _publish(self, state):
        self.control.publish(self.slot, state, self.epoch)
        self.slot = (self.slot + 1) % self.control.buffer_size
        self.fill = 0

    # -- writing --------------------------------------------------------------------------------
    def _ensure_slots(self, tensors, spec):
        if self.slots is None:
            self.slots = ring.Slots.allocate(spec, tensors, self.control.buffer_size, self.rebatched_size)
            self.conn.send(("ready", self.slots))
        elif spec != self.slots.spec:
            raise ValueError("the dataset's batches changed structure; the AsynchronousDataAccessor needs one")

    def _write_whole(self, tensors):
        self._acquire()
        lengths = self.slots.length_values[self.slot]
        for index, (dst, src) in enumerate(zip(self.slots.buffers[self.slot], tensors)):
            if src.dim() == 0:
                if dst.dim() != 0:
                    raise ValueError(f"batch leaf {index} became a 0-d tensor")
                dst.copy_(src)
                lengths[index] = -1
                continue
            if (
                src.dtype != dst.dtype
                or src.dim() != dst.dim()
                or src.shape[1:] != dst.shape[1:]
                or len(src) > len(dst)
            ):
                raise ValueError(
                    f"batch leaf {index} is {src.dtype}{tuple(src.shape)} but the first batch gave "
                    f"{dst.dtype}{tuple(dst.shape)}: the AsynchronousDataAccessor needs batches of one shape "
                    "(only a last batch may be shorter)"
                )
            dst[: src.shape[0]].copy_(src)
            lengths[index] = src.shape[0]
        self._publish(ring.DATA)

    def _write_rebatched(self, tensors):
        rows = {t.shape[0] if t.dim() else -1 for t in tensors}
        if len(rows) != 1 or -1 in rows:
            raise ValueError("rebatching needs every batch leaf to have the same dim 0")
        (count,) = rows
        start = 0
        while start < count:
            if self.fill == 0:
                self._acquire()
            take = min(count - start, self.rebatched_size - self.fill)
            for index, (dst, src) in enumerate(zip(self.slots.buffers[self.slot], tensors)):
                if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
                    raise ValueError(
                        f"batch leaf {index} is {src.dtype}{tuple(src.shape)} but the first batch gave "
                        f"{dst.dtype}{tuple(dst.shape)}: the AsynchronousDataAccessor needs one sample shape"
                    )
                dst[self.fill : self.fill + take].copy_(src[start : start + take])
            self.fill += take
            start += take
            if self.fill == self.rebatched_size:
                self.slots.length_values[self.slot] = self.fill
                self._publish(ring.DATA)

    def _end_epoch(self):
        if self.fill:
            if self.drop_last:
                self.fill = 0
            else:
                self.slots.length_values[self.slot] = self.fill
                self._publish(ring.DATA)
        self._acquire()
        self._publish(ring.END)

    # -- main loop ------------------------------------------------------------------------------
    def _wait_for_request(self):
        """Block while the consumer has not asked for this epoch (always before its first request)."""
        while self.epoch > self.control.want and (not self.load_indefinitely or self.control.want < 0):
            if self.control.stopping or self.conn.poll():
                raise SystemExit(0)
            time.sleep(self.miss_sleep)

    def _run_epoch(self):
        iterator = iter(self.dataset)
        try:
            for batch in iterator:
                self._check()
                tensors, spec = flatten(batch)
                self._ensure_slots(tensors, spec)
                if self.rebatched_size is None:
                    self._write_whole(tensors)
                else:
                    self._write_rebatched(tensors)
            self._end_epoch()
        finally:
            # Shut the dataset's own workers down before leaving (no orphans).
            del iterator

    def run(self):
        while True:
            self._wait_for_request()
            try:
                self._run_epoch()
                self.epoch += 1
            except _Abandon:
                self.fill = 0
                self.epoch = self.control.want


def _report(conn, error):
    """Send ``error`` to the consumer, then stay alive until it hangs up (it may still be receiving the slots)."""
    for _ in range(3):
        try:
            text = "".join(traceback.format_exception(error))
            try:
                blob = pickle.dumps(error)
            except Exception:  # an unpicklable exception still reports its traceback
                blob = None
            conn.send(("error", blob, text))
            conn.poll(None)
            return
        except OSError:
            return
        except BaseException as again:  # torch's SIGCHLD handler may raise here, when a torch worker dies
            error = again


def main(payload, control, conn, consumer_conn, miss_sleep, load_indefinitely, rebatched_size):
    """Entry point of the worker process; any exception is sent to the consumer with its traceback."""
    if consumer_conn is not None:
        consumer_conn.close()
    # SIGTERM (from terminate() or the parent's death) unwinds normally, shutting the dataset's workers down.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    _die_with_parent()
    if "fork" in multiprocessing.get_all_start_methods():
        # Torch workers must be this process's own children (a fork server's would outlive it unnoticed).
        multiprocessing.set_start_method("fork", force=True)
    torch.set_num_threads(1)
    dataset = None
    try:
        dataset = load_payload(payload)
        Producer(dataset, control, conn, miss_sleep, load_indefinitely, rebatched_size).run()
    except SystemExit:
        pass
    except BaseException as error:  # every failure must reach the consumer
        _report(conn, error)
    finally:
        close = getattr(dataset, "close", None)
        if callable(close):
            close()
        conn.close()
