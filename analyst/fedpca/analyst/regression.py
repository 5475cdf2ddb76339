"""Private linear (ridge) regression from noisy sufficient statistics.

:class:`FederatedLinearRegression` is shaped like scikit-learn's LinearRegression
(``fit`` returns self; ``coef_``, ``intercept_``, ``predict``, ``score``), but ``fit``
takes no data: the owners release noisy N, Σx, Σy, XᵀX and Xᵀy, and the model is
solved from them (:func:`fedpca.analyst.aggregates.solve_regression`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fedpca.aggregates import COUNT
from fedpca.analyst.aggregate_estimators import (
    COMMON_PARAMETERS_DOC,
    AggregateEstimator,
)
from fedpca.analyst.aggregates import regression_noise_sd, solve_regression
from fedpca.analyst.component_noise import release_seed
from fedpca.analyst.decode import DecodedRelease
from fedpca.analyst.params import check_number
from fedpca.analyst.schema import ColumnBoundsParam, column_bounds, column_indices, required
from fedpca.errors import ConfigError, DataError
from fedpca.query import DEFAULT_QUERY_DELTA, Aggregate, Calibration

__all__ = ["FederatedLinearRegression"]

FloatArray = npt.NDArray[np.float64]


# ---------------------------------------------------------------- regression
class FederatedLinearRegression(AggregateEstimator):
    """Private linear (ridge) regression from noisy sufficient statistics (AdaSSP-style).

    Parameters
    ----------
    columns : 0-based file columns of the features.
    bounds : public bounds of the features (as :class:`FederatedStatistics`).
    target : 0-based file column of the target.
    target_bounds : (lo, hi) public bounds of the target.

    ``columns``, ``bounds``, ``target`` and ``target_bounds`` are required: public
    facts only the analyst knows, with no default that could be right.
    fit_intercept : fit an intercept (as scikit-learn).
    alpha : "auto" (a ridge at the noise's spectral bound: the noisy XᵀX + alpha·I is
        positive semidefinite with probability 1 − tail_probability), or a fixed
        public regulariser >= 0 (0: least squares on the noisy statistics).
    tail_probability : β of the automatic regulariser.
    budget_split : relative budget weights of "count", "x_sums", "y_sum", "xtx" and
        "xty" (default equal shares).
    """

    def __init__(
        self,
        columns: int | Sequence[int] | None = None,
        *,
        bounds: ColumnBoundsParam = None,
        target: int | None = None,
        target_bounds: Sequence[float] | None = None,
        fit_intercept: bool = True,
        alpha: float | str = "auto",
        tail_probability: float = 0.05,
        budget_split: Mapping[str, float] | Sequence[float] | None = None,
        epsilon: float | None = None,
        delta: float = DEFAULT_QUERY_DELTA,
        calibration: str = Calibration.ZCDP.value,
        neighbouring: str | None = None,
        bounded_owner_tables: bool = False,
        quorum: int | None = None,
        deadline_seconds: float = 300.0,
        wait_for_owners: bool = False,
        max_records_per_owner: int = 1 << 20,
        max_owners: int = 1 << 8,
        frac_bits: int = 32,
        proxy: str | None = None,
        ca: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        insecure: bool = False,
        server_name_override: str | None = None,
        private_key_path: str | Path | None = None,
        n_jobs: int | None = None,
        verbose: bool = False,
        on_status: Any = None,
    ) -> None:
        self.columns = columns
        self.bounds = bounds
        self.target = target
        self.target_bounds = target_bounds
        self.fit_intercept = fit_intercept
        self.alpha = alpha
        self.tail_probability = tail_probability
        self.budget_split = budget_split
        self._store_settings(locals())

    def check_post_processing(self) -> None:
        alpha = self.alpha
        if isinstance(alpha, str):
            if alpha != "auto":
                raise ConfigError(f"alpha must be 'auto' or a number >= 0, got {alpha!r}")
            check_number(self.tail_probability, "tail_probability", low=0.0, high=1.0)
        else:  # numpy scalars too, as the solver takes them (review)
            check_number(alpha, "alpha", low=0.0, low_open=False)

    def aggregate(self) -> Aggregate:
        columns = column_indices(self.columns, "columns")
        lower, upper = column_bounds(self.bounds, columns, "bounds")
        target = required(self.target, "target", "the 0-based column to predict")
        target_bounds = required(
            self.target_bounds, "target_bounds", "the target's public (lo, hi)"
        )
        try:
            target_lo, target_hi = (float(v) for v in target_bounds)
        except (TypeError, ValueError):
            raise ConfigError(
                f"target_bounds must be (lo, hi), got {self.target_bounds!r}"
            ) from None
        return Aggregate.linear_regression(columns, lower, upper, int(target), target_lo, target_hi)

    @classmethod
    def _params_from_aggregate(cls, part: Aggregate) -> dict[str, Any]:
        return {
            "columns": part.columns,
            "bounds": list(zip(part.lower, part.upper, strict=True)),
            "target": part.target_column,
            "target_bounds": (part.target_lower, part.target_upper),
        }

    def _solve(
        self,
        part: Aggregate,
        sections: Mapping[str, FloatArray],
        release: DecodedRelease,
        index: int,
    ) -> None:
        sigmas = self.noise_sigmas_
        fit = solve_regression(
            part,
            sections,
            sigmas,
            alpha=self.alpha,
            fit_intercept=bool(self.fit_intercept),
            tail_probability=float(self.tail_probability),
        )
        self.coef_ = fit.coef
        self.intercept_ = fit.intercept
        # Seeded by the query and the aggregate: a fetch prints the same spread.
        seed = release_seed(release.query.query_id, str(index))
        self.coef_noise_sd_, self.intercept_noise_sd_, self.noise_sd_draws_ = regression_noise_sd(
            part, sections, sigmas, fit, fit_intercept=bool(self.fit_intercept), seed=seed
        )
        self.alpha_ = fit.alpha
        self.n_samples_ = fit.n_samples
        # The count is released as a section of its own: its sigma is N's noise sd.
        self.n_samples_noise_sd_ = float(sigmas.get(COUNT, 0.0))
        self.n_features_in_ = len(part.columns)

    def _check_X(self, X: npt.ArrayLike) -> FloatArray:
        self._check_fitted()
        x = np.asarray(X, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.n_features_in_:
            raise DataError(f"X must have shape (n, {self.n_features_in_}), got {x.shape}")
        return x

    def predict(self, X: npt.ArrayLike) -> FloatArray:
        """X @ coef_ + intercept_ for rows X (n, d) in the features' own units."""
        return np.asarray(self._check_X(X) @ self.coef_ + self.intercept_, dtype=np.float64)

    def score(self, X: npt.ArrayLike, y: npt.ArrayLike) -> float:
        """The coefficient of determination R² of the predictions on (X, y).

        Computed on the analyst's own data (as scikit-learn's ``score``), so it needs no
        budget. 1 is perfect; a model worse than predicting the mean of y is negative.
        """
        target = np.asarray(y, dtype=np.float64).reshape(-1)
        predicted = self.predict(X)
        if predicted.shape != target.shape:
            raise DataError(f"{predicted.shape[0]} rows but {target.shape[0]} targets")
        residual = float(np.sum((target - predicted) ** 2))
        total = float(np.sum((target - target.mean()) ** 2))
        if total == 0:
            return 1.0 if residual == 0 else 0.0
        return 1.0 - residual / total

    coef_: FloatArray
    intercept_: float
    coef_noise_sd_: FloatArray
    intercept_noise_sd_: float
    noise_sd_draws_: int
    alpha_: float
    n_samples_: float
    n_samples_noise_sd_: float
    n_features_in_: int


FederatedLinearRegression.__doc__ = (
    (FederatedLinearRegression.__doc__ or "")
    + COMMON_PARAMETERS_DOC
    + """
    Attributes
    ----------
    coef_ : (d,) coefficients in the features' units.
    intercept_ : the intercept (0.0 with fit_intercept=False).
    coef_noise_sd_, intercept_noise_sd_ : one standard deviation of the privacy noise in
        each coefficient and in the intercept, by a parametric bootstrap of the release
        (:func:`~fedpca.analyst.aggregates.regression_noise_sd`; 0 without noise; not the
        records' sampling error); ``noise_sd_draws_`` draws (0 without noise).
    alpha_ : the regulariser used (see fedpca.analyst.aggregates.solve_regression).
    n_samples_ : count N (noisy under add/remove, exact under replace-one).
    n_samples_noise_sd_ : the noise sd of N (0 where it is exact).
    n_features_in_ : d.
    Provenance attributes as :class:`FederatedStatistics`.
"""
)
