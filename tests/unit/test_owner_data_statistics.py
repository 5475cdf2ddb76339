"""Owner local statistics from preprocessed rows."""

from __future__ import annotations

import numpy as np
import pytest

from fedpca.errors import DataError
from fedpca.owner.statistics import local_statistics
from fedpca.preprocess import clip_rows
from fedpca.query import QueryKind, QuerySpec
from fedpca.stats import StatisticsSpec

LABELS = (-1.0, 1.0, 2.0)


def _rows(seed: int = 0, n: int = 40, m: int = 5) -> np.ndarray:
    return clip_rows(np.random.default_rng(seed).normal(size=(n, m)), 1.0)


def test_pca_statistics_are_the_defining_sums() -> None:
    x = _rows()
    stats = local_statistics(x, None, StatisticsSpec(QueryKind.PCA, 5))
    np.testing.assert_allclose(stats.scatter, x.T @ x, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(stats.scatter, stats.scatter.T)
    np.testing.assert_allclose(stats.sums, x.sum(axis=0), rtol=1e-12)
    assert stats.count == 40.0
    assert stats.class_sums is None


def test_dca_statistics_per_class() -> None:
    x = _rows(1)
    y = np.random.default_rng(1).choice(LABELS, size=40)
    stats = local_statistics(x, y, StatisticsSpec(QueryKind.DCA, 5, class_labels=LABELS))
    assert stats.class_sums is not None and stats.class_counts is not None
    for c, label in enumerate(LABELS):
        np.testing.assert_allclose(stats.class_sums[c], x[y == label].sum(axis=0), atol=1e-13)
        assert stats.class_counts[c] == (y == label).sum()
    np.testing.assert_allclose(stats.sums, x.sum(axis=0), atol=1e-12)
    assert stats.count == 40.0


def test_accepts_a_query_spec() -> None:
    q = QuerySpec(
        query_id="q",
        kind=QueryKind.DCA,
        n_features=5,
        epsilon=1.0,
        delta=1e-6,
        n_components=1,
        analyst_public_key_n=77,
        analyst_key_fingerprint="f",
        label_column=0,
        class_labels=LABELS,
    )
    x = _rows(2)
    stats = local_statistics(x, np.full(40, 2.0), q)
    assert stats.class_counts is not None
    np.testing.assert_array_equal(stats.class_counts, [0.0, 0.0, 40.0])


def test_unknown_label_names_the_record() -> None:
    y = np.full(40, 1.0)
    y[12] = 3.0
    spec = StatisticsSpec(QueryKind.DCA, 5, class_labels=LABELS)
    with pytest.raises(DataError, match=r"record 13 \(1-based\) has label 3.0"):
        local_statistics(_rows(), y, spec)
    with pytest.raises(DataError, match="needs class labels"):
        local_statistics(_rows(), None, spec)
    with pytest.raises(DataError, match="40 records but 39 labels"):
        local_statistics(_rows(), y[:39], spec)


def test_unclipped_rows_are_refused() -> None:
    x = _rows()
    x[4] *= 3.0
    spec = StatisticsSpec(QueryKind.PCA, 5, clip_norm=1.0)
    with pytest.raises(DataError, match=r"record 5 .* norm above clip_norm"):
        local_statistics(x, None, spec)
    # The same rows are fine under a larger public clip.
    local_statistics(x, None, StatisticsSpec(QueryKind.PCA, 5, clip_norm=3.0))


def test_shape_errors() -> None:
    spec = StatisticsSpec(QueryKind.PCA, 5)
    with pytest.raises(DataError, match="4 features, the query has 5"):
        local_statistics(_rows(m=4), None, spec)
    with pytest.raises(DataError, match="2-D"):
        local_statistics(np.zeros(5), None, spec)
    x = _rows()
    x[0, 0] = np.inf
    with pytest.raises(DataError, match="record 1"):
        local_statistics(x, None, spec)
