"""Why fedpca does not calibrate with the continuous Gaussian's exact curve by default.

For each (epsilon, delta) and integer sensitivity Delta_int, take the *analytic*
(continuous) Gaussian's sigma (sigma_int = z * Delta_int) and compute the exact delta of
the one-dimensional *discrete* Gaussian mechanism with that sigma: sum over y of
max(0, p(y) - e^epsilon p(y - Delta_int)), p the normalised discrete Gaussian pmf, in
log space over +-40 sigma. A positive excess over the target delta means the continuous
calibration under-states the discrete mechanism's delta. Then the epsilons of one
release with z = 4 at delta = 1e-5 under the continuous PLD and the proven zCDP bound.

Usage: python benchmarks/discrete_gaussian_gap.py

The last line reads ``max_excess_at_256=<float> pld_epsilon=<float> zcdp_epsilon=<float>``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import logsumexp

from fedpca.dp.accounting import Accountant, compose_epsilon
from fedpca.dp.calibration import calibrate_noise_multiplier

CASES = [(0.1, 1e-6), (0.5, 1e-6), (1.0, 1e-5), (4.0, 1e-8), (10.0, 1e-10)]
SENSITIVITIES = [16, 256, 4096]


def discrete_delta(sigma: float, sensitivity: int, epsilon: float) -> float:
    span = math.ceil(40 * sigma) + sensitivity
    y = np.arange(-span, span + 1, dtype=np.float64)
    log_weights = -(y**2) / (2 * sigma**2)
    log_p = log_weights - logsumexp(log_weights)
    log_q = -((y - sensitivity) ** 2) / (2 * sigma**2) - logsumexp(log_weights)
    difference = np.exp(log_p) - np.exp(epsilon + log_q)
    return float(np.sum(difference[difference > 0]))


def main() -> None:
    print(
        f"{'epsilon':>8}{'delta':>10}" + "".join(f"{'Δ_int=' + str(s):>14}" for s in SENSITIVITIES)
    )
    worst_256 = 0.0
    for epsilon, delta in CASES:
        z = calibrate_noise_multiplier(epsilon, delta, "analytic")
        excesses = []
        for sensitivity in SENSITIVITIES:
            exact = discrete_delta(z * sensitivity, sensitivity, epsilon)
            excesses.append(exact / delta - 1.0)
            if sensitivity == 256:
                worst_256 = max(worst_256, excesses[-1])
        print(f"{epsilon:>8g}{delta:>10.0e}" + "".join(f"{e:>14.2e}" for e in excesses))
    print("(relative excess of the discrete delta over the target; negative = below target)")
    pld = compose_epsilon([4.0], 1e-5, Accountant.PLD_CONTINUOUS)
    zcdp = compose_epsilon([4.0], 1e-5, Accountant.ZCDP)
    print(
        f"one release with z = 4 at delta = 1e-5: continuous PLD epsilon {pld:.4f}, "
        f"proven zCDP epsilon {zcdp:.4f}"
    )
    print(f"max_excess_at_256={worst_256:.3e} pld_epsilon={pld:.4f} zcdp_epsilon={zcdp:.4f}")


if __name__ == "__main__":
    main()
