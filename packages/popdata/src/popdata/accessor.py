"""AsynchronousDataAccessor: a background process prefetches batches into a shared-memory ring buffer."""

import multiprocessing
import os
import pickle
import tempfile
import time
import weakref

from . import producer, ring
from .enums import SharingStrategy
from .tree import unflatten

_PRELOAD = ["torch", "popdata.producer"]
_CHECK_INTERVAL = 0.005


class WorkerError(RuntimeError):
    """The accessor's worker process failed; ``__cause__`` is the original exception when it could be sent."""


def _context(strategy):
    if strategy == SharingStrategy.Fork:
        return multiprocessing.get_context("fork")
    context = multiprocessing.get_context("forkserver")
    # Children of a server that already imported torch start in milliseconds instead of seconds.
    context.set_forkserver_preload(_PRELOAD)
    return context


def _payload(dataset, strategy):
    """What the worker receives for ``dataset`` (see SharingStrategy); returns (payload, file to clean up)."""
    if strategy in (SharingStrategy.Fork, SharingStrategy.ForkServer):
        return dataset, None
    directory = "/dev/shm" if strategy == SharingStrategy.SharedMemory and os.path.isdir("/dev/shm") else None
    handle, path = tempfile.mkstemp(prefix="popdata-", suffix=".pkl", dir=directory)
    with os.fdopen(handle, "wb") as file:
        pickle.dump(dataset, file, protocol=pickle.HIGHEST_PROTOCOL)
    return ("file", path), path


def _shutdown(owner, process, control, conn, leftover):
    """Stop the worker (politely, then by force), close the pipe, remove a dataset file it did not read.

    Only the process that started the worker does this: a forked child (a later accessor's worker, a torch
    worker) inherits this finalizer with the accessor, and must neither stop a worker still in use nor join
    a process that is not its child."""
    if os.getpid() != owner:
        return
    control.stop()
    conn.close()
    if process.pid is not None:
        process.join(timeout=10)
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()
    if leftover is not None and os.path.exists(leftover):
        os.unlink(leftover)


class AsynchronousDataAccessor:
    """Iterate ``dataset`` (usually a DataLoader) in a background process that prefetches into shared memory.

    The worker process starts at construction. It loads batches into a ring of ``buffer_size`` shared-memory
    slots while the consumer works; the consumer polls for the next slot, sleeping
    ``miss_sleep_time_in_ms`` between polls. Every ``iter()`` starts an epoch: leaving a loop early and
    calling ``iter()`` again drops the rest of the epoch and restarts the dataset.

    Args:
        dataset: an iterable of batches: tensors nested in tuples, lists and dicts, of one shape (only the
            last batch of an epoch may be shorter along dim 0).
        buffer_size: slots in the ring (batches loaded ahead).
        miss_sleep_time_in_ms: sleep between polls when a slot is not ready.
        load_indefinitely: if True the worker goes on into the next epoch without waiting for ``iter()``.
        early_preload: if True the worker starts loading before the first ``iter()``.
        sharing_strategy: how the dataset reaches the worker (:class:`popdata.SharingStrategy`). The default,
            ``Fork``, needs no pickling (like torch's own workers on Linux); the others start the worker from
            a fork server, so a script using them needs the ``if __name__ == "__main__":`` guard.
        rebatched_size: if set, the worker concatenates the dataset's batches along dim 0 into batches of
            this many samples; a shorter last batch is kept only if ``dataset.drop_last`` is False.

    The tensors handed out are views of the shared ring, valid until the next batch is requested (the slot
    then goes back to the worker, which overwrites it): ``clone()`` what you keep.

    An exception in the dataset or the worker's death raises :class:`WorkerError` in the consumer (the
    original exception is its ``__cause__``). ``terminate()`` (also run when the accessor is garbage
    collected or the interpreter exits) stops the worker and its own workers.
    """

    def __init__(
        self,
        dataset,
        buffer_size=3,
        miss_sleep_time_in_ms=0.1,
        load_indefinitely=True,
        early_preload=False,
        sharing_strategy=SharingStrategy.Fork,
        rebatched_size=None,
    ):
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"buffer_size must be a positive integer, got {buffer_size!r}")
        if rebatched_size is not None and (not isinstance(rebatched_size, int) or rebatched_size < 1):
            raise ValueError(f"rebatched_size must be a positive integer, got {rebatched_size!r}")
        self._dataset = dataset
        self._sleep = miss_sleep_time_in_ms / 1000.0
        self._control = ring.Control(buffer_size)
        self._slots = None
        self._read = 0
        self._held = None
        self._epoch = 0
        self._iterators = 0  # iter() calls so far: only the latest iterator may advance
        self._consumed = False
        self._failure = None
        self._next_check = 0.0
        if early_preload:
            self._control.want = 0

        strategy = SharingStrategy(sharing_strategy)
        context = _context(strategy)
        payload, leftover = _payload(dataset, strategy)
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=producer.main,
            args=(
                payload,
                self._control,
                child_conn,
                self._conn if strategy == SharingStrategy.Fork else None,
                self._sleep,
                load_indefinitely,
                rebatched_size,
            ),
            name="popdata-accessor",
        )
        try:
            self._process.start()
        except BaseException:
            if leftover is not None:
                os.unlink(leftover)
            raise
        child_conn.close()
        self._finalizer = weakref.finalize(
            self, _shutdown, os.getpid(), self._process, self._control, self._conn, leftover
        )

    def __len__(self):
        return len(self._dataset)

    def terminate(self):
        """Stop the worker process and release its resources (idempotent)."""
        self._release_held()
        self._finalizer()
        # The ring's shared-memory slots (one file descriptor each) go with the worker; batches the caller
        # still holds keep their own slot alive.
        self._slots = None

    def __iter__(self):
        if self._failure is not None:
            raise self._failure
        self._release_held()
        if self._consumed:
            # Leaving an epoch early: ask the worker for a fresh one and skip what it already loaded.
            self._epoch += 1
            self._consumed = False
        self._control.want = self._epoch
        self._iterators += 1
        return _Epoch(self, self._epoch, self._iterators)

    def __next__(self):
        """The next batch of the current epoch (StopIteration at its end)."""
        if self._failure is not None:
            raise self._failure
        if not self._finalizer.alive:
            raise RuntimeError("the AsynchronousDataAccessor was terminated")
        self._release_held()
        if self._control.want < self._epoch:
            self._control.want = self._epoch
        while True:
            slot = self._read
            state = self._control.state(slot)
            if state == ring.EMPTY:
                self._wait()
                continue
            if self._control.tag(slot) < self._epoch:
                self._advance()
                continue
            if state == ring.END:
                self._advance()
                self._epoch += 1
                self._consumed = False
                raise StopIteration
            if self._slots is None:
                self._receive_slots()
            self._held = slot
            self._consumed = True
            return unflatten(self._slots.views(slot), self._slots.spec)

    # -- helpers --------------------------------------------------------------------------------
    def _advance(self):
        self._control.release(self._read)
        self._read = (self._read + 1) % self._control.buffer_size

    def _release_held(self):
        if self._held is not None:
            self._held = None
            self._advance()

    def _receive_slots(self):
        while self._slots is None:
            if self._conn.poll(self._sleep):
                self._receive()
            else:
                self._check_alive()

    def _receive(self):
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            # The worker closed its end without a word, or died before its slots arrived: wait for its exit code.
            self._process.join(timeout=5)
            self._check_alive()
            raise
        self._handle(message)

    def _handle(self, message):
        kind, *rest = message
        if kind == "ready":
            (self._slots,) = rest
            return
        blob, text = rest
        cause = None
        if blob is not None:
            try:
                cause = pickle.loads(blob)
            except Exception:  # fall back to the traceback text alone
                cause = None
        self._fail(WorkerError(f"the AsynchronousDataAccessor worker process failed:\n{text}"), cause)

    def _fail(self, error, cause):
        error.__cause__ = cause
        self._failure = error
        self.terminate()
        raise error

    def _check_alive(self):
        if self._process.exitcode is not None:
            # An error message may have arrived just before the process ended.
            try:
                if self._conn.poll():
                    self._handle(self._conn.recv())
            except (EOFError, OSError):
                pass
            self._fail(
                WorkerError(
                    f"the AsynchronousDataAccessor worker process died unexpectedly (exit code "
                    f"{self._process.exitcode})"
                ),
                None,
            )

    def _wait(self):
        # Messages and the worker's health are checked every few milliseconds, not on every poll.
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + _CHECK_INTERVAL
            if self._conn.poll():
                self._receive()
            else:
                self._check_alive()
        time.sleep(self._sleep)


class _Epoch:
    """The iterator ``iter(accessor)`` returns: one epoch. A later ``iter()`` restarts the dataset, so this
    iterator then refuses to go on (it must not silently end or hand out the new epoch's batches)."""

    def __init__(self, accessor, epoch, serial):
        self._accessor = accessor
        self._epoch = epoch
        self._serial = serial
        self._done = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        if self._accessor._iterators != self._serial:
            raise RuntimeError(
                "this iterator of an asynchronous DataLoader / AsynchronousDataAccessor was superseded: iter() was "
                "called on the same loader again, which restarts its single background stream. Use one iterator at "
                "a time (finish or leave the first loop before starting another), or create a second loader for "
                "independent iteration."
            )
        if self._accessor._epoch != self._epoch:
            self._done = True
            raise StopIteration
        try:
            return next(self._accessor)
        except StopIteration:
            self._done = True
            raise
