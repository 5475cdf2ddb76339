"""The components' noise spread (fedpca.analyst.component_noise): its bootstrap against
the spread of many independently simulated noisy releases of the same records."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from fedpca.analyst.component_noise import (
    ComponentNoise,
    component_noise,
    default_draws,
    redraw_release,
    spectral_norm,
)
from fedpca.analyst.decode import DecodedRelease
from fedpca.analyst.estimators import FederatedDCA, FederatedPCA
from fedpca.errors import DataError
from fedpca.preprocess import preprocess_for_query
from fedpca.protocol import ReleasePlan, masked_sigma
from fedpca.query import Neighbouring, ProtocolMode, QueryKind, QuerySpec
from helpers import plaintext_release, reference_statistics

M = 5
ROWS = np.random.default_rng(7).normal(size=(3000, M)) * np.array([1.0, 0.7, 0.45, 0.25, 0.1])
LABELS = np.where(ROWS[:, 1] + 0.3 * np.random.default_rng(8).normal(size=3000) > 0, 1.0, -1.0)
SIMULATED = 1500
DRAWS = 600


def spec(kind: QueryKind = QueryKind.PCA, epsilon: float = 20.0, **extra: Any) -> QuerySpec:
    """Epsilon 20 over 3,000 records: noise that turns the components by a few degrees,
    where a bootstrap of one release is accurate (first order in the noise)."""
    if kind is QueryKind.DCA:
        extra = {"label_column": 0, "class_labels": (-1.0, 1.0)} | extra
    return QuerySpec(
        query_id="q-spread",
        kind=kind,
        n_features=M,
        epsilon=epsilon,
        delta=1e-6,
        analyst_public_key_n=(1 << 511) + 1,
        analyst_key_fingerprint="sha256:test",
        feature_lower=(-4.0,) * M,
        feature_upper=(4.0,) * M,
        clip_norm=2.0,
        **({"n_components": 2} | extra),
    )


def exact_release(query: QuerySpec, rows: Any = ROWS) -> DecodedRelease:
    """The release with no noise in it yet, and the sigmas its plan states."""
    plan = ReleasePlan.for_query(query, 512)
    x = preprocess_for_query(rows, query)
    statistics = reference_statistics(x, LABELS[: len(x)], query)
    if query.mode is ProtocolMode.MASKED:
        centred = statistics.scatter - np.outer(statistics.sums, statistics.sums) / len(x)
        return DecodedRelease(
            query=query,
            plan=plan,
            n_owners=2,
            key_fingerprint="sha256:test",
            values=None,
            centred_scatter=centred,
            public_count=len(x),
            sigmas={"scatter": masked_sigma(plan, len(x))[0]},
        )
    return plaintext_release(query, x, LABELS[: len(x)])


def simulated_release(exact: DecodedRelease, rng: np.random.Generator) -> DecodedRelease:
    """One noisy release as the proxy makes it, written here independently of the code
    under test: Gaussian noise of each section's sigma on every released value; in
    masked mode on the upper triangle of the centred scatter, mirrored."""
    if exact.centred_scatter is not None:
        m = exact.centred_scatter.shape[0]
        noise = np.zeros((m, m))
        for i in range(m):
            for j in range(i, m):
                noise[i, j] = noise[j, i] = rng.normal(0.0, exact.sigmas["scatter"])
        return dataclasses.replace(exact, centred_scatter=exact.centred_scatter + noise)
    assert exact.values is not None
    noisy = exact.values.copy()
    for name, where in exact.plan.statistics.section_slices().items():
        noisy[where] += rng.normal(0.0, exact.sigmas[name], noisy[where].shape)
    return dataclasses.replace(exact, values=noisy)


def angles(a: Any, b: Any) -> Any:
    cosine = np.abs(np.sum(a * b, axis=1)) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return np.degrees(np.arccos(np.clip(cosine, 0.0, 1.0)))


def true_spread(exact: DecodedRelease, solve: Any) -> tuple[Any, Any]:
    """The standard deviation of each value and the rms angle of each component over
    many simulated releases, against the noise-free solution."""
    rng = np.random.default_rng(11)
    _, components0 = solve(exact)
    values = []
    turned = []
    for _ in range(SIMULATED):
        v, c = solve(simulated_release(exact, rng))
        values.append(v)
        turned.append(angles(components0, c))
    return np.std(values, axis=0, ddof=1), np.sqrt(np.mean(np.square(turned), axis=0))


def pca_solution(release: DecodedRelease) -> Any:
    result = release.pca(2)
    return result.explained_variance, result.components


@pytest.mark.parametrize("mode", ["stats", "masked"])
def test_pca_spread_matches_simulated_releases(mode: str) -> None:
    extra: dict[str, Any] = {"mode": ProtocolMode(mode)}
    if mode == "masked":
        # Its scatter sigma is larger (the sensitivity of a centred scatter): at epsilon
        # 20 the second component turns by 11 degrees, past the first-order regime.
        extra.update(neighbouring=Neighbouring.REPLACE_ONE, epsilon=50.0)
    exact = exact_release(spec(**extra))
    values_sd, angle = true_spread(exact, pca_solution)
    assert angle.min() > 1.0  # the noise turns the components measurably
    released = simulated_release(exact, np.random.default_rng(3))
    estimator = FederatedPCA.from_result(released)
    spread = estimator.component_noise(draws=DRAWS)
    assert spread.draws == DRAWS and spread.failure is None
    assert spread.values_sd is not None and spread.angles_degrees is not None
    np.testing.assert_allclose(spread.values_sd, values_sd, rtol=0.12)
    np.testing.assert_allclose(spread.angles_degrees, angle, rtol=0.12)
    assert estimator.component_noise_ is spread


def covariance_of(release: DecodedRelease) -> Any:
    """The sample covariance of a release, written here from its definition."""
    if release.centred_scatter is not None:
        assert release.public_count is not None
        return release.centred_scatter / (release.public_count - 1)
    statistics = release.statistics
    assert statistics is not None
    n = statistics.count
    return (statistics.scatter - np.outer(statistics.sums, statistics.sums) / n) / (n - 1)


@pytest.mark.parametrize("mode", ["stats", "masked"])
def test_pca_noise_bound_is_the_quantile_of_the_noise_norm_and_covers_every_value(
    mode: str,
) -> None:
    """The bound against simulated releases: it is the 95th percentile of the spectral
    norm the noise adds to the covariance, and no explained variance (of all M, clipped
    at 0 as PCA does) moves further than it in at least about 95 % of them (Weyl)."""
    extra: dict[str, Any] = {"mode": ProtocolMode(mode), "epsilon": 2.0}
    if mode == "masked":
        extra.update(neighbouring=Neighbouring.REPLACE_ONE)
    exact = exact_release(spec(**extra))
    exact_covariance = covariance_of(exact)
    exact_values = np.clip(np.linalg.eigvalsh(exact_covariance), 0.0, None)
    rng = np.random.default_rng(11)
    norms, moved = [], []
    for _ in range(SIMULATED):
        noisy = covariance_of(simulated_release(exact, rng))
        norms.append(np.linalg.norm(noisy - exact_covariance, 2))
        moved.append(np.max(np.abs(np.clip(np.linalg.eigvalsh(noisy), 0.0, None) - exact_values)))
    released = simulated_release(exact, np.random.default_rng(3))
    spread = FederatedPCA.from_result(released).component_noise(draws=DRAWS)
    assert spread.values_bound is not None
    assert spread.values_bound == pytest.approx(np.quantile(norms, 0.95), rel=0.08)
    covered = np.mean(np.array(moved) <= spread.values_bound)
    assert covered >= 0.93
    # Not vacuous: the noise moves the values by a good part of the bound.
    assert np.quantile(moved, 0.95) > 0.5 * spread.values_bound


def test_spectral_norm_is_the_largest_eigenvalue_magnitude_of_the_mirrored_triangle() -> None:
    for shift in (-3.0, 3.0):  # the largest |eigenvalue| negative, then positive
        upper = np.triu(np.random.default_rng(4).normal(size=(6, 6)))
        matrix = upper + np.triu(upper, 1).T + shift * np.eye(6)
        expected = np.linalg.norm(matrix, 2)
        assert spectral_norm(matrix[np.triu_indices(6)]) == pytest.approx(expected, rel=1e-12)


def test_dca_spread_matches_simulated_releases() -> None:
    exact = exact_release(spec(QueryKind.DCA, n_components=1))

    def solve(release: DecodedRelease) -> Any:
        result = release.dca(1, rho=60.0, rho_prime=6.0)
        return result.eigenvalues, result.components

    values_sd, angle = true_spread(exact, solve)
    released = simulated_release(exact, np.random.default_rng(3))
    estimator = FederatedDCA.from_result(released, rho=60.0, rho_prime=6.0)
    spread = estimator.component_noise(draws=DRAWS)
    assert spread.values_sd is not None and spread.angles_degrees is not None
    np.testing.assert_allclose(spread.values_sd, values_sd, rtol=0.12)
    np.testing.assert_allclose(spread.angles_degrees, angle, rtol=0.12)


def test_same_release_gives_the_same_spread_and_noise_is_redrawn_each_time() -> None:
    exact = exact_release(spec())
    released = simulated_release(exact, np.random.default_rng(3))
    first = FederatedPCA.from_result(released).component_noise(draws=40)
    again = FederatedPCA.from_result(released).component_noise(draws=40)
    assert first.values_sd is not None and again.values_sd is not None
    np.testing.assert_array_equal(first.values_sd, again.values_sd)
    rng = np.random.default_rng(0)
    one, two = redraw_release(released, rng), redraw_release(released, rng)
    assert one.values is not None and two.values is not None
    assert not np.array_equal(one.values, two.values)
    assert released.values is not None and not np.array_equal(one.values, released.values)


def test_no_noise_gives_zero_spread_without_draws() -> None:
    exact = exact_release(spec(epsilon=math.inf))  # no noise: NOT PRIVATE
    spread = FederatedPCA.from_result(exact).component_noise()
    assert spread.draws == 0
    assert spread.values_sd is not None and not spread.values_sd.any()
    assert spread.angles_degrees is not None and not spread.angles_degrees.any()
    assert spread.values_bound == 0.0
    dca = exact_release(spec(QueryKind.DCA, epsilon=math.inf, n_components=1))
    assert FederatedDCA.from_result(dca).component_noise().values_bound is None


def test_a_redraw_the_solver_refuses_is_reported_not_hidden() -> None:
    # Ten records at epsilon 0.05: a redrawn count falls to N <= 1 within a few draws.
    query = spec(epsilon=0.05)
    exact = exact_release(query, ROWS[:10])
    released = dataclasses.replace(exact)
    calls = []
    spread = component_noise(
        released, pca_solution, pca_solution(released), draws=200, progress=calls.append
    )
    assert spread.values_sd is None and spread.angles_degrees is None
    assert spread.values_bound is None
    assert spread.failure is not None and "record count" in spread.failure
    assert spread.draws == len(calls) < 200


def test_draws_fall_with_the_features_and_are_checked() -> None:
    assert default_draws(10) == 200 and default_draws(2000) == 30
    assert default_draws(200) == 125
    exact = exact_release(spec())
    with pytest.raises(DataError, match="at least 2"):
        component_noise(exact, pca_solution, pca_solution(exact), draws=1)
    assert isinstance(
        component_noise(exact, pca_solution, pca_solution(exact), draws=2), ComponentNoise
    )


def test_angles_are_root_mean_square_and_ignore_sign() -> None:
    exact = exact_release(spec())
    turns = iter([3.0, -4.0] * 5)

    def solve(release: DecodedRelease) -> Any:
        # A component turned by the next angle in the (x0, x1) plane, its sign flipped.
        turn = math.radians(next(turns))
        return np.array([1.0]), -np.array([[math.cos(turn), math.sin(turn), 0, 0, 0]])

    spread = component_noise(exact, solve, (np.array([1.0]), np.eye(M)[:1]), draws=10)
    assert spread.angles_degrees is not None
    assert spread.angles_degrees[0] == pytest.approx(math.sqrt((9 + 16) / 2))


def test_a_value_the_noise_cannot_move_has_zero_sd_not_a_rounding_error() -> None:
    """DCA's components beyond C − 1 on a constant feature have the value 1 + rho'/rho
    in every draw, up to rounding: a walkthrough's summary printed sd 2.104e-15."""
    exact = exact_release(spec())
    jitter = iter(np.random.default_rng(0).normal(size=(10, 2)))

    def solve(release: DecodedRelease) -> Any:
        step = next(jitter)
        return np.array([2.0 + 0.1 * step[0], 1.1 + 1e-15 * step[1]]), np.eye(M)[:2]

    spread = component_noise(exact, solve, (np.array([2.0, 1.1]), np.eye(M)[:2]), draws=10)
    assert spread.values_sd is not None
    assert spread.values_sd[1] == 0.0 and spread.values_sd[0] > 0.01


def test_n_samples_noise_sd_is_the_count_sigma_and_for_dca_sums_the_class_noise() -> None:
    dca = exact_release(spec(QueryKind.DCA))
    # N = the sum of C = 2 noisy class counts: sigma times sqrt(2).
    assert dca.n_samples_noise_sd == pytest.approx(dca.sigmas["class_counts"] * math.sqrt(2))
    pca = exact_release(spec())
    assert pca.n_samples_noise_sd == pca.sigmas["count"] > 0
    assert exact_release(spec(epsilon=math.inf)).n_samples_noise_sd == 0.0
    masked = exact_release(spec(mode=ProtocolMode.MASKED, neighbouring=Neighbouring.REPLACE_ONE))
    assert masked.n_samples_noise_sd == 0.0  # N is exact and public in masked mode
