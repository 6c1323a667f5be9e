"""The catalogue of bad inputs and faults (docs/reliability.md), one directory per package so the torch-free
sessions collect popir's and popsim's cases alone.

Each case asserts its own outcome (marked ``outcome``: the clear error, the right result, or a recovery with
one warning); this fixture adds that the process survived it: no child process, Python thread, file
descriptor or shared-memory mapping is left behind once the case has had a moment to clean up.
"""

import gc
import os
import pathlib
import threading
import time

import pytest

SETTLE_SECONDS = 10.0
OUTCOMES = ("clear error", "right result", "recovered")


def pytest_configure(config):
    config.addinivalue_line("markers", "outcome(kind): the catalogue outcome of a case, one of " + ", ".join(OUTCOMES))


def pytest_collection_modifyitems(items):
    for item in items:
        if "reliability" in item.path.parts:
            marker = item.get_closest_marker("outcome")
            if marker is None or marker.args[0] not in OUTCOMES:
                raise pytest.UsageError(f"catalogue case {item.nodeid} needs @pytest.mark.outcome(one of {OUTCOMES})")


def _alive(pid):
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _children():
    found = set()
    for task in pathlib.Path("/proc/self/task").glob("*"):
        try:
            found.update(int(pid) for pid in (task / "children").read_text().split())
        except OSError:
            continue
    return {pid for pid in found if _alive(pid)}


def _fds():
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            continue
    return found


def _shm_mappings():
    with open("/proc/self/maps") as maps:
        return {line.split(maxsplit=5)[-1].strip() for line in maps if "/dev/shm/" in line}


def snapshot():
    """What a case must not leave behind: children, Python threads, open files, shared-memory mappings."""
    return {
        "child processes": _children(),
        "threads": {t.name for t in threading.enumerate() if t.is_alive()},
        "file descriptors": _fds(),
        "shared memory": _shm_mappings(),
    }


def leftovers(before):
    """What is alive now and was not in ``before``, after up to SETTLE_SECONDS for it to go away."""
    end = time.monotonic() + SETTLE_SECONDS
    while True:
        gc.collect()  # objects in reference cycles hold their files until collected, which is not a leak
        now = snapshot()
        new = {kind: now[kind] - before[kind] for kind in now if now[kind] - before[kind]}
        if not new or time.monotonic() > end:
            return new
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def process_survives():
    before = snapshot()
    yield
    assert leftovers(before) == {}
