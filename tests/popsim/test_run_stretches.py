"""``run_stretches`` groups a run's consecutive steps holding the same resources; a step of no stage and no
transfer holds only compute tiles, whatever else it records."""

import popsim
from popsim.timeline import HOST_TRANSFER, STREAMING_MEMORY


def test_stretches_merge_consecutive_steps_of_the_same_resources():
    target = popsim.Target.small(num_tiles=4)
    sync = target.bsp_sync_cycles
    steps = [
        {"cycles": 3, "name": "plain"},
        {"cycles": 4},
        {"cycles": 5, "transfer": HOST_TRANSFER},
        {"cycles": 6, "transfer": HOST_TRANSFER},
        {"cycles": 7, "transfer": None},  # no transfer after all: compute tiles only
        {"stage": 0, "ipu": 0, "role": "forward", "cycles": 8},
        {"stage": 0, "ipu": 0, "role": "forward", "cycles": 9, "transfer": STREAMING_MEMORY},
        {"cycles": 10},
    ]
    host_link = popsim.transfer_lane(1, 0, HOST_TRANSFER)
    memory = popsim.transfer_lane(1, 0, STREAMING_MEMORY)
    assert popsim.run_stretches({"steps": steps}, target, 1) == [
        ((None, None, None, (), None), 7 + 2 * sync),
        ((None, None, None, (host_link,), HOST_TRANSFER), 11 + 2 * sync),
        ((None, None, None, (), None), 7 + sync),
        ((0, "forward", 0, (), None), 8 + sync),
        ((0, "forward", 0, (memory,), STREAMING_MEMORY), 9 + sync),
        ((None, None, None, (), None), 10 + sync),
    ]
