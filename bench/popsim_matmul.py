"""How close a large fp16 matmul (fp32 partials) gets to the AMP peak of a simulated Mk2 IPU.

For each size it prints the planner's chosen split and its estimate, the compiled program's compute /
exchange / sync cycles, and a lower bound: the fewest cycles any (M, N, K) block split could take under
the target's figures with every overhead removed. That bound assumes no padding, operands already laid
out so each tile holds its share of its own blocks (1/gn of its LHS block, 1/gm of its RHS block),
K-partials reduced on the tiles that hold them (a reduce-scatter) at the fp32 vector rate, one sync per
BSP phase, and no vertex or exchange setup cost. Efficiency = ideal AMP cycles / cycles.
Run: python bench/popsim_matmul.py [--compile 1024 ...]
"""

import argparse
import time

import popir
import popsim
from popir import DType
from popsim.matmul_plan import plan_matmul


def bound(target, size):
    """(cycles, gm, gn, gk): the zero-overhead BSP lower bound over block splits for size^3 in fp16."""
    tiles = target.num_tiles
    rate = target.exchange_bytes_per_cycle
    best = None
    for gk in range(1, 65):
        for gm in range(1, tiles // gk + 1):
            for gn in range(1, tiles // (gk * gm) + 1):
                mb, nb, kb = size / gm, size / gn, size / gk
                compute = mb * nb * kb / target.amp_macs_fp16
                operands = 2 * kb * (mb * (1 - 1 / gn) + nb * (1 - 1 / gm))
                reduced = mb * nb * (gk - 1) / gk
                cycles = compute + operands / rate + 4 * reduced / rate + reduced / target.vector_width_fp32
                cycles += (4 if gk > 1 else 2) * target.sync_cycles
                if best is None or cycles < best[0]:
                    best = (cycles, gm, gn, gk)
    return best


def compiled(target, size):
    """(compile seconds, profile of the program) for a size^3 fp16 matmul graph."""
    g = popir.Graph("mm")
    a = g.add_input("a", (size, size), "float16")
    b = g.add_input("b", (size, size), "float16")
    g.output("c", a @ b)
    start = time.perf_counter()
    exe = popsim.compile(g, target)
    return time.perf_counter() - start, exe.profile.programs["mm"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--compile", type=int, nargs="*", default=[1024], help="sizes to compile and cost")
    args = parser.parse_args()
    target = popsim.Target.ipu2()
    for size in args.sizes:
        ideal = size**3 / (target.amp_macs_fp16 * target.num_tiles)
        plan = plan_matmul(target, 1, size, size, size, DType.float16)
        low, gm, gn, gk = bound(target, size)
        print(f"{size}^3 fp16, ideal AMP cycles {ideal:,.0f}")
        print(
            f"  planner  split {plan.gm}x{plan.gn}x{plan.gk} blocks {plan.mb}x{plan.nb}x{plan.kb}: "
            f"{plan.cycles:,} cycles, {ideal / plan.cycles:.1%} of peak"
        )
        if size in args.compile:
            seconds, prof = compiled(target, size)
            device = prof["compute_cycles"] + prof["exchange_cycles"] + prof["sync_cycles"]
            print(
                f"  compiled {device:,} cycles (compute {prof['compute_cycles']:,}, exchange "
                f"{prof['exchange_cycles']:,}, sync {prof['sync_cycles']:,}), {ideal / device:.1%} of peak; "
                f"compile {seconds:.1f} s"
            )
        print(f"  bound    split {gm}x{gn}x{gk}: {low:,.0f} cycles, {ideal / low:.1%} of peak")


if __name__ == "__main__":
    main()
