"""Profile: simulated cycles per program and step, split by phase kind, per tile, and memory per tile."""

import itertools
import json
import os

import numpy as np

SUMMARY_ROWS = 8  # operations listed per program by ``summary``


class Profile:
    """Per program: ``steps`` (each compute set / exchange with its cycles), totals by kind, seconds,
    per-tile compute cycles and exchange bytes, memory per tile by category.

    Totals are static. With control flow they count every Repeat iteration and, for an If, the costlier
    branch (a worst case); ``control_cycles`` are loop counters, jumps and branch decisions. Steps, per-tile
    figures and flops count each compute set and exchange once. ``Executable.last_run_cycles`` is the
    dynamic figure of the branches a run actually took."""

    def __init__(self, target):
        self.target = target
        self.programs = {}
        self.replication = None

    def add_program(
        self,
        name,
        steps,
        totals,
        host_cycles,
        memory,
        tile_compute,
        tile_exchange,
        flops,
        budget,
        relaxed,
        tensors=(),
        memory_by_category=None,
        liveness=None,
    ):
        compute, exchange, sync, control = (totals[k] for k in ("compute", "exchange", "sync", "control"))
        total = compute + exchange + sync + control + host_cycles
        used = np.sum([memory[k] for k in ("tensors", "vertex_state", "code")], axis=0)
        self.programs[name] = {
            "total_cycles": int(total),
            "compute_cycles": int(compute),
            "exchange_cycles": int(exchange),
            "sync_cycles": int(sync),
            "control_cycles": int(control),
            "host_cycles": int(host_cycles),
            "seconds": total / self.target.clock_hz,
            "flops": int(sum(flops.values())),
            "flops_by_dtype": {dtype: int(n) for dtype, n in flops.items()},
            "flops_utilisation": self._flops_utilisation(flops, total),
            "steps": steps,
            "tile_compute_cycles": tile_compute.tolist(),
            "tile_exchange_bytes": tile_exchange.tolist(),
            "memory": memory,
            "memory_total_bytes": int(used.sum()),
            "memory_max_tile_bytes": int(used.max()),
            "tiles_over_budget": [t for t, u in enumerate(used.tolist()) if u > self.target.tile_bytes],
            "relax_memory": bool(relaxed),
            "tile_budget_bytes": [int(budget[t]) for t in range(self.target.num_tiles)],
            "tensors": list(tensors),
            "memory_by_category": memory_by_category or {},
            "liveness": liveness or {},
        }

    def _flops_utilisation(self, flops, cycles):
        """The share of ``cycles`` the AMP units of every tile would need for ``flops`` (matmul FLOPs by operand
        dtype) at their peak rate for each dtype: FLOP/s against the peak, for any mix of precisions."""
        t = self.target
        busy = sum(n / (2 * t.amp_macs(dtype) * t.num_tiles) for dtype, n in flops.items())
        return busy / cycles if cycles else 0.0

    def add_replication(self, replicas, replica_step, all_reduce=None, optimizer_step=0):
        """A training step of ``replicas`` replicas running in parallel: each replica's cycles
        (``replica_step``), the gradient ``all_reduce`` (a ``collectives.AllReduce``) and the cycles of the
        ``optimizer_step`` that follows it. Inference (``all_reduce`` None): a call's runs, no collective."""
        reduce_cycles = all_reduce.cycles if all_reduce is not None else 0
        total = replica_step + reduce_cycles + optimizer_step
        self.replication = {
            "replicas": replicas,
            "replica_step_cycles": int(replica_step),
            "all_reduce": all_reduce.to_dict() if all_reduce is not None else None,
            "optimizer_step_cycles": int(optimizer_step),
            "step_cycles": int(total),
            "all_reduce_share": reduce_cycles / total if total else 0.0,
        }

    def to_json(self, path=None):
        """The profile as JSON text; also written to ``path`` when given."""
        t = self.target
        text = json.dumps(
            {
                "target": t.name,
                "clock_hz": t.clock_hz,
                "num_tiles": t.num_tiles,
                "num_ipus": t.num_ipus,
                "tile_bytes": t.tile_bytes,
                "sync_cycles": t.bsp_sync_cycles,
                # Peak FLOP/s: two FLOPs per AMP multiply-accumulate on every tile.
                "peak_flops": {
                    "float32": 2 * t.amp_macs_fp32 * t.num_tiles * t.clock_hz,
                    "float16": 2 * t.amp_macs_fp16 * t.num_tiles * t.clock_hz,
                },
                "programs": self.programs,
                "replication": self.replication,
            }
        )
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def save_html(self, path, **options):
        """Write the self-contained HTML report of this profile to ``path`` (``options`` as in
        ``popsim.report.render``: ``compare``, ``title``, ``samples_per_run``); returns the path."""
        from popsim import report  # the report reads profiles, so it imports this module

        return report.save_html(self, path, **options)

    def operations(self, program):
        """The operations of ``program`` grouped by where they came from (see ``operations``)."""
        return operations(self.programs[program])

    def summary(self):
        """A short human-readable report: totals per program and its costliest modules and source lines."""
        lines = [
            f"popsim profile on {self.target.name} ({self.target.num_tiles} tiles"
            f" @ {self.target.clock_hz / 1e9:.3f} GHz)"
        ]
        for name, p in self.programs.items():
            lines.append(
                f"program {name}: {p['total_cycles']} cycles ({p['seconds'] * 1e6:.1f} us):"
                f" compute {p['compute_cycles']},"
                f" exchange {p['exchange_cycles']}, sync {p['sync_cycles']}, control {p['control_cycles']},"
                f" host {p['host_cycles']}"
            )
            lines.append(
                f"  memory: {p['memory_total_bytes']} bytes in all, busiest tile {p['memory_max_tile_bytes']} bytes"
                + (f"; {len(p['tiles_over_budget'])} tiles over budget" if p["tiles_over_budget"] else "")
                + (f"; {p['streaming_memory_bytes']} in streaming memory" if p.get("streaming_memory_bytes") else "")
            )
            for r in self.operations(name)[:SUMMARY_ROWS]:
                split = f"compute {r['compute_cycles']}, exchange {r['exchange_cycles']}"
                lines.append(f"  {r['cycles']:>10d} cycles ({split}) {r['label']}")
        if self.replication:
            lines += _replication_lines(self.replication)
        return "\n".join(lines)


def describe_origin(origin):
    """``module (role, aten op) at file:line``: a step's provenance in a line."""
    module = origin.get("module")
    what = ", ".join(x for x in (origin.get("role"), origin.get("aten") or origin.get("op")) if x)
    where = short_source(origin.get("source"))
    return f"{module or '(model)'} ({what})" + (f" at {where}" if where else "")


def short_source(source):
    """``file.py:12: code`` of the innermost frame of a node's source line, without the file's folders."""
    if not source:
        return None
    inner = source.split(" (from ", 1)[0]
    return os.path.basename(inner)


def operations(p):
    """The cycles and bytes of a program's profile ``p`` grouped by where they came from: one row per (module, role,
    ATen op, source line), costliest first, with compute and exchange cycles, exchange bytes, the bytes
    of the tensors it made, and its steps. A fused compute set, or an exchange phase that copies of several nodes
    share, counts as a step of each of them, its cycles and bytes split among them (see ``_credits``). Work no
    node owns (the copies of outputs and state updates, host streams) is grouped by step name."""
    rows = {}

    def row(origin, name):
        # Without a frontend op (a graph built on popir directly), the popir op tells rows apart.
        what = origin.get("aten") or origin.get("op")
        key = (origin.get("module"), origin.get("role"), what, origin.get("source")) if origin else (name,)
        if key not in rows:
            rows[key] = {
                "label": describe_origin(origin) if origin else name,
                **({k: origin.get(k) for k in ("module", "role", "aten", "source", "op")} if origin else {}),
                "cycles": 0,
                "compute_cycles": 0,
                "exchange_cycles": 0,
                "host_cycles": 0,
                "exchange_bytes": 0,
                "memory_bytes": 0,
                "steps": 0,
            }
        return rows[key]

    for step in p["steps"]:
        origins, weights = _credits(step)
        cycles, nbytes = _split(step["cycles"], weights), _split(step.get("bytes", 0), weights)
        for origin, share, shared_bytes in zip(origins, cycles, nbytes):
            r = row(origin, step["name"])
            r["cycles"] += share
            r[f"{step['kind']}_cycles"] += share
            r["exchange_bytes"] += shared_bytes
            r["steps"] += 1
    for tensor in p.get("tensors", ()):
        if "op" in tensor:
            row(tensor, tensor["name"])["memory_bytes"] += tensor["bytes"]
    return sorted(rows.values(), key=lambda r: (-r["cycles"], -r["memory_bytes"]))


def _credits(step):
    """The origins a step's cycles are credited to, and their weights: each node a fused compute set computes
    by the elements it makes, each node whose copies share an exchange phase by the bytes they receive."""
    for parts, weight in (("fused", "elements"), ("merged", "bytes")):
        if parts in step:
            origins = [{k: v for k, v in o.items() if k != weight} for o in step[parts]]
            return origins, [o[weight] for o in step[parts]]
    return [step.get("origin")], [1]


def _split(total, weights):
    """``total`` split in proportion to ``weights`` into integers that add up to ``total``."""
    reached = list(itertools.accumulate(weights))
    ends = [total * w // reached[-1] if reached[-1] else 0 for w in reached]
    ends[-1] = total
    return [b - a for a, b in zip([0, *ends], ends)]


def _replication_lines(r):
    reduce = r["all_reduce"]
    if reduce is None:
        return [f"{r['replicas']} replicas in parallel (inference, no collective): {r['step_cycles']} cycles per call"]
    lines = [
        f"{r['replicas']} replicas in parallel: {r['step_cycles']} cycles per step = {r['replica_step_cycles']} per"
        f" replica + all-reduce {reduce['cycles']} ({100 * r['all_reduce_share']:.1f}%) of {reduce['bytes']} bytes"
        f" + optimizer {r['optimizer_step_cycles']}"
    ]
    return lines + [
        f"  {level['name']}: {level['members']} members, {level['link_bytes']} bytes per link, {level['cycles']} cycles"
        for level in reduce["levels"]
    ]
