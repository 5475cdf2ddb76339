"""PCA and DCA from (noisy) sufficient statistics.

Everything here is post-processing of what the analyst decrypted, so it keeps
the DP guarantee of the release whatever it does.  The solvers therefore never
see raw rows; in particular the DCA ridge ρ is derived from the statistics they
are given, which under DP are the noisy ones.

PCA follows scikit-learn's ``PCA(svd_solver="covariance_eigh")`` exactly when
the statistics are noise-free, so that the no-noise mode (ε = inf) can be
verified against it:

    S = R − v vᵀ / N                    (centred scatter)
    C = S / (N − 1)                     (sample covariance)
    eigh(C), eigenvalues descending, negatives clipped to 0
    explained_variance_ratio = λ_k / Σ_all λ (clipped)
    signs: each component's largest-|·| entry is positive (sklearn's svd_flip
    with u_based_decision=False; the first such entry on ties).

DCA follows Kung's discriminant component analysis:

    S_B = Σ_c v_c v_cᵀ / N_c − v vᵀ / N   (between-class scatter)
    S_W = S − S_B = R − Σ_c v_c v_cᵀ / N_c (within-class scatter)
    components = top generalized eigenvectors of
        eigh(S_B + S_W + (ρ + ρ′) I,  S_W + ρ I)

with defaults ρ = 0.02·λmax(S_W) and ρ′ = 0.1·ρ.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import scipy.linalg

from fedpca.analyst.packed_eigen import packed_spectrum
from fedpca.codec.matrix import upper_triangle
from fedpca.errors import ConfigError, DataError, UnusableReleaseError
from fedpca.stats import SufficientStatistics

__all__ = [
    "Covariance",
    "DCAComponentsWarning",
    "DCAResult",
    "PCAResult",
    "check_n_components",
    "covariance_from_centred_scatter",
    "covariance_from_statistics",
    "covariance_from_upper_triangle",
    "dca_from_statistics",
    "pca_from_centred_scatter",
    "pca_from_covariance",
    "pca_from_statistics",
    "pca_from_upper_triangle",
]

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]

# A noisy class count below one record carries no usable class mean: dividing a
# noisy class sum by it would inject an arbitrarily large rank-one term.
_MIN_CLASS_COUNT = 1.0
# S_W + ρI must be numerically positive definite for the generalized problem.
_RIDGE_FLOOR_RELATIVE = 1e-12


class DCAComponentsWarning(UserWarning):
    """More DCA components than the C − 1 discriminant directions were requested."""


def _freeze(*arrays: FloatArray) -> None:
    for array in arrays:
        array.setflags(write=False)


def _flip_signs(components: FloatArray) -> FloatArray:
    """Make the largest-|·| entry of every row positive (svd_flip, u_based_decision=False)."""
    index = np.argmax(np.abs(components), axis=1)
    signs = np.sign(components[np.arange(components.shape[0]), index])
    signs[signs == 0] = 1.0  # an all-zero row has no sign to fix
    return components * signs[:, None]


def check_n_components(n_components: int | None, n_features: int) -> int:
    """``n_components`` as an int in [1, n_features] (None: all of them)."""
    if n_components is None:
        return n_features
    if isinstance(n_components, bool) or not isinstance(n_components, int | np.integer):
        raise ConfigError(f"n_components must be an integer, got {n_components!r}")
    if not 1 <= n_components <= n_features:
        raise ConfigError(f"n_components must be in [1, {n_features}], got {n_components}")
    return int(n_components)


def _check_count(count: float, what: str = "record count N") -> float:
    if not math.isfinite(count) or count <= 1.0:
        raise DataError(
            f"the {what} is {count}: at least two records are needed for a covariance "
            "(with noise, the noisy count may be this small when the true count is tiny "
            "or epsilon is very small; the release carries no usable signal)"
        )
    return float(count)


_CHECK_ROWS = 128
"""Rows checked at a time (2 MiB at M = 2,000) instead of whole-matrix temporaries."""


def _check_square(matrix: FloatArray, name: str) -> None:
    """Square, finite and symmetric to within 1e-9 of its largest |entry| (or of 1).

    Strip by strip of rows, so that no M x M temporary is made.
    """
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise DataError(f"{name} must be a square matrix, got shape {matrix.shape}")
    m = matrix.shape[0]
    strips = [slice(start, start + _CHECK_ROWS) for start in range(0, m, _CHECK_ROWS)]
    scale = 1.0
    for rows in strips:
        if not np.isfinite(matrix[rows]).all():
            raise DataError(f"{name} has non-finite entries")
        scale = max(scale, float(np.max(np.abs(matrix[rows]))))
    tolerance = 1e-9 * scale
    for rows in strips:
        if not (np.abs(matrix[rows] - matrix[:, rows].T) <= tolerance).all():
            raise DataError(f"{name} is not symmetric")


@dataclass(frozen=True, eq=False)
class PCAResult:
    """Principal components from sufficient statistics (sklearn PCA attribute names).

    Attributes
    ----------
    components : (k, M) orthonormal rows, descending variance.
    explained_variance : (k,) eigenvalues of S/(N−1), negatives clipped to 0.
    explained_variance_ratio : (k,) explained_variance / sum of ALL M clipped eigenvalues.
    singular_values : (k,) √(explained_variance·(N−1)), as sklearn reports them.
    mean : (M,) v / N, or None when the statistics do not reveal it (masked mode,
        :func:`pca_from_centred_scatter`).
    n_samples : N (a float: the noisy count under DP).
    noise_variance : mean of the discarded clipped eigenvalues (sklearn's
        probabilistic-PCA noise estimate; 0 when k = min(M, N)).
    n_eigenvalues_clipped : how many of the M eigenvalues were negative (noise larger
        than the variance in their directions) and were set to 0.
    """

    components: FloatArray
    explained_variance: FloatArray
    explained_variance_ratio: FloatArray
    singular_values: FloatArray
    mean: FloatArray | None
    n_samples: float
    noise_variance: float
    n_eigenvalues_clipped: int = 0

    @property
    def n_components(self) -> int:
        return int(self.components.shape[0])


def _pca_inputs(
    statistics: SufficientStatistics | npt.ArrayLike,
    sums: npt.ArrayLike | None,
    count: float | None,
) -> tuple[FloatArray, FloatArray, float]:
    if isinstance(statistics, SufficientStatistics):
        if sums is not None or count is not None:
            raise ConfigError("give either SufficientStatistics or (R, v, N), not both")
        _check_square(statistics.scatter, "scatter R")
        return statistics.scatter, statistics.sums, statistics.count
    if sums is None or count is None:
        raise ConfigError("pca_from_statistics(R, v, N): v and N are required with a matrix R")
    scatter = np.asarray(statistics, dtype=np.float64)
    _check_square(scatter, "scatter R")
    v = np.asarray(sums, dtype=np.float64)
    if v.shape != (scatter.shape[0],):
        raise DataError(f"sums v must have shape ({scatter.shape[0]},), got {v.shape}")
    return scatter, v, float(count)


@dataclass(frozen=True, eq=False)
class Covariance:
    """The sample covariance C that PCA decomposes, as its row-major upper triangle.

    C = (R − v vᵀ/N) / (N − 1) from the statistics, or S / (N − 1) from a centred
    scatter (masked mode). Noisy statistics give a C that is symmetric but need not be
    positive semi-definite; :func:`pca_from_covariance` clips its negative eigenvalues.

    Attributes
    ----------
    triangle : (M(M+1)/2,) C's upper triangle, i <= j, row by row.
    n_samples : N (> 1; the noisy count under DP in stats mode).
    mean : (M,) v / N, or None when the statistics do not reveal it (masked mode).
    """

    triangle: FloatArray
    n_samples: float
    mean: FloatArray | None

    @property
    def n_features(self) -> int:
        return (math.isqrt(8 * self.triangle.size + 1) - 1) // 2


def covariance_from_statistics(
    statistics: SufficientStatistics | npt.ArrayLike,
    sums: npt.ArrayLike | None = None,
    count: float | None = None,
) -> Covariance:
    """C = (R − v vᵀ/N) / (N − 1) from R = Σxxᵀ, v = Σx and N; called as
    :func:`pca_from_statistics` is. N <= 1 raises DataError (see there)."""
    scatter, v, n = _pca_inputs(statistics, sums, count)
    n, mean = _check_sums(v, n)
    return _covariance(_float_triangle(scatter), n, mean, v)


def covariance_from_upper_triangle(
    scatter_triangle: npt.ArrayLike, sums: npt.ArrayLike, count: float
) -> Covariance:
    """C from R given as its row-major upper triangle (the released layout), v and N,
    without an M x M matrix anywhere."""
    triangle = np.asarray(scatter_triangle, dtype=np.float64)
    m = (math.isqrt(8 * triangle.size + 1) - 1) // 2
    if triangle.ndim != 1 or m * (m + 1) // 2 != triangle.size:
        raise DataError(f"{triangle.shape} values are not the upper triangle of a scatter R")
    if not np.isfinite(triangle).all():
        raise DataError("scatter R has non-finite entries")
    v = np.asarray(sums, dtype=np.float64)
    if v.shape != (m,):
        raise DataError(f"sums v must have shape ({m},), got {v.shape}")
    n, mean = _check_sums(v, float(count))
    return _covariance(triangle.copy(), n, mean, v)


def covariance_from_centred_scatter(centred_scatter: npt.ArrayLike, count: float) -> Covariance:
    """C = S / (N − 1) from an already centred scatter S (+ noise) and N: the masked
    mode's release, whose mean the analyst never sees (``mean`` is None)."""
    scatter = np.asarray(centred_scatter, dtype=np.float64)
    _check_square(scatter, "centred scatter S")
    n = _check_count(float(count))
    return _covariance(_float_triangle(scatter), n, None, None)


def pca_from_statistics(
    statistics: SufficientStatistics | npt.ArrayLike,
    sums: npt.ArrayLike | None = None,
    count: float | None = None,
    n_components: int | None = None,
) -> PCAResult:
    """PCA from R = Σxxᵀ, v = Σx and N (equal to sklearn's covariance_eigh when noise-free).

    Call as ``pca_from_statistics(stats, n_components=k)`` or
    ``pca_from_statistics(R, v, N, k)``.

    Parameters
    ----------
    statistics : SufficientStatistics, or the (M, M) symmetric scatter R.
    sums : (M,) v, when ``statistics`` is a matrix.
    count : N, when ``statistics`` is a matrix.  Under DP this is the noisy
        count; N <= 1 (possible when noise dominates a tiny count) raises
        DataError rather than being clamped, because S/(N−1) would be
        meaningless (or flip sign) and a clamped value would hide that the
        release carries no signal.
    n_components : k, default all M.

    Returns
    -------
    PCAResult
    """
    covariance = covariance_from_statistics(statistics, sums, count)
    return pca_from_covariance(covariance, n_components, overwrite=True)


def pca_from_upper_triangle(
    scatter_triangle: npt.ArrayLike,
    sums: npt.ArrayLike,
    count: float,
    n_components: int | None = None,
) -> PCAResult:
    """PCA from R given as its row-major upper triangle (the released layout), v and N.

    The same numbers as :func:`pca_from_statistics` on the mirrored matrix, without an
    M x M matrix anywhere: the analyst keeps a release as its M(M+1)/2 values, and the
    eigensolver works on a packed copy of the covariance of the same size.

    Parameters
    ----------
    scatter_triangle : (M(M+1)/2,) the upper triangle of R, i <= j, row by row.
    sums : (M,) v.
    count : N (> 1; see :func:`pca_from_statistics`).
    n_components : k, default all M.
    """
    covariance = covariance_from_upper_triangle(scatter_triangle, sums, count)
    return pca_from_covariance(covariance, n_components, overwrite=True)


def _check_sums(v: FloatArray, count: float) -> tuple[float, FloatArray]:
    """N checked, and the read-only mean v / N."""
    n = _check_count(count)
    if not np.isfinite(v).all():
        raise DataError("sums v have non-finite entries")
    mean = v / n
    mean.setflags(write=False)
    return n, mean


def _centre(out: FloatArray, v: FloatArray, n: float) -> None:
    """R's upper triangle in ``out`` becomes C = (R − v vᵀ/N) / (N − 1)'s, in place.

    Row by row of the triangle, with the same operations, entry by entry, as
    (R − np.outer(v, v) / N) / (N − 1). With noise, S is symmetric (the noise E is) but
    need not be positive semi-definite; the clipping in pca_from_covariance handles that.
    """
    start = 0
    m = v.shape[0]
    for i in range(m):
        row = np.multiply(v[i], v[i:])
        row /= n
        out[start : start + m - i] -= row
        start += m - i
    out /= n - 1.0


def pca_from_centred_scatter(
    centred_scatter: npt.ArrayLike, count: float, n_components: int | None = None
) -> PCAResult:
    """PCA from an already centred scatter S = Σ(x−μ)(x−μ)ᵀ (+ noise) and N.

    This is what the analyst holds in the masked protocol mode, where it
    computes S + E = (R + G + E) − v′v′ᵀ/N and never sees the unmasked v: the
    result's ``mean`` is therefore None.  Same conventions as
    :func:`pca_from_statistics` (which it equals when S = R − vvᵀ/N).

    Parameters
    ----------
    centred_scatter : (M, M) symmetric S.
    count : N (> 1; see :func:`pca_from_statistics`).
    n_components : k, default all M.
    """
    covariance = covariance_from_centred_scatter(centred_scatter, count)
    return pca_from_covariance(covariance, n_components, overwrite=True)


def _float_triangle(matrix: FloatArray) -> FloatArray:
    """A new float64 copy of a square matrix's row-major upper triangle."""
    m = matrix.shape[0]
    out = np.empty(m * (m + 1) // 2, dtype=np.float64)
    upper_triangle(matrix, out=out)
    return out


def _covariance(
    triangle: FloatArray, n: float, mean: FloatArray | None, sums: FloatArray | None
) -> Covariance:
    """R's (``sums`` given: centred by them) or S's upper triangle, a copy of the
    caller's, made C's in place and checked finite."""
    with np.errstate(over="ignore", invalid="ignore"):  # reported below, as an error
        if sums is None:
            triangle /= n - 1.0
        else:
            _centre(triangle, sums, n)
    # Finite inputs can still overflow when centred or scaled; LAPACK would return NaN.
    if not np.isfinite(triangle).all():
        raise DataError("the covariance overflows float64: the statistics are out of range")
    return Covariance(triangle, n, mean)


def pca_from_covariance(
    covariance: Covariance, n_components: int | None = None, *, overwrite: bool = False
) -> PCAResult:
    """PCA of a :class:`Covariance`.

    Every eigenvalue is needed (the explained variance ratio and the noise variance
    are over all of them) but only k eigenvectors: one reduction of the packed
    triangle (M(M+1)/2 values) to tridiagonal form gives both
    (:func:`fedpca.analyst.packed_eigen.packed_spectrum`). numpy's eigh would compute
    all M eigenvectors with four M x M arrays (128 MiB at M = 2,000) and take about 20
    times as long; scipy's eigh works on the full matrix, twice the packed triangle.

    Parameters
    ----------
    covariance : the covariance.
    n_components : k, default all M.
    overwrite : let the eigensolver overwrite ``covariance.triangle`` (no copy of it).
    """
    m, n, mean = covariance.n_features, covariance.n_samples, covariance.mean
    k = check_n_components(n_components, m)
    buffer = covariance.triangle if overwrite else covariance.triangle.copy()
    eigenvalues, components = packed_spectrum(buffer, k)
    del buffer
    negative = eigenvalues < 0.0
    if negative.any():
        logger.debug("clipping %d negative covariance eigenvalues to 0", int(negative.sum()))
    eigenvalues[negative] = 0.0
    components = _flip_signs(components)

    total = float(eigenvalues.sum())
    ratio = eigenvalues / total if total > 0 else np.zeros_like(eigenvalues)
    singular_values = np.sqrt(eigenvalues * (n - 1.0))
    noise_variance = float(eigenvalues[k:].mean()) if k < min(m, n) else 0.0

    result_components = np.ascontiguousarray(components[:k])
    explained = eigenvalues[:k].copy()
    ratio_k = ratio[:k].copy()
    singular_k = singular_values[:k].copy()
    _freeze(result_components, explained, ratio_k, singular_k)
    return PCAResult(
        components=result_components,
        explained_variance=explained,
        explained_variance_ratio=ratio_k,
        singular_values=singular_k,
        mean=mean,
        n_samples=n,
        noise_variance=noise_variance,
        n_eigenvalues_clipped=int(negative.sum()),
    )


@dataclass(frozen=True, eq=False)
class DCAResult:
    """Discriminant components from per-class sufficient statistics.

    Attributes
    ----------
    components : (k, M) unit-norm rows (not orthogonal in general), ordered by
        descending generalized eigenvalue; largest-|·| entry of each positive.
    eigenvalues : (k,) generalized eigenvalues λ of
        (S_B + S_W + (ρ+ρ′)I) w = λ (S_W + ρI) w, descending.  λ − 1 is the
        regularised discriminant ratio (wᵀ(S_B+ρ′I)w)/(wᵀ(S_W+ρI)w).
    mean : (M,) pooled mean v / N.
    rho, rho_prime : the ridge parameters used.
    n_samples : N = Σ_c N_c (noisy under DP).
    class_counts : (C,) the per-class counts used (noisy under DP).
    n_discriminant : number of classes with usable counts minus one: the number
        of components carrying between-class information.
    """

    components: FloatArray
    eigenvalues: FloatArray
    mean: FloatArray
    rho: float
    rho_prime: float
    n_samples: float
    class_counts: FloatArray
    n_discriminant: int

    @property
    def n_components(self) -> int:
        return int(self.components.shape[0])


def _psd_part(matrix: FloatArray) -> FloatArray:
    """Project a symmetric matrix onto the PSD cone (clip negative eigenvalues)."""
    eigenvalues, eigenvectors = np.linalg.eigh(matrix)
    clipped = np.clip(eigenvalues, 0.0, None)
    projected = (eigenvectors * clipped) @ eigenvectors.T
    return np.asarray((projected + projected.T) / 2.0, dtype=np.float64)


def dca_from_statistics(
    statistics: SufficientStatistics,
    n_components: int,
    rho: float | None = None,
    rho_prime: float | None = None,
) -> DCAResult:
    """Kung's discriminant component analysis from per-class statistics.

    Parameters
    ----------
    statistics : SufficientStatistics with ``class_sums`` (C, M) and
        ``class_counts`` (C,), e.g. the decrypted noisy release of a DCA query.
    n_components : k, 1 <= k <= M.
    rho : ridge on S_W; default 0.02·λmax(S_W), computed from ``statistics``.
        Under DP those are the noisy statistics, so ρ is itself post-processing
        of the release and is never derived from un-noised data.
    rho_prime : ridge on S_B; default 0.1·ρ.

    Returns
    -------
    DCAResult

    Notes
    -----
    Rule for k > C − 1: allowed, with a :class:`DCAComponentsWarning`.  S_B has
    rank at most C − 1, so only C − 1 directions carry between-class signal;
    the further ones are ordered by the ρ′ ridge alone (directions of small
    within-class variance), which Kung's formulation defines deliberately.  The
    solver warns instead of refusing because it runs after the privacy budget
    was spent; refusing such k belongs to query validation, before the release.
    Here C counts classes whose (noisy) count is at least 1: a class below that
    is left out of S_B (logged), and fewer than two usable classes is an error.

    Under noise S_W may be indefinite; it is projected onto the PSD cone before
    ρ is derived and the pencil formed (noise-free S_W is PSD up to rounding, so
    the projection changes nothing there).  The left matrix is then
    S_B + S_W_psd + (ρ+ρ′)I, keeping the pencil (S_B + ρ′I, S_W + ρI) intact.
    """
    if statistics.class_sums is None or statistics.class_counts is None:
        raise ConfigError("DCA needs per-class statistics (class_sums and class_counts)")
    scatter = statistics.scatter
    m = scatter.shape[0]
    k = check_n_components(n_components, m)
    class_sums = statistics.class_sums
    class_counts = statistics.class_counts
    if not (np.isfinite(class_sums).all() and np.isfinite(class_counts).all()):
        raise DataError("per-class statistics have non-finite entries")
    _check_square(scatter, "scatter R")

    usable = class_counts >= _MIN_CLASS_COUNT
    if not usable.all():
        logger.warning(
            "leaving %d class(es) with count < %g out of the between-class scatter",
            int((~usable).sum()),
            _MIN_CLASS_COUNT,
        )
    if usable.sum() < 2:
        shown = ", ".join(f"{c:.4g}" for c in class_counts)
        raise UnusableReleaseError(
            f"DCA needs at least two classes with count >= {_MIN_CLASS_COUNT}, got noisy "
            f"class counts [{shown}] in the order of the query's classes: a count near 0 "
            "is usually a class the owners' labels do not hold (e.g. classes 0,1 for "
            "labels -1,1)",
            still_gives=(
                "--as-pca",
                "the principal components of the records of the query's classes",
            ),
        )
    v = statistics.sums
    n = _check_count(statistics.count, "record count N = Σ_c N_c")

    # Σ_c v_c v_cᵀ / N_c over usable classes: the part of R explained by class means.
    class_means_scatter = np.zeros((m, m))
    for v_c, n_c in zip(class_sums[usable], class_counts[usable], strict=True):
        class_means_scatter += np.outer(v_c, v_c) / n_c
    between = class_means_scatter - np.outer(v, v) / n
    within = scatter - class_means_scatter
    between = (between + between.T) / 2.0
    within = _psd_part((within + within.T) / 2.0)

    lambda_max_within = float(np.linalg.eigvalsh(within)[-1])
    chosen = rho is not None
    if rho is None:
        rho = 0.02 * lambda_max_within
    if not (math.isfinite(rho) and rho >= 0.0):
        raise ConfigError(f"rho must be finite and >= 0, got {rho}")
    if rho_prime is None:
        rho_prime = 0.1 * rho
    if not (math.isfinite(rho_prime) and rho_prime >= 0.0):
        raise ConfigError(f"rho_prime must be finite and >= 0, got {rho_prime}")
    right = within + rho * np.eye(m)
    floor = _RIDGE_FLOOR_RELATIVE * max(lambda_max_within, float(np.max(np.abs(scatter))), 1.0)
    if float(np.linalg.eigvalsh(right)[0]) <= floor:
        raise DataError(
            f"S_W + rho·I is singular (rho = {rho}): "
            + (
                "pass a larger rho"
                if chosen
                else "the within-class scatter has no variance to regularise against (the "
                "default rho is 0.02 of its largest eigenvalue); pass a positive rho"
            )
            + " (`--rho` of `fedpca analyst dca` and `fetch`)"
        )
    left = between + within + (rho + rho_prime) * np.eye(m)

    n_discriminant = int(usable.sum()) - 1
    if k > n_discriminant:
        warnings.warn(
            f"n_components={k} exceeds C − 1 = {n_discriminant}: components beyond the "
            f"first {n_discriminant} carry no between-class information (ordered by the "
            "rho' ridge only)",
            DCAComponentsWarning,
            stacklevel=2,
        )

    eigenvalues, eigenvectors = scipy.linalg.eigh(left, right)
    order = np.argsort(eigenvalues)[::-1][:k]
    top = eigenvectors[:, order].T
    top = top / np.linalg.norm(top, axis=1, keepdims=True)
    components = np.ascontiguousarray(_flip_signs(top))
    top_eigenvalues = np.asarray(eigenvalues[order], dtype=np.float64)
    mean = v / n
    counts = class_counts.copy()
    _freeze(components, top_eigenvalues, mean, counts)
    return DCAResult(
        components=components,
        eigenvalues=top_eigenvalues,
        mean=mean,
        rho=float(rho),
        rho_prime=float(rho_prime),
        n_samples=n,
        class_counts=counts,
        n_discriminant=n_discriminant,
    )
