"""PCA / DCA from sufficient statistics against scikit-learn and a direct reference."""

from __future__ import annotations

import tracemalloc
import warnings

import numpy as np
import pytest
import scipy.linalg
from sklearn.decomposition import PCA

from fedpca.analyst.solvers import (
    DCAComponentsWarning,
    covariance_from_centred_scatter,
    covariance_from_statistics,
    covariance_from_upper_triangle,
    dca_from_statistics,
    pca_from_centred_scatter,
    pca_from_covariance,
    pca_from_statistics,
    pca_from_upper_triangle,
)
from fedpca.data import load_dataset
from fedpca.errors import ConfigError, DataError, UnusableReleaseError
from fedpca.preprocess import FeatureBounds, preprocess
from fedpca.query import QueryKind
from fedpca.stats import StatisticsSpec, SufficientStatistics, sum_statistics
from helpers import reference_statistics

_CACHE: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def _dataset(name: str) -> tuple[np.ndarray, np.ndarray]:
    if name not in _CACHE:
        x, y = load_dataset(name)
        assert y is not None
        _CACHE[name] = (x, y)
    return _CACHE[name]


def _rows(name: str, how: str) -> tuple[np.ndarray, float]:
    """Real rows, prepared as an owner would, and the clip norm they satisfy."""
    x, _ = _dataset(name)
    if how == "clip":
        return preprocess(x, None, clip_norm=1.0), 1.0
    if how == "bounds":
        # Test-only bounds from the data: enough to exercise the scaling path.
        bounds = FeatureBounds.from_arrays(x.min(axis=0) - 1.0, x.max(axis=0) + 1.0)
        return preprocess(x, bounds, clip_norm=2.0), 2.0
    # "raw": unscaled rows under a clip large enough to leave them untouched.
    return x, float(np.linalg.norm(x, axis=1).max()) * 1.01


def _owner_stats(x: np.ndarray, spec: StatisticsSpec, n_owners: int, seed: int = 0) -> list:
    order = np.random.default_rng(seed).permutation(len(x))
    cuts = np.sort(np.random.default_rng(seed + 1).choice(np.arange(1, len(x)), n_owners - 1))
    return [reference_statistics(x[part], None, spec) for part in np.split(order, cuts)]


def _assert_matches_sklearn(x: np.ndarray, stats: SufficientStatistics, k: int) -> None:
    ref = PCA(n_components=k, svd_solver="covariance_eigh").fit(x)
    ours = pca_from_statistics(stats, n_components=k)
    scale = float(ref.explained_variance_[0])
    assert ours.mean is not None
    np.testing.assert_allclose(ours.mean, ref.mean_, rtol=1e-10, atol=1e-12 * np.abs(x).max())
    np.testing.assert_allclose(
        ours.explained_variance, ref.explained_variance_, rtol=1e-10, atol=1e-12 * scale
    )
    np.testing.assert_allclose(
        ours.explained_variance_ratio, ref.explained_variance_ratio_, rtol=1e-10, atol=1e-14
    )
    np.testing.assert_allclose(
        ours.singular_values, ref.singular_values_, rtol=1e-10, atol=1e-12 * ref.singular_values_[0]
    )
    assert ours.noise_variance == pytest.approx(ref.noise_variance_, rel=1e-9, abs=1e-12 * scale)
    assert ours.n_samples == ref.n_samples_
    # Same deterministic sign convention, so components match with their signs.
    np.testing.assert_allclose(ours.components, ref.components_, atol=1e-9)


@pytest.mark.parametrize(
    ("name", "how", "k"),
    [
        ("ionosphere", "clip", 5),
        ("ionosphere", "raw", 5),
        ("australian", "clip", 4),
        ("australian", "bounds", 4),
        ("diabetes", "raw", 4),
        ("diabetes", "bounds", 4),
        ("german", "clip", 6),
        ("madelon", "bounds", 5),
    ],
)
def test_pca_equals_sklearn_covariance_eigh(name: str, how: str, k: int) -> None:
    x, clip = _rows(name, how)
    spec = StatisticsSpec(QueryKind.PCA, x.shape[1], clip)
    _assert_matches_sklearn(x, reference_statistics(x, None, spec), k)


@pytest.mark.parametrize(("name", "n_owners"), [("ionosphere", 3), ("german", 5), ("diabetes", 7)])
def test_pca_of_summed_owner_statistics_equals_sklearn_on_pooled_rows(
    name: str, n_owners: int
) -> None:
    x, clip = _rows(name, "clip")
    spec = StatisticsSpec(QueryKind.PCA, x.shape[1], clip)
    parts = _owner_stats(x, spec, n_owners)
    assert len(parts) == n_owners
    total = sum_statistics(parts)
    _assert_matches_sklearn(x, total, 5)
    # The released vector round trip (what the analyst decrypts) changes nothing.
    decoded = SufficientStatistics.from_vector(spec, total.to_vector(spec))
    _assert_matches_sklearn(x, decoded, 5)


def test_matrix_call_form_equals_statistics_call_form() -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(60, 4)) @ rng.normal(size=(4, 4))
    stats = SufficientStatistics(x.T @ x, x.sum(axis=0), len(x))
    a = pca_from_statistics(stats, n_components=2)
    b = pca_from_statistics(x.T @ x, x.sum(axis=0), len(x), 2)
    np.testing.assert_array_equal(a.components, b.components)
    np.testing.assert_array_equal(a.explained_variance, b.explained_variance)
    assert pca_from_statistics(stats).n_components == 4
    np.testing.assert_allclose(a.components @ a.components.T, np.eye(2), atol=1e-12)


def test_upper_triangle_form_equals_the_matrix_form_bit_for_bit() -> None:
    # The released layout (R as its upper triangle) gives the very numbers of the
    # mirrored matrix, noisy and indefinite included, without an M x M input.
    rng = np.random.default_rng(7)
    m = 9
    x = preprocess(rng.normal(size=(40, m)) * np.linspace(3, 0.1, m), None, 1.0)
    spec = StatisticsSpec(QueryKind.PCA, m)
    vec = reference_statistics(x, None, spec).to_vector(spec)
    vec += rng.normal(scale=0.5, size=vec.shape)
    noisy = SufficientStatistics.from_vector(spec, vec)
    triangle = vec[: m * (m + 1) // 2]
    for k in (1, 4, m):
        a = pca_from_statistics(noisy, n_components=k)
        b = pca_from_upper_triangle(triangle, noisy.sums, noisy.count, k)
        for name in ("components", "explained_variance", "explained_variance_ratio", "mean"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert a.noise_variance == b.noise_variance and a.n_samples == b.n_samples
    with pytest.raises(DataError, match="not the upper triangle"):
        pca_from_upper_triangle(triangle[:-1], noisy.sums, noisy.count)
    with pytest.raises(DataError, match="sums v must have shape"):
        pca_from_upper_triangle(triangle, noisy.sums[:-1], noisy.count)
    bad = triangle.copy()
    bad[3] = np.nan
    with pytest.raises(DataError, match="non-finite"):
        pca_from_upper_triangle(bad, noisy.sums, noisy.count)


def test_a_covariance_that_overflows_is_refused() -> None:
    # Finite statistics whose centring or scaling overflows: LAPACK would return NaN
    # eigenvalues without an error, so the solver refuses the covariance first.
    with pytest.raises(DataError, match="overflows"):
        pca_from_centred_scatter(np.diag([1.5e308, 1.0, 2.0]), 1.5)
    with pytest.raises(DataError, match="overflows"):
        pca_from_statistics(np.diag([1e308, 1.0, 2.0]), np.array([-1e308, 0.0, 0.0]), 1.2)


def test_pca_of_a_release_holds_one_packed_working_copy() -> None:
    # Memory, not time: numpy reports its allocations to tracemalloc, so the peak of a
    # PCA from the released triangle is deterministic. It must be one packed copy of the
    # covariance (M(M+1)/2 values, for LAPACK's packed eigensolver) plus O(M) workspace:
    # not an M x M matrix (twice as much), let alone a mirrored R next to one.
    m = 1000
    rng = np.random.default_rng(1)
    spec = StatisticsSpec(QueryKind.PCA, m)
    vec = rng.normal(size=spec.value_count)
    vec[-1] = 1e4
    triangle, sums = vec[: m * (m + 1) // 2], vec[m * (m + 1) // 2 : -1]
    packed_bytes = triangle.nbytes
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        pca_from_upper_triangle(triangle, sums, vec[-1], 5)
        peak = tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()
    assert packed_bytes < peak < 1.2 * packed_bytes < m * m * 8


def test_negative_eigenvalues_of_a_noisy_matrix_are_clipped() -> None:
    rng = np.random.default_rng(11)
    m = 6
    x = preprocess(rng.normal(size=(30, m)) * np.array([3, 1, 0.3, 0.1, 0.1, 0.1]), None, 1.0)
    spec = StatisticsSpec(QueryKind.PCA, m)
    vec = reference_statistics(x, None, spec).to_vector(spec)
    noisy = SufficientStatistics.from_vector(spec, vec + rng.normal(scale=2.0, size=vec.shape))
    # Independent eigenvalues of the noisy covariance.
    n = noisy.count
    cov = (noisy.scatter - np.outer(noisy.sums, noisy.sums) / n) / (n - 1)
    expected = np.sort(np.linalg.eigvalsh(cov))[::-1]
    assert (expected < 0).sum() >= 2, "the noise must make the covariance indefinite"

    result = pca_from_statistics(noisy, n_components=m)
    assert (result.explained_variance >= 0).all()
    positive = expected > 0
    np.testing.assert_allclose(result.explained_variance[positive], expected[positive], rtol=1e-10)
    assert (result.explained_variance[~positive] == 0).all()
    assert (result.singular_values[~positive] == 0).all()
    # Ratios are over the sum of the clipped eigenvalues, so they sum to one over all M.
    assert result.explained_variance_ratio.sum() == pytest.approx(1.0, rel=1e-12)
    np.testing.assert_allclose(
        result.explained_variance_ratio[positive], expected[positive] / expected[positive].sum()
    )
    np.testing.assert_allclose(result.components @ result.components.T, np.eye(m), atol=1e-10)
    top = np.abs(result.components).argmax(axis=1)
    assert (result.components[np.arange(m), top] > 0).all()


def test_centred_scatter_form_for_the_masked_mode() -> None:
    x, _ = _rows("australian", "clip")
    centred = (x - x.mean(axis=0)).T @ (x - x.mean(axis=0))
    ours = pca_from_centred_scatter(centred, len(x), 3)
    ref = PCA(n_components=3, svd_solver="covariance_eigh").fit(x)
    assert ours.mean is None
    np.testing.assert_allclose(ours.components, ref.components_, atol=1e-9)
    np.testing.assert_allclose(ours.explained_variance, ref.explained_variance_, rtol=1e-10)
    np.testing.assert_allclose(
        ours.explained_variance_ratio, ref.explained_variance_ratio_, rtol=1e-10
    )
    with pytest.raises(DataError, match="at least two records"):
        pca_from_centred_scatter(centred, 1.0, 3)


def test_wide_scatter_checks_reach_every_strip_and_leave_the_input_alone() -> None:
    # The square/finite/symmetric checks run strip by strip of rows: a defect in the
    # last strip is found, and the tolerance is relative to the largest entry anywhere.
    m = 300
    rng = np.random.default_rng(2)
    x = rng.normal(size=(400, m))
    centred = x.T @ x
    before = centred.copy()
    result = pca_from_centred_scatter(centred, 400.0, 4)
    assert np.array_equal(centred, before)
    reference = np.linalg.eigh(centred / 399.0)
    np.testing.assert_allclose(result.explained_variance, reference[0][::-1][:4], rtol=1e-10)
    np.testing.assert_allclose(
        np.abs(result.components @ reference[1][:, ::-1][:, :4]), np.eye(4), atol=1e-9
    )
    asymmetric = centred.copy()
    asymmetric[290, 3] += 1e-6 * np.abs(centred).max()
    with pytest.raises(DataError, match="not symmetric"):
        pca_from_centred_scatter(asymmetric, 400.0, 4)
    tolerated = centred.copy()
    tolerated[290, 3] += 1e-10 * np.abs(centred).max()
    pca_from_centred_scatter(tolerated, 400.0, 4)
    infinite = centred.copy()
    infinite[299, 299] = np.inf
    with pytest.raises(DataError, match="non-finite"):
        pca_from_centred_scatter(infinite, 400.0, 4)


@pytest.mark.parametrize("count", [1.0, 0.3, -5.0, np.nan])
def test_noisy_count_at_most_one_is_refused(count: float) -> None:
    with pytest.raises(DataError, match="at least two records"):
        pca_from_statistics(np.eye(3), np.zeros(3), count, 1)


def test_pca_argument_errors() -> None:
    stats = SufficientStatistics(np.eye(3), np.zeros(3), 10)
    with pytest.raises(ConfigError, match=r"n_components must be in \[1, 3\]"):
        pca_from_statistics(stats, n_components=4)
    with pytest.raises(ConfigError, match="either"):
        pca_from_statistics(stats, np.zeros(3), 10.0)
    with pytest.raises(ConfigError, match="required"):
        pca_from_statistics(np.eye(3), n_components=1)
    with pytest.raises(DataError, match="not symmetric"):
        pca_from_statistics(np.triu(np.ones((3, 3))), np.zeros(3), 10, 1)
    with pytest.raises(DataError, match=r"shape \(3,\)"):
        pca_from_statistics(np.eye(3), np.zeros(2), 10, 1)


# --- DCA ----------------------------------------------------------------------


def _reference_dca(
    x: np.ndarray, y: np.ndarray, k: int, rho: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Kung's DCA straight from pooled rows: scatter matrices built from the data."""
    mu = x.mean(axis=0)
    m = x.shape[1]
    s_w = np.zeros((m, m))
    s_b = np.zeros((m, m))
    for label in np.unique(y):
        xc = x[y == label]
        mu_c = xc.mean(axis=0)
        s_w += (xc - mu_c).T @ (xc - mu_c)
        s_b += len(xc) * np.outer(mu_c - mu, mu_c - mu)
    if rho is None:
        rho = 0.02 * np.linalg.eigvalsh(s_w).max()
    rho_prime = 0.1 * rho
    values, vectors = scipy.linalg.eigh(
        s_b + s_w + (rho + rho_prime) * np.eye(m), s_w + rho * np.eye(m)
    )
    idx = np.argsort(values)[::-1][:k]
    w = vectors[:, idx].T
    return w / np.linalg.norm(w, axis=1, keepdims=True), values[idx]


def _assert_same_directions(ours: np.ndarray, ref: np.ndarray, atol: float) -> None:
    # Unit vectors; compare up to sign.
    signs = np.sign(np.sum(ours * ref, axis=1))
    np.testing.assert_allclose(ours, ref * signs[:, None], atol=atol)


@pytest.mark.parametrize(
    ("name", "n_owners"), [("ionosphere", 1), ("australian", 4), ("german", 3)]
)
def test_dca_equals_reference_on_real_rows(name: str, n_owners: int) -> None:
    x_raw, y = _dataset(name)
    x = preprocess(x_raw, None, clip_norm=1.0)
    labels = (-1.0, 1.0)
    spec = StatisticsSpec(QueryKind.DCA, x.shape[1], 1.0, labels)
    parts = np.array_split(np.random.default_rng(2).permutation(len(x)), n_owners)
    stats = sum_statistics([reference_statistics(x[p], y[p], spec) for p in parts])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DCAComponentsWarning)
        result = dca_from_statistics(stats, n_components=1)
    ref_w, ref_values = _reference_dca(x, y, 1)
    _assert_same_directions(result.components, ref_w, atol=1e-7)
    np.testing.assert_allclose(result.eigenvalues, ref_values, rtol=1e-8)
    np.testing.assert_allclose(result.mean, x.mean(axis=0), atol=1e-12)
    assert result.n_samples == len(x)
    assert result.n_discriminant == 1


def _three_class_data(seed: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = np.array([[2.0, 0, 0, 0, 0], [0, 2.0, 0, 0, 1.0], [-1.0, -1.0, 1.0, 0, 0]])
    y = rng.choice([0.0, 1.0, 2.0], size=300)
    x = centres[y.astype(int)] + rng.normal(size=(300, 5)) * [1.0, 2.0, 0.5, 3.0, 1.0]
    return preprocess(x, None, clip_norm=4.0), y


def test_dca_equals_reference_with_three_classes_and_explicit_rho() -> None:
    x, y = _three_class_data()
    spec = StatisticsSpec(QueryKind.DCA, 5, 4.0, (0.0, 1.0, 2.0))
    stats = reference_statistics(x[:120], y[:120], spec) + reference_statistics(
        x[120:], y[120:], spec
    )
    for rho in (None, 5.0):
        result = dca_from_statistics(stats, n_components=2, rho=rho)
        ref_w, ref_values = _reference_dca(x, y, 2, rho)
        _assert_same_directions(result.components, ref_w, atol=1e-8)
        np.testing.assert_allclose(result.eigenvalues, ref_values, rtol=1e-9)
        np.testing.assert_allclose(np.linalg.norm(result.components, axis=1), 1.0)
        top = np.abs(result.components).argmax(axis=1)
        assert (result.components[np.arange(2), top] > 0).all()
    assert result.rho == 5.0 and result.rho_prime == 0.5


def test_dca_warns_beyond_c_minus_one_components() -> None:
    x, y = _three_class_data()
    spec = StatisticsSpec(QueryKind.DCA, 5, 4.0, (0.0, 1.0, 2.0))
    stats = reference_statistics(x, y, spec)
    with pytest.warns(DCAComponentsWarning, match="exceeds C − 1 = 2"):
        result = dca_from_statistics(stats, n_components=4)
    assert result.components.shape == (4, 5)
    # The extra components are still the reference formulation's next eigenvectors.
    ref_w, _ = _reference_dca(x, y, 4)
    _assert_same_directions(result.components, ref_w, atol=1e-7)


def test_dca_drops_classes_with_count_below_one() -> None:
    x, y = _three_class_data()
    y = np.where(y == 2.0, 1.0, y)  # class 2 is empty
    spec = StatisticsSpec(QueryKind.DCA, 5, 4.0, (0.0, 1.0, 2.0))
    stats = reference_statistics(x, y, spec)
    with pytest.warns(DCAComponentsWarning, match="C − 1 = 1"):
        result = dca_from_statistics(stats, n_components=2)
    ref_w, _ = _reference_dca(x, y, 2)
    _assert_same_directions(result.components, ref_w, atol=1e-7)
    assert result.n_discriminant == 1

    assert stats.class_sums is not None and stats.class_counts is not None
    lonely = SufficientStatistics.for_classes(
        stats.scatter, stats.class_sums, stats.class_counts * [1.0, 0.0, 0.0]
    )
    with pytest.raises(UnusableReleaseError, match="at least two classes") as raised:
        dca_from_statistics(lonely, n_components=1)
    counts = stats.class_counts * [1.0, 0.0, 0.0]
    assert f"class counts [{counts[0]:.4g}, 0, 0]" in str(raised.value)


def test_dca_on_noisy_statistics_stays_well_defined() -> None:
    x, y = _three_class_data()
    labels = (0.0, 1.0, 2.0)
    spec = StatisticsSpec(QueryKind.DCA, 5, 4.0, labels)
    vec = reference_statistics(x[:40], y[:40], spec).to_vector(spec)
    rng = np.random.default_rng(9)
    noisy = SufficientStatistics.from_vector(spec, vec + rng.normal(scale=5.0, size=vec.shape))
    s_w = noisy.scatter - sum(
        np.outer(s, s) / c
        for s, c in zip(noisy.class_sums, noisy.class_counts, strict=True)  # type: ignore[arg-type]
        if c >= 1
    )
    assert np.linalg.eigvalsh(s_w).min() < 0, "noise must make S_W indefinite"
    result = dca_from_statistics(noisy, n_components=2)
    assert np.isfinite(result.components).all()
    np.testing.assert_allclose(np.linalg.norm(result.components, axis=1), 1.0)
    assert result.rho > 0


def test_dca_argument_errors() -> None:
    pca_stats = SufficientStatistics(np.eye(3), np.zeros(3), 10)
    with pytest.raises(ConfigError, match="per-class"):
        dca_from_statistics(pca_stats, n_components=1)
    x, y = _three_class_data()
    stats = reference_statistics(x, y, StatisticsSpec(QueryKind.DCA, 5, 4.0, (0.0, 1.0, 2.0)))
    with pytest.raises(ConfigError, match="n_components"):
        dca_from_statistics(stats, n_components=6)
    with pytest.raises(ConfigError, match="rho must be"):
        dca_from_statistics(stats, n_components=1, rho=-1.0)
    with pytest.raises(ConfigError, match="rho_prime"):
        dca_from_statistics(stats, n_components=1, rho_prime=float("nan"))
    # Every class a single repeated point: S_W = 0, so the default rho is 0 too.
    pts = np.array([[0.5, 0.0], [0.0, 0.5]])
    yy = np.array([0.0, 0.0, 1.0, 1.0])
    flat = reference_statistics(
        pts[[0, 0, 1, 1]], yy, StatisticsSpec(QueryKind.DCA, 2, 1.0, (0, 1))
    )
    with pytest.raises(DataError, match="singular"):
        dca_from_statistics(flat, n_components=1)
    assert dca_from_statistics(flat, n_components=1, rho=0.1).components.shape == (1, 2)


def test_the_covariance_each_form_gives_is_the_sample_covariance() -> None:
    x, _ = _rows("australian", "clip")
    expected = np.cov(x, rowvar=False)
    upper = np.triu_indices(x.shape[1])
    stats = SufficientStatistics(scatter=x.T @ x, sums=x.sum(axis=0), count=float(len(x)))
    centred = (x - x.mean(axis=0)).T @ (x - x.mean(axis=0))
    forms = [
        covariance_from_statistics(stats),
        covariance_from_upper_triangle((x.T @ x)[upper], x.sum(axis=0), len(x)),
        covariance_from_centred_scatter(centred, len(x)),
    ]
    for covariance in forms:
        np.testing.assert_allclose(covariance.triangle, expected[upper], rtol=1e-9, atol=1e-12)
        assert covariance.n_features == x.shape[1] and covariance.n_samples == len(x)
    assert forms[2].mean is None and forms[0].mean is not None
    # The solver copies the triangle unless told it may overwrite it.
    kept = forms[0].triangle.copy()
    result = pca_from_covariance(forms[0], 2)
    assert np.array_equal(forms[0].triangle, kept)
    reference = PCA(n_components=2, svd_solver="covariance_eigh").fit(x)
    np.testing.assert_allclose(result.explained_variance, reference.explained_variance_)
    pca_from_covariance(forms[0], 2, overwrite=True)
    assert not np.array_equal(forms[0].triangle, kept)
