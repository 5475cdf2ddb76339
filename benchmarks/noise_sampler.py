"""Cost of one exact discrete Gaussian draw (the proxy's noise), across noise scales.

The proxy draws its noise with OpenDP's exact sampler
(:class:`fedpca.dp.noise.DiscreteGaussianSampler`). This measures the CPU time per drawn
value at scales sigma_int from 10 to 10^15 (in integer units; the madelon round of
benchmarks/end_to_end.py uses about 4 x 10^10), in one process, after loading OpenDP.
It shows whether the noise step of benchmarks/end_to_end.py could be made cheaper by
choosing the scale or the fixed-point resolution: if the cost per value does not depend
on sigma, it cannot.

Usage: python benchmarks/noise_sampler.py [--values 20000]

The last line reads ``us_per_value_min=<float> us_per_value_max=<float>
max_over_min=<float>``.
"""

from __future__ import annotations

import argparse
import time

from fedpca.dp.noise import DiscreteGaussianSampler

SCALES = (10.0, 1e3, 1e6, 1e9, 1e12, 1e15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=20_000, help="draws per scale")
    args = parser.parse_args()
    sampler = DiscreteGaussianSampler()
    sampler.load()
    costs = []
    print(f"{args.values} draws per scale, one process, CPU time (time.process_time)")
    for sigma in SCALES:
        started = time.process_time()
        sampler.sample(sigma, args.values)
        per_value = (time.process_time() - started) / args.values * 1e6
        costs.append(per_value)
        print(f"  sigma_int = {sigma:8.0e}   {per_value:7.2f} µs per value")
    low, high = min(costs), max(costs)
    print(f"us_per_value_min={low:.3f} us_per_value_max={high:.3f} max_over_min={high / low:.3f}")


if __name__ == "__main__":
    main()
