"""PrivateLocalPCA historical baseline (Imtiaz & Sarwate 2016): merge algebra and noise."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.linalg

from fedpca.analyst.baseline import (
    private_local_pca_baseline,
    private_local_pca_merge,
    private_local_pca_owner_share,
)
from fedpca.data import load_dataset
from fedpca.errors import ConfigError, DataError
from fedpca.preprocess import preprocess


def _top_k(matrix: np.ndarray, k: int) -> np.ndarray:
    values, vectors = np.linalg.eigh(matrix)
    return vectors[:, np.argsort(values)[::-1][:k]]


def _max_angle(components: np.ndarray, basis: np.ndarray) -> float:
    return float(scipy.linalg.subspace_angles(components.T, basis).max())


def test_noise_free_merge_equals_pooled_top_k_when_owners_have_rank_k() -> None:
    rng = np.random.default_rng(0)
    d, k = 8, 3
    # Every owner's rows live in the same k-dim subspace, so each local rank-k
    # truncation is exact and the merged subspace must be the pooled one.
    basis = np.linalg.qr(rng.normal(size=(d, k)))[0]
    owners = [rng.normal(size=(n, k)) * [3.0, 2.0, 1.0] @ basis.T / 10 for n in (5, 40, 12, 3)]
    result = private_local_pca_baseline(owners, k, math.inf, rng)
    pooled = np.vstack(owners)
    assert _max_angle(result.components, _top_k(pooled.T @ pooled, k)) < 1e-10
    np.testing.assert_allclose(
        result.singular_values**2, np.linalg.eigvalsh(pooled.T @ pooled)[::-1][:k], rtol=1e-10
    )
    assert result.n_owners == 4


def test_noise_free_on_real_rows_matches_the_truncated_sum() -> None:
    x, _ = load_dataset("ionosphere")
    x = preprocess(x, None, 1.0)
    k = 4
    one = private_local_pca_baseline([x], k, math.inf, np.random.default_rng(0))
    # A single owner: exactly the top-k subspace of XᵀX.
    assert _max_angle(one.components, _top_k(x.T @ x, k)) < 1e-10

    owners = np.array_split(x, 3)
    merged = private_local_pca_baseline(owners, k, math.inf, np.random.default_rng(0))

    # Several full-rank owners: by construction P Pᵀ after owner l is the best rank-k
    # approximation of (previous P Pᵀ) + (X_lᵀX_l)_k, truncated again at every step,
    # which is not the top-k subspace of the pooled XᵀX in general.
    def truncate(matrix: np.ndarray) -> np.ndarray:
        values, vectors = np.linalg.eigh(matrix)
        top = np.argsort(values)[::-1][:k]
        return (vectors[:, top] * values[top]) @ vectors[:, top].T

    running = truncate(owners[0].T @ owners[0])
    for part in owners[1:]:
        running = truncate(running + truncate(part.T @ part))
    assert _max_angle(merged.components, _top_k(running, k)) < 1e-8
    # ...which on these rows is still close to the pooled subspace.
    assert _max_angle(merged.components, _top_k(x.T @ x, k)) < 0.2


def test_with_noise_shape_orthonormality_and_seed() -> None:
    rng = np.random.default_rng(1)
    owners = [preprocess(rng.normal(size=(30, 6)), None, 1.0) for _ in range(3)]
    a = private_local_pca_baseline(owners, 2, 0.5, np.random.default_rng(7))
    b = private_local_pca_baseline(owners, 2, 0.5, np.random.default_rng(7))
    c = private_local_pca_baseline(owners, 2, 0.5, np.random.default_rng(8))
    clean = private_local_pca_baseline(owners, 2, math.inf, np.random.default_rng(7))
    assert a.components.shape == (2, 6)
    np.testing.assert_allclose(a.components @ a.components.T, np.eye(2), atol=1e-12)
    np.testing.assert_array_equal(a.components, b.components)
    assert not np.allclose(np.abs(a.components), np.abs(c.components))
    # Wishart noise is PSD and, at this ε, large compared with the signal.
    assert (a.singular_values > clean.singular_values).all()


def test_wishart_noise_has_the_reference_scale() -> None:
    # E[W] = df · scale = (d + 1)/ε · I: check the noise actually added to XᵀX.
    d, eps = 3, 2.0
    x = np.zeros((1, d))
    rng = np.random.default_rng(3)
    draws = []
    for _ in range(400):
        p = private_local_pca_owner_share(x, d, eps, rng)
        draws.append(p @ p.T)
    mean = np.mean(draws, axis=0)
    np.testing.assert_allclose(mean, (d + 1) / eps * np.eye(d), atol=0.25)


def test_single_feature_and_merge_shapes() -> None:
    p = private_local_pca_owner_share(np.ones((4, 1)) * 0.5, 1, 1.0, np.random.default_rng(0))
    assert p.shape == (1, 1)
    merged = private_local_pca_merge(np.ones((5, 2)), np.eye(5)[:, :3], 2)
    assert merged.shape == (5, 2)


def test_errors() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ConfigError, match="epsilon"):
        private_local_pca_owner_share(np.ones((2, 2)), 1, 0.0, rng)
    with pytest.raises(ConfigError, match="n_components"):
        private_local_pca_owner_share(np.ones((2, 2)), 3, 1.0, rng)
    with pytest.raises(DataError, match="non-empty"):
        private_local_pca_owner_share(np.ones((0, 2)), 1, 1.0, rng)
    with pytest.raises(DataError, match="at least one owner"):
        private_local_pca_baseline([], 1, 1.0, rng)
    with pytest.raises(DataError, match="owner 1 has 3 features"):
        private_local_pca_baseline([np.ones((2, 2)), np.ones((2, 3))], 1, math.inf, rng)
    with pytest.raises(DataError, match="cannot merge"):
        private_local_pca_merge(np.ones((3, 1)), np.ones((4, 1)), 1)
