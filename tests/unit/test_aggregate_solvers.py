"""Post-processing of aggregate releases and the estimators' scikit-learn conventions."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from sklearn.linear_model import LinearRegression, Ridge

from fedpca.analyst import (
    FederatedHistogram,
    FederatedLinearRegression,
    FederatedQuery,
    FederatedStatistics,
)
from fedpca.analyst.aggregates import (
    describe,
    histogram_counts,
    noise_spectral_bound,
    regression_noise_sd,
    solve_regression,
)
from fedpca.analyst.querying import charged_release
from fedpca.errors import ConfigError, KeyFileError, UnusableReleaseError
from fedpca.query import Aggregate, Moments

FEATURES = Aggregate.linear_regression((0, 1, 2), (-1.0, 0.0, 5.0), (1.0, 10.0, 15.0), 3, 0.0, 4.0)


def _scaled(x: np.ndarray, lower: tuple[float, ...], upper: tuple[float, ...]) -> np.ndarray:
    lo, hi = np.array(lower), np.array(upper)
    return 2 * (x - lo) / (hi - lo) - 1


def _regression_sections(x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """Exact (noise-free) sections of FEATURES for rows inside the bounds."""
    assert FEATURES.target_lower is not None and FEATURES.target_upper is not None
    u = _scaled(x, FEATURES.lower, FEATURES.upper)
    v = _scaled(y[:, None], (FEATURES.target_lower,), (FEATURES.target_upper,))[:, 0]
    return {
        "count": np.array([float(len(x))]),
        "x_sums": u.sum(axis=0),
        "y_sum": np.array([v.sum()]),
        "xtx": (u.T @ u)[np.triu_indices(3)],
        "xty": u.T @ v,
    }


def _data(seed: int = 0, n: int = 200) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = np.column_stack([rng.uniform(-1, 1, n), rng.uniform(0, 10, n), rng.uniform(5, 15, n)])
    y = np.clip(0.5 + 0.8 * x[:, 0] + 0.2 * x[:, 1] + 0.05 * x[:, 2] + rng.normal(0, 0.2, n), 0, 4)
    return x, y


NO_NOISE = {"count": 0.0, "x_sums": 0.0, "y_sum": 0.0, "xtx": 0.0, "xty": 0.0}


@pytest.mark.parametrize("fit_intercept", [True, False])
def test_noise_free_statistics_give_least_squares(fit_intercept: bool) -> None:
    x, y = _data()
    fit = solve_regression(
        FEATURES, _regression_sections(x, y), NO_NOISE, fit_intercept=fit_intercept
    )
    reference = LinearRegression(fit_intercept=fit_intercept).fit(x, y)
    np.testing.assert_allclose(fit.coef, reference.coef_, rtol=1e-9, atol=1e-12)
    assert fit.intercept == pytest.approx(reference.intercept_, abs=1e-9)
    assert fit.alpha == 0.0 and fit.n_samples == len(x)


def test_fixed_alpha_is_ridge_with_an_unpenalised_intercept() -> None:
    x, y = _data(1)
    sections = _regression_sections(x, y)
    # Without an intercept the design is in the columns' units: scikit-learn's Ridge.
    fit = solve_regression(FEATURES, sections, NO_NOISE, alpha=7.0, fit_intercept=False)
    reference = Ridge(alpha=7.0, fit_intercept=False).fit(x, y)
    np.testing.assert_allclose(fit.coef, reference.coef_, rtol=1e-9)
    # With an intercept, alpha applies to the scaled columns and the intercept is not
    # penalised: scikit-learn's Ridge on the scaled data, mapped back.
    fit = solve_regression(FEATURES, sections, NO_NOISE, alpha=7.0)
    u = _scaled(x, FEATURES.lower, FEATURES.upper)
    v = _scaled(y[:, None], (0.0,), (4.0,))[:, 0]
    scaled = Ridge(alpha=7.0).fit(u, v)
    np.testing.assert_allclose(x @ fit.coef + fit.intercept, 2.0 + 2.0 * scaled.predict(u))
    with pytest.raises(ConfigError, match="alpha must be 'auto' or a number"):
        solve_regression(FEATURES, sections, NO_NOISE, alpha="large")
    with pytest.raises(ConfigError, match="finite number >= 0"):
        solve_regression(FEATURES, sections, NO_NOISE, alpha=-1.0)


def test_automatic_alpha_is_the_spectral_bound_of_the_noise() -> None:
    sigmas = {"count": 2.0, "x_sums": 3.0, "y_sum": 1.0, "xtx": 5.0, "xty": 1.0}
    x, y = _data(2)
    fit = solve_regression(FEATURES, _regression_sections(x, y), sigmas, tail_probability=0.05)
    # Identity transform: the variance proxy is the largest row sum of entry variances,
    # row 0: 2² + 3·3², rows 1-3: 3² + 3·5².
    v = max(4 + 3 * 9, 9 + 3 * 25)
    assert fit.alpha == pytest.approx(math.sqrt(2 * v * math.log(2 * 4 / 0.05)), rel=1e-12)


@pytest.mark.parametrize("fit_intercept", [True, False])
def test_regression_noise_sd_is_the_spread_of_noisy_releases(fit_intercept: bool) -> None:
    """The coefficients' noise sd, a bootstrap from one noisy release, is checked against
    its definition: the spread of the coefficients over many releases of the same
    records, each with fresh noise of the sigmas, solved with the same regulariser."""
    x, y = _data(3, n=3000)
    exact = _regression_sections(x, y)
    sigmas = {"count": 4.0, "x_sums": 6.0, "y_sum": 3.0, "xtx": 8.0, "xty": 5.0}
    rng = np.random.default_rng(8)

    def noisy() -> dict[str, np.ndarray]:
        return {k: v + rng.normal(0.0, sigmas[k], np.shape(v)) for k, v in exact.items()}

    released = noisy()
    fit = solve_regression(FEATURES, released, sigmas, fit_intercept=fit_intercept)
    assert fit.alpha > 0
    runs = [
        solve_regression(FEATURES, noisy(), sigmas, alpha=fit.alpha, fit_intercept=fit_intercept)
        for _ in range(4000)
    ]
    coef_sd = np.std([run.coef for run in runs], axis=0)
    intercept_sd = np.std([run.intercept for run in runs])
    sd, intercept, draws = regression_noise_sd(
        FEATURES, released, sigmas, fit, fit_intercept=fit_intercept, draws=1000, seed=1
    )
    assert draws == 1000
    np.testing.assert_allclose(sd, coef_sd, rtol=0.15)
    if fit_intercept:
        assert intercept == pytest.approx(intercept_sd, rel=0.15)
    else:
        assert intercept == 0.0 == intercept_sd
    # The default number of draws (200 at 3 features) and the seed make it repeatable.
    again = regression_noise_sd(FEATURES, released, sigmas, fit, fit_intercept=fit_intercept)
    assert again[2] == 200
    assert np.array_equal(
        again[0],
        regression_noise_sd(FEATURES, released, sigmas, fit, fit_intercept=fit_intercept)[0],
    )
    # No noise: no spread, no draws.
    none = regression_noise_sd(FEATURES, exact, NO_NOISE, fit, fit_intercept=fit_intercept)
    assert none[2] == 0 and not np.any(none[0]) and none[1] == 0.0


def test_spectral_bound_holds_for_sampled_noise() -> None:
    rng = np.random.default_rng(5)
    n = 6
    sigmas = rng.uniform(0.5, 3.0, (n, n))
    sigmas = np.triu(sigmas) + np.triu(sigmas, 1).T
    transform = rng.normal(size=(4, n))
    beta = 0.05
    bound = noise_spectral_bound(sigmas, transform, beta)
    trials = 2000
    exceeded = 0
    for _ in range(trials):
        upper = np.triu(rng.normal(size=(n, n)) * sigmas)
        noise = upper + np.triu(upper, 1).T
        exceeded += np.linalg.norm(transform @ noise @ transform.T, 2) >= bound
    # Tropp's bound is conservative: far fewer than beta of the draws exceed it.
    assert exceeded / trials <= beta
    assert noise_spectral_bound(np.zeros((n, n)), transform, beta) == 0.0
    with pytest.raises(ConfigError, match="tail_probability"):
        noise_spectral_bound(sigmas, transform, 1.0)


def test_describe_post_processing_is_labelled_and_consistent() -> None:
    part = Aggregate.statistics((0, 1), (0.0, 10.0), (2.0, 30.0))
    # Noisy sections that no dataset has: a negative variance and a non-PSD matrix.
    sections = {
        "count": np.array([0.4]),
        "sums": np.array([5.0, -3.0]),
        "products": np.array([-1.0, 4.0, 2.0]),
    }
    clipped = describe(part, sections)
    assert clipped.clipped and clipped.n_samples == 1.0
    assert clipped.moved == ("N", "mean", "covariance", "variance")  # what the CLI names
    assert np.all(clipped.mean >= [0.0, 10.0]) and np.all(clipped.mean <= [2.0, 30.0])
    assert np.linalg.eigvalsh(clipped.covariance).min() >= -1e-12
    assert np.all(np.abs(clipped.correlation[~np.isnan(clipped.correlation)]) <= 1.0)
    raw = describe(part, sections, clip=False)
    assert not raw.clipped and raw.n_samples == 0.4
    assert raw.mean[0] == pytest.approx(1.0 + 1.0 * 5.0 / 0.4)
    assert raw.covariance[0, 0] == pytest.approx((-1.0 - 25.0 / 0.4) / 0.4)
    # Variances only: within [0, s²].
    variance = Aggregate.statistics((0,), (0.0,), (2.0,), Moments.VARIANCE)
    out = describe(variance, {"count": [10.0], "sums": [9.0], "squares": [50.0]})
    assert out.variance is not None and out.variance[0] == 1.0 and out.covariance is None
    assert out.moved == ("variance",)
    # Values within their ranges: clipping applied, nothing moved.
    inside = describe(variance, {"count": [10.0], "sums": [9.0], "squares": [10.0]})
    assert inside.clipped and inside.moved == ()
    # Exact sections of real data (float error only) move nothing (found by review:
    # correlations of 1 + 2e-16 on the diagonal, eigenvalues of -1e-17, were named).
    rng = np.random.default_rng(5)
    two = Aggregate.statistics((0, 1), (-1.0, -1.0), (1.0, 1.0))
    for _ in range(200):
        x = rng.uniform(-1, 1, size=(50, 1)) @ np.ones((1, 2))  # collinear columns
        x[:, 1] *= rng.uniform(0.1, 1.0)
        exact = {
            "count": np.array([50.0]),
            "sums": x.sum(axis=0),
            "products": np.array([x[:, 0] @ x[:, 0], x[:, 0] @ x[:, 1], x[:, 1] @ x[:, 1]]),
        }
        assert describe(two, exact).moved == ()


def test_covariance_mode_keeps_variances_within_the_bounds_and_names_the_divisor() -> None:
    """Found by review: the covariance mode only projected onto the PSD matrices, so
    with bounds -1:1 it reported variances of 2.5 (459 in another run) as clipped into
    [0, (hi - lo)^2/4 = 1]; and a ddof at or above the noisy N raised the divisor while
    the report said N had moved."""
    part = Aggregate.statistics((0, 1), (-1.0, -1.0), (1.0, 1.0))
    # Noise of epsilon 0.02: products far above what 10 records in [-1, 1] allow.
    sections = {"count": [10.0], "sums": [1.0, -2.0], "products": [60.0, 8.0, 4.0]}
    raw = describe(part, sections, clip=False)
    assert raw.variance is not None and raw.variance[0] > 5.0
    out = describe(part, sections)
    assert out.variance is not None and out.covariance is not None
    assert np.all(out.variance <= 1.0 + 1e-12) and out.variance[0] == pytest.approx(1.0)
    assert out.variance[1] == pytest.approx(raw.variance[1])  # within its bound: kept
    assert np.linalg.eigvalsh(out.covariance).min() >= -1e-12
    assert out.correlation is not None  # the rescaling keeps the correlation
    assert out.correlation[0, 1] == pytest.approx(raw.correlation[0, 1])
    assert "variance" in out.moved
    # With ddof = 1 the largest sample variance is (hi - lo)^2/4 * N/(N - 1): exact
    # data {lo, hi} is not clipped (review: it was, to half its variance).
    ends = {"count": [2.0], "sums": [0.0, 0.0], "products": [2.0, 2.0, 2.0]}
    pair = describe(part, ends, ddof=1)
    assert pair.variance is not None and pair.variance == pytest.approx([2.0, 2.0])
    assert pair.moved == ()
    # ddof above N: the divisor N - ddof is raised to 1 and named as such; N is not.
    late = describe(part, {**sections, "count": [10.0]}, ddof=500)
    assert late.n_samples == 10.0 and late.moved[0] == "N - ddof" and "N" not in late.moved


@pytest.mark.parametrize(
    ("moments", "second", "ddof"),
    [(Moments.VARIANCE, "squares", 0), (Moments.COVARIANCE, "products", 1)],
)
def test_noise_sd_of_means_and_variances_is_the_spread_of_noisy_releases(
    moments: Moments, second: str, ddof: int
) -> None:
    """The printed noise sd is checked against its definition: the standard deviation
    of the estimates over many releases of the same records, each with fresh Gaussian
    noise of the sigmas (the first-order formula is within a few per cent at N = 400)."""
    rng = np.random.default_rng(11)
    part = Aggregate.statistics((0, 1), (0.0, -5.0), (10.0, 5.0), moments)
    x = np.column_stack([rng.uniform(6.0, 10.0, 400), rng.uniform(-5.0, 0.0, 400)])
    u = _scaled(x, part.lower, part.upper)
    exact = {
        "count": np.array([400.0]),
        "sums": u.sum(axis=0),
        "squares": (u * u).sum(axis=0),
        "products": (u.T @ u)[np.triu_indices(2)],
    }
    sigmas = {"count": 30.0, "sums": 25.0, second: 20.0}
    runs = 20_000
    means, variances = np.empty((runs, 2)), np.empty((runs, 2))
    for r in range(runs):
        noisy = {
            name: exact[name] + rng.normal(0.0, sigma, exact[name].shape)
            for name, sigma in sigmas.items()
        }
        out = describe(part, noisy, ddof=ddof, clip=False)
        assert out.variance is not None
        means[r], variances[r] = out.mean, out.variance
    at_exact = describe(part, exact, ddof=ddof, clip=False, sigmas=sigmas)
    assert at_exact.n_samples_noise_sd == 30.0
    assert at_exact.mean_noise_sd is not None and at_exact.variance_noise_sd is not None
    np.testing.assert_allclose(at_exact.mean_noise_sd, means.std(axis=0), rtol=0.05)
    np.testing.assert_allclose(at_exact.variance_noise_sd, variances.std(axis=0), rtol=0.05)
    # Without the count's noise term (as if N were exact) the mean's sd is too small
    # here: the test tells the terms apart.
    assert np.all(0.9 * means.std(axis=0) > 25.0 * 5.0 / 400.0)
    # Evaluated at a noisy release it is close to the same.
    noisy = {k: exact[k] + rng.normal(0.0, v, exact[k].shape) for k, v in sigmas.items()}
    again = describe(part, noisy, ddof=ddof, clip=False, sigmas=sigmas)
    assert again.mean_noise_sd is not None
    np.testing.assert_allclose(again.mean_noise_sd, at_exact.mean_noise_sd, rtol=0.2)
    # No sigmas, no spread; exact N under replace-one (no count sigma) gives sd 0 for N.
    assert describe(part, exact).mean_noise_sd is None
    assert describe(part, exact, sigmas={"sums": 1.0}).n_samples_noise_sd == 0.0


def test_histogram_counts_shapes_and_clamp() -> None:
    part = Aggregate.histogram((0, 1), ((0, 1, 2), (0, 1, 2, 3)), 2, (1.0, 2.0))
    raw = np.arange(-3.0, 9.0)
    counts = histogram_counts(part, {"counts": raw})
    assert counts.counts.shape == (2, 2, 3) and counts.clamped
    assert counts.counts.min() == 0 and counts.raw_counts.min() == -3
    assert not histogram_counts(part, {"counts": raw}, clamp=False).clamped


# -------------------------------------------------------------- the estimators
def test_estimators_follow_scikit_learn_conventions() -> None:
    model = FederatedLinearRegression([1, 2], bounds="0:1,0:5", target=3, target_bounds=(0, 9))
    params = model.get_params()
    assert params["columns"] == [1, 2] and params["alpha"] == "auto"
    assert model.set_params(alpha=0.5) is model and model.alpha == 0.5
    assert repr(model).startswith("FederatedLinearRegression(columns=[1, 2], bounds='0:1,0:5'")
    with pytest.raises(ConfigError, match="no parameter 'alpah'"):
        model.set_params(alpah=1)
    with pytest.raises(ConfigError, match="takes no data"):
        model.fit(np.zeros((3, 2)))
    with pytest.raises(AttributeError, match="not fitted"):
        model.predict(np.zeros((1, 2)))
    assert model.aggregate().lower == (0.0, 0.0) and model.aggregate().upper == (1.0, 5.0)
    histogram = FederatedHistogram([0, 4], bins=[[0, 1, 2], [5, 6]])
    assert histogram.aggregate().bin_edges == ((0.0, 1.0, 2.0), (5.0, 6.0))
    stats = FederatedStatistics(3, bounds=(0, 1), moments="mean")
    assert stats.aggregate().columns == (3,)
    with pytest.raises(ConfigError, match="one \\(lo, hi\\) pair per column"):
        FederatedStatistics([1, 2, 3], bounds=[(0, 1), (0, 2)]).aggregate()


def test_combined_query_splits_its_budget() -> None:
    stats = FederatedStatistics(
        [1, 2], bounds=(0, 1), budget_split={"count": 1, "sums": 3, "products": 4}
    )
    histogram = FederatedHistogram(0, bins=[0, 1, 2])
    combined = FederatedQuery([stats, histogram], weights=[3.0, 1.0])
    weights = combined.noise_weights()
    np.testing.assert_allclose(weights, [0.75 / 8, 0.75 * 3 / 8, 0.75 * 4 / 8, 0.25])
    with pytest.raises(ConfigError, match="names \\['means'\\]"):
        FederatedStatistics([1], bounds=(0, 1), budget_split={"means": 1.0}).section_weights()
    with pytest.raises(ConfigError, match="one positive weight per estimator"):
        FederatedQuery([stats], weights=[1.0, 2.0]).noise_weights()
    with pytest.raises(ConfigError, match="at least one estimator"):
        FederatedQuery([]).noise_weights()


def test_score_is_the_coefficient_of_determination() -> None:
    x, y = _data(3)
    sections = _regression_sections(x, y)
    model = FederatedLinearRegression(
        [0, 1, 2],
        bounds=list(zip(FEATURES.lower, FEATURES.upper, strict=True)),
        target=3,
        target_bounds=(0.0, 4.0),
    )
    fit = solve_regression(FEATURES, sections, NO_NOISE)
    model.coef_, model.intercept_ = fit.coef, fit.intercept
    model.n_features_in_ = 3
    model.release_ = object()  # type: ignore[assignment]
    reference = LinearRegression().fit(x, y)
    assert model.score(x, y) == pytest.approx(reference.score(x, y), rel=1e-9)
    np.testing.assert_allclose(model.predict(x), reference.predict(x), rtol=1e-9)


@pytest.mark.parametrize("alpha", [-1.0, math.nan, math.inf, "ridge"])
def test_a_regression_parameter_that_cannot_work_is_refused_before_any_query(
    alpha: float | str, tmp_path: Any
) -> None:
    """Found by review: ``--alpha -1`` (or nan, inf) was checked only after the query was
    charged and decrypted, and the result could not be rebuilt with the alpha meant.
    Refused now before keys or the network are touched (none exist here: the error
    would be about them if the check came later)."""
    settings = {"proxy": "127.0.0.1:1", "private_key_path": tmp_path / "no-such-key"}
    model = FederatedLinearRegression(
        [1], bounds="0:1", target=2, target_bounds=(0, 1), alpha=alpha, **settings
    )
    with pytest.raises(ConfigError, match="alpha must be"):
        model.fit()
    stats = FederatedStatistics([1], bounds="0:1", **settings)
    with pytest.raises(ConfigError, match="alpha must be"):
        FederatedQuery([stats, model], **settings).fit()


def test_parameters_checked_before_a_query_take_numpy_numbers_and_cover_every_estimator(
    tmp_path: Any,
) -> None:
    """Review of the check: numpy scalars (a grid of alphas from np.arange) were refused,
    a tail_probability was checked where it is unused, and DCA's ridges and the
    statistics' ddof were still checked only after the release was charged."""
    import numpy as np

    from fedpca.analyst.estimators import FederatedDCA

    settings = {"proxy": "127.0.0.1:1", "private_key_path": tmp_path / "no-such-key"}
    for alpha in (np.float32(0.5), np.int64(1), 0):
        model = FederatedLinearRegression([1], bounds="0:1", target=2, alpha=alpha)
        model.check_post_processing()
    FederatedLinearRegression(
        [1], bounds="0:1", alpha=1.0, tail_probability=2.0
    ).check_post_processing()
    with pytest.raises(ConfigError, match=r"tail_probability must be a finite number in \(0, 1\)"):
        FederatedLinearRegression([1], bounds="0:1", tail_probability="x").check_post_processing()
    with pytest.raises(ConfigError, match="alpha must be a finite number"):
        FederatedLinearRegression([1], bounds="0:1", alpha=True).check_post_processing()
    for ddof in (-1, 1.5, "x"):
        with pytest.raises(ConfigError, match="ddof must be an integer >= 0"):
            FederatedStatistics([1], bounds="0:1", ddof=ddof, **settings).fit()
    for rho in (-1.0, math.nan, math.inf):
        dca = FederatedDCA(1, classes=(0, 1), bounds=(0, 1), rho=rho, **settings)
        with pytest.raises(ConfigError, match="rho must be a finite number"):
            dca.fit(n_features=2)


def test_an_error_after_a_release_names_the_query_and_how_to_fetch_it() -> None:
    with pytest.raises(ConfigError) as raised, charged_release("q-1234"):
        raise ConfigError("DCA needs at least two classes")
    message = str(raised.value)
    assert message.startswith("DCA needs at least two classes (query q-1234 is charged")
    assert "`fedpca analyst fetch q-1234 --out result.json`" in message


def test_an_error_no_post_processing_mends_does_not_advise_fetching_again() -> None:
    """Found by an analyst's walkthrough: DCA asked for classes 0,1 of labels -1,1 was
    charged, failed for want of two classes, and advised a fetch that failed the same
    way."""
    with pytest.raises(UnusableReleaseError) as raised, charged_release("q-1234"):
        raise UnusableReleaseError("DCA needs at least two classes")
    message = str(raised.value)
    assert message.startswith("DCA needs at least two classes (query q-1234 is charged;")
    assert "fetching it as asked would fail the same way" in message
    assert "fedpca analyst fetch" not in message


def test_an_aggregate_has_no_default_columns_bounds_or_bins(tmp_path: Any) -> None:
    """Found by review: bounds and bins defaulted to [0, 1] (and the columns to 0,
    the target to 1), so ``FederatedStatistics([1, 6]).fit()`` clipped every value into
    [0, 1], reported means of 0.86 and 0.99 for columns whose means are 3.85 and 32,
    and spent the budget doing so. Each is now required, refused before keys or the
    network are touched (none exist here: the error would be about them otherwise)."""
    settings = {"proxy": "127.0.0.1:1", "private_key_path": tmp_path / "no-such-key"}
    cases = [
        (FederatedStatistics([1, 6], **settings), "give bounds"),
        (FederatedStatistics(bounds="0:1", **settings), "give columns"),
        (FederatedHistogram(8, **settings), "give bins"),
        (FederatedHistogram(bins=[0, 1], **settings), "give columns"),
        (FederatedLinearRegression([1], target=2, target_bounds=(0, 9), **settings), "give bounds"),
        (FederatedLinearRegression([1], bounds="0:1", target=2, **settings), "give target_bounds"),
        (
            FederatedLinearRegression([1], bounds="0:1", target_bounds=(0, 9), **settings),
            "give target",
        ),
    ]
    for estimator, message in cases:
        with pytest.raises(ConfigError, match=message):
            estimator.fit()
    with pytest.raises(ConfigError, match="give bounds"):
        FederatedQuery(
            [FederatedStatistics([1]), FederatedHistogram(8, bins=[0, 1])], **settings
        ).fit()


def test_write_report_names_the_writer_of_aggregates(tmp_path: Any) -> None:
    """Found by an analyst's walkthrough: write_report of a fitted FederatedStatistics
    raised AttributeError about components_; the aggregate writer was not exported."""
    import fedpca.analyst as analyst

    for estimator in (
        FederatedStatistics([1], bounds="0:1"),
        FederatedQuery([FederatedHistogram(0, bins=[0, 1])]),
    ):
        with pytest.raises(ConfigError, match="write_aggregate_result"):
            analyst.write_report(tmp_path / "result.json", estimator)  # type: ignore[arg-type]
    assert analyst.write_aggregate_result.__module__ == "fedpca.analyst.aggregate_report"
    assert not (tmp_path / "result.json").exists()


def test_a_combined_query_refuses_settings_of_its_estimators_it_would_ignore(
    tmp_path: Any,
) -> None:
    """Found by an analyst's walkthrough: FederatedQuery([FederatedStatistics(...,
    epsilon=5.0)], epsilon=0.5) spent 0.5 and reported epsilon_ = 0.5 without a word.
    Refused before keys or the network (none exist here)."""
    settings = {"proxy": "127.0.0.1:1", "private_key_path": tmp_path / "no-such-key"}
    inner = FederatedStatistics([1], bounds="0:1", epsilon=5.0)
    with pytest.raises(ConfigError, match=r"FederatedStatistics\(epsilon=5\.0\): inside a"):
        FederatedQuery([inner], epsilon=0.5, **settings).fit()
    # The same settings as the query's, or the defaults, are no conflict: the error is
    # then about the missing key, after the check.
    for agreeing in (
        FederatedStatistics([1], bounds="0:1", epsilon=0.5, **settings),
        FederatedStatistics([1], bounds="0:1"),
    ):
        with pytest.raises(KeyFileError):
            FederatedQuery([agreeing], epsilon=0.5, **settings).fit()


def test_a_bounds_error_names_the_file_column() -> None:
    """Found by an analyst's walkthrough: ``--columns 1 --bounds 5:1`` was refused for
    "feature 0", the position of the pair, not the column it bounds."""
    with pytest.raises(ConfigError, match=r"bounds of column 3: .*got \[5\.0, 1\.0\]"):
        FederatedStatistics([3], bounds="5:1").aggregate()
    with pytest.raises(ConfigError, match=r"column 6: bounds must have lower < upper"):
        FederatedStatistics([1, 6], bounds=[(0, 17), (5, 1)]).aggregate()
    with pytest.raises(ConfigError, match=r"column 8: bounds must have lower < upper"):
        FederatedLinearRegression(
            [2, 8], bounds=[(0, 1), (9, 9)], target=3, target_bounds=(0, 1)
        ).aggregate()
