"""From the noisy sections of an aggregate release to statistics and regressions.

Pure post-processing of the differentially private release (no grpc, no files):
nothing here can weaken the guarantee. Owners sum scaled values: every bounded column
is clipped to its public bounds [lo, hi] and mapped onto [-1, 1] with
u = (x - m)/s, m = (hi + lo)/2, s = (hi - lo)/2 (:mod:`fedpca.aggregates`); the
functions here map back to the columns' own units.

Descriptive statistics
    mean = m + s·Σu/N; variance and covariance from the centred second moments,
    (Σuuᵀ − ΣuΣuᵀ/N)/(N − ddof), scaled by s_i s_j. With ``clip=True`` (the default,
    labelled in every result) the post-processing keeps them consistent: N at least 1,
    means inside the public bounds, variances in [0, s² · N/(N − ddof)], the covariance
    projected onto the positive semidefinite matrices (negative eigenvalues set to 0)
    and its rows and columns scaled down to those variances, correlations from that
    covariance.

Histograms
    The noisy counts are integers (discrete Gaussian noise on the integer grid).
    ``clamp=True`` (labelled) sets negative counts to 0.

Linear regression
    Ordinary least squares on the noisy sufficient statistics with a ridge regulariser
    chosen from public quantities and the noise scale only (never from the data):
    the augmented moment matrix A = Σ [1, u][1, u]ᵀ is released with symmetric noise
    E whose entries have the plan's standard deviations, and for a Gaussian series
    E = Σ_k g_k σ_k B_k (B_k the symmetric unit matrices) the matrix Gaussian series
    bound (Tropp 2012, Thm 4.1.1; it holds for the discrete Gaussian, whose moment
    generating function is bounded by the continuous one's) gives

        P(‖E‖₂ >= t) <= 2D exp(−t² / (2v)),   v = ‖Σ_k σ_k² B_k²‖₂,

    so with alpha = √(2v ln(2D/β)) the regularised A + alpha·I is positive
    semidefinite with probability at least 1 − β. This is the regulariser of AdaSSP
    (Wang 2018) without its private estimate of λ_min(XᵀX): that term needs budget
    of its own and a value derived from the data, and alpha/N → 0 as N grows anyway.
    Unlike AdaSSP's augmented design, the intercept is not penalised (the centred
    normal equations, as scikit-learn's Ridge): alpha is of the order of N at small
    epsilon, and shrinking the intercept would pull every prediction toward the
    midpoint of the target's bounds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fedpca.aggregates import COUNT, COUNTS, PRODUCTS, SQUARES, SUMS, X_SUMS, XTX, XTY, Y_SUM
from fedpca.codec.matrix import symmetric_from_upper_triangle
from fedpca.errors import ConfigError
from fedpca.query import Aggregate, AggregateKind, Moments

__all__ = [
    "DescriptiveStatistics",
    "HistogramCounts",
    "RegressionFit",
    "describe",
    "histogram_counts",
    "noise_spectral_bound",
    "regression_noise_sd",
    "solve_regression",
    "statistics_noise_sd",
]

FloatArray = npt.NDArray[np.float64]


def _centres_and_scales(
    lower: tuple[float, ...], upper: tuple[float, ...]
) -> tuple[FloatArray, FloatArray]:
    lo = np.asarray(lower, dtype=np.float64)
    hi = np.asarray(upper, dtype=np.float64)
    return (hi + lo) / 2.0, (hi - lo) / 2.0


def _symmetric(upper: FloatArray, n: int) -> FloatArray:
    return np.asarray(symmetric_from_upper_triangle(upper, n), dtype=np.float64)


# ------------------------------------------------------------------ statistics
@dataclass(frozen=True, eq=False)
class DescriptiveStatistics:
    """Descriptive statistics of the columns of one ``stats`` aggregate.

    Attributes
    ----------
    n_samples : the count N (noisy under add/remove, exact under replace-one).
    mean : (d,) in the columns' units.
    variance : (d,) or None (moments = mean).
    covariance, correlation : (d, d) or None (moments other than covariance).
    clipped : whether the consistency post-processing was applied.
    moved : the quantities it changed ("N", "N - ddof", "mean", "variance",
        "covariance", "correlation"): their noisy values lay outside their public
        ranges.
    n_samples_noise_sd, mean_noise_sd, variance_noise_sd : the standard deviation the
        privacy noise gives N, each mean and each variance (None without the noise's
        sigmas, or for variances with moments = mean); see :func:`statistics_noise_sd`.
    """

    n_samples: float
    mean: FloatArray
    variance: FloatArray | None
    covariance: FloatArray | None
    correlation: FloatArray | None
    clipped: bool
    moved: tuple[str, ...] = ()
    n_samples_noise_sd: float | None = None
    mean_noise_sd: FloatArray | None = None
    variance_noise_sd: FloatArray | None = None


def statistics_noise_sd(
    part: Aggregate,
    sigmas: Mapping[str, float],
    *,
    n: float,
    mean_u: FloatArray,
    var_u: FloatArray | None,
    divisor: float,
) -> tuple[float, FloatArray, FloatArray | None]:
    """How far the privacy noise alone moves N, the means and the variances (one
    standard deviation, in the columns' units), to first order (the delta method).

    The sections get independent noise: the count sd σ_N (0 where N is exact), each
    sum σ_S and each square (or diagonal product) σ_Q, in the scaled units u. With
    m = S/N and v = (Q − S²/N)/D, D = N − ddof, the first-order terms give

        sd(m) = √(σ_S² + m² σ_N²) / N,
        sd(v) = √(σ_Q² + 4 m² σ_S² + (m² − v)² σ_N²) / D

    (∂v/∂Q = 1/D, ∂v/∂S = −2m/D, ∂v/∂N = (m² − v)/D), evaluated at the released
    values and scaled by s and s². Post-processing of the release and of the public
    sigmas: nothing here costs budget. Not the sampling error of the records, only the
    noise's; first order, so it is rough when N is within a few σ_N of 0.
    """
    _, scale = _centres_and_scales(part.lower, part.upper)
    sd_n = float(sigmas.get(COUNT, 0.0))
    sd_s = float(sigmas.get(SUMS, 0.0))
    mean_sd = scale * np.sqrt(sd_s**2 + mean_u**2 * sd_n**2) / n
    if var_u is None:
        return sd_n, mean_sd, None
    sd_q = float(sigmas.get(SQUARES, sigmas.get(PRODUCTS, 0.0)))
    terms = sd_q**2 + 4.0 * mean_u**2 * sd_s**2 + (mean_u**2 - var_u) ** 2 * sd_n**2
    return sd_n, mean_sd, scale * scale * np.sqrt(terms) / divisor


def describe(
    part: Aggregate,
    sections: Mapping[str, FloatArray],
    *,
    ddof: int = 0,
    clip: bool = True,
    sigmas: Mapping[str, float] | None = None,
) -> DescriptiveStatistics:
    """Means, variances and covariances from a ``stats`` aggregate's noisy sections.

    Parameters
    ----------
    part : the aggregate (columns, bounds, moments).
    sections : its noisy sections by name ("count", "sums", "squares" or "products").
    ddof : the divisor is N − ddof (0 as numpy.var; 1 as numpy.cov).
    clip : apply the consistency post-processing (see the module docstring).
    sigmas : the noise's standard deviation by section name, for the ``*_noise_sd``
        fields (None: they are None).
    """
    if part.kind is not AggregateKind.STATS:
        raise ConfigError(f"describe needs a stats aggregate, got {part.kind.value}")
    d = len(part.columns)
    centre, scale = _centres_and_scales(part.lower, part.upper)
    moved: list[str] = []
    n = float(sections[COUNT][0])
    if clip and n < 1.0:
        n = 1.0
        moved.append("N")
    sums = np.asarray(sections[SUMS], dtype=np.float64)
    mean_u = sums / n
    if clip and np.any(np.abs(mean_u) > 1.0):
        mean_u = np.clip(mean_u, -1.0, 1.0)
        moved.append("mean")
    mean = centre + scale * mean_u
    divisor = n - ddof
    if clip and divisor < 1.0:
        divisor = 1.0
        moved.append("N - ddof")  # N itself is as released (or moved above)
    variance = covariance = correlation = None
    # The largest variance values in [-1, 1] can have: 1 (half at each end) times
    # N / (N - ddof): with ddof = 1, {lo, hi} has the sample variance (hi - lo)^2 / 2,
    # which a bound of (hi - lo)^2 / 4 clipped (found by review).
    most = max(n / divisor, 1.0)
    if part.moments is Moments.VARIANCE:
        var_u = (np.asarray(sections[SQUARES]) - sums * sums / n) / divisor
        if clip and np.any((var_u < 0.0) | (var_u > most)):
            var_u = np.clip(var_u, 0.0, most)
            moved.append("variance")
        variance = scale * scale * var_u
    elif part.moments is Moments.COVARIANCE:
        products = _symmetric(np.asarray(sections[PRODUCTS]), d)
        cov_u = (products - np.outer(sums, sums) / n) / divisor
        covariance = np.outer(scale, scale) * cov_u
        if clip:
            values, vectors = np.linalg.eigh(covariance)
            # Below float error of the largest (a constant or collinear column gives
            # -1e-17): not a move the analyst needs to hear about.
            if np.any(values < -1e-9 * max(float(np.abs(values).max()), np.finfo(float).tiny)):
                moved.append("covariance")
            covariance = (vectors * np.maximum(values, 0.0)) @ vectors.T
            covariance = (covariance + covariance.T) / 2.0
            # Variances at most (hi - lo)^2/4 = scale^2, as in the variance mode: each
            # row and column rescaled (D C D keeps C positive semidefinite and its
            # correlations). Before, only the projection ran and variances far above
            # what the bounds allow were reported as clipped (found by review).
            sd = np.sqrt(np.maximum(np.diag(covariance), 0.0))
            largest = scale * math.sqrt(most)
            with np.errstate(divide="ignore"):
                factor = np.where(sd > largest, largest / sd, 1.0)
            if np.any(factor < 1.0):
                moved.append("variance")
                covariance = covariance * np.outer(factor, factor)
        variance = np.diag(covariance).copy()
        with np.errstate(invalid="ignore", divide="ignore"):
            sd = np.sqrt(np.maximum(variance, 0.0))
            correlation = covariance / np.outer(sd, sd)
        if clip:
            # Off the diagonal, beyond float error (the diagonal is set to 1 below).
            off = ~np.eye(d, dtype=bool)
            if np.any(np.abs(np.nan_to_num(correlation[off])) > 1.0 + 1e-9):
                moved.append("correlation")
            correlation = np.clip(correlation, -1.0, 1.0)
            np.fill_diagonal(correlation, np.where(sd > 0, 1.0, np.nan))
    spread: tuple[float | None, FloatArray | None, FloatArray | None] = (None, None, None)
    if sigmas is not None:
        released_u = None if variance is None else variance / (scale * scale)
        spread = statistics_noise_sd(
            part, sigmas, n=n, mean_u=mean_u, var_u=released_u, divisor=divisor
        )
    return DescriptiveStatistics(
        n, mean, variance, covariance, correlation, clip, tuple(moved), *spread
    )


# ------------------------------------------------------------------ histograms
@dataclass(frozen=True, eq=False)
class HistogramCounts:
    """The noisy counts of one ``histogram`` aggregate.

    Attributes
    ----------
    raw_counts : the released noisy counts, shaped (categories?, bins_0, bins_1?).
    counts : ``raw_counts`` clamped at 0 if ``clamped``, else the same.
    clamped : whether negative counts were set to 0 (post-processing).
    """

    raw_counts: FloatArray
    counts: FloatArray
    clamped: bool


def histogram_counts(
    part: Aggregate, sections: Mapping[str, FloatArray], *, clamp: bool = True
) -> HistogramCounts:
    """The noisy counts of a histogram aggregate, shaped like numpy's histogramdd."""
    if part.kind is not AggregateKind.HISTOGRAM:
        raise ConfigError(f"histogram_counts needs a histogram aggregate, got {part.kind.value}")
    shape = part.bins_per_column
    if part.categories:
        shape = (len(part.categories), *shape)
    raw = np.rint(np.asarray(sections[COUNTS], dtype=np.float64)).reshape(shape)
    counts = np.maximum(raw, 0.0) if clamp else raw.copy()
    return HistogramCounts(raw, counts, clamp)


# ------------------------------------------------------------------ regression
def noise_spectral_bound(
    entry_sigmas: FloatArray, transform: FloatArray, tail_probability: float
) -> float:
    """t with P(‖T E Tᵀ‖₂ >= t) <= β for symmetric E with independent upper entries.

    Parameters
    ----------
    entry_sigmas : (n, n) symmetric: the standard deviation of each entry of E
        (entries on and above the diagonal independent, the lower mirror).
    transform : (D, n) the linear map T applied on both sides.
    tail_probability : β in (0, 1).

    Returns
    -------
    √(2 v ln(2D/β)) with v = ‖Σ_{i<=j} σ_ij² (T B_ij Tᵀ)²‖₂ (matrix Gaussian series
    bound; see the module docstring); 0 when every σ is 0.
    """
    if not 0 < tail_probability < 1:
        raise ConfigError(f"tail_probability must be in (0, 1), got {tail_probability}")
    sigma = np.asarray(entry_sigmas, dtype=np.float64)
    t = np.asarray(transform, dtype=np.float64)
    n = sigma.shape[0]
    dim = t.shape[0]
    total = np.zeros((dim, dim))
    for i in range(n):
        for j in range(i, n):
            if sigma[i, j] == 0:
                continue
            basis = np.outer(t[:, i], t[:, j])
            if i != j:
                basis = basis + basis.T
            total += sigma[i, j] ** 2 * (basis @ basis)
    variance = float(np.linalg.eigvalsh(total)[-1]) if total.any() else 0.0
    if variance <= 0:
        return 0.0
    return math.sqrt(2.0 * variance * math.log(2.0 * dim / tail_probability))


def _to_columns(centre: FloatArray, scale: FloatArray) -> FloatArray:
    """T with x = T [1, u]: the features in their own units from the scaled ones."""
    d = centre.shape[0]
    transform = np.zeros((d, d + 1))
    transform[:, 0] = centre
    transform[np.arange(d), np.arange(1, d + 1)] = scale
    return transform


@dataclass(frozen=True, eq=False)
class RegressionFit:
    """A linear model in the columns' units: y ≈ X @ coef + intercept.

    Attributes
    ----------
    coef : (d,) coefficients.
    intercept : the intercept (0 without one).
    alpha : the ridge regulariser used, in the space it was applied in (the scaled
        columns with an intercept, the columns' own units without).
    n_samples : the noisy count N.
    """

    coef: FloatArray
    intercept: float
    alpha: float
    n_samples: float


def solve_regression(
    part: Aggregate,
    sections: Mapping[str, FloatArray],
    sigmas: Mapping[str, float],
    *,
    alpha: float | str = "auto",
    fit_intercept: bool = True,
    tail_probability: float = 0.05,
) -> RegressionFit:
    """Least squares (ridge) from a ``linreg`` aggregate's noisy sufficient statistics.

    Parameters
    ----------
    part : the aggregate (features, target and their bounds).
    sections : its noisy sections ("count", "x_sums", "y_sum", "xtx", "xty").
    sigmas : the noise standard deviation of each of those sections (0: no noise).
    alpha : "auto" (the noise bound of the module docstring), or a fixed public
        regulariser >= 0 (0: plain least squares on the noisy statistics).
    fit_intercept : with an intercept, which is not penalised (the centred normal
        equations in the scaled space: scikit-learn's Ridge on the scaled columns), or
        through the origin of the columns' own units (alpha then applies there).
    tail_probability : β of the automatic regulariser.
    """
    if part.kind is not AggregateKind.LINREG:
        raise ConfigError(f"solve_regression needs a linreg aggregate, got {part.kind.value}")
    assert part.target_lower is not None and part.target_upper is not None
    d = len(part.columns)
    centre, scale = _centres_and_scales(part.lower, part.upper)
    y_centre = (part.target_upper + part.target_lower) / 2.0
    y_scale = (part.target_upper - part.target_lower) / 2.0
    n = float(sections[COUNT][0])
    x_sums = np.asarray(sections[X_SUMS], dtype=np.float64)
    moments = np.empty((d + 1, d + 1))
    moments[0, 0] = n
    moments[0, 1:] = moments[1:, 0] = x_sums
    moments[1:, 1:] = _symmetric(np.asarray(sections[XTX]), d)
    # Σ [1, u] v, the target's moments with the augmented features.
    cross = np.concatenate([np.asarray(sections[Y_SUM]), np.asarray(sections[XTY])])
    entry_sigmas = np.full((d + 1, d + 1), float(sigmas[XTX]))
    entry_sigmas[0, :] = entry_sigmas[:, 0] = float(sigmas[X_SUMS])
    entry_sigmas[0, 0] = float(sigmas[COUNT])
    if isinstance(alpha, str):
        if alpha != "auto":
            raise ConfigError(f"alpha must be 'auto' or a number >= 0, got {alpha!r}")
        transform = np.eye(d + 1) if fit_intercept else _to_columns(centre, scale)
        used = noise_spectral_bound(entry_sigmas, transform, tail_probability)
    else:
        used = float(alpha)
        if not (math.isfinite(used) and used >= 0):
            raise ConfigError(f"alpha must be 'auto' or a finite number >= 0, got {alpha!r}")
    if not fit_intercept:
        transform = _to_columns(centre, scale)
        # Σ x y with y = m_y + s_y v.
        target = transform @ (y_centre * moments[:, 0] + y_scale * cross)
        design = transform @ moments @ transform.T
        theta = np.linalg.lstsq(design + used * np.eye(d), target, rcond=None)[0]
        return RegressionFit(np.asarray(theta, dtype=np.float64), 0.0, used, n)
    # The intercept is not penalised (as scikit-learn's Ridge): the centred normal
    # equations of the scaled space. Post-processing keeps them meaningful after noise:
    # N >= 1, and the means of the scaled columns and target inside their bounds [-1, 1].
    count = max(n, 1.0)
    mean_x = np.clip(x_sums / count, -1.0, 1.0)
    mean_y = float(np.clip(cross[0] / count, -1.0, 1.0))
    centred = moments[1:, 1:] - count * np.outer(mean_x, mean_x)
    covariance = cross[1:] - count * mean_x * mean_y
    weights = np.linalg.lstsq(centred + used * np.eye(d), covariance, rcond=None)[0]
    theta0 = mean_y - weights @ mean_x
    coef = y_scale * weights / scale
    intercept = float(y_centre + y_scale * theta0 - coef @ centre)
    return RegressionFit(np.asarray(coef, dtype=np.float64), intercept, used, n)


def regression_noise_sd(
    part: Aggregate,
    sections: Mapping[str, FloatArray],
    sigmas: Mapping[str, float],
    fit: RegressionFit,
    *,
    fit_intercept: bool = True,
    draws: int | None = None,
    seed: int = 0,
) -> tuple[FloatArray, float, int]:
    """How far the privacy noise alone moves the coefficients and the intercept (one
    standard deviation each), by a parametric bootstrap of the release.

    Each draw adds fresh Gaussian noise of the sections' public sigmas to the released
    sections and solves again with the same regulariser (``fit.alpha``); the spread of
    the solutions estimates the spread of the estimator under the noise (the
    estimator's own clipping and centring included, which a closed form would miss).
    Post-processing of the release and the public sigmas, at no charge; ``seed`` makes
    it repeatable (the caller derives it from the query id). Not the records' sampling
    error; a ridge's bias toward 0 is not in it either.

    Returns the coefficients' and the intercept's standard deviations and the number
    of draws: ``draws``, or by default 200 up to 100 features and fewer above (each
    draw is one d × d solve; at least 30, a relative error of about 13 %).
    """
    d = len(part.columns)
    if not any(float(sigma) > 0.0 for sigma in sigmas.values()):
        return np.zeros(d), 0.0, 0
    if draws is None:
        draws = min(200, max(30, int(2e8 / (d + 1) ** 3)))
    rng = np.random.default_rng(seed)
    released = {name: np.asarray(values, dtype=np.float64) for name, values in sections.items()}
    coefs = np.empty((draws, d))
    intercepts = np.empty(draws)
    for draw in range(draws):
        noisy = {
            name: values + rng.normal(0.0, float(sigmas.get(name, 0.0)), values.shape)
            for name, values in released.items()
        }
        again = solve_regression(part, noisy, sigmas, alpha=fit.alpha, fit_intercept=fit_intercept)
        coefs[draw], intercepts[draw] = again.coef, again.intercept
    return coefs.std(axis=0, ddof=1), float(intercepts.std(ddof=1)), draws
