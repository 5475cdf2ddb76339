"""Gaussian noise on the fixed-point integer grid.

The proxy adds noise to *encrypted fixed-point integers* (real value x 2^frac_bits),
so the noise itself must be an integer. Rounding a floating-point Gaussian sample
is not safe: floating-point samplers leave the noiseless value recoverable from the
low-order bits of the output (Mironov 2012). We therefore sample an exact
**discrete Gaussian** N_Z(0, sigma^2), P[Y = y] proportional to exp(-y^2 / (2 sigma^2)),
with :mod:`fedpca.dp.discrete_gaussian`, which uses only integer arithmetic and the
operating system's cryptographic RNG.
docs/privacy.md states the privacy claim relied on and its conditions.

Every draw is checked against :func:`noise_headroom`, the public bound used to size
packed slots; a value beyond it raises :class:`~fedpca.errors.EncodingOverflowError`
instead of being allowed to carry into the neighbouring slot.
"""

from __future__ import annotations

import logging
import math
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from fedpca.codec.matrix import symmetric_from_upper_triangle, upper_triangle_length
from fedpca.dp.discrete_gaussian import MAX_NOISE_BOUND, sample_discrete_gaussian
from fedpca.errors import ConfigError, EncodingOverflowError

__all__ = [
    "FLOAT_MARGIN",
    "HEADROOM_SECURITY_BITS",
    "MAX_NOISE_BOUND",
    "DiscreteGaussianSampler",
    "NoiseSampler",
    "TestOnlySeededSampler",
    "mirror_upper_triangle",
    "noise_headroom",
    "refusal_delta",
    "symmetric_noise",
    "upper_triangle_length",
    "vector_noise",
]

logger = logging.getLogger(__name__)

IntArray = NDArray[np.int64]

FLOAT_MARGIN = 1.0 + 2.0**-50
"""Factor a bound computed in floats is raised by before rounding up, so that the
integer bound is at least the real one (float error is a few parts in 2^52)."""

HEADROOM_SECURITY_BITS = 100
"""k of :func:`noise_headroom`: a draw lies beyond a query's headroom with probability
below 2^-k per value, and is then refused (docs/privacy.md, "Headroom")."""


def refusal_delta(n_values: int) -> float:
    """The additive delta a release pays for refusing draws beyond its headroom:
    ``n_values`` 2^-k, k = :data:`HEADROOM_SECURITY_BITS`.

    Derivation (docs/privacy.md, "Headroom"): with the headroom B at least the tail
    bound plus the most one coordinate can move between neighbours, the proxy's
    refusal flag can differ between neighbours, for the same noisy output, only when a
    draw passes the tail bound: probability below 2^-k per noised value. Outside that
    event the release is a function of the exact mechanism's output.
    """
    if n_values < 0:
        raise ConfigError(f"n_values must be >= 0, got {n_values!r}")
    return n_values * 2.0**-HEADROOM_SECURITY_BITS


@runtime_checkable
class NoiseSampler(Protocol):
    """Source of i.i.d. integer Gaussian noise.

    Implementations return ``size`` independent draws of (a distribution equal to,
    or for tests approximating) the discrete Gaussian N_Z(0, sigma_int^2).
    """

    def sample(self, sigma_int: float, size: int) -> IntArray:
        """Draw ``size`` values with scale ``sigma_int`` (> 0, integer units)."""
        ...


class DiscreteGaussianSampler:
    """Production sampler: exact discrete Gaussian, OS randomness.

    Draws with :func:`fedpca.dp.discrete_gaussian.sample_discrete_gaussian` (Karney's
    algorithm with Canonne, Kamath & Steinke's coins, integer arithmetic only) from
    the operating system's CSPRNG; there is deliberately no seed.
    """

    parallel_safe = True
    """Calls from several threads at once are independent draws (OS randomness, no
    state kept between calls); numpy's array loops run without Python's GIL, so they
    partly draw in parallel. A sampler without this attribute (the seeded test
    sampler, whose output depends on the order of calls) is used from one thread."""

    def sample(self, sigma_int: float, size: int) -> IntArray:
        _check_sigma_int(sigma_int)
        return sample_discrete_gaussian(sigma_int, size)


class TestOnlySeededSampler:
    """TEST ONLY: reproducible, *insecure* approximation of the discrete Gaussian.

    Rounds numpy floating-point normal draws from a seeded generator. Both the seed
    and floating-point sampling (Mironov 2012) destroy the privacy guarantee: this
    class exists so that tests are deterministic and fast. Production code never
    constructs it; tests inject it where a :class:`NoiseSampler` is accepted.

    Parameters
    ----------
    seed : int
        Seed of the numpy generator.
    """

    # Keep pytest from trying to collect this class as a test case.
    __test__ = False

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def sample(self, sigma_int: float, size: int) -> IntArray:
        _check_sigma_int(sigma_int)
        if size < 0:
            raise ConfigError(f"noise size must be >= 0, got {size!r}")
        return np.rint(self._rng.normal(0.0, sigma_int, size)).astype(np.int64)


def _check_sigma_int(sigma_int: float) -> None:
    if not (math.isfinite(sigma_int) and sigma_int > 0):
        raise ConfigError(f"sigma_int must be finite and > 0, got {sigma_int!r}")


def noise_headroom(
    sigma_int: float, *, security_bits: int = HEADROOM_SECURITY_BITS, n_values: int = 1
) -> int:
    """Integer B with P(|Z| > B) < 2^-security_bits for each of ``n_values`` draws jointly.

    Derivation. The continuous Gaussian X ~ N(0, s^2) has the Chernoff tail
    P(|X| > t) <= 2 exp(-t^2 / (2 s^2)). The discrete Gaussian N_Z(0, s^2) is
    subgaussian with the same parameter (Canonne, Kamath & Steinke 2020:
    E[exp(lambda Y)] <= exp(lambda^2 s^2 / 2)), so the same bound holds for it.
    Requiring n * 2 exp(-t^2 / (2 s^2)) <= 2^-k (a union bound over n draws) gives
    t = s * sqrt(2 ln(n * 2^(k+1))). t is computed in floats and multiplied by
    :data:`FLOAT_MARGIN` before rounding up, which covers the float error (a few ulps)
    at any scale; rounding a continuous draw (the test-only sampler) moves it by at
    most 1/2, which the + 1 absorbs, so B = ceil(t') + 1 holds for every sampler in
    this module with a strict inequality.

    Parameters
    ----------
    sigma_int : float
        Noise scale in integer (fixed-point) units; ``0`` means no noise and gives 0.
    security_bits : int
        k: the failure probability is below ``2**-k``.
    n_values : int
        Number of draws the bound must cover at once (1 = per value).

    Returns
    -------
    int
        The bound B, also the headroom packed slots must reserve for noise.
    """
    if not (math.isfinite(sigma_int) and sigma_int >= 0):
        raise ConfigError(f"sigma_int must be finite and >= 0, got {sigma_int!r}")
    if security_bits < 1:
        raise ConfigError(f"security_bits must be >= 1, got {security_bits!r}")
    if n_values < 1:
        raise ConfigError(f"n_values must be >= 1, got {n_values!r}")
    if sigma_int == 0:
        return 0
    log_inverse_failure = math.log(n_values) + (security_bits + 1) * math.log(2.0)
    # The float product is within a few ulps (2^-52 relative) of t; raised by 2^-50 of
    # itself before rounding up, it is at least t whatever sigma's size.
    return math.ceil(sigma_int * math.sqrt(2.0 * log_inverse_failure) * FLOAT_MARGIN) + 1


def vector_noise(
    size: int,
    sigma_int: float,
    *,
    sampler: NoiseSampler | None = None,
    bound: int | None = None,
) -> IntArray:
    """``size`` i.i.d. integer Gaussian noise values of scale ``sigma_int``.

    Parameters
    ----------
    size : int
        Number of values.
    sigma_int : float
        Scale in fixed-point integer units (sigma x 2^frac_bits). ``0`` returns zeros:
        the NOT PRIVATE verification mode (epsilon = inf).
    sampler : NoiseSampler, optional
        Defaults to the production :class:`DiscreteGaussianSampler`.
    bound : int, optional
        Largest |value| allowed; defaults to ``noise_headroom(sigma_int)``. Must equal
        the headroom the packed slots were sized with.

    Returns
    -------
    ndarray of int64, shape (size,)

    Raises
    ------
    EncodingOverflowError
        If a draw exceeds ``bound`` (never wrapped or clipped), or the bound is too
        large for 64-bit sampling.
    """
    if size < 0:
        raise ConfigError(f"noise size must be >= 0, got {size!r}")
    if not (math.isfinite(sigma_int) and sigma_int >= 0):
        raise ConfigError(f"sigma_int must be finite and >= 0, got {sigma_int!r}")
    if sigma_int == 0:
        logger.warning("sigma_int = 0: adding no noise, the release is NOT PRIVATE")
        return np.zeros(size, dtype=np.int64)
    limit = noise_headroom(sigma_int) if bound is None else bound
    if limit > MAX_NOISE_BOUND:
        raise EncodingOverflowError(
            f"noise bound {limit} for sigma_int={sigma_int!r} exceeds 2^62, the range the "
            "64-bit sampler supports; use fewer frac_bits"
        )
    if limit < 0:
        raise ConfigError(f"noise bound must be >= 0, got {limit!r}")
    chosen = DiscreteGaussianSampler() if sampler is None else sampler
    noise = np.asarray(chosen.sample(sigma_int, size), dtype=np.int64)
    if noise.shape != (size,):
        raise ConfigError(f"sampler returned shape {noise.shape}, expected ({size},)")
    if size:
        worst = int(np.max(np.abs(noise)))
        if worst > limit:
            index = int(np.argmax(np.abs(noise)))
            raise EncodingOverflowError(
                f"noise draw {int(noise[index])} at index {index} exceeds the slot headroom "
                f"{limit} (sigma_int={sigma_int!r}); refusing rather than wrapping"
            )
    return noise


def symmetric_noise(
    dim: int,
    sigma_int: float,
    *,
    sampler: NoiseSampler | None = None,
    bound: int | None = None,
) -> IntArray:
    """Noise for a symmetric ``dim x dim`` matrix, as its upper triangle.

    The entries i <= j (diagonal included) are i.i.d. with scale ``sigma_int``; the
    lower triangle is their mirror image (Wang & Chang's E). Returned in row-major
    order of the upper triangle (:func:`fedpca.codec.matrix.upper_triangle`, the
    order of ``numpy.triu_indices(dim)``), the order the scatter is released in.

    Parameters and errors as in :func:`vector_noise`.

    Returns
    -------
    ndarray of int64, shape (dim (dim + 1) / 2,)
    """
    return vector_noise(upper_triangle_length(dim), sigma_int, sampler=sampler, bound=bound)


def mirror_upper_triangle(upper: NDArray[np.generic], dim: int) -> NDArray[np.generic]:
    """Full symmetric ``dim x dim`` matrix from its row-major upper triangle (i <= j).

    Delegates to :func:`fedpca.codec.matrix.symmetric_from_upper_triangle`, the one
    definition of the released layout.

    Raises
    ------
    ConfigError
        If ``upper`` does not have ``dim (dim + 1) / 2`` entries.
    """
    values = np.asarray(upper)
    expected = upper_triangle_length(dim)
    if values.shape != (expected,):
        raise ConfigError(
            f"upper triangle of a {dim}x{dim} matrix needs shape ({expected},), got {values.shape}"
        )
    return symmetric_from_upper_triangle(values, dim)
