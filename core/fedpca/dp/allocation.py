"""Splitting one Gaussian release's noise across the sections of a released vector.

A release is the concatenation of sections (scatter upper triangle, sum, count,
per-class sums, ...). Section j has its own L2 sensitivity Delta_j (the largest
change one record can make to that section alone) and receives Gaussian noise of
its own scale sigma_j. With budget weights omega_j > 0, sum omega_j = 1, the choice

    sigma_j = Delta_j * z / sqrt(omega_j)

makes the whole release a Gaussian mechanism with noise multiplier exactly z.

Proof. Divide section j of both the query and its noise by sigma_j. This is an
invertible, data-independent linear map, so it changes no privacy guarantee, and it
turns the release into q'(D) + N(0, I) with q'_j = q_j / sigma_j. For neighbouring
D, D' each section moves by at most Delta_j, hence

    ||q'(D) - q'(D')||_2^2 <= sum_j (Delta_j / sigma_j)^2 = sum_j omega_j / z^2 = 1 / z^2,

i.e. an isotropic Gaussian mechanism with unit noise and L2 sensitivity 1/z:
noise multiplier z. (Sections with Delta_j = 0 carry no private information and
get sigma_j = 0; they may have weight 0.) A larger weight buys a section less
noise: omega_j is the share of the squared privacy loss spent on section j.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fedpca.errors import ConfigError

__all__ = ["allocate_noise", "effective_noise_multiplier", "normalise_weights"]


def normalise_weights(weights: Sequence[float]) -> tuple[float, ...]:
    """Weights divided by their sum.

    Raises
    ------
    ConfigError
        If a weight is negative or not finite, or they sum to 0.
    """
    for j, w in enumerate(weights):
        if not (math.isfinite(w) and w >= 0):
            raise ConfigError(f"noise weight {j} must be finite and >= 0, got {w!r}")
    total = math.fsum(weights)
    if not total > 0:
        raise ConfigError(f"noise weights must have a positive sum, got {list(weights)!r}")
    return tuple(w / total for w in weights)


def allocate_noise(
    sensitivities: Sequence[float], weights: Sequence[float], noise_multiplier: float
) -> tuple[float, ...]:
    """Per-section sigma_j = Delta_j z / sqrt(omega_j) for an overall noise multiplier z.

    Parameters
    ----------
    sensitivities : sequence of float
        Delta_j >= 0 of each section, in the units the noise will be added in.
    weights : sequence of float
        Budget weights omega_j >= 0, same length; normalised to sum 1 here. A weight
        may be 0 only for a section with Delta_j = 0.
    noise_multiplier : float
        Target z > 0 of the whole release (``0`` gives all-zero sigmas: the NOT
        PRIVATE verification mode).

    Returns
    -------
    tuple of float
        sigma_j per section; ``sum((Delta_j / sigma_j)**2) == 1 / z**2`` over the
        sections with Delta_j > 0.

    Raises
    ------
    ConfigError
        On length mismatch, negative values, or a zero weight on a sensitive section.
    """
    if len(sensitivities) != len(weights):
        raise ConfigError(
            f"{len(sensitivities)} sensitivities but {len(weights)} noise weights: one per section"
        )
    if not sensitivities:
        raise ConfigError("a release needs at least one section")
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ConfigError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}")
    omegas = normalise_weights(weights)
    sigmas = []
    for j, (delta_j, omega_j) in enumerate(zip(sensitivities, omegas, strict=True)):
        if not (math.isfinite(delta_j) and delta_j >= 0):
            raise ConfigError(
                f"sensitivity of section {j} must be finite and >= 0, got {delta_j!r}"
            )
        if delta_j == 0:
            sigmas.append(0.0)
        elif omega_j == 0:
            raise ConfigError(
                f"section {j} has sensitivity {delta_j!r} but noise weight 0: it would need "
                "infinite noise"
            )
        else:
            sigmas.append(delta_j * noise_multiplier / math.sqrt(omega_j))
    return tuple(sigmas)


def effective_noise_multiplier(sensitivities: Sequence[float], sigmas: Sequence[float]) -> float:
    """Noise multiplier of a release with per-section noise: ``(sum (Delta_j/sigma_j)^2)^-1/2``.

    See the module docstring for why this single number accounts for the release.
    Returns ``inf`` if no section is sensitive and ``0`` if a sensitive section gets
    no noise.
    """
    if len(sensitivities) != len(sigmas):
        raise ConfigError(f"{len(sensitivities)} sensitivities but {len(sigmas)} sigmas")
    total = 0.0
    for j, (delta_j, sigma_j) in enumerate(zip(sensitivities, sigmas, strict=True)):
        if not (math.isfinite(delta_j) and delta_j >= 0):
            raise ConfigError(
                f"sensitivity of section {j} must be finite and >= 0, got {delta_j!r}"
            )
        if not (math.isfinite(sigma_j) and sigma_j >= 0):
            raise ConfigError(f"sigma of section {j} must be finite and >= 0, got {sigma_j!r}")
        if delta_j == 0:
            continue
        if sigma_j == 0:
            return 0.0
        total += (delta_j / sigma_j) ** 2
    return math.inf if total == 0 else 1.0 / math.sqrt(total)
