"""Noise allocation across sections: sum_j (Delta_j / sigma_j)^2 must equal 1 / z^2."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedpca.dp.allocation import allocate_noise, effective_noise_multiplier, normalise_weights
from fedpca.errors import ConfigError

positive = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(
    sections=st.lists(st.tuples(positive, positive), min_size=1, max_size=8),
    z=st.floats(min_value=1e-3, max_value=1e3),
)
def test_allocation_meets_the_defining_equation(
    sections: list[tuple[float, float]], z: float
) -> None:
    sensitivities = [d for d, _ in sections]
    weights = [w for _, w in sections]  # deliberately not normalised
    sigmas = allocate_noise(sensitivities, weights, z)
    # Independent of the implementation: the squared privacy loss per section adds up.
    total = math.fsum((d / s) ** 2 for d, s in zip(sensitivities, sigmas, strict=True))
    assert total == pytest.approx(1.0 / z**2, rel=1e-12)
    assert effective_noise_multiplier(sensitivities, sigmas) == pytest.approx(z, rel=1e-12)
    # Each section's share of the squared loss is its normalised weight.
    weight_sum = math.fsum(weights)
    for d, s, w in zip(sensitivities, sigmas, weights, strict=True):
        assert (d / s) ** 2 * z**2 == pytest.approx(w / weight_sum, rel=1e-12)


def test_stats_mode_example() -> None:
    # R (Delta 1), v (Delta 1), N (Delta 1) with weights 2:1:1 and z = 3.73.
    sigmas = allocate_noise([1.0, 1.0, 1.0], [2.0, 1.0, 1.0], 3.73)
    assert sigmas == pytest.approx((3.73 * math.sqrt(2), 3.73 * 2, 3.73 * 2))
    # Equal weights over k sections of equal sensitivity: sigma = z sqrt(k) each, the
    # same as one Gaussian on the concatenated vector with joint sensitivity sqrt(k).
    assert allocate_noise([1.0] * 3, [1.0] * 3, 2.0) == pytest.approx((2 * math.sqrt(3),) * 3)


def test_insensitive_sections_get_no_noise() -> None:
    sigmas = allocate_noise([2.0, 0.0], [1.0, 0.0], 5.0)
    assert sigmas == (10.0, 0.0)
    assert effective_noise_multiplier([2.0, 0.0], sigmas) == pytest.approx(5.0)


def test_zero_noise_multiplier_is_the_non_private_mode() -> None:
    assert allocate_noise([1.0, 2.0], [1.0, 1.0], 0.0) == (0.0, 0.0)
    assert effective_noise_multiplier([1.0, 2.0], [0.0, 0.0]) == 0.0
    assert effective_noise_multiplier([0.0], [0.0]) == math.inf


@pytest.mark.parametrize(
    ("sensitivities", "weights", "z", "named"),
    [
        ([1.0], [1.0, 1.0], 1.0, "2 noise weights"),
        ([1.0, 1.0], [1.0, 0.0], 1.0, "section 1"),
        ([1.0], [-1.0], 1.0, "-1.0"),
        ([1.0], [0.0], 1.0, "positive sum"),
        ([-2.0], [1.0], 1.0, "-2.0"),
        ([1.0], [1.0], -1.0, "noise_multiplier"),
        ([], [], 1.0, "at least one section"),
    ],
)
def test_bad_allocations_are_refused(
    sensitivities: list[float], weights: list[float], z: float, named: str
) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        allocate_noise(sensitivities, weights, z)


def test_normalise_weights() -> None:
    assert normalise_weights([1.0, 3.0]) == (0.25, 0.75)
    with pytest.raises(ConfigError, match="inf"):
        normalise_weights([1.0, math.inf])
