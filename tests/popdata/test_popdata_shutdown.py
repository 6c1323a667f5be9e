"""A consumer that exits or is killed without terminate() leaves no process or shared memory behind."""

import os
import subprocess
import sys

import pytest
from popdata_datasets import alive, shm_entries, wait_until

CONSUMER = """
import os, signal, sys, torch
sys.path.insert(0, {here!r})
import popdata
from popdata_datasets import Indexed, descendants, wait_until
loader = popdata.DataLoader(popdata.BatchingOptions(), Indexed(1000), batch_size=2, num_workers=2,
                            mode=popdata.DataLoaderMode.Async)
next(iter(loader))
wait_until(lambda: len(descendants()) >= 3)
print(" ".join(map(str, descendants())), flush=True)
{ending}
"""


@pytest.mark.parametrize("ending", ["pass", "os.kill(os.getpid(), signal.SIGKILL)"])
def test_no_orphans_when_the_consumer_exits_or_is_killed(ending):
    script = CONSUMER.format(here=os.path.dirname(__file__), ending=ending)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pids = [int(pid) for pid in run.stdout.split()]
    assert len(pids) >= 3, run.stderr
    assert wait_until(lambda: not any(alive(pid) for pid in pids)), [pid for pid in pids if alive(pid)]
    assert shm_entries(pids) == set()
