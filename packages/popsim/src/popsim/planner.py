"""Planners (our PopLibs): build compute sets and exchanges for movement, elementwise, reduction and matmul.

Every movement is an index map: element i of a destination takes element ``index[i]`` of its sources
(``-1`` means a fill value, which becomes a one-element constant source). The engine turns each map into
byte-run copies between tiles, so one mechanism serves every movement op.
"""

import hashlib
import math
from typing import NamedTuple

import numpy as np

from popir import DType
from popsim import _opcodes as oc
from popsim import _reduce_plan, broadcast_rows, cost
from popsim.device_graph import Regions
from popsim.mapping import TileMapping
from popsim.matmul_plan import DEFAULT_AVAILABLE_MEMORY, plan_matmul

IDENTITY = {"sum": 0.0, "max": -math.inf, "min": math.inf, "prod": 1.0}


def _runs_both_ways(srcs, index):
    """Exchange rows needed to read a (B, rows, cols) operand index map into the concatenated ``srcs`` row by
    row, and to read its transpose (B, cols, rows) row by row: a run continues while the next element is the
    next one of the same source tile block. Each element's block is looked up once for both."""
    if index.size == 0:
        return 0, 0
    block_of = np.concatenate(
        [np.repeat(np.arange(len(s.mapping.tiles)), s.mapping.stops - s.mapping.starts) for s in srcs]
        + [np.zeros(0, np.int64)]
    )
    # Blocks numbered over all the sources, as a source's own numbers repeat from 0.
    block_of += np.repeat(np.cumsum([0] + [len(s.mapping.tiles) for s in srcs[:-1]]), [s.size for s in srcs])
    valid = (index >= 0) & (index < block_of.size)
    block = np.where(valid, block_of[np.where(valid, index, 0)], -1)
    return tuple(
        int(
            index.size // index.shape[axis]
            + ((np.diff(index, axis=axis) != 1) | (np.diff(block, axis=axis) != 0)).sum()
        )
        for axis in (2, 1)
    )


def _part_order(index, pairs):
    """The elements of a reduction (flat positions of ``index``) in the order ``_reduce_on_source_tiles``
    stages them: by tile, then their part's element count, then row; a part's elements in index order."""
    rows, group = index.shape
    tile, part_of, _, _, counts = pairs
    return np.lexsort((np.repeat(np.arange(rows), group), counts[part_of], tile))  # stable


def _codelet(name):
    """(instruction kind, sub-op) of an elementwise codelet."""
    if name == "where":
        return oc.WHERE, 0
    if name in oc.BINARY_OPS:
        return oc.BINARY, oc.BINARY_OPS[name]
    return oc.UNARY, oc.UNARY_OPS[name]


class Lowerer:
    """Builds device tensors and programs on a DeviceGraph for one popir graph: the ``lw`` a lowering gets.

    The planner helpers a lowering (see ``popsim.register_lowering``) may call: ``new``, ``constant``,
    ``fill``, ``gather``, ``move``, ``relayout``, ``broadcast_like``, ``reshape``, ``elementwise``,
    ``expression``, ``reduce_axes``, ``reduce_index`` and ``matmul_index``; ``dg`` (the DeviceGraph) and
    ``target`` for hand-placed vertices. Each helper places its result by the target's linear mapping unless
    told otherwise, and inserts the exchanges its operands need.
    """

    def __init__(self, dg, partials_type=DType.float32, available_memory=None, conv_dithering=False):
        self.dg = dg
        self.target = dg.target
        self.model_partials_type = partials_type
        self.partials_type = partials_type  # the node being lowered's: its own, else the model's
        self.model_conv_dithering = conv_dithering  # Poplar's enableConvDithering for every convolution
        self.conv_dithering = conv_dithering  # the node being lowered's: its own setting, else the model's
        self.dither = None  # (start tile, step) of the dithered convolution being lowered, else None
        self.ipu_available_memory = dict(available_memory or {})  # IPU index -> proportion of a tile
        self.available_memory = DEFAULT_AVAILABLE_MEMORY  # the proportion the node being lowered may use
        self._constants = {}
        self._scalars = {}  # (scalar tensor, IPU's first tile, tile count) -> its copy on each of those tiles
        self.in_place = {}  # popir value id -> the device variable its elementwise node writes in place
        self._matmul_plans = {}  # everything a matmul plan depends on -> its _MatmulLayout
        self._reduce_pairs = {}  # everything a reduction's _local_pairs depends on -> its result
        self.conv_layouts = {}  # everything a direct convolution's layout depends on -> its conv_plan.ConvLayout

    def budget_node(self, node, ipu):
        """Plan ``node``'s matmuls within its own available-memory proportion, else its IPU's, else Poplar's
        default; dither its convolution and accumulate its float16 partials as it says, else as the model
        does."""
        own = node.available_memory
        self.available_memory = own if own is not None else self.ipu_available_memory.get(ipu, DEFAULT_AVAILABLE_MEMORY)
        dithering = node.conv_dithering
        self.conv_dithering = dithering if dithering is not None else self.model_conv_dithering
        own = node.partials_type
        self.partials_type = DType(own) if own is not None else self.model_partials_type

    def task_tiles(self, tasks):
        """The tiles of a plan's ``tasks`` tasks in order round the IPU: from a start tile spread by the task
        count, ascending; or, lowering a dithered convolution, from its own start tile in its own direction."""
        first, step = ((tasks * 7919) % self.target.num_tiles, 1) if self.dither is None else self.dither
        return self.target.first_tile + (first + step * np.arange(tasks)) % self.target.num_tiles

    # -- tensors and movement ---------------------------------------------------------------------
    def new(self, shape, dtype, mapping=None, name=None):
        """A new device tensor (linearly mapped unless ``mapping`` is given), for vertices to write."""
        if mapping is None:
            mapping = TileMapping.linear(int(np.prod(shape, dtype=np.int64)), dtype.itemsize, self.target)
        return self.dg.add_tensor(shape, dtype, mapping, name)

    def constant(self, array, dtype):
        """A constant tensor (scalars are shared)."""
        array = np.array(array, dtype=dtype.numpy, order="C")
        key = (dtype, array.shape, array.tobytes(), self.target.first_tile) if array.size == 1 else None
        if key in self._constants:
            return self._constants[key]
        mapping = TileMapping.linear(array.size, dtype.itemsize, self.target)
        t = self.dg.add_tensor(array.shape, dtype, mapping, f"const{len(self.dg.tensors)}", "constant", array)
        if key is not None:
            self._constants[key] = t
        return t

    def fill_value(self, dtype, value):
        """A one-element constant holding ``value`` (an infinite value clamps to int32's range)."""
        if dtype == DType.int32 and not math.isfinite(value):
            value = np.iinfo(np.int32).max if value > 0 else np.iinfo(np.int32).min
        return self.constant(np.array(value), dtype)

    def gather(self, shape, dtype, srcs, index, mapping=None, fill=0.0, name="copy"):
        """A new tensor of ``shape`` whose element i is element ``index[i]`` of the sources (-1: ``fill``)."""
        out = self.new(shape, dtype, mapping)
        self.move(out, srcs, index, fill, name)
        return out

    def move(self, dst, srcs, index, fill=0.0, name="copy"):
        """An exchange filling the existing ``dst`` as ``gather`` fills a new tensor."""
        index = np.asarray(index, np.int64).reshape(-1)
        srcs = list(srcs)
        if index.size and index.min() < 0:
            total = sum(s.size for s in srcs)
            srcs.append(self.fill_value(dst.dtype, fill))
            index = np.where(index < 0, total, index)
        self.dg.add_copy(name, dst, srcs, index)

    def relayout(self, x, shape, mapping):
        """``x`` (same element count) placed by ``mapping``; an alias when the placement already agrees."""
        if x.mapping == mapping:
            return x if x.shape == tuple(shape) else self.dg.alias(x, shape)
        return self.gather(shape, x.dtype, [x], np.arange(x.size), mapping, name="relayout")

    def broadcast_like(self, x, shape, mapping):
        """``x`` broadcast to ``shape`` and placed by ``mapping`` (copies only what differs)."""
        if x.shape == tuple(shape):
            return self.relayout(x, shape, mapping)
        index = np.broadcast_to(np.arange(x.size).reshape(x.shape), shape)
        return self.gather(shape, x.dtype, [x], index, mapping, name="broadcast")

    def reshape(self, x, shape):
        """``x`` seen with another shape of the same size: an alias, no copy."""
        return self.dg.alias(x, shape) if x.shape != tuple(shape) else x

    # -- elementwise ------------------------------------------------------------------------------
    def elementwise(self, codelet, inputs, shape, dtype, out=None):
        """``codelet`` (a name of _opcodes.UNARY_OPS or BINARY_OPS, or "where") over ``inputs`` (NumPy
        broadcasting), as one vertex per block of the output (a new tensor of ``shape`` and ``dtype``, or
        ``out`` written in place), or per row of a block when an input is read by broadcast (``_vertex_rows``);
        inputs are exchanged into the output's placement."""
        out = self.new(shape, dtype) if out is None else out
        rows, fields, scalars, reads = self._vertex_rows(out, inputs, "abc")
        cs = self.dg.add_compute_set(codelet)
        work_dtype = inputs[-1].dtype if inputs else dtype
        cycles = self._row_cycles(
            out.mapping, rows, reads["wraps"], lambda n: cost.elementwise_cycles(self.target, n, work_dtype, codelet)
        )
        operands = [fields[name] for name in "abc"[: len(inputs)]]
        n = rows.stops - rows.starts
        oc.elementwise(
            self.dg.add_vertices,
            cs,
            codelet,
            rows.tiles,
            n,
            cycles,
            operands=operands,
            out=fields["out"],
            scalars=scalars,
            period=reads["period"],
            phase=reads["phase"],
        )
        return out

    def expression(self, steps, inputs, shape, dtype, out=None):
        """Elementwise ops fused into one vertex per block of the output (or per row, as ``elementwise``), as
        popops' map expressions: the registers are the ``inputs`` (at most 6), then one per step; each step
        (codelet, registers read, result dtype, operand dtype) rounds its result to its dtype, so the result is
        exactly that of the separate ops. The last step's register is the result, written to a new tensor or
        ``out``."""
        out = self.new(shape, dtype) if out is None else out
        rows, fields, scalars, reads = self._vertex_rows(out, inputs, oc.EXPR_FIELDS)
        program = np.zeros((1 + len(steps), oc.NCOLS), np.int64)
        head, op_row = oc.EXPR_HEAD, oc.EXPR_OP
        program[0, head["leaves"]] = len(inputs)
        program[0, head["ops"]] = len(steps)
        program[0, head["result"]] = len(inputs) + len(steps) - 1
        program[0, head["out_dt"]] = oc.DTYPE_CODES[dtype.value]
        leaf_dt = head["leaf_dt"]
        program[0, leaf_dt : leaf_dt + len(inputs)] = [oc.DTYPE_CODES[x.dtype.value] for x in inputs]
        program[0, head["float32"]] = all(x.dtype == DType.float32 for x in inputs) and all(
            codelet in oc.BINARY_FLOAT32_OPS and result == DType.float32 for codelet, _, result, _ in steps
        )
        for j, (codelet, regs, result, operand) in enumerate(steps):
            row = program[1 + j]
            row[op_row["kind"]], row[op_row["sub"]] = _codelet(codelet)
            row[op_row["dst"]] = len(inputs) + j
            row[op_row["src"] : op_row["src"] + oc.EXPR_SRCS] = [*regs, 0, 0][: oc.EXPR_SRCS]
            row[op_row["dt"]] = oc.DTYPE_CODES[result.value]
            row[op_row["integer"]] = operand == DType.int32
        ops = [(codelet, operand) for codelet, _, _, operand in steps]
        cs = self.dg.add_compute_set("+".join(codelet for codelet, _ in ops))
        cycles = self._row_cycles(
            out.mapping, rows, reads["wraps"], lambda n: cost.expression_cycles(self.target, n, ops)
        )
        n = rows.stops - rows.starts
        # The scalars mask is the program's: one program per mask the rows use.
        for mask in np.unique(scalars):
            pick = np.flatnonzero(scalars == mask)
            program[0, head["scalars"]] = mask
            chosen = {name: Regions(r.tensor, r.starts[pick], r.stops[pick]) for name, r in fields.items()}
            leaves = [chosen[name] for name in oc.EXPR_FIELDS[: len(inputs)]]
            oc.expression(
                self.dg.add_vertices, cs, rows.tiles[pick], n[pick], cycles[pick], leaves=leaves, out=chosen["out"],
                program=program.copy(), period=reads["period"][pick], phase=reads["phase"][pick],
            )  # fmt: skip
        return out

    def _vertex_rows(self, out, inputs, names):
        """The vertices of an elementwise op writing ``out`` from ``inputs``: their rows (broadcast_rows.Rows),
        each field's Regions (by ``names``, and "out"), each row's operand-forms mask and the period and phase
        of its repeating or held operands (_opcodes' OPERAND FORMS), and each row's wraps of them.

        Same-shaped inputs are exchanged into the output's placement and read block by block. A scalar goes
        to each tile once and the vertices broadcast it. An input broadcast over the output whose element by
        element exchange would bring some element to a tile twice goes to each tile once too (the distinct
        elements its vertices read): one broadcast over leading axes only is read *repeating* and one constant
        over aligned runs (a row statistic) *held*, a block per vertex; any other is read in rows, the output's
        blocks cut into stretches over which it is a contiguous slice or one broadcast element: identical
        operands reach a tile once."""
        m = out.mapping
        tiles = np.unique(m.tiles)
        placed = self._operand_forms(out, inputs)
        runs = [p[3] for p in placed if p[0] == "rows"]
        rows = broadcast_rows.cut_rows(m, runs)
        if runs and (np.bincount(rows.block) > 1).any():
            # Each further row would be a vertex whose state stays resident for the whole program: such
            # operands are exchanged whole instead.
            placed = [("block", self.broadcast_like(p[1], out.shape, m)) if p[0] == "rows" else p for p in placed]
            rows, runs = broadcast_rows.cut_rows(m, []), []
        copies, reads = self._broadcast_copies(out, placed, rows, runs)
        n = rows.stops - rows.starts
        fields = {"out": out.regions(rows.starts, rows.stops)}
        forms = np.zeros(len(rows.starts), np.int64)
        for i, (name, (form, x, *how)) in enumerate(zip(names, placed)):
            if form == "block":
                fields[name] = x.regions(rows.starts, rows.stops)
                continue
            if form == "scalar":
                (at,) = how
                at = at[np.searchsorted(tiles, rows.tiles)]
                fields[name] = x.regions(at, at + 1)
                forms |= 1 << i
                continue
            c = copies[i]
            x = self.gather((c.index.size,), x.dtype, [x], c.index, c.mapping, name="broadcast")
            if form == "repeat":
                first = c.at - reads["phase"]
                fields[name] = x.regions(first, first + reads["period"])
                forms |= 1 << (oc.REPEAT_SHIFT + i)
            elif form == "held":
                fields[name] = x.regions(c.at, c.at - (-(reads["phase"] + n) // reads["period"]))
                forms |= 1 << (oc.HELD_SHIFT + i)
            else:
                constant = how[2]
                fields[name] = x.regions(c.at, c.at + (1 if constant else n))
                forms |= int(constant) << i
        return rows, fields, forms, reads

    def _broadcast_copies(self, out, placed, rows, runs):
        """The tile copies ({input's position: broadcast_rows.TileCopies}) of the inputs ``placed`` reads in
        ``rows`` (cut at ``runs``), and the rows' period, phase and wraps of the repeating and held ones. A held
        input whose period and phase differ from the repeating ones' (the vertex has one pair) is exchanged
        whole (``placed`` is updated in place), and so is every input when reading the copies would cost more
        than exchanging them (``_rows_pay``)."""
        m = out.mapping
        zeros = np.zeros(len(rows.starts), np.int64)
        copies, reads, shared = {}, {"period": zeros, "phase": zeros, "wraps": zeros}, None
        for i, p in enumerate(placed):
            if p[0] in ("rows", "repeat"):
                copies[i] = broadcast_rows.tile_copies(p[2], rows, p[1].size, p[0] == "rows" and p[4])
            if p[0] == "repeat":
                _, period, phase = broadcast_rows.repeating_reads(copies[i], rows)
                reads, shared = {"period": period, "phase": phase}, p[3]
        for i, p in enumerate(placed):
            if p[0] != "held":
                continue
            c = broadcast_rows.held_copies(p[2], rows, p[1].size, p[3], m, runs)
            phase = rows.starts % p[3]
            if shared is not None and not ((reads["period"] == p[3]) & (reads["phase"] == phase)).all():
                placed[i] = ("block", self.broadcast_like(p[1], out.shape, m))
                continue
            copies[i], reads, shared = c, {"period": np.full_like(zeros, p[3]), "phase": phase}, p[3]
        reads["wraps"] = broadcast_rows.wraps(rows, shared) if shared else zeros
        if copies and not self._rows_pay(m, rows, reads["wraps"], [(placed[i][1], c) for i, c in copies.items()]):
            for i in copies:
                placed[i] = ("block", self.broadcast_like(placed[i][1], out.shape, m))
            return {}, {"period": zeros, "phase": zeros, "wraps": zeros}
        return copies, reads

    def _operand_forms(self, out, inputs):
        """How each input is first meant to be read (``_vertex_rows``): ("scalar", copy, element on each tile),
        ("repeat", x, index, period), ("held", x, index, run length), ("rows", x, index, run length, constant)
        or ("block", x exchanged into the output's placement). Repeating operands of one vertex share a period,
        held ones a run length: only the first one's inputs take the form, others are read in rows."""
        m, shape = out.mapping, out.shape
        placed, period, run = [], None, None
        for x in inputs:
            if x.size == 1 and m.size > 1:
                placed.append(("scalar", *self._scalar_on_tiles(x, np.unique(m.tiles))))
                continue
            if x.shape != tuple(shape) and m.size:
                g, constant = broadcast_rows.run_length(x.shape, shape)
                index = np.broadcast_to(np.arange(x.size).reshape(x.shape), shape).reshape(-1)
                if g >= broadcast_rows.MIN_ROW_ELEMENTS and broadcast_rows.may_repeat(g, constant, m):
                    if broadcast_rows.repeats(x.size, g, constant) and period in (None, g):
                        period = g
                        placed.append(("repeat", x, index, g))
                    elif constant and run in (None, g):
                        run = g
                        placed.append(("held", x, index, g))
                    else:
                        placed.append(("rows", x, index, g, constant))
                    continue
            placed.append(("block", self.broadcast_like(x, shape, m)))
        return placed

    def _rows_pay(self, mapping, rows, wraps, broadcasts):
        """Whether reading the ``broadcasts`` ((operand, its broadcast_rows.TileCopies)) in ``rows`` costs no
        more cycles, by estimate, than exchanging them whole into the output's blocks: the busiest tile's
        further row set-ups (rows beyond a block's first, and ``wraps`` of repeating operands) against the
        bytes the busiest receiver no longer receives, counted at ``broadcast_rows.SAVING_SHARE`` (the phase's
        busiest tile may be another copy's)."""
        further = np.bincount(rows.block, wraps + 1, minlength=len(mapping.tiles)).astype(np.int64) - 1
        extra = cost.row_cycles(self.target, further)
        overhead = np.bincount(mapping.tiles, extra).max()
        whole = np.bincount(mapping.tiles, mapping.stops - mapping.starts).max()
        saved = sum((whole - c.mapping.tile_bytes(1)[1].max()) * x.itemsize for x, c in broadcasts)
        return overhead * self.target.exchange_bytes_per_cycle <= saved * broadcast_rows.SAVING_SHARE

    def _row_cycles(self, mapping, rows, wraps, block_cycles):
        """Cycles of each row's vertex: a block's rows run as one vertex (popops' 2D vertices), costed as that
        vertex over the whole block (``block_cycles`` of its element counts) plus a set-up per further row
        (rows beyond the first, and ``wraps`` of repeating operands, each a row of popops' BroadcastVectorInner),
        all on the block's first row."""
        blocks = mapping.stops - mapping.starts
        further = np.bincount(rows.block, wraps + 1, minlength=blocks.size).astype(np.int64) - 1
        per_block = np.asarray(block_cycles(blocks), np.int64) + cost.row_cycles(self.target, further)
        first = np.r_[True, rows.block[1:] != rows.block[:-1]]
        return np.where(first, per_block[rows.block], 0)

    def _scalar_on_tiles(self, x, tiles):
        """One copy of the scalar ``x`` on each of ``tiles``, for vertices that broadcast it, and the element
        of each tile's copy. A constant is placed there when the program is loaded, as Poplar places
        constants; anything else is exchanged to every tile of the IPU at its first such use, so later uses
        (an optimizer's hyper-parameter in every parameter's update) find it there: identical operands reach
        a tile once. A variable only the host writes has its copies written at load instead (``_scalar_loaded``)."""
        if x.storage in self.dg.host_written:
            return self._scalar_loaded(x, tiles)
        if x.storage.category != "constant":
            return self._scalar_everywhere(x, tiles)
        mapping = TileMapping.on_tiles(np.ones(tiles.size), tiles)
        value = np.asarray(x.storage.value).reshape(-1)[:1]
        key = (x.dtype, value.tobytes(), tiles.tobytes())
        if key not in self._constants:
            array = np.repeat(value.astype(x.dtype.numpy), tiles.size)
            self._constants[key] = self.dg.add_tensor(
                array.shape, x.dtype, mapping, f"const{len(self.dg.tensors)}", "constant", array
            )
        return self._constants[key], np.arange(tiles.size)

    def _scalar_loaded(self, x, tiles):
        """``_scalar_on_tiles`` of a scalar variable no program updates (an optimizer hyper-parameter the host
        sets): a copy on each tile of the IPU, shared by every program and written when the executable is loaded
        and whenever the host writes the variable, as Poplar streams such values only when they change; no run
        exchanges it. Once every program is lowered, the copy keeps only its readers' tiles (``loaded_copies``)."""
        first, count = self.target.first_tile, self.target.num_tiles
        if tiles.min() < first or tiles.max() >= first + count:
            return self._scalar_everywhere(x, tiles)
        everywhere = TileMapping.on_tiles(np.ones(count), np.arange(first, first + count))
        return self.host_copy(x, first, everywhere, f"{x.storage.name} on tiles {first}+"), tiles - first

    def host_copy(self, x, key, mapping, name):
        """The copy ``key`` of host-written scalar variable ``x`` (or of a copy of it), one element per element
        of ``mapping``: a variable the executable writes with ``x``'s value at load and on each host write."""
        variable = self.dg.host_copy_of.get(x.storage, x.storage)
        copies = self.dg.loaded_copies.setdefault(variable, {})
        if key not in copies:
            copies[key] = self.dg.add_tensor((mapping.size,), x.dtype, mapping, name, "variable")
            self.dg.state_kinds[name] = self.dg.state_kinds.get(variable.name)
            self.dg.host_copy_of[copies[key]] = variable
            self.dg.host_written.add(copies[key])
        return copies[key]

    def _scalar_everywhere(self, x, tiles):
        """``_scalar_on_tiles`` of a computed or variable scalar: one copy per tile of the IPU being lowered
        for, made once per program (the program is straight-line, so every later use runs after the copy)."""
        first, count = self.target.first_tile, self.target.num_tiles
        if tiles.min() < first or tiles.max() >= first + count:  # vertices beyond this IPU: a copy for them
            mapping = TileMapping.on_tiles(np.ones(tiles.size), tiles)
            copy = self.gather((tiles.size,), x.dtype, [x], np.zeros(tiles.size), mapping, name="broadcast-scalar")
            return copy, np.arange(tiles.size)
        key = (x, first, count)
        if key not in self._scalars:
            everywhere = TileMapping.on_tiles(np.ones(count), np.arange(first, first + count))
            self._scalars[key] = self.gather(
                (count,), x.dtype, [x], np.zeros(count), everywhere, name="broadcast-scalar"
            )
        return self._scalars[key], tiles - first

    def fill(self, shape, dtype, value):
        """A tensor of ``shape`` holding ``value`` everywhere, written by Fill vertices on its tiles."""
        out = self.new(shape, dtype)
        cs = self.dg.add_compute_set("fill")
        m = out.mapping
        n = m.stops - m.starts
        cycles = cost.elementwise_cycles(self.target, n, dtype, "fill")
        oc.fill(self.dg.add_vertices, cs, m.tiles, n, cycles, out=out.regions(m.starts, m.stops), value=value)
        return out

    def fill_elements(self, out, elements, value):
        """Fill vertices writing ``value`` into the existing ``out``'s ``elements`` (ascending) on the tiles
        that hold them, one vertex per contiguous run on a tile: nothing crosses the exchange."""
        elements = np.asarray(elements, np.int64)
        if not elements.size:
            return
        m = out.mapping
        block = np.searchsorted(m.starts, elements, side="right") - 1
        breaks = np.flatnonzero((np.diff(elements) != 1) | (np.diff(block) != 0)) + 1
        firsts = np.concatenate(([0], breaks))
        lasts = np.concatenate((breaks, [elements.size])) - 1
        starts, stops = elements[firsts], elements[lasts] + 1
        n = stops - starts
        cycles = cost.elementwise_cycles(self.target, n, out.dtype, "fill")
        cs = self.dg.add_compute_set("fill")
        tiles = m.tiles[block[firsts]]
        oc.fill(self.dg.add_vertices, cs, tiles, n, cycles, out=out.regions(starts, stops), value=value)

    # -- reductions -------------------------------------------------------------------------------
    def reduce_index(self, op, srcs, index, shape, dtype, src_dtype):
        """out (``shape``, R elements) [r] = op over the G source elements ``index[r]`` (an (R, G) map).

        Rows small enough go whole to the tile of their output (one stage). Long rows are split into
        chunks on many tiles; the chunk partials are exchanged to the output's tiles and reduced again.
        When the sources' tiles hold several elements of a row, as popops::reduce does, each tile first
        reduces the elements of each row it holds (``_reduce_on_source_tiles``) and only those partials are
        reduced onward as above, if that exchanges fewer elements.
        """
        rows, group = index.shape
        if rows == 0 or group == 0:
            out = self.new(shape, dtype)
            return out if rows == 0 else self._copy_fill(out, IDENTITY[op])
        grain = max(64, self.target.min_bytes_per_tile // src_dtype.itemsize)
        splits = max(1, min(math.ceil(group / grain), self.target.num_tiles // rows))
        partial = self.partials_type if (op == "sum" and dtype == DType.float16) else dtype
        out_mapping = TileMapping.linear(rows, dtype.itemsize, self.target)
        pairs = self._reused_local_pairs(srcs, index, out_mapping, grain, splits)
        if pairs is not None:
            partials, index = self._reduce_on_source_tiles(op, srcs, index, src_dtype, partial, pairs)
            return self.reduce_index(op, [partials], index, shape, dtype, partial)
        out = self.new(shape, dtype)
        if splits == 1:
            staged = self.gather(
                (rows, group), src_dtype, srcs, index, out.mapping.scaled(group), IDENTITY[op], "reduce-gather"
            )
            self._reduce_vertices(op, staged, out, group)
            return out
        chunk = math.ceil(group / splits)
        splits = math.ceil(group / chunk)
        padded = np.full((rows, splits * chunk), -1, np.int64)
        padded[:, :group] = index
        first = (rows * 40503) % self.target.num_tiles
        tiles = self.target.first_tile + (first + np.arange(rows * splits)) % self.target.num_tiles
        staged = self.gather(
            (rows * splits, chunk),
            src_dtype,
            srcs,
            padded,
            TileMapping.on_tiles(np.full(rows * splits, chunk), tiles),
            IDENTITY[op],
            "reduce-gather",
        )
        partials = self.new((rows * splits,), partial, TileMapping.on_tiles(np.ones(rows * splits, np.int64), tiles))
        self._reduce_vertices(op, staged, partials, chunk)
        gathered = self.gather(
            (rows, splits),
            partial,
            [partials],
            np.arange(rows * splits),
            out.mapping.scaled(splits),
            name="reduce-partials",
        )
        self._reduce_vertices(op, gathered, out, splits)
        return out

    def _reused_local_pairs(self, srcs, index, out_mapping, grain, splits):
        """``_local_pairs``, worked out once per distinct reduction: a repeated layer's reductions (equal index
        maps, source sizes, placements and dtypes, output placements) reuse those of its first instance."""
        where = (self.target.first_tile, self.target.num_tiles, srcs[0].dtype, grain, splits)
        key = (where, out_mapping.key(), _sources_key(srcs), _index_key(index))
        if key not in self._reduce_pairs:
            pairs = self._local_pairs(srcs, index, out_mapping, grain, splits)
            for array in pairs or ():
                array.flags.writeable = False  # shared by every reduction with this key
            self._reduce_pairs[key] = pairs
        return self._reduce_pairs[key]

    def _local_pairs(self, srcs, index, out_mapping, grain, splits):
        """The parts of a reduction's elements that ``_reduce_on_source_tiles`` reduces on their tiles, as
        (each element's tile, each element's part, each part's tile, row and element count), when some tile
        holds two elements of a row and that plan pays (``_local_pays``); else None. A part is the elements of
        one row on one tile, or, when they are many, a share of them of at least ``grain`` elements for each
        of the tile's workers (a vertex's row runs on one worker)."""
        if index.min() < 0:
            return None
        rows, group = index.shape
        tile_of = np.concatenate([np.repeat(s.mapping.tiles, s.mapping.stops - s.mapping.starts) for s in srcs])
        tile = tile_of[index.reshape(-1)]
        # Each element's (row, tile) pair, numbered by tile then row, and its place among its pair's elements.
        found = _reduce_plan.row_tile_pairs(tile, group)
        if found is None:  # no tile holds two elements of one row
            return None
        pair_of, rank, pair_tile, pair_row, counts = found
        share = np.maximum(grain, -(-counts // self.target.workers))
        # A pair's parts are its consecutive shares of ``share`` elements, numbered pair after pair.
        per_pair = -(-counts // share)
        part_pair = np.repeat(np.arange(counts.size), per_pair)
        part_first = np.cumsum(per_pair) - per_pair
        sub = np.arange(part_pair.size) - part_first[part_pair]  # each part's place among its pair's
        part_counts = np.minimum(share[part_pair], counts[part_pair] - sub * share[part_pair])
        part_of = part_first[pair_of] + rank // share[pair_of]
        pairs = tile, part_of, pair_tile[part_pair], pair_row[part_pair], part_counts
        return pairs if self._local_pays(srcs, index, pairs, out_mapping, splits) else None

    def _local_pays(self, srcs, index, pairs, out_mapping, splits):
        """Whether reducing on the source tiles first (``pairs`` from ``_local_pairs``) costs fewer cycles, by
        estimate, than the plan without it: its first stage's busiest tile, the on-tile copy that stage needs
        unless it reads its sources in place, and a sync each, against the exchange and final reduction of
        the elements whole (or of the long rows' chunks, as ``reduce_index`` splits them)."""
        t, dtype = self.target, srcs[0].dtype
        rows, group = index.shape
        tile, _, part_tile, part_row, _ = pairs
        out_tile = np.repeat(out_mapping.tiles, out_mapping.stops - out_mapping.starts)
        rows_on = np.bincount(out_tile).max()

        def busiest(tiles):  # elements the busiest tile receives
            return np.bincount(tiles, minlength=1).max() * dtype.itemsize

        sent = part_tile != out_tile[part_row]
        per_row = np.bincount(part_row, minlength=rows).max()
        parts_on, elements_on = np.bincount(part_tile), np.bincount(tile)
        first = cost.reduce_cycles(t, parts_on, -(-elements_on // np.maximum(parts_on, 1)), dtype).max()
        local = first + t.bsp_sync_cycles + cost.exchange_cycles(t, busiest(out_tile[part_row][sent]))
        local += cost.reduce_cycles(t, rows_on, per_row, dtype)
        if self._in_place_source(srcs, index.reshape(-1)[_part_order(index, pairs)]) is None:
            copied = elements_on.max() * dtype.itemsize * t.exchange_bytes_per_cycle // t.store_bytes_per_cycle
            local += cost.exchange_cycles(t, copied) + t.bsp_sync_cycles
        if splits == 1:
            away = (tile.reshape(rows, group) != out_tile[:, None]).reshape(-1)
            whole = cost.exchange_cycles(t, busiest(np.repeat(out_tile, group)[away]))
            whole += cost.reduce_cycles(t, rows_on, group, dtype)
        else:
            chunk = math.ceil(group / splits)
            whole = cost.exchange_cycles(t, chunk * dtype.itemsize) + cost.reduce_cycles(t, 1, chunk, dtype)
            whole += cost.exchange_cycles(t, rows_on * splits * dtype.itemsize) + t.bsp_sync_cycles
            whole += cost.reduce_cycles(t, rows_on, splits, dtype)
        return local < whole

    def _reduce_on_source_tiles(self, op, srcs, index, src_dtype, partial, pairs):
        """Reduce each row's elements on the tiles holding them into one ``partial`` per (row, tile) pair
        (``_local_pairs`` gives the pairs); returns the partials and the (R, S) map of each row's partials,
        in tile order (a row with fewer than S pads with -1). Elements of a pair keep their order in
        ``index``; a tile's pairs are ordered by element count, then row, so its pairs of one count run as
        one vertex."""
        rows, group = index.shape
        tile, pair_of, pair_tile, pair_row, counts = pairs
        flat = index.reshape(-1)
        order = _part_order(index, pairs)
        p_order = np.lexsort((pair_row, counts, pair_tile))
        on, per_tile = np.unique(pair_tile[p_order], return_counts=True)
        partials = self.new((p_order.size,), partial, TileMapping.on_tiles(per_tile, on))
        in_place = self._in_place_source(srcs, flat[order])
        if in_place is None:
            on, per_tile = np.unique(tile[order], return_counts=True)
            staged = self.gather((flat.size,), src_dtype, srcs, flat[order], TileMapping.on_tiles(per_tile, on),
                                 name="reduce-local")  # fmt: skip
            self._reduce_vertices(op, staged, partials, counts[p_order])
        else:
            self._reduce_vertices(op, srcs[0], partials, counts[p_order], in_place)
        by_row = np.lexsort((pair_tile[p_order], pair_row[p_order]))  # partial positions, row by row
        per_row = np.bincount(pair_row, minlength=rows)
        index = np.full((rows, per_row.max()), -1, np.int64)
        index[np.arange(per_row.max()) < per_row[:, None]] = by_row
        return partials, index

    @staticmethod
    def _in_place_source(srcs, elements):
        """``elements`` (the pairs' source elements, pair by pair) when they are consecutive elements of the one
        source, holding one block per tile, so the vertices read them where they are; else None."""
        tiles = srcs[0].mapping.tiles
        if len(srcs) != 1 or np.unique(tiles).size != tiles.size or np.any(np.diff(elements) != 1):
            return None
        return elements

    def _reduce_vertices(self, op, staged, out, group, source_elements=None):
        """Vertices reducing ``staged`` into ``out``: element j of ``out`` is ``op`` over the next ``group``
        elements of ``staged`` (one count, or an array of one count per element of ``out``), read from its
        start on; given ``source_elements`` (which element of ``staged`` each of those is), read there instead
        (each vertex's elements are consecutive there). Each run of equal counts in a block is one vertex."""
        cs = self.dg.add_compute_set(f"reduce-{op}")
        m = out.mapping
        counts = np.broadcast_to(np.asarray(group, np.int64), (out.size,))
        first = np.zeros(out.size, bool)
        first[m.starts] = True
        first[1:] |= counts[1:] != counts[:-1]
        starts = np.flatnonzero(first)
        stops = np.r_[starts[1:], out.size]
        offsets = np.r_[0, np.cumsum(counts)]
        rows, per_row = stops - starts, counts[starts]
        tiles = m.tiles[m.block_of(starts)]
        base = offsets[starts] if source_elements is None else source_elements[offsets[starts]]
        source, target = staged.regions(base, base + rows * per_row), out.regions(starts, stops)
        cycles = cost.reduce_cycles(self.target, rows, per_row, staged.dtype)
        oc.reduce(
            self.dg.add_vertices, cs, op, tiles, rows, cycles, source=source, out=target, rows=rows, group=per_row
        )

    def _copy_fill(self, out, value):
        filled = self.fill(out.shape, out.dtype, value)
        self.move(out, [filled], np.arange(out.size), name="fill")
        return out

    def reduce_axes(self, op, x, axes, keepdims, dtype=None):
        """Reduce ``x`` over ``axes`` (sorted non-negative) like np.sum/max/min."""
        kept = [i for i in range(len(x.shape)) if i not in axes]
        rows = int(np.prod([x.shape[i] for i in kept], dtype=np.int64))
        index = np.arange(x.size).reshape(x.shape).transpose(kept + list(axes)).reshape(rows, -1)
        shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape) if keepdims or i not in axes)
        return self.reduce_index(op, [x], index, shape, dtype or x.dtype, x.dtype)

    # -- matmul -----------------------------------------------------------------------------------
    def matmul_index(self, a_srcs, a_index, b_srcs, b_index, dtype, order=None):
        """R (B, M, N) = A @ B per batch, with A given as a (B, M, K) index map into ``a_srcs`` and B as a
        (B, K, N) map into ``b_srcs`` (-1: zero). The plan splits B, M, N and K over tiles; each tile
        receives its operand blocks by exchange, runs an AMP partial, and K-partials are reduced.

        The plan keeps its temporary memory within ``available_memory`` (the node's proportion of a tile).
        A plan depends only on the index maps, the dtype, that proportion and the sizes and tile mappings of
        the sources, so a repeated layer (same shapes, dtypes and placements) reuses the plan of its first
        instance.

        ``order`` (an index map into R, of the shape wanted) arranges the result otherwise (a convolution's
        NCHW output of its im2col product): its elements are gathered, or reduced, from the partials straight
        into that arrangement, with no second exchange."""
        # The IPU whose tiles the plan uses, and the share of their memory it may take.
        where = (self.target.first_tile, self.target.num_tiles, self.available_memory, self.dither)
        key = (where, dtype, _sources_key(a_srcs), _sources_key(b_srcs), _index_key(a_index), _index_key(b_index))
        if key not in self._matmul_plans:
            self._matmul_plans[key] = self._plan_matmul(a_srcs, a_index, b_srcs, b_index, dtype)
        plan = self._matmul_plans[key]
        return self._matmul(*((b_srcs, a_srcs) if plan.transposed else (a_srcs, b_srcs)), dtype, plan, order)

    def _plan_matmul(self, a_srcs, a_index, b_srcs, b_index, dtype):
        (a_rows, a_cols), (b_rows, b_cols) = _runs_both_ways(a_srcs, a_index), _runs_both_ways(b_srcs, b_index)
        if b_cols + a_cols < a_rows + b_rows:
            # R^T = B^T @ A^T reads both operands in longer contiguous runs (fewer, larger exchange rows);
            # the partials are read back transposed, so the result's layout is the same.
            return self._matmul_layout(b_index.transpose(0, 2, 1), a_index.transpose(0, 2, 1), dtype, True)
        return self._matmul_layout(a_index, b_index, dtype, False)

    def _matmul_layout(self, a_index, b_index, dtype, transposed):
        """The tile plan of a matmul and the index maps it gathers its operands and partials by. A task at the
        edge of M, N or K runs its smaller block (the vertex's own m, k and n), so no zero padding is
        exchanged to it. Tasks are laid out (and given tiles round the IPU) by their block sizes first, so
        that the tasks of one size sit at regular strides and their operand copies stay few exchange rows."""
        nb_, m, k = a_index.shape
        n = b_index.shape[2]
        partial = self.partials_type if dtype == DType.float16 else DType.float32
        split = plan_matmul(self.target, nb_, m, n, k, dtype, partial, self.available_memory)
        gm, gn, gk, mb, nb, kb = split.gm, split.gn, split.gk, split.mb, split.nb, split.kb
        tasks = nb_ * gm * gn * gk
        # Each task's own block sizes, task (b, i, j, kk) in that order: its rows of M, columns of N, share of K.
        edge = [
            np.minimum(block, size - block * np.arange(g)) for g, block, size in ((gm, mb, m), (gn, nb, n), (gk, kb, k))
        ]
        mi, nj, kk = (a.reshape(-1) for a in np.meshgrid(np.arange(nb_), *edge, indexing="ij")[1:])
        order = np.argsort((mi < mb) * 4 + (nj < nb) * 2 + (kk < kb), kind="stable")  # slot -> task
        slot = np.argsort(order)  # task -> slot
        mi, nj, kk = mi[order], nj[order], kk[order]
        pa = np.full((nb_, gm * mb, gk * kb), -1, np.int64)
        pa[:, :m, :k] = a_index
        pb = np.full((nb_, gk * kb, gn * nb), -1, np.int64)
        pb[:, :k, :n] = b_index
        ordered = np.unravel_index(order, (nb_, gm, gn, gk))
        a_blocks = pa.reshape(nb_, gm, mb, gk, kb).transpose(0, 1, 3, 2, 4)[:, :, None]
        a_tasks = _trimmed(np.broadcast_to(a_blocks, (nb_, gm, gn, gk, mb, kb))[ordered], mi, kk)
        b_blocks = pb.reshape(nb_, gk, kb, gn, nb).transpose(0, 3, 1, 2, 4)[:, None]
        b_tasks = _trimmed(np.broadcast_to(b_blocks, (nb_, gm, gn, gk, kb, nb))[ordered], kk, nj)
        tiles = self.task_tiles(tasks)
        sizes = np.stack([mi, kk, nj], axis=1)
        p_start = np.cumsum(mi * nj) - mi * nj
        # Partials of output (b, i, j): task (b, i // mb, j // nb, kk)'s element (i % mb, j % nb), for each kk.
        bi, ii, jj = np.meshgrid(np.arange(nb_), np.arange(m), np.arange(n), indexing="ij")
        task = slot[(((bi * gm + ii // mb) * gn + jj // nb) * gk)[..., None] + np.arange(gk)]
        q = p_start[task] + (ii % mb)[..., None] * nj[task] + (jj % nb)[..., None]
        shape = (nb_, n, m) if transposed else (nb_, m, n)
        q = (q.transpose(0, 2, 1, 3) if transposed else q).reshape(-1, gk)
        return _MatmulLayout(transposed, split, tiles, sizes, a_tasks, b_tasks, q, shape, partial)

    def _matmul(self, a_srcs, b_srcs, dtype, plan, order=None):
        tiles = plan.tiles
        mi, kk, nj = plan.sizes.T
        a_t = self._task_blocks(a_srcs, plan.a_tasks, mi * kk, tiles, dtype, "matmul-lhs")
        b_t = self._task_blocks(b_srcs, plan.b_tasks, kk * nj, tiles, dtype, "matmul-rhs")
        p = self._task_blocks(None, None, mi * nj, tiles, plan.partial)
        cs = self.dg.add_compute_set("matmul")
        cycles = cost.amp_cycles(self.target, mi, kk, nj, dtype)
        lhs, rhs, out = (x.regions(x.mapping.starts, x.mapping.stops) for x in (a_t, b_t, p))
        oc.matmul(self.dg.add_vertices, cs, tiles, nj, cycles, lhs=lhs, rhs=rhs, out=out, m=mi, k=kk)
        q, shape = plan.q, plan.shape
        if order is not None:
            q, shape = q[np.asarray(order, np.int64).reshape(-1)], np.shape(order)
        if plan.split.gk == 1 and dtype == plan.partial:
            return self.gather(shape, dtype, [p], q)
        return self.reduce_index("sum", [p], q, shape, dtype, plan.partial)

    def _task_blocks(self, srcs, index, sizes, tiles, dtype, name=None):
        """One block per matmul task (``sizes`` elements on ``tiles``): gathered from ``srcs`` by ``index``,
        else new (for the vertices to write)."""
        mapping = TileMapping.on_tiles(sizes, tiles)
        if srcs is None:
            return self.new((mapping.size,), dtype, mapping)
        return self.gather((mapping.size,), dtype, srcs, index, mapping, name=name)


class _MatmulLayout(NamedTuple):
    """A matmul's plan: whether it runs transposed, its split, the tile of each task and its (m, k, n) block
    sizes, the index maps of the operand and partial gathers (into the operands' sources and into the
    partials), the result's shape and the partials' dtype."""

    transposed: bool
    split: object
    tiles: np.ndarray
    sizes: np.ndarray
    a_tasks: np.ndarray
    b_tasks: np.ndarray
    q: np.ndarray
    shape: tuple
    partial: DType


def _trimmed(blocks, rows, cols):
    """The (tasks, R, C) ``blocks``, each cut to its task's ``rows`` x ``cols`` (equal over runs of tasks, as
    a matmul lays its tasks out), flattened task after task."""
    cut = np.flatnonzero((np.diff(rows) != 0) | (np.diff(cols) != 0)) + 1
    bounds = np.r_[0, cut, len(rows)]
    return np.concatenate([blocks[a:b, : rows[a], : cols[a]].reshape(-1) for a, b in zip(bounds[:-1], bounds[1:])])


def _sources_key(srcs):
    return tuple((s.size, s.mapping.key()) for s in srcs)


def _index_key(index):
    """An index map's part of a plan's key: its shape, dtype and a digest of its values. SHA-256 reads the
    array's memory in place (hashlib takes any C-contiguous buffer), about twice as fast here as a copy
    through ``tobytes`` into BLAKE2b, for the same exactness (a collision would reuse a wrong plan)."""
    index = np.ascontiguousarray(index)
    return index.shape, index.dtype.str, hashlib.sha256(index).digest()
