"""The exact discrete Gaussian sampler against the distribution's defining equation.

P[Y = y] = exp(-y^2 / (2 sigma^2)) / sum_z exp(-z^2 / (2 sigma^2)). Each frequency test
draws from a seeded byte source (reproducible, so it cannot flake) and compares the
counts with those probabilities by Pearson's chi-square: the p-value must exceed 1e-6,
and the same counts must fail against sigma 3 % off, to show the test has power.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from numpy.typing import NDArray
from scipy.stats import chi2

from fedpca.dp import discrete_gaussian
from fedpca.dp import noise as noise_module
from fedpca.dp.discrete_gaussian import (
    BATCH_CANDIDATES,
    LARGEST_K,
    LARGEST_SIGMA,
    MAX_NOISE_BOUND,
    SATURATED,
    exact_scale,
    sample_discrete_gaussian,
)
from fedpca.dp.noise import noise_headroom
from fedpca.errors import ConfigError


def seeded_bytes(seed: int) -> Callable[[int], bytes]:
    return np.random.default_rng(seed).bytes


def chi_square_p_value(draws: NDArray[np.int64], sigma: float) -> float:
    """Pearson's test of the draws against N_Z(0, sigma^2), bins with >= 5 expected
    (the two tails beyond them pooled into one bin each)."""
    reach = int(12 * sigma) + 3
    support = np.arange(-reach, reach + 1)
    log_weights = -(support.astype(np.float64) ** 2) / (2 * sigma**2)
    probabilities = np.exp(log_weights - log_weights.max())
    probabilities /= probabilities.sum()
    counts = np.bincount(draws + reach, minlength=support.size)
    assert counts.size == support.size, "a draw beyond 12 sigma"
    expected = probabilities * draws.size
    inner = np.flatnonzero(expected >= 5)
    low, high = inner[0], inner[-1]
    observed_bins = np.concatenate(
        ([counts[:low].sum()], counts[low : high + 1], [counts[high + 1 :].sum()])
    )
    expected_bins = np.concatenate(
        ([expected[:low].sum()], expected[low : high + 1], [expected[high + 1 :].sum()])
    )
    used = expected_bins > 0
    statistic = float((((observed_bins - expected_bins) ** 2)[used] / expected_bins[used]).sum())
    return float(chi2.sf(statistic, int(used.sum()) - 1))


@pytest.mark.parametrize(
    ("sigma", "seed"),
    [(1 / 3, 1), (0.7, 2), (1.0, 3), (2.5, 4), (3.0, 5), (12.25, 6), (100.0 / 7.0, 7)],
)
def test_frequencies_match_the_discrete_gaussian(sigma: float, seed: int) -> None:
    draws = sample_discrete_gaussian(sigma, 200_000, random_bytes=seeded_bytes(seed))
    assert draws.dtype == np.int64 and draws.shape == (200_000,)
    assert chi_square_p_value(draws, sigma) > 1e-6
    assert chi_square_p_value(draws, sigma * 1.03) < 1e-6


def test_more_values_than_one_batch_keep_the_distribution() -> None:
    size = BATCH_CANDIDATES * 2 + 123
    draws = sample_discrete_gaussian(4.5, size, random_bytes=seeded_bytes(11))
    assert draws.shape == (size,)
    assert chi_square_p_value(draws, 4.5) > 1e-6
    # Batches are not copies of each other.
    assert not np.array_equal(draws[:1000], draws[BATCH_CANDIDATES : BATCH_CANDIDATES + 1000])


def test_large_scales_have_the_requested_spread_and_reach_beyond_32_bits() -> None:
    sigma = 4e10
    draws = sample_discrete_gaussian(sigma, 100_000, random_bytes=seeded_bytes(12))
    ratio = float(np.var(draws.astype(np.float64), ddof=1)) / sigma**2
    # Relative standard error of a sample variance: sqrt(2 / (n - 1)) = 0.0045.
    assert abs(ratio - 1) < 5 * 0.0045
    assert abs(float(np.mean(draws))) < 5 * sigma / np.sqrt(draws.size)
    assert int(np.max(np.abs(draws))) > 2**31


def test_the_same_seed_draws_the_same_values_and_the_os_source_differs() -> None:
    first = sample_discrete_gaussian(9.0, 5_000, random_bytes=seeded_bytes(13))
    again = sample_discrete_gaussian(9.0, 5_000, random_bytes=seeded_bytes(13))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(
        sample_discrete_gaussian(9.0, 5_000), sample_discrete_gaussian(9.0, 5_000)
    )


def test_the_scale_is_the_float_itself_or_rounded_up_below_one() -> None:
    assert exact_scale(2.5) == (5, 2)
    assert exact_scale(4e10) == (40_000_000_000, 1)
    p, q = exact_scale(1234.0625)
    assert p / q == 1234.0625 and q == 16
    for small in (1 / 3, 0.1, 1e-30):
        p, q = exact_scale(small)
        assert q == 2**52
        assert p * 2**52 >= small * 2**52 * 1  # never less noise than asked ...
        assert p - 1 < small * 2**52  # ... and less than one step of 2^-52 more
    assert exact_scale(LARGEST_SIGMA) == (2**59, 1)


@pytest.mark.parametrize("sigma", [2**53 + 1, 2**58 + 3, 2**59 - 1])
def test_an_int_scale_is_read_exactly_not_through_a_float(sigma: int) -> None:
    # float() rounds each to a neighbouring float, the first two downwards: less noise
    # than asked (found by review).
    assert float(sigma) != sigma
    assert exact_scale(sigma) == (sigma, 1)


@pytest.mark.parametrize("sigma", [0.0, -1.0, float("inf"), float("nan"), LARGEST_SIGMA * 2])
def test_a_scale_outside_the_supported_range_is_refused(sigma: float) -> None:
    with pytest.raises(ConfigError, match="sigma"):
        sample_discrete_gaussian(sigma, 10)


@pytest.mark.parametrize(
    "sigma", [np.longdouble(2**59) - np.longdouble(0.5), Fraction(7, 3), Decimal("2.5"), True]
)
def test_a_scale_that_is_not_a_float_is_refused(sigma: object) -> None:
    # A longdouble or a Decimal can carry more bits than the 64-bit arithmetic allows
    # for; only floats (numpy's float64 included) and ints are read exactly.
    with pytest.raises(ConfigError, match="must be a float"):
        exact_scale(sigma)  # type: ignore[arg-type]
    assert exact_scale(np.float64(2.5)) == (5, 2)
    assert exact_scale(7) == (7, 1)


def test_every_scale_a_noise_bound_allows_can_be_drawn() -> None:
    """A plan accepts a scale when its bound is at most 2^62; the sampler must draw every
    such scale (a review found plans at 2^58.07 that a 2^58 limit refused at the draw)."""
    assert noise_headroom(LARGEST_SIGMA) > MAX_NOISE_BOUND
    # The largest scale whose headroom fits, found by bisection, draws as asked.
    low, high = 2.0**50, LARGEST_SIGMA
    for _ in range(80):
        middle = (low + high) / 2
        low, high = (middle, high) if noise_headroom(middle) <= MAX_NOISE_BOUND else (low, middle)
    assert low > 2.0**58
    draws = sample_discrete_gaussian(low, 20_000, random_bytes=seeded_bytes(16))
    ratio = float(np.var(draws.astype(np.float64), ddof=1)) / low**2
    assert abs(ratio - 1) < 5 * np.sqrt(2 / 19_999)
    assert int(np.max(np.abs(draws))) < MAX_NOISE_BOUND


def test_sizes_zero_and_negative() -> None:
    assert sample_discrete_gaussian(3.0, 0).shape == (0,)
    with pytest.raises(ConfigError, match="size"):
        sample_discrete_gaussian(3.0, -1)


def test_a_short_byte_source_is_an_error_not_a_biased_draw() -> None:
    with pytest.raises(ConfigError, match="random_bytes returned"):
        sample_discrete_gaussian(3.0, 10, random_bytes=lambda n: bytes(n - 1))


def test_uniform_words_in_the_biased_range_are_redrawn() -> None:
    # Bound 3 on bytes: 256 mod 3 = 1, so the byte 0 would make 0 one count too likely
    # (86 of 256 against 85 for 1 and 2). It is redrawn: the next byte, 5, gives 2.
    supplied = iter([bytes([0]), bytes([5])])
    coins = discrete_gaussian._Coins(lambda n: next(supplied))
    assert coins.below(np.array([3], dtype=np.uint64)).tolist() == [2]
    # Bounds above a byte take 16-bit or 64-bit words.
    wide = discrete_gaussian._Coins(lambda n: (7).to_bytes(8, "little") * (n // 8))
    assert wide.below(np.array([2**40], dtype=np.uint64)).tolist() == [7]


def test_the_bernoulli_exp_loop_has_the_defining_probability() -> None:
    # CKS algorithm 1 for gamma = 1/2 and for gamma = 0.9 (coins a / b): 200,000 flips
    # each, within 5 standard errors of exp(-gamma).
    coins = discrete_gaussian._Coins(seeded_bytes(14))
    n = 200_000
    half = coins.exp_minus_half(n).mean()
    numerators = np.full(n, 9, dtype=np.uint64)
    point_nine = coins.exp_minus(
        n, lambda looping, k: coins.fraction(numerators[looping], 10) & coins.one_in(k)
    ).mean()
    for observed, gamma in ((half, 0.5), (point_nine, 0.9)):
        p = np.exp(-gamma)
        assert abs(observed - p) < 5 * np.sqrt(p * (1 - p) / n)


def test_a_draw_beyond_64_bit_products_is_exact_or_saturated_not_wrapped() -> None:
    """k above LARGEST_K would overflow 64-bit products (an event below exp(-450) a
    value, forced here: coins that always succeed for the first candidate's run and for
    its k (k - 1) further coins). It is worked out in Python's integers: exact at a small
    scale, saturated at 2^62 + 1 where the value is beyond every headroom."""

    class Forced(discrete_gaussian._Coins):
        """One stream of Bernoulli(exp(-1/2)) coins: LARGEST_K + 1 successes (the first
        candidate's k), a failure ending it, three more (k = 0 for the other three
        candidates), then successes only."""

        def __init__(self, seed: int) -> None:
            super().__init__(seeded_bytes(seed))
            self.position = 0

        def exp_minus_half(self, count: int) -> NDArray[np.bool_]:
            positions = np.arange(self.position, self.position + count)
            self.position += count
            return ~((positions > LARGEST_K) & (positions <= LARGEST_K + 4))

    k = LARGEST_K + 1
    seen_small, seen_large = [], []
    for seed in range(40):
        # sigma = 3: the candidate is k sigma + j, j in {0, 1, 2}, kept unless step 3's
        # coins refuse it (j = 0, x = 0, always passes).
        small = discrete_gaussian._survivors(3, 1, 4, Forced(seed))
        seen_small += [int(v) for v in small if abs(int(v)) >= 3 * k]
        large = discrete_gaussian._survivors(1 << 58, 1, 4, Forced(seed))
        seen_large += [int(v) for v in large if v != 0 and abs(int(v)) > MAX_NOISE_BOUND]
    assert seen_small and {abs(v) for v in seen_small} <= {3 * k, 3 * k + 1, 3 * k + 2}
    assert seen_large and {abs(v) for v in seen_large} == {SATURATED}
    assert SATURATED > MAX_NOISE_BOUND == noise_module.MAX_NOISE_BOUND
