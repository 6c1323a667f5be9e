"""Flatten a lowered program into the engine's arrays (phases, instruction rows, copy rows) and cost it."""

from types import SimpleNamespace

import numpy as np

from popsim import _kernels, cost
from popsim import _opcodes as oc
from popsim.device_graph import ComputeSet

NCOLS = 12
DT = oc.DTYPE_CODES


def _address(region, block_base):
    storage = region.tensor.storage
    m = storage.mapping
    block = m.block_of_one(region.start)
    return block_base(storage)[block] + (region.start - m.lists()[1][block]) * storage.itemsize


def element_addresses(tensor, elements, block_base):
    """Absolute arena byte offset and tile of each element of ``tensor``."""
    m = tensor.storage.mapping
    block = m.block_of(elements)
    return block_base(tensor.storage)[block] + (elements - m.starts[block]) * tensor.itemsize, m.tiles[block]


def host_blocks(tensor, block_base):
    """(host byte offsets, arena byte offsets, byte counts) of each block: a StreamCopy's plan."""
    m = tensor.storage.mapping
    isz = tensor.itemsize
    return (m.starts * isz, np.ascontiguousarray(block_base(tensor.storage)), (m.stops - m.starts) * isz)


def _copy_rows(step, block_base):
    """Coalesced byte-run copies for an index-map Copy, plus per-tile received/sent/local bytes."""
    dst = step.dst
    isz = dst.itemsize
    index = step.index
    dst_addr, dst_tile = element_addresses(dst, np.arange(dst.size), block_base)
    src_addr = np.empty(dst.size, np.int64)
    src_tile = np.empty(dst.size, np.int64)
    base = 0
    for s in step.srcs:
        sel = (index >= base) & (index < base + s.size)
        if sel.any():
            src_addr[sel], src_tile[sel] = element_addresses(s, index[sel] - base, block_base)
        base += s.size
    rows = _kernels.copy_runs(src_addr, dst_addr, isz)
    return rows, src_tile, dst_tile, src_addr


def flatten_program(target, steps, block_base, block_base_list, tile_size):
    """The engine arrays of ``steps`` and their cost: one phase per compute set, and one per run of
    consecutive independent copies (an exchange phase)."""
    phases, rows, fparams, copies, profile_steps = [], [], [], [], []
    tile_compute = np.zeros(target.num_tiles, np.int64)
    tile_exchange = np.zeros(target.num_tiles, np.int64)
    flops = 0
    ncopies = 0
    open_load, open_dsts = None, set()
    for step in steps:
        if isinstance(step, ComputeSet):
            if not step.vertices:
                continue
            start = len(rows)
            per_tile = np.zeros(target.num_tiles, np.int64)
            for v in step.vertices:
                f = v.fields
                row = [v.kind, v.sub, v.n, 0, 0, 0, 0, 0, 0, 0, v.p0, v.p1]
                for col, name in ((3, "a"), (4, "b"), (5, "c"), (6, "out")):
                    if name in f:
                        row[col] = _address(f[name], block_base_list)
                for col, name in ((7, "a"), (8, "b"), (9, "out")):
                    if name in f:
                        row[col] = DT[f[name].tensor.dtype.value]
                rows.append(row)
                fparams.append(v.fparam)
                per_tile[v.tile] += v.cycles
                if v.kind == oc.MATMUL:
                    flops += 2 * v.p0 * v.p1 * v.n
            phases.append((0, start, len(rows)))
            tile_compute += per_tile
            cycles = int(per_tile.max())
            profile_steps.append(
                {
                    "name": step.name,
                    "kind": "compute",
                    "cycles": cycles,
                    "vertices": len(step.vertices),
                    "tiles": int((per_tile > 0).sum()),
                }
            )
        else:
            block, src_tile, dst_tile, src_addr = _copy_rows(step, block_base)
            if not len(block):
                continue
            isz = step.dst.itemsize
            cross = src_tile != dst_tile
            recv = np.bincount(dst_tile[cross], minlength=target.num_tiles) * isz
            # A source element sent to many tiles leaves its tile once (the exchange broadcasts it).
            unique_src = np.unique(src_addr[cross])
            sent = np.bincount(unique_src // tile_size, minlength=target.num_tiles) * isz
            local = np.bincount(dst_tile[~cross], minlength=target.num_tiles) * isz
            load = np.maximum(recv, sent) + local * target.exchange_bytes_per_cycle // target.store_bytes_per_cycle
            tile_exchange += load
            sources = {x.storage for x in step.srcs}
            if phases and phases[-1][0] == 1 and not (sources & open_dsts):
                # No data dependence on the open exchange: both run in one BSP exchange phase.
                open_load += load
                open_dsts.add(step.dst.storage)
                merged = profile_steps[-1]
                merged["name"] += f"+{step.name}"
                merged["bytes"] += int(recv.sum())
            else:
                open_load = load
                open_dsts = {step.dst.storage}
                merged = {"name": step.name, "kind": "exchange", "bytes": int(recv.sum())}
                profile_steps.append(merged)
            busiest = int(open_load.max())
            merged["cycles"] = cost.exchange_cycles(target, busiest)
            merged["busiest_tile_bytes"] = busiest
            # The engine runs each copy on its own: the rows of one copy are independent of each other and
            # can be shared among threads, while two merged copies may reuse each other's memory.
            phases.append((1, ncopies, ncopies + len(block)))
            copies.append(block)
            ncopies += len(block)
    return SimpleNamespace(
        phases=np.array(phases, np.int64).reshape(-1, 3),
        instructions=np.array(rows, np.int64).reshape(-1, NCOLS),
        fparams=np.array(fparams, np.float64),
        copies=np.concatenate(copies).astype(np.int64) if copies else np.zeros((0, 5), np.int64),
        steps=profile_steps,
        tile_compute=tile_compute,
        tile_exchange=tile_exchange,
        flops=flops,
    )
