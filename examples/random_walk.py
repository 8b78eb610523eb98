"""Diffusion of many random walkers, one megakernel for every step, checked against theory.

    python examples/random_walk.py [--walkers 100000] [--steps 1000] [--seed 7]

Each walker takes a Gaussian step of size sigma per time step, drawn with lk.random.normal
(counter-based: the same numbers on the CPU and the GPU, for any launch shape). After T steps
the positions are normal with mean 0 and variance T * sigma**2; the script checks the sample
mean, variance and kurtosis against that, and that a second run with the same seed is
identical.
"""

import argparse
import time

import numpy as np

import loopkern as lk


@lk.megakernel
def walk(t, x, sigma):
    for i in lk.range(x.shape[0]):
        x[i] += sigma * lk.random.normal(i)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--walkers", type=int, default=100_000)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--sigma", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--backend", default="auto")
    args = p.parse_args()

    x = np.zeros(args.walkers)
    t0 = time.perf_counter()
    run = walk(x, args.sigma, steps=args.steps, seed=args.seed, backend=args.backend)
    elapsed = time.perf_counter() - t0
    var = args.steps * args.sigma ** 2
    n = args.walkers
    mean_err = abs(x.mean()) / np.sqrt(var / n)               # in standard errors
    var_err = abs(x.var() / var - 1) / np.sqrt(2 / n)
    kurt = np.mean(x ** 4) / x.var() ** 2
    print(f"{n} walkers, {run.steps} steps on {run.backend} ({run.scope}, {run.blocks}x{run.threads}), "
          f"{elapsed:.3f} s including compile")
    print(f"  mean {x.mean():+.5f} (theory 0, {mean_err:.1f} standard errors)")
    print(f"  variance {x.var():.5f} (theory {var:.5f}, {var_err:.1f} standard errors)")
    print(f"  kurtosis {kurt:.3f} (theory 3)")
    again = np.zeros(args.walkers)
    walk(again, args.sigma, steps=args.steps, seed=args.seed, backend=args.backend)
    assert mean_err < 5 and var_err < 5 and abs(kurt - 3) < 0.1, "statistics off"
    assert np.array_equal(x, again), "the same seed gave different walks"
    print("OK random_walk: statistics match diffusion theory; the same seed reproduces the run exactly")


if __name__ == "__main__":
    main()
