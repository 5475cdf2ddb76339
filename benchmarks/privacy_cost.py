"""The noise cost of the privacy fixes: proven calibration and capped-owner sensitivity.

Two changes made every release sound and cost noise at equal (epsilon, delta):

* calibration: the noise multiplier z now comes from the discrete Gaussian's zCDP
  bound (proven for the sampler fedpca runs) instead of the continuous Gaussian's
  analytic curve (fedpca 0.1's default);
* sensitivity: an owner at its public record cap contributes a uniform sample, so one
  added record can displace another (of its class: DCA caps each class); the noise
  covers that swap (sqrt(4.5) = 2.121 at clip norm 1, PCA and DCA) instead of the
  add/remove-only sqrt(3) = 1.732 of fedpca 0.1.

The script prints, for a grid of (epsilon, delta), both noise multipliers and the ratio
of the noise standard deviation now to before for PCA and DCA (equal section weights,
clip norm 1). The captured-variance cost on real data is printed by
benchmarks/mode_utility.py.

Usage: python benchmarks/privacy_cost.py

The last line reads ``pca_sigma_ratio_min=… pca_sigma_ratio_max=… dca_sigma_ratio_max=…``.
"""

from __future__ import annotations

import math

from fedpca.dp.calibration import analytic_gaussian_sigma, zcdp_noise_multiplier
from fedpca.query import Neighbouring, QueryKind
from fedpca.stats import StatisticsSpec

CASES = [(0.1, 1e-6), (0.3, 1e-5), (0.5, 1e-5), (1.0, 1e-5), (3.0, 1e-5), (10.0, 1e-10)]
ADD_REMOVE_ONLY = math.sqrt(3.0)  # fedpca 0.1: sqrt(c^4 + c^2 + 1) at c = 1


def main() -> None:
    pca = StatisticsSpec(QueryKind.PCA, 2).l2_sensitivity_under(Neighbouring.ADD_REMOVE)
    dca = StatisticsSpec(QueryKind.DCA, 2, class_labels=(0.0, 1.0)).l2_sensitivity_under(
        Neighbouring.ADD_REMOVE
    )
    print(f"sensitivity at clip norm 1: before {ADD_REMOVE_ONLY:.4f}, PCA {pca:.4f}, DCA {dca:.4f}")
    header = f"{'epsilon':>8}{'delta':>9}{'z analytic':>12}{'z zcdp':>9}{'z ratio':>9}"
    header += f"{'PCA sigma':>11}{'DCA sigma':>11}"
    print(header)
    pca_ratios, dca_ratios = [], []
    for epsilon, delta in CASES:
        before = analytic_gaussian_sigma(epsilon, delta)
        now = zcdp_noise_multiplier(epsilon, delta)
        pca_ratio = now * pca / (before * ADD_REMOVE_ONLY)
        dca_ratio = now * dca / (before * ADD_REMOVE_ONLY)
        pca_ratios.append(pca_ratio)
        dca_ratios.append(dca_ratio)
        print(
            f"{epsilon:>8g}{delta:>9.0e}{before:>12.4f}{now:>9.4f}{now / before:>9.4f}"
            f"{pca_ratio:>11.4f}{dca_ratio:>11.4f}"
        )
    print("(sigma columns: noise standard deviation now / fedpca 0.1, same epsilon and delta)")
    print(
        f"pca_sigma_ratio_min={min(pca_ratios):.4f} pca_sigma_ratio_max={max(pca_ratios):.4f} "
        f"dca_sigma_ratio_max={max(dca_ratios):.4f}"
    )


if __name__ == "__main__":
    main()
