"""scikit-learn-shaped estimators for federated, differentially private PCA and DCA.

>>> pca = FederatedPCA(n_components=2, epsilon=1.0, delta=1e-6, bounds=(-1, 1),
...                    proxy="proxy:7443", ca="ca.pem", cert="cert.pem", key="key.pem",
...                    private_key_path="keys/analyst.key.json")
>>> pca.fit(n_features=34)          # doctest: +SKIP
>>> pca.transform(my_rows)          # doctest: +SKIP

The constructor only stores parameters.  ``fit`` does not take X: the rows are
federated and never leave their owners, so ``fit`` takes the *public schema*
(the number of features; the public feature ``bounds`` are a constructor
parameter), submits the query to the proxy, follows its progress, fetches the
encrypted result, decrypts it with the analyst's key and solves PCA/DCA.  It
returns ``self``; learned attributes end in ``_`` as in scikit-learn.

``from_result`` builds a fitted estimator from an already decrypted release
(:class:`fedpca.analyst.decode.DecodedRelease`) without any network.

Components live in the *preprocessed* space the owners summed in: each feature
mapped from its public bounds onto [−1, 1], then each row clipped to
‖x‖₂ <= clip_norm.  As in scikit-learn, ``transform`` and ``inverse_transform``
work in that space; ``preprocess`` maps rows given in the raw units of the
schema into it with the query's public bounds and clip norm::

    scores = pca.transform(pca.preprocess(raw_rows))
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fedpca.analyst.decode import DecodedRelease
from fedpca.analyst.federated_estimator import FederatedEstimator
from fedpca.analyst.params import check_number
from fedpca.analyst.schema import FeatureBoundsParam
from fedpca.analyst.solvers import Covariance
from fedpca.errors import ConfigError, DataError
from fedpca.formatting import exact
from fedpca.query import DEFAULT_QUERY_DELTA, Calibration, ProtocolMode, QueryKind, QuerySpec
from fedpca.stats import CLASS_COUNTS

__all__ = ["FederatedDCA", "FederatedPCA", "WeakClassWarning"]

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
StatusCallback = Callable[[Any], None]


# ----------------------------------------------------------------------- PCA
class FederatedPCA(FederatedEstimator):
    """Differentially private PCA over rows held by several owners.

    Parameters
    ----------
    n_components : k, components to compute (1 <= k <= M).
    epsilon, delta : privacy parameters of the release; epsilon is required (no
        default spends budget unasked; ``epsilon=inf``: no noise, NOT PRIVATE,
        verification only).
    mode : "stats" (noisy sufficient statistics, default) or "masked"
        (corrected Wang & Chang: the mean is never released).
    calibration : "zcdp" (default: proven for the discrete Gaussian fedpca samples),
        or the continuous Gaussian's "analytic" (Balle & Wang) or "classic" (epsilon < 1).
    neighbouring : the relation (epsilon, delta) are stated for, "add-remove" or
        "replace-one"; it must be the deployment's. Default: replace-one for masked
        mode (the only relation it has a finite epsilon under), else add-remove.
    bounded_owner_tables : add/remove only: calibrate for owners that never hold more
        records than their public capacity (``data.enforce_max_records``): the noise
        covers one added record and no swap, as a central curator's does. Owners that
        do not enforce their capacity, or whose capacity is above
        ``max_records_per_owner``, decline with a public reason.
    bounds : public per-feature bounds: None (raw values, only the row
        clip applies), "LO:HI" or (lo, hi) for every feature, "LO:HI,LO:HI,…" or
        one (lo, hi) pair per feature, as the aggregates take them
        (:data:`~fedpca.analyst.schema.BoundsParam` lists every form).  Never derive
        them from private data.
    columns : the owners' file columns (0-based) that are the features, in order, e.g.
        ``(1, 2, 5)``; None (default): every column but the label. M is then their
        number, and ``bounds`` are given for them in this order. Owners whose
        ``policy.allowed_columns`` leave a column out answer only queries that name
        their columns.
    clip_norm : rows are clipped to ‖x‖₂ <= clip_norm before summing.
    quorum : owners that must contribute; collection closes as soon as this many
        uploaded. None (default): every owner the proxy accepts (``fit`` asks the
        proxy and states the number in the signed query). A smaller quorum lets a
        result cover fewer owners: ``fit`` then warns (:class:`MissingOwnersWarning`).
    deadline_seconds : seconds the proxy collects uploads.
    wait_for_owners : submit even when fewer owners than the quorum are connected to
        the proxy (they may connect before the deadline). False (default): ``fit``
        waits up to :data:`~fedpca.analyst.owner_wait.OWNERS_CONNECT_SECONDS` for them,
        then refuses, submitting nothing: a query that fails for want of its quorum
        after an owner began an upload stays charged in full.
    max_records_per_owner, max_owners : public bounds that size packed slots.
    frac_bits : fixed-point fractional bits.
    noise_weights : relative budget split over the released sections.
    proxy : ``host:port`` of the proxy.
    ca, cert, key : paths of the fedpca CA certificate and of the analyst's TLS
        certificate and key (mutual TLS).
    insecure : dial the proxy without TLS (local tests only).
    server_name_override : name to verify the proxy certificate against.
    private_key_path : the analyst's Paillier private key file (or its key directory).
    n_jobs : decryption processes (default: all cores).
    verbose : show progress bars (owners / quorum, decryption).
    on_status : called with every query status update.

    Attributes
    ----------
    components_ : (k, M) principal axes in the preprocessed space.
    explained_variance_ : (k,) variance along each component (noisy).
    explained_variance_ratio_ : (k,) fraction of the total (noisy) variance.
    singular_values_ : (k,)
    mean_ : (M,) noisy mean in stats mode; None in masked mode.
    n_samples_ : N; noisy in stats mode (``n_samples_is_noisy_``), exact and
        public in masked mode.
    n_samples_is_noisy_ : bool
    noise_variance_ : mean of the discarded eigenvalues.
    n_eigenvalues_clipped_ : eigenvalues of the M that noise made negative, set to 0
        (the ratios are over the others).
    component_noise_ : after :meth:`component_noise`: the standard deviation the
        privacy noise alone gives each explained variance, and the angle it turns each
        component by (:class:`~fedpca.analyst.component_noise.ComponentNoise`).
    n_components_ : k.
    n_features_in_ : M.
    n_owners_ : owners aggregated.
    n_owners_registered_ : owners the proxy accepts (None for ``from_result``).
    quorum_ : the quorum the query stated.
    epsilon_, delta_ : privacy parameters of the release (delta_ = 0 without noise).
    not_private_ : True for epsilon = inf.
    noise_sigmas_ : section -> standard deviation of the noise added to it, in the
        section's own units: records for a count; for sums and products the features
        as scaled by their public bounds (each (lo, hi) mapped to [−1, 1], i.e. divided
        by (hi − lo)/2 after centring; raw units without bounds), not the data's units.
    timings_ : phase -> seconds ("prepare": keys, connection, the deployment's facts and
        the query, before anything is submitted; "owners connect" when it waited for
        owners to connect; then "start workers", "submit", "wait", "decrypt", "tail",
        "decrypt_cpu", "solve"; see :func:`run_query`).
    query_id_, key_fingerprint_, mode_ : provenance.
    release_ : the decrypted :class:`~fedpca.analyst.decode.DecodedRelease`.
    """

    _kind = QueryKind.PCA
    # A DCA release's R, v and N give the principal components of its classes' records.
    _also_fits_from = (QueryKind.DCA,)

    explained_variance_: FloatArray
    explained_variance_ratio_: FloatArray
    singular_values_: FloatArray
    noise_variance_: float
    n_eigenvalues_clipped_: int
    n_components_: int
    n_samples_is_noisy_: bool

    def _solve(self, release: DecodedRelease) -> None:
        result = release.pca(int(self.n_components))
        self.components_ = result.components
        self.explained_variance_ = result.explained_variance
        self.explained_variance_ratio_ = result.explained_variance_ratio
        self.singular_values_ = result.singular_values
        self.mean_ = result.mean
        self.n_samples_ = result.n_samples
        self.n_samples_is_noisy_ = release.n_samples_is_noisy
        self.noise_variance_ = result.noise_variance
        self.n_eigenvalues_clipped_ = result.n_eigenvalues_clipped
        self.n_components_ = result.n_components

    def _solution(self, release: DecodedRelease) -> tuple[FloatArray, FloatArray]:
        result = release.pca(self.n_components_)
        return result.explained_variance, result.components

    def _released_solution(self) -> tuple[FloatArray, FloatArray]:
        return self.explained_variance_, self.components_

    def _values_covariance(self) -> Callable[[DecodedRelease], Covariance]:
        return DecodedRelease.pca_covariance

    def inverse_transform(self, X: npt.ArrayLike) -> FloatArray:
        """Map scores back to the preprocessed space: X @ components_ + mean_.

        Parameters
        ----------
        X : (n, k) scores.

        Returns
        -------
        (n, M) rows in the preprocessed space (mean_ is not added in masked
        mode, mirroring :meth:`transform`).
        """
        self._check_fitted()
        scores = np.asarray(X, dtype=np.float64)
        if scores.ndim != 2 or scores.shape[1] != self.components_.shape[0]:
            raise DataError(
                f"X must have shape (n, {self.components_.shape[0]}), got {scores.shape}"
            )
        rows = scores @ self.components_
        if self.mean_ is not None:
            rows = rows + self.mean_
        return np.asarray(rows, dtype=np.float64)


# ----------------------------------------------------------------------- DCA
class FederatedDCA(FederatedEstimator):
    """Differentially private discriminant component analysis (Kung) over federated rows.

    Parameters
    ----------
    n_components : k (at most C − 1 carry between-class information).
    classes : the public class labels (at least two, distinct).
    label_column : column of the owners' files holding the label.
    rho, rho_prime : DCA ridges (default 0.02·λmax(S_W) and 0.1·ρ of the noisy
        statistics).
    Other parameters as :class:`FederatedPCA`; DCA runs in stats mode only.

    Attributes
    ----------
    classes_ : (C,) the public class labels, in release order.
    components_ : (k, M) unit-norm discriminant directions (not orthogonal).
    eigenvalues_ : (k,) generalized eigenvalues, descending.
    mean_ : (M,) noisy pooled mean.
    class_counts_ : (C,) noisy class counts.
    n_samples_ : noisy N.
    rho_, rho_prime_ : ridges used.
    n_discriminant_ : usable classes − 1.
    component_noise_ : after :meth:`component_noise`: as :class:`FederatedPCA`'s, for
        the generalized eigenvalues and the discriminant directions.
    Provenance attributes as :class:`FederatedPCA`.
    """

    _kind = QueryKind.DCA

    classes_: FloatArray
    eigenvalues_: FloatArray
    class_counts_: FloatArray
    rho_: float
    rho_prime_: float
    n_discriminant_: int
    n_components_: int
    n_samples_is_noisy_: bool

    def __init__(
        self,
        n_components: int = 1,
        *,
        classes: Sequence[float] = (-1.0, 1.0),
        label_column: int = 0,
        rho: float | None = None,
        rho_prime: float | None = None,
        epsilon: float | None = None,
        delta: float = DEFAULT_QUERY_DELTA,
        mode: str = ProtocolMode.STATS.value,
        calibration: str = Calibration.ZCDP.value,
        neighbouring: str | None = None,
        bounded_owner_tables: bool = False,
        bounds: FeatureBoundsParam = None,
        columns: Sequence[int] | None = None,
        clip_norm: float = 1.0,
        quorum: int | None = None,
        deadline_seconds: float = 300.0,
        wait_for_owners: bool = False,
        max_records_per_owner: int = 1 << 20,
        max_owners: int = 1 << 8,
        frac_bits: int = 32,
        noise_weights: Sequence[float] | None = None,
        proxy: str | None = None,
        ca: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        insecure: bool = False,
        server_name_override: str | None = None,
        private_key_path: str | Path | None = None,
        n_jobs: int | None = None,
        verbose: bool = False,
        on_status: StatusCallback | None = None,
    ) -> None:
        super().__init__(
            n_components,
            epsilon=epsilon,
            delta=delta,
            mode=mode,
            calibration=calibration,
            neighbouring=neighbouring,
            bounded_owner_tables=bounded_owner_tables,
            bounds=bounds,
            columns=columns,
            clip_norm=clip_norm,
            quorum=quorum,
            deadline_seconds=deadline_seconds,
            wait_for_owners=wait_for_owners,
            max_records_per_owner=max_records_per_owner,
            max_owners=max_owners,
            frac_bits=frac_bits,
            noise_weights=noise_weights,
            proxy=proxy,
            ca=ca,
            cert=cert,
            key=key,
            insecure=insecure,
            server_name_override=server_name_override,
            private_key_path=private_key_path,
            n_jobs=n_jobs,
            verbose=verbose,
            on_status=on_status,
        )
        self.classes = classes
        self.label_column = label_column
        self.rho = rho
        self.rho_prime = rho_prime

    def _query_extras(self) -> dict[str, Any]:
        if self.mode != ProtocolMode.STATS.value:
            raise ConfigError(
                "DCA runs in stats mode only (masked mode is the published PCA protocol)"
            )
        classes = tuple(float(c) for c in self.classes)
        if not all(math.isfinite(c) for c in classes):
            raise ConfigError(f"classes must be finite numbers, got {self.classes!r}")
        return {"label_column": int(self.label_column), "class_labels": classes}

    @classmethod
    def _params_from_query(cls, query: QuerySpec) -> dict[str, Any]:
        return {"classes": query.class_labels, "label_column": query.label_column}

    def check_post_processing(self) -> None:
        for name in ("rho", "rho_prime"):
            value = getattr(self, name)
            if value is not None:
                check_number(value, name, low=0.0, low_open=False)

    def _solve(self, release: DecodedRelease) -> None:
        _warn_of_weak_classes(release)
        result = release.dca(int(self.n_components), rho=self.rho, rho_prime=self.rho_prime)
        self.classes_ = np.asarray(release.query.class_labels, dtype=np.float64)
        self.components_ = result.components
        self.eigenvalues_ = result.eigenvalues
        self.mean_ = result.mean
        self.class_counts_ = result.class_counts
        self.n_samples_ = result.n_samples
        self.n_samples_is_noisy_ = release.n_samples_is_noisy
        self.rho_ = result.rho
        self.rho_prime_ = result.rho_prime
        self.n_discriminant_ = result.n_discriminant
        self.n_components_ = result.n_components

    def _solution(self, release: DecodedRelease) -> tuple[FloatArray, FloatArray]:
        # The ridges of the fit: as a regression's redraws keep its alpha.
        result = release.dca(self.n_components_, rho=self.rho_, rho_prime=self.rho_prime_)
        return result.eigenvalues, result.components

    def _released_solution(self) -> tuple[FloatArray, FloatArray]:
        return self.eigenvalues_, self.components_


class WeakClassWarning(UserWarning):
    """A DCA class's noisy count is within three noise deviations of zero."""


def _warn_of_weak_classes(release: DecodedRelease) -> None:
    """Warn of classes whose noisy count cannot be told from zero (3 sigma): classes the
    owners' labels may not hold at all (``classes`` that name no label gave a result
    whose discriminant was noise, without a word: review)."""
    statistics = release.statistics
    sigma = release.sigmas.get(CLASS_COUNTS)
    if statistics is None or statistics.class_counts is None or not sigma:
        return
    labels = release.query.class_labels
    weak = [
        f"{exact(label)} ({count:.3g})"
        for label, count in zip(labels, statistics.class_counts, strict=True)
        if count < 3.0 * sigma
    ]
    if weak:
        warnings.warn(
            f"query {release.query.query_id}: the noisy counts of class(es) {', '.join(weak)} "
            f"are within 3 sigma ({3.0 * sigma:.3g}) of zero: the owners may hold no records "
            "of them (are the classes the labels' values?); their discriminant directions "
            "are mostly noise",
            WeakClassWarning,
            stacklevel=4,
        )
