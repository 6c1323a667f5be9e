"""A timeline of one call's work: intervals on resources (each IPU's compute tiles, its I/O tiles, the
IPU-Links), scheduled in the order they are added. An interval starts once all its resources are free, every
interval it depends on has ended, and not before a given cycle; the call's cycles are the makespan.

Overlap follows from the resources alone: work on different IPUs, or on the I/O tiles while the compute tiles
run, shares no resource and so runs at the same time unless a dependency orders it.
"""

import re
from dataclasses import dataclass, field

# An inter-IPU copy's exchange step is named after the IPU it lands on (one per destination in a merged step).
_INTER_IPU_COPY = "inter-ipu to {ipu}"
_INTER_IPU_DESTINATION = re.compile(r"inter-ipu to (\d+)")


def compute_lane(replica, ipu):
    """The resource of the compute tiles of ``ipu`` in ``replica``."""
    return f"replica {replica} IPU {ipu} compute"


def io_lane(replica, ipu):
    """The resource of the I/O tiles of ``ipu`` in ``replica`` (TensorLocations.numIOTiles)."""
    return f"replica {replica} IPU {ipu} I/O tiles"


def link_lane(replica, source, destination):
    """The resource of the IPU-Links carrying data from IPU ``source`` to IPU ``destination`` of ``replica``
    (one per direction: the links are full duplex)."""
    return f"replica {replica} IPU-Link {source}->{destination}"


# The kinds of host-side work a program step does (its profile entry's "transfer"), each with a lane of its
# own beside the compute tiles it stops: a host stream, the host running a callback, a streaming-memory
# load or store.
HOST_TRANSFER, HOST_CALLBACK, STREAMING_MEMORY = "host transfer", "host callback", "streaming memory"


def transfer_lane(replica, ipu, kind):
    """The resource a host-side transfer of ``kind`` of ``ipu`` in ``replica`` holds: the replica's host link
    (streams), its host (callbacks) or the IPU's streaming-memory link (remote buffers)."""
    if kind == STREAMING_MEMORY:
        return f"replica {replica} IPU {ipu} streaming memory"
    return f"replica {replica} host" if kind == HOST_CALLBACK else f"replica {replica} host link"


def inter_ipu_copy_name(ipu):
    """The name of the exchange step copying a tensor onto IPU ``ipu``."""
    return _INTER_IPU_COPY.format(ipu=ipu)


def copy_destinations(step_name):
    """The IPUs the inter-IPU copies merged into the exchange step ``step_name`` land on (none: no copy)."""
    return [int(ipu) for ipu in _INTER_IPU_DESTINATION.findall(step_name)]


@dataclass(frozen=True)
class Interval:
    """``end - start`` cycles of work holding ``resources``; ``label`` says what (JSON-friendly values)."""

    resources: tuple
    start: int
    end: int
    label: dict = field(default_factory=dict)


class Timeline:
    """Intervals on resources, each placed as early as its resources and dependencies allow."""

    def __init__(self):
        self.intervals = []
        self._free = {}  # resource -> the cycle it is next free

    def add(self, resources, cycles, after=(), not_before=0, **label):
        """Place ``cycles`` of work holding every one of ``resources`` once they are free, the intervals
        ``after`` have ended and not before cycle ``not_before``; returns the Interval."""
        if cycles < 0:
            raise ValueError(f"an interval cannot last {cycles} cycles")
        resources = tuple(resources)
        start = max([int(not_before), *(self._free.get(r, 0) for r in resources), *(i.end for i in after)])
        interval = Interval(resources, start, start + int(cycles), label)
        for resource in resources:
            self._free[resource] = interval.end
        self.intervals.append(interval)
        return interval

    def free_at(self, resources):
        """The cycle all of ``resources`` are free."""
        return max((self._free.get(r, 0) for r in resources), default=0)

    @property
    def makespan(self):
        """Cycles from the start to the end of the last interval."""
        return max((i.end for i in self.intervals), default=0)

    def as_dict(self):
        """For a profile: the makespan, the lanes (resources) in order of first use, and each interval with
        its lanes, start, end and label."""
        lanes = list(dict.fromkeys(r for i in self.intervals for r in i.resources))
        return {
            "makespan": self.makespan,
            "lanes": lanes,
            "intervals": [
                {"lanes": list(i.resources), "start": i.start, "end": i.end, **i.label}
                for i in self.intervals
                if i.end > i.start
            ],
        }
