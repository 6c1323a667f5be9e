"""Targets (one IPU's published figures) and Devices (one or more IPUs of one target)."""

from dataclasses import dataclass, replace

from popsim.errors import Error


@dataclass(frozen=True)
class Target:
    """One IPU. Figures marked *estimate* in docs/architecture.md are ours to calibrate."""

    name: str
    num_tiles: int
    tile_bytes: int
    clock_hz: float
    workers: int = 6
    amp_macs_fp16: int = 64
    amp_macs_fp32: int = 16
    vector_width_fp32: int = 2
    vector_width_fp16: int = 4
    load_bytes_per_cycle: int = 16
    store_bytes_per_cycle: int = 8
    exchange_bytes_per_cycle: int = 4
    exchange_fixed_cycles: int = 30
    sync_cycles: int = 150
    sync_cycles_across_ipus: int = 600
    host_bytes_per_second: float = 16e9
    num_ipus: int = 1
    # Mk2 GC200: 10 IPU-Links at 32 GB/s each, 320 GB/s per IPU (Graphcore's IPU-M2000 datasheet).
    ipu_link_bytes_per_second: float = 320e9
    min_bytes_per_tile: int = 128
    code_bytes_per_codelet: int = 512
    # The first tile of this target within its device: nonzero only for a view of one IPU (``ipu_view``).
    first_tile: int = 0

    @staticmethod
    def ipu2():
        """Mk2 GC200: 1,472 tiles x 624 KiB at 1.325 GHz."""
        return Target("ipu2", 1472, 638_976, 1.325e9)

    @staticmethod
    def ipu21():
        """Bow (Mk2 at 1.85 GHz)."""
        return replace(Target.ipu2(), name="ipu21", clock_hz=1.85e9)

    @staticmethod
    def ipu1():
        """Mk1 GC2: 1,216 tiles x 256 KiB at 1.6 GHz; its AMP does half Mk2's MACs per cycle (124.5 TFLOPS
        fp16 with fp32 partials, 31.1 TFLOPS fp32, as published)."""
        return Target("ipu1", 1216, 262_144, 1.6e9, amp_macs_fp16=32, amp_macs_fp32=8)

    @staticmethod
    def small(num_tiles=16, tile_bytes=262_144, **overrides):
        """A few-tile Mk2-like IPU that keeps tests fast."""
        return replace(Target.ipu2(), name="small", num_tiles=num_tiles, tile_bytes=tile_bytes, **overrides)

    @staticmethod
    def named(target):
        """A Target from a Target or one of the names ipu1 / ipu2 / ipu21 / small."""
        if isinstance(target, Target):
            return target
        makers = {"ipu1": Target.ipu1, "ipu2": Target.ipu2, "ipu21": Target.ipu21, "small": Target.small}
        if target not in makers:
            raise Error(f"unknown target {target!r}; expected one of {sorted(makers)} or a popsim.Target")
        return makers[target]()

    def vector_width(self, dtype):
        """Elements per vector instruction: 2 for 32-bit types, 4 for float16."""
        return self.vector_width_fp16 if str(dtype) == "float16" else self.vector_width_fp32

    def amp_macs(self, dtype):
        """Multiply-accumulates per cycle per tile of the AMP unit for ``dtype`` operands."""
        return self.amp_macs_fp16 if str(dtype) == "float16" else self.amp_macs_fp32

    @property
    def tiles_per_ipu(self):
        """Tiles of one IPU; tile t of a multi-IPU target is tile t % tiles_per_ipu of IPU t // tiles_per_ipu."""
        return self.num_tiles // self.num_ipus

    def ipu_view(self, ipu):
        """IPU ``ipu`` of this multi-IPU graph target, as planners see it: they place tensors and vertices
        only on its ``tiles_per_ipu`` tiles, numbered from ``first_tile`` in the whole device."""
        if not 0 <= ipu < self.num_ipus:
            raise Error(f"{self.name} has no IPU {ipu} (it has {self.num_ipus})")
        if self.num_ipus == 1:
            return self
        return replace(
            self,
            name=f"{self.name}/ipu{ipu}",
            num_tiles=self.tiles_per_ipu,
            num_ipus=1,
            first_tile=self.first_tile + ipu * self.tiles_per_ipu,
        )

    @property
    def bsp_sync_cycles(self):
        """Cycles of one BSP sync: every tile of every IPU joins it."""
        return self.sync_cycles_across_ipus if self.num_ipus > 1 else self.sync_cycles

    def describe_tile(self, tile):
        """``tile 5`` on one IPU, ``tile 1500 (IPU 1, tile 28)`` on several."""
        if self.num_ipus == 1:
            return f"tile {tile}"
        return f"tile {tile} (IPU {tile // self.tiles_per_ipu}, tile {tile % self.tiles_per_ipu})"

    @property
    def peak_flops(self):
        """Peak fp16 FLOP/s of the whole IPU (2 FLOPs per MAC)."""
        return 2 * self.amp_macs_fp16 * self.num_tiles * self.clock_hz


@dataclass(frozen=True)
class Device:
    """``num_ipus`` IPUs of one target, programmed as one graph (as Poplar does for a multi-IPU device):
    its ``graph_target`` has the tiles of every IPU, numbered IPU by IPU. A placed popir node runs on its
    IPU's tiles, an unplaced graph on IPU 0 (see ``popsim.placement``). Exchanges between IPUs also pay for
    the IPU-Links, and every sync spans all IPUs."""

    target: Target
    num_ipus: int = 1

    def __post_init__(self):
        if self.num_ipus < 1:
            raise Error(f"a Device needs at least one IPU, got {self.num_ipus}")
        if self.target.num_ipus != 1:
            raise Error(f"a Device is built from a one-IPU target, got {self.target.name}")

    @property
    def graph_target(self):
        """The target a graph for this device is compiled for: all tiles of all its IPUs."""
        if self.num_ipus == 1:
            return self.target
        t = self.target
        return replace(
            t, name=f"{t.name}x{self.num_ipus}", num_tiles=t.num_tiles * self.num_ipus, num_ipus=self.num_ipus
        )
