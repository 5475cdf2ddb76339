"""How far the privacy noise alone moves a PCA or DCA release's components and their
values, by a parametric bootstrap of the release.

Each draw adds fresh Gaussian noise of the release's public sigmas to what was
released (every value of every section of a stats-mode release; the upper triangle
of the centred scatter, mirrored, in masked mode, where N is exact and public) and
solves again as the estimator did (the same k, and for DCA the same ridges ρ and ρ′).
The spread of the redrawn solutions around the released one estimates the spread of
the released solution around the noise-free one. It is post-processing of the
release and the public sigmas, at no privacy charge, and says nothing of the records'
own sampling error.

Reported per component: the standard deviation of its value (explained variance for
PCA, generalized eigenvalue for DCA) and the root-mean-square angle, in degrees,
between the released component and the redrawn one of the same rank (sign ignored).
An angle near 90° says the noise decides that component's direction; two components
whose values the noise can swap both show large angles.

For PCA also a bound on how far the noise moves the explained variances, all at once
and including the upward push the noise gives the leading ones (which an sd does not
show): by Weyl's inequality no eigenvalue of a symmetric matrix moves by more than the
spectral norm of what is added to it, and clipping negative eigenvalues to 0 moves
none further. The bound is the 95th percentile, over the draws, of the spectral norm of
(redrawn covariance − released covariance). In masked mode that difference is the
noise itself divided by N − 1 (N exact), so the draws sample exactly the distribution
of the release's own noise on the covariance; in stats mode the centring uses the
released sums and count in place of the true ones, a first-order approximation like
the sd's. DCA gets no bound: its values solve a generalized problem, to which Weyl's
inequality does not apply as it stands.

No gRPC here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import scipy.linalg

from fedpca.analyst.decode import DecodedRelease
from fedpca.analyst.solvers import Covariance
from fedpca.codec.matrix import symmetric_from_upper_triangle
from fedpca.errors import DataError

__all__ = [
    "ComponentNoise",
    "component_noise",
    "default_draws",
    "redraw_release",
    "release_seed",
    "spectral_norm",
]

FloatArray = npt.NDArray[np.float64]
Solution = tuple[FloatArray, FloatArray]
"""(values (k,), components (k, M)) of one solve."""

MIN_DRAWS = 30
"""Fewest draws: a standard deviation from 30 draws has a relative error of about 13 %."""
MAX_DRAWS = 200
BOUND_QUANTILE = 0.95
"""The share of draws within the values' noise bound."""


@dataclass(frozen=True)
class ComponentNoise:
    """The spread the privacy noise alone gives a release's k components.

    Attributes
    ----------
    values_sd : (k,) standard deviation of each component's value (explained variance
        for PCA, generalized eigenvalue for DCA); None when a redraw failed.
    angles_degrees : (k,) root-mean-square angle between each released component and
        its redraws, in degrees (0 to 90); None when a redraw failed.
    draws : redraws made (0 without noise).
    failure : why a redraw could not be solved (the noise can make this release
        unusable, e.g. a class count or N at or below what the solver accepts); None
        when every redraw solved.
    values_bound : PCA: the noise bound on the explained variances (see the module):
        each is within ± this of its noise-free value, all of them at once, in 95 % of
        the draws; 0 without noise; None for DCA and when a redraw failed.
    """

    values_sd: FloatArray | None
    angles_degrees: FloatArray | None
    draws: int
    failure: str | None = None
    values_bound: float | None = None


def default_draws(n_features: int) -> int:
    """200 draws up to about 170 features, fewer above (each draw is one M x M
    eigendecomposition, whose cost grows as M³), never fewer than 30."""
    return min(MAX_DRAWS, max(MIN_DRAWS, int(1e9 / max(n_features, 1) ** 3)))


def release_seed(query_id: str, salt: str = "") -> int:
    """A seed derived from the query id: the same release gives the same spread every
    time it is reported (``fetch`` prints what the query's own command printed)."""
    return int.from_bytes(hashlib.sha256(f"{query_id}/{salt}".encode()).digest()[:8], "big")


def redraw_release(release: DecodedRelease, rng: np.random.Generator) -> DecodedRelease:
    """The release with fresh Gaussian noise of its public sigmas added once more."""
    if release.centred_scatter is not None:
        sigma = float(release.sigmas.get("scatter", 0.0))
        m = release.centred_scatter.shape[0]
        upper = np.triu(rng.normal(0.0, sigma, (m, m)))
        noise = upper + np.triu(upper, 1).T
        return dataclasses.replace(release, centred_scatter=release.centred_scatter + noise)
    if release.values is None:
        raise DataError(f"query {release.query.query_id!r} is not a PCA or DCA release")
    values = np.array(release.values, dtype=np.float64)
    for name, where in release.plan.statistics.section_slices().items():
        sigma = float(release.sigmas.get(name, 0.0))
        if sigma > 0.0:
            part = values[where]
            part += rng.normal(0.0, sigma, part.shape)
    return dataclasses.replace(release, values=values)


@contextlib.contextmanager
def _quiet_solver() -> Iterator[None]:
    """The solvers' warnings and log lines (e.g. k > C − 1, a class left out) were
    given for the release itself; its redraws repeat them hundreds of times."""
    solver_log = logging.getLogger("fedpca.analyst.solvers")
    previous = solver_log.disabled
    solver_log.disabled = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        solver_log.disabled = previous


def _angles_degrees(released: FloatArray, redrawn: FloatArray) -> FloatArray:
    """Per row, the angle between two directions, sign ignored, in degrees."""
    norms = np.linalg.norm(released, axis=1) * np.linalg.norm(redrawn, axis=1)
    cosine = np.abs(np.einsum("ij,ij->i", released, redrawn)) / norms
    return np.asarray(np.degrees(np.arccos(np.clip(cosine, 0.0, 1.0))), dtype=np.float64)


def spectral_norm(triangle: FloatArray) -> float:
    """The largest |eigenvalue| of the symmetric matrix whose row-major upper triangle
    ``triangle`` is."""
    m = (math.isqrt(8 * triangle.size + 1) - 1) // 2
    extremes = scipy.linalg.eigvalsh(symmetric_from_upper_triangle(triangle, m))
    return float(max(-extremes[0], extremes[-1]))


def component_noise(
    release: DecodedRelease,
    solve: Callable[[DecodedRelease], Solution],
    released: Solution,
    *,
    draws: int | None = None,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    covariance: Callable[[DecodedRelease], Covariance] | None = None,
) -> ComponentNoise:
    """Bootstrap the spread of ``released`` (what ``solve`` gave on ``release``).

    Parameters
    ----------
    release : the decrypted release.
    solve : solves a (redrawn) release as the estimator did: its values and components.
    released : ``solve(release)``, the solution reported.
    draws : redraws; default :func:`default_draws` of the release's M.
    seed : seeds the redraws (see :func:`release_seed`).
    progress : called with 1 after each draw (a progress bar's ``update``).
    covariance : PCA: the covariance whose eigenvalues are the values
        (:meth:`~fedpca.analyst.decode.DecodedRelease.pca_covariance`), for the values'
        noise bound; None: no bound.
    """
    values, components = released
    k = len(values)
    if not release.private or not any(float(s) > 0.0 for s in release.sigmas.values()):
        return ComponentNoise(
            np.zeros(k), np.zeros(k), 0, values_bound=None if covariance is None else 0.0
        )
    if draws is None:
        draws = default_draws(release.query.n_features)
    if draws < 2:
        raise DataError(f"noise sd draws must be at least 2, got {draws}")
    rng = np.random.default_rng(seed)
    released_covariance = None if covariance is None else covariance(release).triangle
    redrawn_values = np.empty((draws, k))
    angles = np.empty((draws, k))
    norms = np.empty(draws)
    for draw in range(draws):
        redrawn = redraw_release(release, rng)
        try:
            with _quiet_solver():
                again_values, again_components = solve(redrawn)
                if released_covariance is not None:
                    assert covariance is not None
                    moved = covariance(redrawn).triangle
                    moved -= released_covariance
                    norms[draw] = spectral_norm(moved)
        except DataError as error:
            return ComponentNoise(None, None, draw, failure=str(error))
        redrawn_values[draw] = again_values
        angles[draw] = _angles_degrees(components, again_components)
        if progress is not None:
            progress(1)
    values_sd = redrawn_values.std(axis=0, ddof=1)
    # A value the noise cannot move (DCA's components beyond C − 1 are 1 + ρ′/ρ by
    # construction) varies at rounding level only: 2e-15 was printed.
    values_sd[values_sd <= 1e-12 * np.maximum(np.abs(values), 1e-300)] = 0.0
    return ComponentNoise(
        values_sd=values_sd,
        angles_degrees=np.sqrt(np.mean(angles**2, axis=0)),
        draws=draws,
        values_bound=None if covariance is None else float(np.quantile(norms, BOUND_QUANTILE)),
    )
