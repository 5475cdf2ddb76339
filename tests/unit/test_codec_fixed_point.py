"""Fixed-point encoding: rounding modes, unbiasedness, int64 safety, big-int decoding."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedpca.codec import decode_fixed_point, encode_fixed_point
from fedpca.errors import EncodingOverflowError

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@given(st.lists(finite, min_size=1, max_size=50), st.integers(0, 30))
def test_nearest_rounding_is_within_half_a_unit(values: list[float], frac_bits: int) -> None:
    encoded = encode_fixed_point(values, frac_bits, rounding="nearest")
    assert encoded.dtype == np.int64
    for x, e in zip(values, encoded.tolist(), strict=True):
        assert abs(e - math.ldexp(x, frac_bits)) <= 0.5


@given(st.lists(finite, min_size=1, max_size=50), st.integers(0, 30), st.integers(0, 2**32))
def test_stochastic_rounding_picks_floor_or_ceil(
    values: list[float], frac_bits: int, seed: int
) -> None:
    encoded = encode_fixed_point(values, frac_bits, rng=np.random.default_rng(seed))
    for x, e in zip(values, encoded.tolist(), strict=True):
        scaled = math.ldexp(x, frac_bits)
        assert e in (math.floor(scaled), math.ceil(scaled))


def test_stochastic_rounding_is_unbiased() -> None:
    # Each encoding is floor(s) + Bernoulli(frac(s)), whose standard deviation is at
    # most 1/2, so the mean error over n draws has standard error <= 0.5 / sqrt(n).
    # Tolerance: 5 standard errors (false-failure probability ~6e-7 per value).
    n = 200_000
    frac_bits = 8
    values = np.array([0.3, -1.7, 2.0 / 3.0, 1e-3, -5.123456789], dtype=np.float64)
    rng = np.random.default_rng(20240611)
    draws = encode_fixed_point(np.repeat(values[None, :], n, axis=0), frac_bits, rng=rng)
    mean_error = draws.mean(axis=0) - np.ldexp(values, frac_bits)
    tolerance = 5 * 0.5 / math.sqrt(n)
    assert np.all(np.abs(mean_error) < tolerance), mean_error
    # The same test rejects round-to-nearest, whose bias here is up to 0.3 units.
    nearest = encode_fixed_point(values, frac_bits, rounding="nearest")
    assert np.any(np.abs(nearest - np.ldexp(values, frac_bits)) > tolerance)


def test_encoding_keeps_shape() -> None:
    matrix = np.arange(6, dtype=np.float64).reshape(2, 3) / 4
    encoded = encode_fixed_point(matrix, 2, rounding="nearest")
    assert encoded.shape == (2, 3)
    assert encoded.tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_values_too_large_for_int64_are_refused_with_index(rounding: str) -> None:
    values = np.zeros((2, 3))
    values[1, 2] = 2.0**30  # 2^30 * 2^32 = 2^62: one past the safe range
    with pytest.raises(EncodingOverflowError, match=r"index \(1, 2\)") as info:
        encode_fixed_point(values, 32, rounding=rounding)  # type: ignore[arg-type]
    assert "1073741824" in str(info.value)
    # Just inside the safe range is accepted.
    values[1, 2] = 2.0**30 - 2.0**-20
    assert encode_fixed_point(values, 32, rounding="nearest")[1, 2] < 2**62


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_values_are_refused(bad: float) -> None:
    with pytest.raises(EncodingOverflowError, match="index 1"):
        encode_fixed_point([0.0, bad], 4)


def test_decode_accepts_python_ints_beyond_int64() -> None:
    big = [2**100 + 2**60, -(2**70) + 1, 3]
    decoded = decode_fixed_point(big, 32)
    assert decoded.tolist() == [(2**100 + 2**60) / 2**32, (-(2**70) + 1) / 2**32, 3 / 2**32]


def test_decode_int64_array_matches_python_path() -> None:
    rng = np.random.default_rng(7)
    ints = rng.integers(-(2**62), 2**62, size=(4, 5))
    assert np.array_equal(
        decode_fixed_point(ints, 20),
        decode_fixed_point(ints.ravel().tolist(), 20).reshape(4, 5),
    )


def test_invalid_parameters() -> None:
    with pytest.raises(ValueError, match="frac_bits"):
        encode_fixed_point([1.0], -1)
    with pytest.raises(ValueError, match="rounding"):
        encode_fixed_point([1.0], 3, rounding="up")  # type: ignore[arg-type]
