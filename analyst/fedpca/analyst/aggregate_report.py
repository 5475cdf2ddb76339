"""``result.json`` of aggregate queries (statistics, histograms, regressions).

Everything written is post-processing of the differentially private release. The
document is strict JSON like the PCA report (:mod:`fedpca.analyst.report`): an infinite
epsilon (NOT PRIVATE) is ``null`` with ``"not_private": true``, a NaN (e.g. the
correlation of a column whose noisy variance is 0) is ``null``. Post-processing that
changes released values (clipping, clamping) is labelled in the document.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from fedpca.analyst.aggregate_estimators import AggregateEstimator, FederatedQuery
from fedpca.analyst.decode import DecodedRelease
from fedpca.analyst.querying import warn_if_owners_missing
from fedpca.analyst.regression import FederatedLinearRegression
from fedpca.analyst.report import (
    REPORT_FORMAT,
    REPORT_VERSION,
    owners_summary,
    write_report_json,
)
from fedpca.analyst.statistics import FederatedHistogram, FederatedStatistics
from fedpca.errors import ConfigError
from fedpca.query import Aggregate, AggregateKind, QueryKind
from fedpca.version import __version__

__all__ = ["ESTIMATOR_OF", "aggregate_document", "fitted_from_release", "write_aggregate_result"]

logger = logging.getLogger(__name__)

Fitted = AggregateEstimator | FederatedQuery

ESTIMATOR_OF: dict[AggregateKind, type[AggregateEstimator]] = {
    AggregateKind.STATS: FederatedStatistics,
    AggregateKind.HISTOGRAM: FederatedHistogram,
    AggregateKind.LINREG: FederatedLinearRegression,
}


def _list(value: Any) -> Any:
    return None if value is None else np.asarray(value, dtype=np.float64).tolist()


def fitted_from_release(
    release: DecodedRelease,
    *,
    owners_registered: int | None = None,
    timings: dict[str, float] | None = None,
    post_processing: Mapping[str, Any] | None = None,
) -> Fitted:
    """Fitted estimators from a decrypted aggregate release read back (no network).

    One aggregate: the estimator of its kind, as ``fedpca analyst stats|histogram|linreg``
    fits it; several: a :class:`FederatedQuery` of them. Post-processing parameters are
    the defaults but for those in ``post_processing`` (``ddof``, ``clip``, ``clamp``,
    ``alpha``, ``fit_intercept``, …), each given to every estimator that has it, so a
    fetch rebuilds what its query's own command computed; everything else is the
    release's query.
    """
    query = release.query
    if query.kind is not QueryKind.AGGREGATE:
        raise ConfigError(f"query {query.query_id!r} is a {query.kind.value} query")
    estimators = [
        ESTIMATOR_OF[part.kind](**ESTIMATOR_OF[part.kind]._params_from_aggregate(part))
        for part in query.aggregates
    ]
    for estimator in estimators:
        names = estimator.get_params(deep=False)
        estimator.set_params(**{k: v for k, v in (post_processing or {}).items() if k in names})
        estimator.check_post_processing()
    fitted: Fitted
    if len(estimators) == 1:
        fitted = estimators[0]
        fitted._fit_release(release, 0, timings or {}, owners_registered)
    else:
        fitted = FederatedQuery(
            estimators,
            epsilon=query.epsilon,
            delta=query.delta,
            calibration=query.calibration.value,
            neighbouring=query.neighbouring.value,
            bounded_owner_tables=query.bounded_owner_tables,
            quorum=query.quorum,
            deadline_seconds=query.deadline_seconds,
            max_records_per_owner=query.max_records_per_owner,
            max_owners=query.max_owners,
            frac_bits=query.frac_bits,
        )
        fitted._fit_release(estimators, release, timings or {}, owners_registered)
    warn_if_owners_missing(release, owners_registered)
    return fitted


def _release_header(fitted: Fitted, release: DecodedRelease) -> dict[str, Any]:
    query = release.query
    return {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "fedpca_version": __version__,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "query_id": query.query_id,
        "kind": query.kind.value,
        "n_owners": release.n_owners,
        "quorum": query.quorum,
        "owners": owners_summary(fitted),
        "epsilon": query.epsilon,
        "delta": query.delta if release.private else 0.0,
        "not_private": not release.private,
        "mechanism": "gaussian" if release.private else "none",
        "calibration": query.calibration.value,
        "neighbouring": query.neighbouring.value,
        "bounded_owner_tables": query.bounded_owner_tables,
        "noise_multiplier": float(release.plan.noise_multiplier),
        "noise_sigma": {name: float(sigma) for name, sigma in release.sigmas.items()},
        "key_fingerprint": release.key_fingerprint,
        "timings": {phase: float(seconds) for phase, seconds in fitted.timings_.items()},
    }


def _part(estimator: AggregateEstimator) -> dict[str, Any]:
    part: Aggregate = estimator.release_.query.aggregates[estimator.aggregate_index_]
    document: dict[str, Any] = {
        "aggregate": part.kind.value,
        "columns": list(part.columns),
        "noise_sigma": dict(estimator.noise_sigmas_),
    }
    if isinstance(estimator, FederatedStatistics):
        document.update(
            bounds={"lower": list(part.lower), "upper": list(part.upper)},
            moments=part.moments.value if part.moments is not None else None,
            n_samples=float(estimator.n_samples_),
            n_samples_noisy=bool(estimator.n_samples_noise_sd_),
            n_samples_noise_sd=estimator.n_samples_noise_sd_,
            mean=_list(estimator.mean_),
            mean_noise_sd=_list(estimator.mean_noise_sd_),
            variance=_list(estimator.variance_),
            variance_noise_sd=_list(estimator.variance_noise_sd_),
            covariance=_list(estimator.covariance_),
            correlation=_list(estimator.correlation_),
            ddof=int(estimator.ddof),
            postprocessing=(
                "clipped: N >= 1, N - ddof >= 1, means within the bounds, variances in "
                "[0, (hi - lo)^2/4 * N/(N - ddof)], covariance projected onto the positive "
                "semidefinite matrices and its rows and columns scaled down to those variances"
                if estimator.clipped_
                else "none"
            ),
            clip_moved=list(estimator.clip_moved_),
        )
    elif isinstance(estimator, FederatedHistogram):
        document.update(
            bin_edges=[_list(e) for e in estimator.bin_edges_],
            group_column=part.group_column,
            categories=_list(estimator.categories_),
            counts=_list(estimator.counts_),
            raw_counts=_list(estimator.raw_counts_),
            postprocessing="negative counts clamped to 0" if estimator.clamped_ else "none",
        )
    elif isinstance(estimator, FederatedLinearRegression):
        document.update(
            bounds={"lower": list(part.lower), "upper": list(part.upper)},
            target_column=part.target_column,
            target_bounds=[part.target_lower, part.target_upper],
            coef=_list(estimator.coef_),
            coef_noise_sd=_list(estimator.coef_noise_sd_),
            intercept=float(estimator.intercept_),
            intercept_noise_sd=float(estimator.intercept_noise_sd_),
            noise_sd_draws=int(estimator.noise_sd_draws_),
            fit_intercept=bool(estimator.fit_intercept),
            alpha=float(estimator.alpha_),
            alpha_rule=(
                "auto: spectral bound of the noise, tail probability "
                f"{float(estimator.tail_probability):g}"
                if isinstance(estimator.alpha, str)
                else "fixed"
            ),
            n_samples=float(estimator.n_samples_),
            n_samples_noisy=bool(estimator.n_samples_noise_sd_),
            n_samples_noise_sd=float(estimator.n_samples_noise_sd_),
        )
    return document


def aggregate_document(fitted: Fitted) -> dict[str, Any]:
    """The JSON-ready description of a fitted aggregate estimator or combined query.

    One estimator: the release header (query id, privacy parameters, noise, owners,
    timings) and its results at the top level. A :class:`FederatedQuery`: the header
    and ``"aggregates"``, one entry per estimator.
    """
    release = getattr(fitted, "release_", None)
    if release is None:
        raise ConfigError("the estimator is not fitted; nothing to report")
    document = _release_header(fitted, release)
    if isinstance(fitted, FederatedQuery):
        document["aggregates"] = [_part(e) for e in fitted.estimators_]
    else:
        document.update(_part(fitted))
    return document


def write_aggregate_result(path: str | os.PathLike[str], fitted: Fitted) -> Path:
    """Write :func:`aggregate_document` to ``path`` as strict JSON (folders created)."""
    return write_report_json(path, aggregate_document(fitted))
