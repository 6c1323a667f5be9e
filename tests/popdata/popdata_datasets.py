"""Datasets and process helpers shared by the popdata tests (module level, so they pickle)."""

import os
import pathlib
import signal
import time

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class Indexed(Dataset):
    """Sample i is (float tensor [i, -i], int tensor i)."""

    def __init__(self, length):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if not 0 <= index < self.length:
            raise IndexError(index)
        return torch.tensor([index, -index], dtype=torch.float32), torch.tensor(index)


class Stream(IterableDataset):
    """Yields 0..length-1 as int tensors, sharded between torch workers by contiguous ranges."""

    def __init__(self, length):
        self.length = length

    def __len__(self):
        return self.length

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        share = -(-self.length // workers)
        for index in range(worker * share, min(self.length, (worker + 1) * share)):
            yield torch.tensor(index)


class Failing(Indexed):
    """Raises ValueError at index ``bad``."""

    def __init__(self, length, bad):
        super().__init__(length)
        self.bad = bad

    def __getitem__(self, index):
        if index == self.bad:
            raise ValueError(f"sample {index} is corrupt")
        return super().__getitem__(index)


class Crashing(Indexed):
    """The process loading index ``bad`` dies: ``os._exit(code)``, or SIGKILL if ``code`` is None."""

    def __init__(self, length, bad, code=None):
        super().__init__(length)
        self.bad = bad
        self.code = code

    def __getitem__(self, index):
        if index == self.bad:
            if self.code is None:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(self.code)
        return super().__getitem__(index)


class Strings(Dataset):
    """Samples that collate into lists of strings (the accessor cannot share them)."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return f"sample {index}"


class Sleepy(Indexed):
    """Every __getitem__ sleeps ``seconds``; counts loads in a shared tensor."""

    def __init__(self, length, seconds=0.0):
        super().__init__(length)
        self.seconds = seconds
        self.loads = torch.zeros(1, dtype=torch.int64).share_memory_()

    def __getitem__(self, index):
        time.sleep(self.seconds)
        self.loads += 1
        return super().__getitem__(index)


def descendants(pid=None):
    """Pids of every live descendant of ``pid`` (default: this process)."""
    pending, found = [pid or os.getpid()], []
    while pending:
        parent = pending.pop()
        for task in pathlib.Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                found.append(child)
                pending.append(child)
    return found


def alive(pid):
    """True if ``pid`` exists and is not a zombie."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def wait_until(condition, timeout=20.0):
    """Poll ``condition`` until it holds or ``timeout`` seconds pass; returns its last value."""
    end = time.monotonic() + timeout
    while not condition() and time.monotonic() < end:
        time.sleep(0.02)
    return condition()


def shm_entries(pids):
    """/dev/shm names popdata or torch created for the processes ``pids``."""
    names = {entry.name for entry in pathlib.Path("/dev/shm").glob("*")} if os.path.isdir("/dev/shm") else set()
    prefixes = ("popdata-", *(f"torch_{pid}_" for pid in pids))
    return {name for name in names if name.startswith(prefixes)}
