"""Cost of one exact discrete Gaussian draw (the proxy's noise): fedpca's sampler
against OpenDP's, across noise scales.

The proxy draws its noise with :func:`fedpca.dp.discrete_gaussian.sample_discrete_gaussian`
(:class:`fedpca.dp.noise.DiscreteGaussianSampler`), written because OpenDP's exact
sampler (``make_gaussian`` on i64, which the proxy used before) costs several
microseconds a value. This measures the CPU time per drawn value of both, in one process,
at scales sigma_int from 10 to 10^15 (in integer units; the madelon round of
benchmarks/end_to_end.py uses about 4 x 10^10), each sampler asked for the same number of
values in pieces of 4,096 (the proxy's piece, ``NOISE_PIECE_VALUES``), the two
alternating scale by scale so that the machine's load falls on both alike.

Usage: python benchmarks/noise_sampler.py [--values 65536]

Beside the cost it prints each sample's standard deviation over sigma_int (about 1 for a
discrete Gaussian at these scales), so that a sampler which ignored its scale shows.
docs/privacy.md has the proof that fedpca's draws are exact; the tests compare them with
the exact probabilities.

The last line reads ``us_per_value_min=… us_per_value_max=… opendp_us_per_value_min=…
opendp_us_per_value_max=… speedup_min=… speedup_max=… sd_over_sigma_min=…
sd_over_sigma_max=…`` (the us and sd figures are fedpca's; speedup is OpenDP's time
over fedpca's at the same scale).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from fedpca.dp.noise import DiscreteGaussianSampler
from fedpca.proxy.prepared_noise import NOISE_PIECE_VALUES

SCALES = (10.0, 1e3, 1e6, 1e9, 4e10, 1e12, 1e15)

Draw = Callable[[float, int], NDArray[np.int64]]


def opendp_draw() -> Draw:
    """OpenDP's exact discrete Gaussian on an i64 vector (what the proxy used to call)."""
    import opendp.prelude as dp

    dp.enable_features("contrib")

    def draw(sigma: float, size: int) -> NDArray[np.int64]:
        measurement = dp.m.make_gaussian(
            dp.vector_domain(dp.atom_domain(T="i64"), size=size),
            dp.l2_distance(T="i64"),
            scale=sigma,
        )
        return np.asarray(measurement(np.zeros(size, dtype=np.int64)), dtype=np.int64)

    draw(1.0, 1)  # load the native library outside the timings
    return draw


def cost(draw: Draw, sigma: float, values: int) -> tuple[float, NDArray[np.int64]]:
    """CPU µs per value of drawing ``values`` values in the proxy's pieces."""
    pieces = []
    started = time.process_time()
    for start in range(0, values, NOISE_PIECE_VALUES):
        pieces.append(draw(sigma, min(NOISE_PIECE_VALUES, values - start)))
    per_value = (time.process_time() - started) / values * 1e6
    return per_value, np.concatenate(pieces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=65_536, help="draws per scale and sampler")
    args = parser.parse_args()
    ours = DiscreteGaussianSampler().sample
    theirs = opendp_draw()
    costs, opendp_costs, spreads = [], [], []
    print(f"{args.values} draws per scale and sampler, one process, CPU time")
    print("  sigma_int    fedpca µs/value   OpenDP µs/value   OpenDP/fedpca   sd/sigma")
    for sigma in SCALES:
        per_value, draws = cost(ours, sigma, args.values)
        opendp_per_value, _ = cost(theirs, sigma, args.values)
        # float64 holds these draws to 53 bits, far finer than the spread being checked.
        spread = float(np.std(draws.astype(np.float64))) / sigma
        costs.append(per_value)
        opendp_costs.append(opendp_per_value)
        spreads.append(spread)
        print(
            f"  {sigma:9.0e}   {per_value:15.2f}   {opendp_per_value:15.2f}   "
            f"{opendp_per_value / per_value:13.1f}   {spread:8.3f}"
        )
    speedups = [
        theirs_cost / ours_cost for theirs_cost, ours_cost in zip(opendp_costs, costs, strict=True)
    ]
    print(
        f"us_per_value_min={min(costs):.3f} us_per_value_max={max(costs):.3f} "
        f"opendp_us_per_value_min={min(opendp_costs):.3f} "
        f"opendp_us_per_value_max={max(opendp_costs):.3f} "
        f"speedup_min={min(speedups):.2f} speedup_max={max(speedups):.2f} "
        f"sd_over_sigma_min={min(spreads):.3f} sd_over_sigma_max={max(spreads):.3f}"
    )


if __name__ == "__main__":
    main()
