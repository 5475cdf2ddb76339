"""Integer Gaussian noise: variance, symmetry, headroom and refusal to overflow.

Statistical tolerances: for n i.i.d. Gaussian draws the sample variance s^2 has
relative standard error sqrt(2/(n-1)). Tests accept |s^2/sigma^2 - 1| < 5 standard
errors (false-alarm probability about 6e-7) and, to show they can fail, also check
that sigma off by 3 % would be rejected.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from numpy.typing import NDArray
from scipy.special import logsumexp
from scipy.stats import norm

from fedpca.codec.matrix import upper_triangle
from fedpca.dp.noise import (
    DiscreteGaussianSampler,
    NoiseSampler,
    TestOnlySeededSampler,
    mirror_upper_triangle,
    noise_headroom,
    symmetric_noise,
    upper_triangle_length,
    vector_noise,
)
from fedpca.errors import ConfigError, EncodingOverflowError
from helpers import record_exact_draws


def variance_tolerance(n: int, standard_errors: float = 5.0) -> float:
    return standard_errors * math.sqrt(2.0 / (n - 1))


def assert_variance_matches(noise: NDArray[np.int64], sigma: float) -> None:
    n = noise.size
    tolerance = variance_tolerance(n)
    sample = np.asarray(noise, dtype=np.float64)
    ratio = float(np.var(sample, ddof=1)) / sigma**2
    assert abs(ratio - 1.0) < tolerance, f"variance ratio {ratio}, tolerance {tolerance}"
    # Power: a sampler whose sigma were 3 % off would fail the same check.
    assert abs(ratio / 1.03**2 - 1.0) > tolerance
    assert abs(ratio / 0.97**2 - 1.0) > tolerance
    # Mean zero within 5 standard errors sigma / sqrt(n).
    assert abs(float(np.mean(sample))) < 5.0 * sigma / math.sqrt(n)


def test_production_discrete_gaussian_has_the_requested_variance() -> None:
    # The production sampler draws from the OS CSPRNG; 40 000 draws (~0.05 s)
    # give a 3.5 % acceptance band on the variance, so a 3 % error in sigma (6 % in
    # variance) fails. For sigma >= 1 the discrete Gaussian's variance equals sigma^2
    # to within 1e-15 (Canonne, Kamath & Steinke 2020).
    sigma = 2.0**20 * 1.7
    noise = vector_noise(40_000, sigma, sampler=DiscreteGaussianSampler())
    assert noise.dtype == np.int64
    assert_variance_matches(noise, sigma)


def test_default_sampler_is_the_production_one_and_values_are_integers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default goes through the exact sampler (a test audit found the check a
    tautology: a default switched to the seeded float sampler passed it)."""
    calls = record_exact_draws(monkeypatch)
    noise = vector_noise(2_000, 7.5)
    assert calls == [(7.5, 2_000)]
    assert noise.dtype == np.int64 and noise.shape == (2_000,)
    # Small sigma: values are genuinely spread over several integers.
    assert len(np.unique(noise)) > 10
    # Fresh randomness every draw (the seeded sampler repeats itself).
    assert not np.array_equal(noise, vector_noise(2_000, 7.5))
    assert isinstance(DiscreteGaussianSampler(), NoiseSampler)


@pytest.mark.parametrize("z", [0.7, 3.73, 40.0])
@pytest.mark.parametrize("sensitivity", [1.0, 2.0**32 + 354.0])
def test_opendp_states_the_continuous_gaussian_zcdp_for_the_discrete_gaussian(
    z: float, sensitivity: float
) -> None:
    """The claim docs/privacy.md relies on, checked against the privacy map OpenDP
    attaches to its own discrete Gaussian on i64 (OpenDP is a test dependency only)."""
    import opendp.prelude as dp

    dp.enable_features("contrib")

    def rho(sigma_int: float, l2_sensitivity: int) -> float:
        measurement = dp.m.make_gaussian(
            dp.vector_domain(dp.atom_domain(T="i64"), size=1),
            dp.l2_distance(T="i64"),
            scale=sigma_int,
        )
        return float(measurement.map(l2_sensitivity))

    assert rho(z * sensitivity, math.ceil(sensitivity)) == pytest.approx(1 / (2 * z**2), rel=1e-12)


def test_production_sampler_reaches_beyond_32_bits() -> None:
    # Fixed-point noise is far larger than 32-bit integers hold.
    noise = vector_noise(200, 2.0**40)
    assert int(np.max(np.abs(noise))) > 2**31


def test_seeded_test_sampler_has_the_requested_variance_and_is_reproducible() -> None:
    sigma = 1234.5
    noise = vector_noise(400_000, sigma, sampler=TestOnlySeededSampler(seed=20240521))
    assert_variance_matches(noise, sigma)
    again = vector_noise(400_000, sigma, sampler=TestOnlySeededSampler(seed=20240521))
    np.testing.assert_array_equal(noise, again)


def test_test_only_sampler_says_so() -> None:
    assert "TEST ONLY" in (TestOnlySeededSampler.__doc__ or "")
    assert "TestOnly" in TestOnlySeededSampler.__name__


def test_symmetric_noise_is_an_iid_upper_triangle() -> None:
    dim, sigma, draws = 5, 100.0, 20_000
    sampler = TestOnlySeededSampler(seed=7)
    samples = np.stack([symmetric_noise(dim, sigma, sampler=sampler) for _ in range(draws)])
    assert samples.shape == (draws, upper_triangle_length(dim)) == (draws, 15)
    tolerance = variance_tolerance(draws)
    # Every entry of the triangle, diagonal included, has variance sigma^2 ...
    ratios = samples.astype(np.float64).var(axis=0, ddof=1) / sigma**2
    assert np.all(np.abs(ratios - 1.0) < tolerance), ratios
    # ... and distinct entries are uncorrelated (|r| < 5 / sqrt(n)).
    correlations = np.asarray(np.corrcoef(samples.T.astype(np.float64)))
    off_diagonal = correlations[~np.eye(15, dtype=bool)]
    assert np.max(np.abs(off_diagonal)) < 5.0 / math.sqrt(draws)


def test_mirrored_noise_matrix_is_symmetric_and_keeps_the_triangle() -> None:
    dim = 6
    upper = symmetric_noise(dim, 50.0, sampler=TestOnlySeededSampler(seed=3))
    full = mirror_upper_triangle(upper, dim)
    assert full.shape == (dim, dim) and full.dtype == np.int64
    np.testing.assert_array_equal(full, full.T)
    rows, cols = np.triu_indices(dim)
    np.testing.assert_array_equal(full[rows, cols], upper)
    np.testing.assert_array_equal(upper_triangle(full), upper)  # the codec's layout
    # Row-major order: the second value is entry (0, 1), the (dim+1)-th is (1, 1).
    assert full[0, 1] == upper[1] and full[1, 1] == upper[dim]


def test_mirror_refuses_a_wrong_length() -> None:
    with pytest.raises(ConfigError, match=r"\(10,\)"):
        mirror_upper_triangle(np.zeros(9), 4)


def exact_discrete_gaussian_tail(sigma: float, bound: int) -> float:
    """P(|Y| > bound) for Y ~ N_Z(0, sigma^2), summing the normalised pmf in log space."""
    support = np.arange(-int(60 * sigma) - bound, int(60 * sigma) + bound + 1, dtype=np.float64)
    log_weights = -(support**2) / (2 * sigma**2)
    log_tail = logsumexp(log_weights[np.abs(support) > bound])
    return float(np.exp(log_tail - logsumexp(log_weights)))


@pytest.mark.parametrize("sigma", [1.0, 3.3, 1000.0, 2.0**32 * 3.73])
def test_headroom_bounds_the_tail_below_2_to_the_minus_100(sigma: float) -> None:
    bound = noise_headroom(sigma)
    # Rounded continuous Gaussian (|round(x)| > B implies |x| > B - 1/2):
    assert 2 * norm.sf((bound - 0.5) / sigma) < 2.0**-100
    if sigma < 2000:
        assert exact_discrete_gaussian_tail(sigma, bound) < 2.0**-100
    # ... and it is not wastefully loose: 20 % less would not be safe.
    assert 2 * norm.sf(0.8 * bound / sigma) > 2.0**-100


@pytest.mark.parametrize("sigma", [2.161923103019736e17, 2.0**57.3, 3.0e15 + 1.0, 2.0**52 * 1.37])
def test_headroom_is_at_least_the_exact_tail_point_at_large_scales(sigma: float) -> None:
    """B >= t = sigma sqrt(2 ln 2^101) exactly, not only up to float error: without the
    margin, a review found B 28.9 below t at the first scale (float error of sigma t)."""
    import mpmath

    mpmath.mp.dps = 60
    exact = mpmath.mpf(sigma) * mpmath.sqrt(2 * mpmath.log(mpmath.mpf(2) ** 101))
    assert noise_headroom(sigma) > exact
    assert noise_headroom(sigma) - exact < sigma * 2.0**-45  # and not wastefully more


def test_headroom_grows_with_the_number_of_values_and_security() -> None:
    sigma = 1e6
    per_value = noise_headroom(sigma)
    joint = noise_headroom(sigma, n_values=125_250)
    assert joint > per_value
    assert 125_250 * 2 * norm.sf((joint - 0.5) / sigma) < 2.0**-100
    assert noise_headroom(sigma, security_bits=128) > per_value
    assert noise_headroom(0.0) == 0
    with pytest.raises(ConfigError, match=re.escape("-1.0")):
        noise_headroom(-1.0)


class FixedSampler:
    """A sampler returning given values, to force the overflow path."""

    def __init__(self, values: list[int]) -> None:
        self.values = values

    def sample(self, sigma_int: float, size: int) -> NDArray[np.int64]:
        return np.asarray(self.values[:size], dtype=np.int64)


def test_a_draw_beyond_the_headroom_raises_instead_of_wrapping() -> None:
    sigma = 10.0
    bound = noise_headroom(sigma)
    ok = vector_noise(3, sigma, sampler=FixedSampler([0, bound, -bound]))
    np.testing.assert_array_equal(ok, [0, bound, -bound])
    with pytest.raises(EncodingOverflowError, match=str(bound + 1)):
        vector_noise(3, sigma, sampler=FixedSampler([0, -(bound + 1), 2]))
    with pytest.raises(EncodingOverflowError, match="index 1"):
        symmetric_noise(2, sigma, sampler=FixedSampler([1, 50, 2]), bound=49)


def test_noise_too_large_for_64_bits_is_refused_before_sampling() -> None:
    with pytest.raises(EncodingOverflowError, match="2\\^62"):
        vector_noise(1, 2.0**60)


def test_zero_sigma_is_the_non_private_mode() -> None:
    np.testing.assert_array_equal(vector_noise(4, 0.0), np.zeros(4, dtype=np.int64))


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ConfigError, match="-3"):
        vector_noise(-3, 1.0)
    with pytest.raises(ConfigError, match="nan"):
        vector_noise(3, math.nan)
    with pytest.raises(ConfigError, match="shape"):
        vector_noise(3, 1.0, sampler=FixedSampler([1]))
    with pytest.raises(ConfigError, match="sigma_int"):
        DiscreteGaussianSampler().sample(0.0, 3)
