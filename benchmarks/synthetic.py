"""Synthetic tables with a spiked covariance for the scale benchmarks (fixed seeds).

Rows are ``x = z W^T + noise`` with ``k`` strong directions (the spikes) and unit
isotropic noise, then clipped to the public bounds ``[-bound, bound]`` that every
benchmark states in its query. Nothing here touches the network or the protocol.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

BOUND = 4.0
"""Public per-feature bounds of the synthetic tables: every value lies in [-BOUND, BOUND]."""


def spiked_rows(
    n_rows: int, n_features: int, *, seed: int, spikes: int = 3, strength: float = 3.0
) -> FloatArray:
    """``n_rows`` × ``n_features`` rows with ``spikes`` dominant directions, in the bounds.

    The spike directions are orthonormal and fixed by ``seed``; spike ``i`` has
    standard deviation ``strength / (i + 1)`` on top of unit noise, so the leading
    principal components are well separated.
    """
    rng = np.random.default_rng(seed)
    spikes = min(spikes, n_features)
    directions, _ = np.linalg.qr(rng.standard_normal((n_features, spikes)))
    scales = strength / np.arange(1, spikes + 1)
    latent = rng.standard_normal((n_rows, spikes)) * scales
    rows = latent @ directions.T + 0.5 * rng.standard_normal((n_rows, n_features))
    return np.clip(rows, -BOUND, BOUND)


def owner_tables(
    n_owners: int, rows_per_owner: int, n_features: int, *, seed: int
) -> list[FloatArray]:
    """One table per owner, cut from one spiked sample (the same directions for all)."""
    table = spiked_rows(n_owners * rows_per_owner, n_features, seed=seed)
    return [table[i * rows_per_owner : (i + 1) * rows_per_owner] for i in range(n_owners)]
