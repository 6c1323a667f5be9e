"""Streaming memory (Poplar's remote buffers): device variables that live off chip and reach the tiles only
through explicit loads and stores.

A remote variable holds no tile memory. Its bytes sit in a region of the simulator's arena beyond the last
tile (the host-side buffer standing for the IPU-Machine's DDR), laid out densely in element order. Its readers
read a tile buffer that a ``RemoteCopy`` load fills just before the first of them (once per phase, or for
each reader: ``Loads``), so the buffer is live only from that load to its last reader; a state update writes
its new value back by a store. Each
transfer is charged at the streaming-memory bandwidth, which is far below the exchange's: cycles go up,
peak tile memory goes down.
"""

import math
from dataclasses import dataclass

import numpy as np

from popsim.device_graph import Copy
from popsim.errors import Error
from popsim.mapping import TileMapping

# Streaming memory is the IPU-Machine's DDR4 behind its gateway (IPU-M2000 datasheet: up to 448 GB per
# machine). Per IPU we take 20 GB/s, the order Graphcore quotes for an IPU-M2000's streaming memory; an
# *estimate* (no exact per-IPU figure is published in the datasheet), used for every target.
STREAMING_BYTES_PER_SECOND = 20e9


@dataclass
class RemoteCopy(Copy):
    """A transfer between streaming memory and tile memory: a load (remote storage -> tile buffer) or a store
    (tile tensor -> remote storage). The engine runs it as byte copies; it is costed as one streaming-memory
    transfer (see ``transfer_cycles``) of 1/``shards`` of the bytes when the storage is sharded over replicas
    (each replica moves its own shard)."""

    shards: int = 1


def is_remote(dg, tensor):
    """Whether ``tensor`` is (an alias of) a variable ``dg`` keeps in streaming memory."""
    return tensor.storage in dg.remote


def load(dg, var, where, name):
    """A fresh tile buffer (linear on ``where``, a Target view) that a load fills from remote ``var`` now."""
    buffer = dg.add_tensor(var.shape, var.dtype, TileMapping.linear(var.size, var.itemsize, where), name)
    dg.program.append(RemoteCopy(name, buffer, [var], np.arange(var.size), dg.origin, dg.remote_shards.get(var, 1)))
    return buffer


def store(dg, var, value):
    """Write tile tensor ``value`` back to remote variable ``var``."""
    shards = dg.remote_shards.get(var, 1)
    dg.program.append(RemoteCopy(f"remote store {var.name}", var, [value], np.arange(var.size), dg.origin, shards))


def load_operands(dg, args, where):
    """``args`` with each remote variable among them replaced by one freshly loaded tile buffer."""
    buffers = {}  # remote storage -> its buffer: one load per storage, whatever aliases read it
    out = []
    for a in args:
        if getattr(a, "storage", None) is not None and is_remote(dg, a):
            if a.storage not in buffers:
                buffers[a.storage] = load(dg, a.storage, where, f"remote load {a.storage.name}")
            a = buffers[a.storage] if a is a.storage else dg.alias(buffers[a.storage], a.shape)
        out.append(a)
    return out


# How remote variables reach their readers: "phase" loads each once per phase for all its readers there,
# "shared_phase" likewise with the last forward phase and the backward pass's first phase as one phase,
# "reader" loads it afresh for each reading node (the least tile memory).
LOAD_MODES = ("phase", "shared_phase", "reader")


class Loads:
    """The loads of remote variables for the nodes of one graph (``mode`` one of ``LOAD_MODES``).

    With "phase" a variable is loaded once per phase for all its readers in that phase: one tile buffer per
    variable, pass (forward or later) and placement (pipeline stage or phase, and IPU), live from its first
    reader there to its last, as PopART loads a phase's streamed weights at the start of the phase. A store
    of a new value ends the buffers of the old one. "shared_phase" counts the later passes' nodes of the last
    forward phase (``placement[0]`` of ``graph``'s forward nodes) in that forward phase, as phased execution
    runs the end of the forward pass and the start of the backward pass in one phase. With "reader" each
    reading node gets a fresh buffer.
    """

    def __init__(self, dg, graph, mode="phase"):
        if mode not in LOAD_MODES:
            raise Error(f"remote_loads must be one of {LOAD_MODES}, got {mode!r}")
        self.dg, self.mode = dg, mode
        self.buffers = {}  # (remote storage, pass, placement) -> its tile buffer
        placed = [n.placement[0] for n in graph.nodes if n.role in (None, "forward") and n.placement is not None]
        self.shared = max(placed) if mode == "shared_phase" and placed else None  # the phase both passes share

    def _phase(self, node):
        later = node.role not in (None, "forward")
        shared = node.placement is not None and node.placement[0] == self.shared
        return (later and not shared, node.placement)

    def operands(self, node, args, where):
        """``args`` of ``node`` with each remote variable among them read from its phase's buffer (loaded now if
        this is its first reader in the phase), on ``where`` (a Target view)."""
        if self.mode == "reader":
            return load_operands(self.dg, args, where)
        phase = self._phase(node)
        out = []
        for a in args:
            storage = getattr(a, "storage", None)
            if storage is not None and storage in self.dg.remote:
                buffer = self.buffers.get((storage, *phase))
                if buffer is None:
                    buffer = load(self.dg, storage, where, f"remote load {storage.name}")
                    self.buffers[(storage, *phase)] = buffer
                a = buffer if a is storage else self.dg.alias(buffer, a.shape)
            out.append(a)
        return out

    def stored(self, storage):
        """``storage`` took a new value: later readers load it afresh."""
        for key in [k for k in self.buffers if k[0] is storage]:
            del self.buffers[key]


def store_points(graph, streamed):
    """{node index: [(state, new value)]}: where each update of a variable named in ``streamed`` is stored, just
    after the later of its new value's producer and the last node reading the old value, so the new value
    need not stay on the tiles until the end of the program. Old values read by outputs or other updates
    (read at the end) keep their update at the end (absent here)."""
    produced, last_read = {}, {}
    for i, node in enumerate(graph.nodes):
        for v in node.inputs:
            last_read[v.id] = i
        for v in node.outputs:
            produced[v.id] = i
    at_end = {v.id for v in graph.outputs.values()} | {v.id for v in graph.updates.values()}
    points = {}
    for state, value in graph.updates.items():
        if state.name in streamed and value.id in produced and state.id not in at_end:
            points.setdefault(max(produced[value.id], last_read.get(state.id, -1)), []).append((state, value))
    return points


def region_bytes(storages):
    """{storage: byte offset} of each remote storage in the streaming-memory region, and the region's size."""
    offsets, at = {}, 0
    for s in storages:
        offsets[s] = at
        at += -(-s.size * s.itemsize // 8) * 8
    return offsets, at


def replica_bytes(storages, shards):
    """Bytes of streaming memory one replica holds: each of ``storages`` whole, or 1/``shards[storage]`` of it
    (8-byte aligned, as ``region_bytes`` lays them out)."""
    total = 0
    for s in storages:
        shard = -(-s.size * s.itemsize // shards.get(s, 1))
        total += -(-shard // 8) * 8
    return total


def block_base(storage, region_start):
    """Arena byte offset of each tile-mapping block of remote ``storage`` (dense, in element order)."""
    return region_start + storage.mapping.starts * storage.itemsize


def transfer_cycles(target, nbytes):
    """Cycles to move ``nbytes`` between streaming memory and the tiles at ``STREAMING_BYTES_PER_SECOND``."""
    return math.ceil(nbytes / STREAMING_BYTES_PER_SECOND * target.clock_hz)


SPILL_MODES = ("backward", "phase")


@dataclass(frozen=True)
class Spill:
    """Which activations ``Spiller`` moves to streaming memory: ``mode`` (one of ``SPILL_MODES``) says which
    reads take a value off chip, and values of fewer than ``min_elements`` elements stay on the tiles."""

    mode: str
    min_elements: int = 0


class Spiller:
    """Activations moved to streaming memory between the parts of a program (PopTorch's phased ``Liveness``,
    or activations in streaming memory by ``TensorLocations.setActivationLocation``).

    ``spill`` is None (nothing moves), a mode of ``SPILL_MODES`` or a ``Spill``. With mode "backward", a
    forward value that a later pass (backward, optimizer) reads is stored off chip after its last forward
    reader and loaded afresh before each later reader (once per pass and placement for all a placed graph's
    readers there); with "phase", so is every value read outside its own segment, a segment being the nodes
    of one pipeline stage or phase (``placement[0]``) in one pass. Values computed inside their reader's
    fused vertex, variables, inputs, constants and values smaller than the ``Spill``'s ``min_elements``
    never move.
    """

    def __init__(self, dg, graph, spill):
        spill = Spill(spill) if isinstance(spill, str) else spill
        if spill is not None and spill.mode not in SPILL_MODES:
            raise Error(f"spill mode must be None or one of {SPILL_MODES}, got {spill.mode!r}")
        self.dg = dg
        self.due = {}  # node index -> values to store once that node has been lowered
        self.spilled = {}  # popir value id -> its storage in streaming memory
        self.loaded = {}  # (popir value id, pass, placement) or (value id, reader) -> its loaded tile buffer
        if spill is None:
            return
        mode = spill.mode
        nodes = graph.nodes

        def segment(node):
            later = node.role not in (None, "forward")
            return later if mode == "backward" else (later, node.placement[0] if node.placement else None)

        readers = {}
        for i, node in enumerate(nodes):
            for v in node.inputs:
                readers.setdefault(v.id, []).append(i)
        for i, node in enumerate(nodes):
            home = segment(node)
            for v in node.outputs:
                uses = readers.get(v.id, [])
                away = [r for r in uses if segment(nodes[r]) != home]
                if node.op == "constant" or not away or v.type.size < spill.min_elements:
                    continue
                at = max([i] + [r for r in uses if r < away[0]])
                self.due.setdefault(at, []).append(v)

    def store_due(self, index, env):
        """Store the values due after node ``index`` whose tile tensors are in ``env`` (popir value id ->)."""
        for v in self.due.get(index, ()):
            t = env[v.id]
            if getattr(t, "storage", None) is None or t.storage.category != "temporary":
                continue  # fused into its reader's vertex, or a variable / input that lives elsewhere already
            label = v.name or f"{v.producer.op} %{v.id}"  # the popir value, as profiles name it
            storage = self.dg.add_tensor(t.shape, t.dtype, t.mapping, label, "variable")
            self.dg.remote.add(storage)
            step = RemoteCopy(f"remote store {label}", storage, [t], np.arange(t.size), v.producer)
            self.dg.program.append(step)
            self.spilled[v.id] = storage

    def operands(self, node, args, where):
        """``args`` of ``node`` with each stored value read from a tile buffer on ``where``: loaded once per
        unit (pass and placement, as PopART loads a phase's tensors at its start) for all a placed node's
        readers there, afresh for an unplaced reader."""
        later = node.role not in (None, "forward")
        out = []
        for v, a in zip(node.inputs, args):
            if v.id in self.spilled:
                key = (v.id, later, node.placement) if node.placement is not None else (v.id, node)
                if key not in self.loaded:
                    storage = self.spilled[v.id]
                    self.loaded[key] = load(self.dg, storage, where, f"remote load {storage.name}")
                a = self.loaded[key]
            out.append(a)
        return out
