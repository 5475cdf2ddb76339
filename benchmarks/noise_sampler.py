"""Cost of one exact discrete Gaussian draw (the proxy's noise), across noise scales.

The proxy draws its noise with OpenDP's exact sampler
(:class:`fedpca.dp.noise.DiscreteGaussianSampler`). This measures the CPU time per drawn
value at scales sigma_int from 10 to 10^15 (in integer units; the madelon round of
benchmarks/end_to_end.py uses about 4 x 10^10), in one process, after loading OpenDP.
It shows whether the noise step of benchmarks/end_to_end.py could be made cheaper by
choosing the scale or the fixed-point resolution: if the cost per value does not depend
on sigma, it cannot.

Usage: python benchmarks/noise_sampler.py [--values 20000]

Beside the cost it prints each scale's sample standard deviation over sigma_int (about 1
for a discrete Gaussian at these scales), so that a sampler which ignored its scale shows.

The last line reads ``us_per_value_min=<float> us_per_value_max=<float>
max_over_min=<float> sd_over_sigma_min=<float> sd_over_sigma_max=<float>``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from fedpca.dp.noise import DiscreteGaussianSampler

SCALES = (10.0, 1e3, 1e6, 1e9, 1e12, 1e15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=20_000, help="draws per scale")
    args = parser.parse_args()
    sampler = DiscreteGaussianSampler()
    sampler.load()
    costs = []
    spreads = []
    print(f"{args.values} draws per scale, one process, CPU time (time.process_time)")
    for sigma in SCALES:
        started = time.process_time()
        draws = sampler.sample(sigma, args.values)
        per_value = (time.process_time() - started) / args.values * 1e6
        costs.append(per_value)
        # float64 holds these draws to 53 bits, far finer than the spread being checked.
        spread = float(np.std(draws.astype(np.float64))) / sigma
        spreads.append(spread)
        print(f"  sigma_int = {sigma:8.0e}   {per_value:7.2f} µs per value   sd/sigma {spread:.3f}")
    low, high = min(costs), max(costs)
    print(
        f"us_per_value_min={low:.3f} us_per_value_max={high:.3f} max_over_min={high / low:.3f} "
        f"sd_over_sigma_min={min(spreads):.3f} sd_over_sigma_max={max(spreads):.3f}"
    )


if __name__ == "__main__":
    main()
