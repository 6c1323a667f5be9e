"""Profile: simulated cycles per program and step, split by phase kind, per tile, and memory per tile."""

import json

import numpy as np


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
        self, name, steps, totals, host_cycles, memory, tile_compute, tile_exchange, flops, budget, relaxed
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
            "flops": int(flops),
            "steps": steps,
            "tile_compute_cycles": tile_compute.tolist(),
            "tile_exchange_bytes": tile_exchange.tolist(),
            "memory": memory,
            "memory_total_bytes": int(used.sum()),
            "memory_max_tile_bytes": int(used.max()),
            "tiles_over_budget": [t for t, u in enumerate(used.tolist()) if u > self.target.tile_bytes],
            "relax_memory": bool(relaxed),
        }

    def add_replication(self, replicas, replica_step, all_reduce, optimizer_step):
        """A training step of ``replicas`` replicas running in parallel: each replica's cycles
        (``replica_step``), the gradient ``all_reduce`` (a ``collectives.AllReduce``) and the cycles of the
        ``optimizer_step`` that follows it."""
        total = replica_step + all_reduce.cycles + optimizer_step
        self.replication = {
            "replicas": replicas,
            "replica_step_cycles": int(replica_step),
            "all_reduce": all_reduce.to_dict(),
            "optimizer_step_cycles": int(optimizer_step),
            "step_cycles": int(total),
            "all_reduce_share": all_reduce.cycles / total if total else 0.0,
        }

    def to_json(self, path=None):
        """The profile as JSON text; also written to ``path`` when given."""
        text = json.dumps(
            {
                "target": self.target.name,
                "clock_hz": self.target.clock_hz,
                "programs": self.programs,
                "replication": self.replication,
            }
        )
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def summary(self):
        """A short human-readable report."""
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
            )
            top = sorted(p["steps"], key=lambda s: -s["cycles"])[:5]
            lines += [f"  {s['kind']:8s} {s['name']:20s} {s['cycles']:>10d} cycles" for s in top]
        if self.replication:
            lines += _replication_lines(self.replication)
        return "\n".join(lines)


def _replication_lines(r):
    reduce = r["all_reduce"]
    lines = [
        f"{r['replicas']} replicas in parallel: {r['step_cycles']} cycles per step = {r['replica_step_cycles']} per"
        f" replica + all-reduce {reduce['cycles']} ({100 * r['all_reduce_share']:.1f}%) of {reduce['bytes']} bytes"
        f" + optimizer {r['optimizer_step_cycles']}"
    ]
    return lines + [
        f"  {level['name']}: {level['members']} members, {level['link_bytes']} bytes per link, {level['cycles']} cycles"
        for level in reduce["levels"]
    ]
