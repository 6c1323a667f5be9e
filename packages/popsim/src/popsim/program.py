"""Flatten a program into the engine's arrays (phases, instruction rows, copy rows) and cost it.

Each phase row is (kind, a, b, c), with a static cycle count charged every time the engine runs it:

- COMPUTE (0, start, stop): instruction rows start..stop-1, one compute set.
- EXCHANGE (1, start, stop): copy rows start..stop-1, one Copy.
- BRANCH_IF_ZERO (2, offset, nbytes, target): go to phase ``target`` when the condition's bytes are all zero.
- JUMP (3, target): go to phase ``target``.
- LOOP_INIT (4, slot, count): set loop counter ``slot`` to ``count``.
- LOOP_BACK (5, slot, target): decrement counter ``slot``; go to phase ``target`` while it stays positive.
- SYNC (6): an explicit sync; no work.
- STREAM (7, slot, start, stop): a StreamCopy; stream rows start..stop-1 move one slice between host stream
  ``slot`` and tile memory.
- HOST_CALL (8, call): the engine stops so the host runs host call ``call`` (see ``HostCall``), then resumes.
- RUNS (9, start, stop, itemsize): compact rows start..stop-1 (see _exchange.split_rows): the rows of one
  repetition of the Copy whose EXCHANGE phase it follows, run as part of that exchange (no cycles of its own).
"""

from types import SimpleNamespace

import numpy as np

from popir import DType
from popsim import _exchange, cost, remote
from popsim import _opcodes as oc
from popsim.device_graph import ComputeSet, Copy, Execute, HostCall, If, Repeat, StreamCopy, Sync, children
from popsim.provenance import busy_ipus, credit_merged, fused_origins, origin_of
from popsim.timeline import HOST_CALLBACK, HOST_TRANSFER, STREAMING_MEMORY

NCOLS = oc.NCOLS
COMPUTE, EXCHANGE, BRANCH_IF_ZERO, JUMP, LOOP_INIT, LOOP_BACK, SYNC, STREAM, HOST_CALL, RUNS = (
    oc.PHASES[n] for n in oc.PHASE_NAMES
)
DT = oc.DTYPE_CODES
_TARGET_OF = {BRANCH_IF_ZERO: oc.PHASE_COL["c"], JUMP: oc.PHASE_COL["a"]}  # the column of a jump's target

# Instruction columns holding field addresses; an EXPR vertex's leaves a..f sit in EXPR_LEAF_COLUMNS (its
# program holds their dtypes).
_COLUMNS = tuple((col, name) for name, col in oc.FIELD_COLUMNS.items())
_EXPR_COLUMNS = ((oc.COL["out"], "out"), *zip(oc.EXPR_LEAF_COLUMNS, oc.EXPR_FIELDS))
# Column lookups done once rather than per instruction row.
_OP_COL, _SUB_COL, _N_COL = oc.COL["op"], oc.COL["sub"], oc.COL["n"]
_PARAM_COLS = {kind: {name: oc.COL[col] for name, col in params.items()} for kind, params in oc.VERTEX_PARAMS.items()}
_DTYPE_COLUMNS = tuple(oc.DTYPE_COLUMNS.items())
_DTYPE_CODE = {d: DT[d.value] for d in DType}


def element_addresses(tensor, elements, block_base):
    """Absolute arena byte offset and tile of each element of ``tensor``."""
    m = tensor.storage.mapping
    if m.size <= 2 * elements.size:
        # Many lookups: each element's block by one gather from a table of every element's block, which is
        # cheaper than a binary search per element.
        block = np.repeat(np.arange(m.starts.size), m.stops - m.starts)[elements]
    else:
        block = m.block_of(elements)
    return block_base(tensor.storage)[block] + (elements - m.starts[block]) * tensor.itemsize, m.tiles[block]


def _all_element_addresses(tensor, block_base):
    """``element_addresses`` of every element in order. A TileMapping's blocks cover 0..size in order, so
    each block's run is laid out in one pass instead of a binary search per element."""
    m = tensor.storage.mapping
    base = np.ascontiguousarray(block_base(tensor.storage), np.int64)
    return _exchange.block_elements(base, m.tiles, m.stops - m.starts, tensor.itemsize)


def host_blocks(tensor, block_base):
    """(host byte offsets, arena byte offsets, byte counts) of each block: a StreamCopy's plan."""
    m = tensor.storage.mapping
    isz = tensor.itemsize
    return (m.starts * isz, np.ascontiguousarray(block_base(tensor.storage)), (m.stops - m.starts) * isz)


def _storage_elements(step):
    """The Copy's index map with sources that share a storage (aliases, or one tensor listed twice) numbered
    alike: equal entries are one element of tile memory."""
    storages = [s.storage for s in step.srcs]
    if len(set(storages)) == len(storages):
        return step.index
    starts = np.cumsum([0] + [s.size for s in step.srcs])
    shift = np.array([starts[storages.index(st)] - starts[i] for i, st in enumerate(storages)], np.int64)
    return step.index + shift[np.searchsorted(starts, step.index, side="right") - 1]


def flatten_program(target, program, block_base, streams):
    """The engine arrays of ``program`` (a step or a list of steps) and its cost: one phase per compute set,
    one per Copy (consecutive independent copies are costed as one BSP exchange phase), one per StreamCopy
    and one per control step. ``streams`` numbers the host streams (name -> slot).

    ``totals`` holds static compute / exchange / sync / control / host cycles: exact for straight-line
    programs and Repeats, and for an If the costlier branch (a worst case). ``steps``, the per-tile figures
    and ``flops`` count each compute set and exchange once, however often it runs.
    """
    f = _Flattener(target, block_base, streams)
    totals = f.emit(program)
    return SimpleNamespace(
        phases=np.array(f.phases, np.int64).reshape(-1, oc.PHASE_COLS),
        phase_cycles=np.array(f.cycles, np.int64),
        num_counters=f.counters,
        instructions=f.instruction_table(),
        fparams=np.concatenate([*f.fparams, np.zeros(len(f.expr_rows))]),
        copies=np.concatenate(f.copies) if f.copies else np.zeros((0, len(oc.COPY_COLUMNS)), np.int32),
        runs=np.concatenate(f.runs) if f.runs else np.zeros((0, len(oc.RUN_COLUMNS)), np.int32),
        stream_rows=np.array(f.stream_rows, np.int64).reshape(-1, len(oc.STREAM_ROW_COLUMNS)),
        host_calls=f.host_calls,
        steps=f.steps,
        totals=dict(zip(("compute", "exchange", "sync", "control", "host"), totals.tolist())),
        tile_compute=f.tile_compute,
        tile_exchange=f.tile_exchange,
        flops=f.flops,
    )


def _placed(step):
    """The profile fields saying which pipeline stage and IPU a step works for, and in which pass (none when
    its popir node is unplaced)."""
    node = getattr(step, "origin", None)
    placement = getattr(node, "placement", None)
    if placement is None:
        return {}
    return {"stage": int(placement[0]), "ipu": int(placement[1]), "role": node.role}


def _totals(compute=0, exchange=0, sync=0, control=0, host=0):
    return np.array([compute, exchange, sync, control, host], np.int64)


class _Flattener:
    def __init__(self, target, block_base, streams):
        self.target = target
        self.streams = streams
        self.stream_rows = []
        self.host_calls = []  # {"callback", "sends", "receives"} of each HOST_CALL phase's call
        self.block_base = block_base
        self.phases, self.cycles, self.fparams, self.copies, self.steps = [], [], [], [], []
        self.rows, self.nrows = [], 0  # instruction rows: one array per batch of vertices, and their count
        self.tile_compute = np.zeros(target.num_tiles, np.int64)
        self.tile_exchange = np.zeros(target.num_tiles, np.int64)
        self.flops = {}  # matmul FLOPs by operand dtype: the AMP's peak rate depends on it
        self.ncopies = 0
        self.runs, self.nruns = [], 0  # compact exchange rows (see exchange_phases) and their count
        self.counters = 0
        # EXPR programs sit after every phase's rows (never run as vertices): their rows, each distinct
        # program's first row there, and the (first row, count) of each batch of vertex rows pointing at one.
        self.expr_rows, self.expr_start, self.expr_refs = [], {}, []
        self.open = None  # (load, destinations, profile step) of the exchange a next Copy may join
        self.addresses = {}  # storage -> (arena byte offset, tile) of each of its elements

    def phase(self, kind, a=0, b=0, c=0, cycles=0):
        self.phases.append([kind, a, b, c])
        self.cycles.append(int(cycles))
        if kind not in (EXCHANGE, RUNS):
            self.open = None
        return len(self.phases) - 1

    def exchange_phases(self, rows, itemsize, cycles):
        """One Copy's phases: an EXCHANGE phase for its rows of several repetitions, then a RUNS phase for
        the compact form of the others (an exchange reads fewer row bytes), the cycles on the first."""
        general, runs = _exchange.split_rows(rows)
        if len(general) or not len(runs):
            self.phase(EXCHANGE, self.ncopies, self.ncopies + len(general), cycles=cycles)
            self.copies.append(general)
            self.ncopies += len(general)
            cycles = 0
        if len(runs):
            self.phase(RUNS, self.nruns, self.nruns + len(runs), itemsize, cycles=cycles)
            self.runs.append(runs)
            self.nruns += len(runs)

    def _expr_program(self, program):
        key = program.tobytes()
        if key not in self.expr_start:
            self.expr_start[key] = len(self.expr_rows)
            self.expr_rows.extend(program.tolist())
        return self.expr_start[key]

    def instruction_table(self):
        """Vertex rows, then the EXPR programs, each EXPR row's P0 pointing at its program's first row."""
        programs = np.array(self.expr_rows, np.int64).reshape(-1, NCOLS)
        table = np.concatenate([*self.rows, programs]) if self.rows else programs
        for row, count, start in self.expr_refs:
            table[row : row + count, oc.COL["p0"]] = self.nrows + start
        return table

    def emit(self, step):
        """Append the phases of ``step``; returns its static totals."""
        if isinstance(step, Execute):
            step = step.compute_set
        if isinstance(step, ComputeSet):
            return self.compute_set(step)
        if isinstance(step, remote.RemoteCopy):
            return self.remote_copy(step)
        if isinstance(step, Copy):
            return self.copy(step)
        if isinstance(step, Sync):
            self.phase(SYNC, cycles=self.target.bsp_sync_cycles)
            return _totals(sync=self.target.bsp_sync_cycles)
        if isinstance(step, StreamCopy):
            return self.stream(step)
        if isinstance(step, Repeat):
            return self.repeat(step)
        if isinstance(step, If):
            return self.branch(step)
        if isinstance(step, HostCall):
            return self.host_call(step)
        return sum((self.emit(child) for child in children(step)), _totals())

    def repeat(self, step):
        if step.count == 0:
            return _totals()
        slot = self.counters
        self.counters += 1
        self.phase(LOOP_INIT, slot, step.count, cycles=cost.CONTROL_CYCLES)
        start = len(self.phases)
        body = self.emit(step.body)
        self.phase(LOOP_BACK, slot, start, cycles=cost.CONTROL_CYCLES)
        return step.count * (body + _totals(control=cost.CONTROL_CYCLES)) + _totals(control=cost.CONTROL_CYCLES)

    def branch(self, step):
        c = step.condition
        sync = self.target.bsp_sync_cycles
        decide = _totals(exchange=cost.branch_cycles(self.target) - sync, sync=sync)
        (address,), _ = element_addresses(c.tensor, np.array([c.start]), self.block_base)
        test = self.phase(BRANCH_IF_ZERO, int(address), c.tensor.itemsize, 0, decide.sum())
        then = self.emit(step.then_body)
        otherwise = _totals()
        if step.else_body is not None:
            jump = self.phase(JUMP, cycles=cost.CONTROL_CYCLES)
            then = then + _totals(control=cost.CONTROL_CYCLES)
            self.phases[test][_TARGET_OF[BRANCH_IF_ZERO]] = len(self.phases)
            otherwise = self.emit(step.else_body)
            self.phases[jump][_TARGET_OF[JUMP]] = len(self.phases)
        else:
            self.phases[test][_TARGET_OF[BRANCH_IF_ZERO]] = len(self.phases)
        # Both branches end here; an exchange after the If must not be costed as part of either.
        self.open = None
        return decide + (then if then.sum() >= otherwise.sum() else otherwise)

    def stream(self, step):
        """A host transfer: the tiles sync with the host, then the slice moves at the host link's rate."""
        t = step.tensor
        start = len(self.stream_rows)
        host_offsets, arena_offsets, nbytes = host_blocks(t, self.block_base)
        self.stream_rows += np.stack([host_offsets, arena_offsets, nbytes], axis=1).tolist()
        host = cost.host_cycles(self.target, t.size * t.itemsize)
        sync = self.target.bsp_sync_cycles
        self.phase(STREAM, self.streams[step.stream], start, len(self.stream_rows), cycles=host + sync)
        direction = "in" if step.to_device else "out"
        origin = origin_of(getattr(step, "origin", None))
        self.steps.append(
            {"name": f"stream-{direction} {step.stream}", "kind": "host", "cycles": int(host), "origin": origin}
            | {"transfer": HOST_TRANSFER}
        )
        return _totals(sync=sync, host=host)

    def host_call(self, step):
        """The inputs stream out, the host runs the callback while the tiles wait, the results stream in."""
        sent = sum((self.stream(s) for s in step.sends), _totals())
        names = {"sends": [s.stream for s in step.sends], "receives": [s.stream for s in step.receives]}
        self.host_calls.append({"callback": step.callback, **names})
        # The tiles sync with the host, then wait while it runs the callback (cost.host_callback_cycles).
        host = cost.host_callback_cycles(self.target, sum(t.size for t in [*step.inputs, *step.outputs]))
        sync = self.target.bsp_sync_cycles
        self.phase(HOST_CALL, len(self.host_calls) - 1, cycles=host + sync)
        entry = {"name": f"host-call {step.callback}", "kind": "host", "cycles": host, "transfer": HOST_CALLBACK}
        self.steps.append({**entry, "origin": origin_of(step.origin)})
        return sum((self.stream(s) for s in step.receives), sent + _totals(sync=sync, host=host))

    def remote_copy(self, step):
        """A streaming-memory load or store: a sync, then every byte crosses the streaming-memory link."""
        elements = np.arange(step.dst.size)
        src_addr, _ = element_addresses(step.srcs[0], elements, self.block_base)
        dst_addr, _ = element_addresses(step.dst, elements, self.block_base)
        rows = _exchange.copy_runs(src_addr, dst_addr, step.dst.itemsize)
        if not len(rows):
            return _totals()
        nbytes = -(-step.dst.size * step.dst.itemsize // step.shards)  # a sharded storage: one replica's shard
        cycles = remote.transfer_cycles(self.target, nbytes)
        sync = self.target.bsp_sync_cycles
        self.exchange_phases(rows, step.dst.itemsize, cycles + sync)
        self.open = None
        entry = {"name": step.name, "kind": "host", "cycles": int(cycles), "bytes": int(nbytes), **_placed(step)}
        entry["transfer"] = STREAMING_MEMORY
        self.steps.append({**entry, "origin": origin_of(step.origin)})
        return _totals(sync=sync, host=cycles)

    def compute_set(self, step):
        if not step.batches:
            return _totals()
        target = self.target
        start = self.nrows
        per_tile = np.zeros(target.num_tiles, np.int64)
        for batch in step.batches:
            self.rows.append(self._instruction_rows(batch))
            self.fparams.append(np.full(len(batch), batch.fparam))
            if batch.kind == oc.EXPR:
                self.expr_refs.append((self.nrows, len(batch), self._expr_program(batch.program)))
            self.nrows += len(batch)
            per_tile += np.bincount(batch.tiles, batch.cycles, target.num_tiles).astype(np.int64)
            if batch.kind == oc.MATMUL:
                self._count_flops(batch.fields["a"], 2 * batch.params["m"] * batch.params["k"] * batch.n)
            elif batch.kind == oc.CONV:  # a MAC per tap for each output
                self._count_flops(batch.fields["a"], 2 * batch.params["taps"] * batch.n)
        self.tile_compute += per_tile
        cycles = int(per_tile.max())
        self.phase(COMPUTE, start, self.nrows, cycles=cycles + target.bsp_sync_cycles)
        self.steps.append(
            {
                "name": step.name,
                "kind": "compute",
                "cycles": cycles,
                "vertices": step.num_vertices,
                "tiles": int((per_tile > 0).sum()),
                "ipus": busy_ipus(target, per_tile),
                "origin": origin_of(step.origin),
                **fused_origins(step),
                **_placed(step),
            }
        )
        return _totals(compute=cycles, sync=target.bsp_sync_cycles)

    def _count_flops(self, operand, flops):
        """Add a batch's FLOPs under its operand's dtype (the AMP's peak rate depends on it)."""
        dtype = operand.tensor.dtype.value
        self.flops[dtype] = self.flops.get(dtype, 0) + int(flops.sum())

    def _instruction_rows(self, batch):
        """The instruction rows of a batch of vertices: one row each, its fields' arena addresses."""
        rows = np.zeros((len(batch), NCOLS), np.int64)
        rows[:, _OP_COL], rows[:, _SUB_COL], rows[:, _N_COL] = batch.kind, batch.sub, batch.n
        param_cols = _PARAM_COLS[batch.kind]
        for name, values in batch.params.items():
            rows[:, param_cols[name]] = values
        fields = batch.fields
        for col, name in _EXPR_COLUMNS if batch.kind == oc.EXPR else _COLUMNS:
            if name in fields:
                regions, block = fields[name], batch.blocks[name]
                storage = regions.tensor.storage
                within = regions.starts - storage.mapping.starts[block]
                rows[:, col] = self.block_base(storage)[block] + within * storage.itemsize
        if batch.kind != oc.EXPR:
            for name, col in _DTYPE_COLUMNS:
                if name in fields:
                    rows[:, col] = _DTYPE_CODE[fields[name].tensor.dtype]
        return rows

    def _addresses(self, tensor):
        """``_all_element_addresses`` of ``tensor``, worked out once per storage: many copies read one."""
        key = tensor.storage
        if key not in self.addresses:
            self.addresses[key] = _all_element_addresses(tensor, self.block_base)
        return self.addresses[key]

    def copy(self, step):
        target = self.target
        if not step.index.size:
            return _totals()
        isz = step.dst.itemsize
        m = step.dst.storage.mapping
        dst_blocks = (self.block_base(step.dst.storage), m.tiles, m.stops - m.starts)
        if step.dst_elements is not None:  # a copy into some elements only: each is a block of one
            dst_addr, dst_tile = element_addresses(step.dst, step.dst_elements, self.block_base)
            dst_blocks = (dst_addr, dst_tile, np.ones(dst_addr.size, np.int64))
        sources = [self._addresses(s) for s in step.srcs]
        src_addr, src_tile = sources[0] if len(sources) == 1 else map(np.concatenate, zip(*sources))
        block, recv, sent, local, link = _exchange.copy_plan(
            *(np.ascontiguousarray(a, np.int64) for a in (step.index, _storage_elements(step))),
            src_addr, src_tile, *(np.ascontiguousarray(a, np.int64) for a in dst_blocks),
            isz, target.num_tiles, target.tiles_per_ipu, target.num_ipus,
        )  # fmt: skip
        recv, sent, local, link = recv * isz, sent * isz, local * isz, link * isz
        load = np.maximum(recv, sent) + local * target.exchange_bytes_per_cycle // target.store_bytes_per_cycle
        self.tile_exchange += load
        sources = {x.storage for x in step.srcs}
        if self.open is not None and not (sources & self.open[1]):
            # No data dependence on the open exchange: both run in one BSP exchange phase, so this copy is
            # charged only what it adds to that phase.
            open_load, dsts, merged, open_link = self.open
            open_load += load
            open_link += link
            dsts.add(step.dst.storage)
            merged["name"] += f"+{step.name}"
            credit_merged(merged, origin_of(step.origin), int(recv.sum()))
            merged["bytes"] += int(recv.sum())
            before, sync = merged["cycles"], 0
        else:
            open_load, dsts, open_link = load, {step.dst.storage}, link
            merged = {"name": step.name, "kind": "exchange", "bytes": int(recv.sum()), **_placed(step)}
            merged["origin"] = origin_of(step.origin)
            self.steps.append(merged)
            before, sync = 0, target.bsp_sync_cycles
        busiest, busiest_link = int(open_load.max()), int(open_link.max())
        merged["cycles"] = max(cost.exchange_cycles(target, busiest), cost.link_cycles(target, busiest_link))
        merged["busiest_tile_bytes"] = busiest
        merged["tiles"] = int((open_load > 0).sum())
        merged["ipus"] = busy_ipus(target, open_load)
        if target.num_ipus > 1:
            merged["busiest_link_bytes"] = busiest_link
        # The engine runs each copy on its own: the rows of one copy are independent of each other and
        # can be shared among threads, while two merged copies may reuse each other's memory.
        self.exchange_phases(block, isz, merged["cycles"] - before + sync)
        self.open = (open_load, dsts, merged, open_link)
        return _totals(exchange=merged["cycles"] - before, sync=sync)
