"""The device ids of the simulated system, numbered as ``gc-info --list-devices`` numbers them, for
``Options.useIpuId``.

The simulator models an IPU-POD16: ids 0 to 15 are its single IPUs, then come its multi-IPU devices, each of
consecutive IPUs: the pairs (16 to 23), the groups of 4 (24 to 27), of 8 (28 and 29) and all 16 IPUs (30).
"""

from dataclasses import dataclass

from poptorch._logging import logger
from poptorch.enums import ConnectionType
from poptorch.errors import Error

SYSTEM = "IPU-POD16"
SYSTEM_IPUS = 16


@dataclass(frozen=True)
class Device:
    """One device of the system: ``num_ipus`` IPUs from ``first_ipu``."""

    id: int
    first_ipu: int
    num_ipus: int

    def __str__(self):
        if self.num_ipus == 1:
            return f"device {self.id} (IPU {self.first_ipu})"
        return f"device {self.id} (IPUs {self.first_ipu} to {self.first_ipu + self.num_ipus - 1})"


def _table():
    """The devices in gc-info's order: by size (1, 2, 4, ... IPUs), then by first IPU."""
    sizes = [1 << k for k in range(SYSTEM_IPUS.bit_length())]
    groups = [(first, size) for size in sizes for first in range(0, SYSTEM_IPUS, size)]
    return tuple(Device(device_id, first, size) for device_id, (first, size) in enumerate(groups))


DEVICES = _table()


def device(ipu_id):
    """The device of id ``ipu_id``; an id the system does not have is refused, naming the valid ids."""
    if isinstance(ipu_id, bool) or not isinstance(ipu_id, int):
        raise Error(f"useIpuId takes an integer device id (as gc-info lists them), got {ipu_id!r}")
    if not 0 <= ipu_id < len(DEVICES):
        raise Error(
            f"No such device set id: '{ipu_id}'. The simulated {SYSTEM}'s device ids are 0 to {len(DEVICES) - 1}: "
            f"0 to {SYSTEM_IPUS - 1} are its single IPUs, then come its devices of 2, 4, 8 and {SYSTEM_IPUS} IPUs "
            "(as gc-info lists them)"
        )
    return DEVICES[ipu_id]


def check(options, ipus_per_replica):
    """As PopTorch when it attaches to the device ``Options.useIpuId`` chose for a model whose replicas use
    ``ipus_per_replica`` IPUs each: refuse a device with fewer IPUs than the replicas need, warn about one
    with more. The IPU model ignores the id; an offline target refuses it."""
    if options.ipu_id is None:
        return
    chosen = DEVICES[options.ipu_id]
    if options.use_ipu_model:
        logger.warning("useIpuId(%d) has no effect with the IPU model, which creates its own device", chosen.id)
        return
    if options.connection_type == ConnectionType.Never:
        raise Error("Offline compilation targeting a specific id not supported")
    replicas = options.replication_factor
    needed = ipus_per_replica * replicas
    if chosen.num_ipus < needed:
        raise Error(
            f"Expected at least replication factor * used IPUs = {ipus_per_replica} * {replicas} = {needed} "
            f"device Ids but the user provided {chosen.num_ipus} ({chosen}: choose a device of {needed} IPUs)"
        )
    if chosen.num_ipus > needed:
        logger.warning(
            "Expected replication factor * used IPUs = %d * %d = %d device Ids but the device selected has %d "
            "IPUs which means some of them will not be used.",
            ipus_per_replica,
            replicas,
            needed,
            chosen.num_ipus,
        )
    logger.debug("Acquired IPU device with id %d, running on %s.", chosen.id, chosen)
