"""Historical comparison baseline: PrivateLocalPCA (Imtiaz & Sarwate, 2016).

.. warning::
   Later work showed that the Wishart mechanism *as published* does not
   satisfy differential privacy.  This module exists only to reproduce the
   published runtime/utility comparison against fedpca.  It is not a privacy
   mechanism and must never be used to release data.

The algorithm, as described in the literature the seed protocol compares
against:

1. Owner l forms C_l = X_lᵀX_l + W_l with W_l ~ Wishart(d + 1, (1/ε)·I)
   (d = number of features; the scale (1/ε)·I follows the reference code).
2. Owner l eigendecomposes C_l and keeps the top k eigenpairs:
   P_l = U_k S_k^{1/2}  (d×k), so that P_l P_lᵀ is the best rank-k
   approximation of C_l.
3. The P matrices travel sequentially from owner to owner; each owner merges
   the incoming one with its own: [P_prev, P_l] = U Σ Vᵀ (SVD), keep
   P = U_k Σ_k.  Then P Pᵀ is the best rank-k approximation of
   P_prev P_prevᵀ + P_l P_lᵀ.
4. The last P gives the subspace U_k.

Runtime therefore grows linearly with the number of owners, and every step
truncates to rank k: even without noise the final P Pᵀ is
(…((C_1)_k + (C_2)_k)_k + … + (C_L)_k)_k, where (·)_k is the best rank-k
approximation.  Its top-k subspace equals that of the pooled XᵀX exactly when
every local C_l has rank <= k (the truncations then lose nothing), and only
approximately otherwise.
Rows are expected to be preprocessed like fedpca's (‖x‖₂ <= 1), which is what
the Wishart calibration assumed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import scipy.stats

from fedpca.errors import ConfigError, DataError

__all__ = [
    "PrivateLocalPCABaselineResult",
    "private_local_pca_baseline",
    "private_local_pca_merge",
    "private_local_pca_owner_share",
]

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, eq=False)
class PrivateLocalPCABaselineResult:
    """Output of the PrivateLocalPCA baseline (historical, NOT differentially private).

    Attributes
    ----------
    components : (k, d) orthonormal rows spanning the merged subspace.
    singular_values : (k,) singular values of the final merged P; their squares
        approximate the top eigenvalues of Σ_l C_l.
    n_owners : number of owners merged.
    """

    components: FloatArray
    singular_values: FloatArray
    n_owners: int


def _check_epsilon(epsilon: float) -> None:
    if not (epsilon > 0):
        raise ConfigError(f"epsilon must be > 0 (or inf for no noise), got {epsilon}")


def _check_k(n_components: int, n_features: int) -> None:
    if not 1 <= n_components <= n_features:
        raise ConfigError(f"n_components must be in [1, {n_features}], got {n_components}")


def private_local_pca_owner_share(
    rows: npt.ArrayLike,
    n_components: int,
    epsilon: float,
    rng: np.random.Generator,
) -> FloatArray:
    """One owner's step of the PrivateLocalPCA baseline: P_l = U_k S_k^{1/2}.

    NOT differentially private (see the module docstring).

    Parameters
    ----------
    rows : (N_l, d) the owner's preprocessed records.
    n_components : k.
    epsilon : ε of the (flawed) Wishart mechanism; ``math.inf`` disables noise.
    rng : numpy Generator the Wishart noise is drawn from.

    Returns
    -------
    (d, k) P_l.
    """
    _check_epsilon(epsilon)
    x = np.asarray(rows, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0:
        raise DataError(f"expected a non-empty 2-D table of records, got shape {x.shape}")
    d = x.shape[1]
    _check_k(n_components, d)
    second_moment = x.T @ x
    if math.isfinite(epsilon):
        wishart = scipy.stats.wishart(df=d + 1, scale=np.eye(d) / epsilon)
        noise = np.asarray(wishart.rvs(random_state=rng), dtype=np.float64).reshape(d, d)
        second_moment = second_moment + noise
    eigenvalues, eigenvectors = np.linalg.eigh((second_moment + second_moment.T) / 2.0)
    top = np.argsort(eigenvalues)[::-1][:n_components]
    # Wishart noise keeps C_l PSD; the clip only absorbs rounding below zero.
    scale = np.sqrt(np.clip(eigenvalues[top], 0.0, None))
    return np.asarray(eigenvectors[:, top] * scale, dtype=np.float64)


def private_local_pca_merge(
    previous: npt.ArrayLike, share: npt.ArrayLike, n_components: int
) -> FloatArray:
    """Merge two PrivateLocalPCA baseline factors: SVD of [P_prev, P_l], keep U_k Σ_k.

    Parameters
    ----------
    previous, share : (d, k_a) and (d, k_b) factors.
    n_components : k.

    Returns
    -------
    (d, k) merged factor P with P Pᵀ the best rank-k approximation of
    P_prev P_prevᵀ + P_l P_lᵀ.
    """
    a = np.asarray(previous, dtype=np.float64)
    b = np.asarray(share, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0]:
        raise DataError(f"cannot merge factors of shapes {a.shape} and {b.shape}")
    _check_k(n_components, a.shape[0])
    u, s, _ = np.linalg.svd(np.hstack([a, b]), full_matrices=False)
    k = min(n_components, s.shape[0])
    return np.asarray(u[:, :k] * s[:k], dtype=np.float64)


def private_local_pca_baseline(
    owner_rows: Sequence[npt.ArrayLike],
    n_components: int,
    epsilon: float,
    rng: np.random.Generator,
) -> PrivateLocalPCABaselineResult:
    """Run the PrivateLocalPCA baseline over owners in order (sequential merge).

    Historical comparison only: the Wishart mechanism as published is not DP.

    Parameters
    ----------
    owner_rows : one (N_l, d) table per owner, in the order P is passed along.
    n_components : k.
    epsilon : per-owner ε of the Wishart mechanism; ``math.inf`` = no noise.
    rng : numpy Generator for all owners' Wishart draws (consumed in order).

    Returns
    -------
    PrivateLocalPCABaselineResult
    """
    if len(owner_rows) == 0:
        raise DataError("the baseline needs at least one owner")
    merged: FloatArray | None = None
    n_features: int | None = None
    for index, rows in enumerate(owner_rows):
        share = private_local_pca_owner_share(rows, n_components, epsilon, rng)
        if n_features is not None and share.shape[0] != n_features:
            raise DataError(
                f"owner {index} has {share.shape[0]} features, the first owner has {n_features}"
            )
        n_features = share.shape[0]
        merged = share if merged is None else private_local_pca_merge(merged, share, n_components)
    assert merged is not None
    # Re-orthonormalise and order the final factor: a single owner's P_l is
    # already U_k S_k^{1/2}, but taking the SVD makes both cases identical.
    u, s, _ = np.linalg.svd(merged, full_matrices=False)
    components = np.ascontiguousarray(u[:, :n_components].T)
    logger.debug("PrivateLocalPCA baseline merged %d owners", len(owner_rows))
    return PrivateLocalPCABaselineResult(
        components=components,
        singular_values=np.asarray(s[:n_components], dtype=np.float64),
        n_owners=len(owner_rows),
    )
