"""Differential privacy for fedpca: mechanisms as data, calibration, noise, accounting.

* :mod:`~fedpca.dp.mechanisms` - :class:`PrivacyParams`, :class:`GaussianMechanism`,
  :class:`PrivacyEvent` (the release record ledgers store).
* :mod:`~fedpca.dp.calibration` - classic and analytic (Balle & Wang) Gaussian calibration.
* :mod:`~fedpca.dp.noise` - exact discrete Gaussian noise on the fixed-point integer grid.
* :mod:`~fedpca.dp.allocation` - splitting one release's noise across its sections.
* :mod:`~fedpca.dp.accounting` - PLD/RDP composition against a total budget.
* :mod:`~fedpca.dp.next_query` - the largest epsilon one more query is admitted with.

The rationale and proofs are in docs/privacy.md. :mod:`~fedpca.dp.accounting` and
:mod:`~fedpca.dp.next_query` are not imported here because dp_accounting is slow to
import; import them where budgets are checked.
"""

from __future__ import annotations

from fedpca.dp.allocation import allocate_noise, effective_noise_multiplier, normalise_weights
from fedpca.dp.calibration import (
    analytic_gaussian_delta,
    analytic_gaussian_sigma,
    calibrate_noise_multiplier,
    calibrate_sigma,
    classic_gaussian_sigma,
    gaussian_epsilon,
)
from fedpca.dp.mechanisms import GaussianMechanism, PrivacyEvent, PrivacyParams
from fedpca.dp.noise import (
    DiscreteGaussianSampler,
    NoiseSampler,
    mirror_upper_triangle,
    noise_headroom,
    symmetric_noise,
    upper_triangle_length,
    vector_noise,
)

__all__ = [
    "DiscreteGaussianSampler",
    "GaussianMechanism",
    "NoiseSampler",
    "PrivacyEvent",
    "PrivacyParams",
    "allocate_noise",
    "analytic_gaussian_delta",
    "analytic_gaussian_sigma",
    "calibrate_noise_multiplier",
    "calibrate_sigma",
    "classic_gaussian_sigma",
    "effective_noise_multiplier",
    "gaussian_epsilon",
    "mirror_upper_triangle",
    "noise_headroom",
    "normalise_weights",
    "symmetric_noise",
    "upper_triangle_length",
    "vector_noise",
]
