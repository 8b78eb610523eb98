"""Conway's Game of Life on a periodic (torus) board, every generation inside ONE kernel.

    python examples/life.py                       # 256 x 256, 500 generations

Each step also counts the live cells with lk.sum and records them in pop[t].
"""

import argparse
import sys

import numpy as np

import loopkern as lk


@lk.megakernel(swap=[("a", "b")])
def life(t, a, b, pop):
    n, m = a.shape[0], a.shape[1]
    alive = 0
    for i, j in lk.grid(n, m):
        up, down = (i + n - 1) % n, (i + 1) % n   # periodic neighbours
        left, right = (j + m - 1) % m, (j + 1) % m
        s = (a[up, left] + a[up, j] + a[up, right] + a[i, left] + a[i, right]
             + a[down, left] + a[down, j] + a[down, right])
        cell = 1 if s == 3 or (s == 2 and a[i, j] == 1) else 0
        b[i, j] = cell
        alive += cell
    total = lk.sum(alive)                          # grid-wide, int64, the same on every thread
    if lk.thread_id() == 0:
        pop[t] = total


def reference(board, steps):
    """The same rules in NumPy; returns (final board, population after each step)."""
    a = board.copy()
    pop = np.zeros(steps, np.int64)
    for t in range(steps):
        s = sum(np.roll(np.roll(a, di, 0), dj, 1)
                for di in (-1, 0, 1) for dj in (-1, 0, 1) if (di, dj) != (0, 0))
        a = ((s == 3) | ((s == 2) & (a == 1))).astype(np.int32)
        pop[t] = a.sum()
    return a, pop


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=256, help="board size n x n (default 256)")
    p.add_argument("--steps", type=int, default=500, help="generations (default 500)")
    p.add_argument("--backend", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--scope", choices=["auto", "grid", "block"], default="auto")
    args = p.parse_args(argv)

    rng = np.random.default_rng(2)
    board = (rng.random((args.n, args.n)) < 0.3).astype(np.int32)
    a, b = board.copy(), np.zeros_like(board)
    pop = np.zeros(args.steps, np.int64)

    run = life(a, b, pop, steps=args.steps, backend=args.backend, scope=args.scope)
    print(f"life: {args.n}x{args.n} steps={run.steps} backend={run.backend} scope={run.scope} "
          f"blocks={run.blocks} threads={run.threads}")
    print(f"  population: start {int(board.sum())}, after step 1 {pop[0]}, at the end {pop[-1]}")

    ref, ref_pop = reference(board, args.steps)
    if not (np.array_equal(a, ref) and np.array_equal(pop, ref_pop)):   # a holds the final board
        print(f"FAIL life: {int((a != ref).sum())} cells and "
              f"{int((pop != ref_pop).sum())} population counts differ from NumPy")
        return 1
    print(f"OK life: final board and all {args.steps} population counts equal NumPy's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
