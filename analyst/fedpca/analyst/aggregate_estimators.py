"""scikit-learn-shaped estimators for private aggregates over federated rows.

>>> stats = FederatedStatistics(columns=[1, 6], bounds=[(0, 17), (0, 70)],
...                             epsilon=1.0, delta=1e-6, proxy="proxy:50051",
...                             ca="ca.pem", cert="cert.pem", key="key.pem",
...                             private_key_path="keys/analyst.key.json")
>>> stats.fit().mean_                                       # doctest: +SKIP

* :class:`~fedpca.analyst.statistics.FederatedStatistics` - count, means, variances,
  covariance and correlation.
* :class:`~fedpca.analyst.statistics.FederatedHistogram` - counts over public bins of
  one or two columns, optionally per public category.
* :class:`~fedpca.analyst.regression.FederatedLinearRegression` - linear (ridge)
  regression from noisy sufficient statistics, with ``coef_``, ``intercept_``,
  ``predict`` and ``score``.
* :class:`FederatedQuery` (here) - several of them from one release: one round trip,
  one budget, split across them with ``weights``.

This module holds what they share: the privacy and connection parameters, the fit
pipeline and the combined query.

As for :class:`~fedpca.analyst.estimators.FederatedPCA`, the constructor only stores
parameters and ``fit`` takes no data: the rows stay with their owners. Columns are
0-based indices into the owners' files; every bound, bin edge and category is public
and must not be derived from the private rows. Learned attributes end in ``_``.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from fedpca.aggregates import part_sections
from fedpca.analyst.decode import DecodedRelease
from fedpca.analyst.keys import load_analyst_private_key, load_analyst_signing_key
from fedpca.analyst.params import NotFittedError, SklearnParams, differs, required_epsilon
from fedpca.analyst.querying import (
    charged_release,
    new_query_id,
    refuse_in_bootstrapping_child,
    resolve_quorum,
    run_estimator_query,
    warn_if_owners_missing,
)
from fedpca.codec.keys import key_fingerprint
from fedpca.errors import ConfigError
from fedpca.messages import DeploymentInfo
from fedpca.query import (
    DEFAULT_QUERY_DELTA,
    Aggregate,
    Calibration,
    Neighbouring,
    QueryKind,
    QuerySpec,
)

__all__ = ["COMMON_PARAMETERS_DOC", "PRIVACY_PARAMETERS", "FederatedQuery", "aggregate_query"]

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]

PRIVACY_PARAMETERS = (
    "epsilon",
    "delta",
    "calibration",
    "neighbouring",
    "bounded_owner_tables",
    "quorum",
    "deadline_seconds",
    "wait_for_owners",
    "max_records_per_owner",
    "max_owners",
    "frac_bits",
    "proxy",
    "ca",
    "cert",
    "key",
    "insecure",
    "server_name_override",
    "private_key_path",
    "n_jobs",
    "verbose",
    "on_status",
)
"""The parameters every aggregate estimator shares: privacy, collection and connection.
Inside a :class:`FederatedQuery` only the query's are used."""


def _split(
    budget_split: Mapping[str, float] | Sequence[float] | None, names: Sequence[str]
) -> list[float]:
    """Weights of an aggregate's sections, summing to 1 (equal by default)."""
    if budget_split is None:
        return [1.0 / len(names)] * len(names)
    if isinstance(budget_split, Mapping):
        unknown = sorted(set(budget_split) - set(names))
        if unknown:
            raise ConfigError(f"budget_split names {unknown}; this aggregate has {list(names)}")
        weights = [float(budget_split.get(name, 0.0)) for name in names]
    else:
        weights = [float(w) for w in budget_split]
        if len(weights) != len(names):
            raise ConfigError(
                f"budget_split has {len(weights)} weights; this aggregate has sections {names}"
            )
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ConfigError(f"budget_split: every section {list(names)} needs a weight > 0")
    total = math.fsum(weights)
    return [w / total for w in weights]


class _Settings(SklearnParams):
    """Privacy, sizing and connection parameters shared by every aggregate estimator."""

    epsilon: float
    delta: float
    calibration: str
    neighbouring: str | None
    bounded_owner_tables: bool
    quorum: int | None
    deadline_seconds: float
    wait_for_owners: bool
    max_records_per_owner: int
    max_owners: int
    frac_bits: int
    proxy: str | None
    ca: str | Path | None
    cert: str | Path | None
    key: str | Path | None
    insecure: bool
    server_name_override: str | None
    private_key_path: str | Path | None
    n_jobs: int | None
    verbose: bool
    on_status: Any

    def _store_settings(self, arguments: Mapping[str, Any]) -> None:
        """Store the shared constructor arguments (scikit-learn: parameters as given)."""
        for name in PRIVACY_PARAMETERS:
            setattr(self, name, arguments[name])

    def _run(
        self, aggregates: Sequence[Aggregate], weights: Sequence[float]
    ) -> tuple[DecodedRelease, dict[str, float], int]:
        """Submit one aggregate query, wait, fetch and decrypt it.

        Returns the release, the timings and the number of owners the proxy accepts.
        As for PCA, ``fit`` first asks the proxy for the deployment's public facts: an
        unset quorum waits for every registered owner and an unset relation is the
        deployment's; the signed query states both.
        """

        refuse_in_bootstrapping_child()
        if self.proxy is None:
            raise ConfigError("set proxy='host:port' to fit against a proxy")
        if self.private_key_path is None:
            raise ConfigError(
                "set private_key_path to the analyst's key file (or its key directory)"
            )
        private_key = load_analyst_private_key(self.private_key_path)
        signing_key = load_analyst_signing_key(self.private_key_path)
        run = run_estimator_query(
            self,
            private_key,
            signing_key,
            lambda deployment: aggregate_query(
                aggregates,
                private_key.public_key,
                noise_weights=weights,
                **self._query_settings(deployment),
            ),
        )
        return run.release, run.timings, run.owners_registered

    def _query_settings(self, deployment: DeploymentInfo | None = None) -> dict[str, Any]:
        """The query parameters; ``deployment`` fills in an unset quorum and relation."""
        neighbouring = self.neighbouring
        if neighbouring is None and deployment is not None:
            neighbouring = deployment.neighbouring.value
        return {
            "epsilon": required_epsilon(self.epsilon),
            "delta": float(self.delta),
            "calibration": self.calibration,
            "neighbouring": neighbouring,
            "bounded_owner_tables": bool(self.bounded_owner_tables),
            "quorum": resolve_quorum(self.quorum, deployment),
            "deadline_seconds": float(self.deadline_seconds),
            "max_records_per_owner": int(self.max_records_per_owner),
            "max_owners": int(self.max_owners),
            "frac_bits": int(self.frac_bits),
        }


def aggregate_query(
    aggregates: Sequence[Aggregate],
    public_key: Any,
    *,
    epsilon: float,
    delta: float,
    noise_weights: Sequence[float] = (),
    calibration: str = Calibration.ZCDP.value,
    neighbouring: str | None = None,
    bounded_owner_tables: bool = False,
    quorum: int = 1,
    deadline_seconds: float = 300.0,
    max_records_per_owner: int = 1 << 20,
    max_owners: int = 1 << 8,
    frac_bits: int = 32,
    query_id: str | None = None,
) -> QuerySpec:
    """The public aggregate query of ``aggregates``, addressed to ``public_key``.

    Parameters
    ----------
    aggregates : the aggregates released together.
    public_key : the analyst's phe public key.
    noise_weights : one relative budget weight per released section, in release order
        (empty: equal shares).
    Other parameters: :data:`COMMON_PARAMETERS_DOC`.
    """
    columns = sorted({c for part in aggregates for c in part.read_columns})
    try:
        return QuerySpec(
            query_id=query_id or new_query_id(),
            kind=QueryKind.AGGREGATE,
            n_features=max(1, len(columns)),
            epsilon=float(epsilon),
            delta=float(delta),
            n_components=1,
            analyst_public_key_n=public_key.n,
            analyst_key_fingerprint=key_fingerprint(public_key),
            calibration=Calibration(calibration),
            neighbouring=Neighbouring(neighbouring or Neighbouring.ADD_REMOVE),
            bounded_owner_tables=bool(bounded_owner_tables),
            quorum=int(quorum),
            deadline_seconds=float(deadline_seconds),
            max_records_per_owner=int(max_records_per_owner),
            max_owners=int(max_owners),
            frac_bits=int(frac_bits),
            noise_weights=tuple(noise_weights),
            aggregates=tuple(aggregates),
            issued_at=time.time(),  # as build_query: a resubmission is the same query
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


# ---------------------------------------------------------------------- base
class AggregateEstimator(_Settings):
    """One aggregate: its public definition, fitting and provenance."""

    def aggregate(self) -> Aggregate:
        """The public aggregate this estimator asks for."""
        raise NotImplementedError

    def section_weights(self) -> list[float]:
        """Relative budget weights of this aggregate's sections (summing to 1)."""
        names = [s.name for s in part_sections(self.aggregate())]
        return _split(getattr(self, "budget_split", None), names)

    def fit(self, X: Any = None, y: Any = None) -> Self:
        """Run one private query for this aggregate and post-process it.

        There is no X: the rows stay with their owners (passing data is an error).

        Returns
        -------
        self

        Raises
        ------
        BudgetExceededError
            The proxy refused the release: it does not fit what is left of the
            analyst's budget (the message says how much does, or how to find out).
        QueryStateError
            The query failed at the proxy (e.g. owners declined it, the quorum was not
            reached by the deadline).
        """
        if X is not None or y is not None:
            raise ConfigError(
                f"{type(self).__name__}.fit() takes no data: the rows stay with their owners"
            )
        self.check_post_processing()
        parts = [self.aggregate()]
        required_epsilon(self.epsilon)  # before keys and the network
        release, timings, registered = self._run(parts, self.section_weights())
        with charged_release(release.query.query_id):
            self._fit_release(release, 0, timings, registered)
        warn_if_owners_missing(release, registered)
        return self

    @classmethod
    def from_result(
        cls,
        release: DecodedRelease,
        index: int = 0,
        *,
        owners_registered: int | None = None,
        timings: Mapping[str, float] | None = None,
        **params: Any,
    ) -> Self:
        """A fitted estimator from aggregate ``index`` of a decrypted release (no network).

        Parameters
        ----------
        release : the decrypted aggregate release.
        index : which of its aggregates.
        owners_registered : owners the proxy accepts, if known (for
            ``n_owners_registered_`` and the warning when fewer contributed).
        timings : phase -> seconds already spent (e.g. "fetch", "decrypt").
        **params : post-processing parameters (e.g. ``clamp``, ``alpha``).
        """
        if release.kind is not QueryKind.AGGREGATE or not 0 <= index < len(release.aggregates):
            raise ConfigError(f"the release has no aggregate {index}")
        estimator = cls(**cls._params_from_aggregate(release.query.aggregates[index]), **params)
        estimator._fit_release(release, index, timings or {}, owners_registered)
        warn_if_owners_missing(release, owners_registered)
        return estimator

    @classmethod
    def _params_from_aggregate(cls, part: Aggregate) -> dict[str, Any]:
        raise NotImplementedError

    def _fit_release(
        self,
        release: DecodedRelease,
        index: int,
        timings: Mapping[str, float],
        owners_registered: int | None = None,
    ) -> None:
        part = release.query.aggregates[index]
        if part != self.aggregate():
            raise ConfigError(
                f"aggregate {index} of the release is not the one {type(self).__name__} asks for"
            )
        prefix = f"{index}."
        # Before _solve: statistics derive their noise's standard deviations from it.
        self.noise_sigmas_ = {
            name.removeprefix(prefix): sigma
            for name, sigma in release.sigmas.items()
            if name.startswith(prefix)
        }
        start = time.perf_counter()
        self._solve(part, release.aggregates[index], release, index)
        query = release.query
        all_timings = dict(timings)
        all_timings["solve"] = time.perf_counter() - start
        self.release_ = release
        self.aggregate_index_ = index
        self.n_owners_ = release.n_owners
        self.n_owners_registered_ = owners_registered
        self.quorum_ = query.quorum
        self.epsilon_ = query.epsilon
        self.delta_ = query.delta if release.private else 0.0
        self.not_private_ = not release.private
        self.query_id_ = query.query_id
        self.key_fingerprint_ = release.key_fingerprint
        self.timings_ = all_timings

    def _solve(
        self,
        part: Aggregate,
        sections: Mapping[str, FloatArray],
        release: DecodedRelease,
        index: int,
    ) -> None:
        raise NotImplementedError

    def _check_fitted(self) -> DecodedRelease:
        release: DecodedRelease | None = getattr(self, "release_", None)
        if release is None:
            raise NotFittedError(
                f"this {type(self).__name__} is not fitted yet; call fit() or from_result()"
            )
        return release

    # Declared for type checkers; set by fit / from_result.
    release_: DecodedRelease
    aggregate_index_: int
    n_owners_: int
    n_owners_registered_: int | None
    quorum_: int
    epsilon_: float
    delta_: float
    not_private_: bool
    query_id_: str
    key_fingerprint_: str
    noise_sigmas_: dict[str, float]
    timings_: dict[str, float]


COMMON_PARAMETERS_DOC = """
    epsilon, delta : privacy parameters of the release; epsilon is required (no default
        spends budget unasked; ``epsilon=inf``: no noise, NOT PRIVATE, verification only).
    calibration : "zcdp" (default, proven for the discrete Gaussian), "analytic" or
        "classic" (the continuous Gaussian's).
    neighbouring : "add-remove" or "replace-one": the deployment's relation (None, the
        default: ``fit`` asks the proxy for it).
    bounded_owner_tables : add/remove only: calibrate for owners that never hold more
        records than their public capacity (``data.enforce_max_records``), so the noise
        covers one added record and no swap, as a central curator's does; owners that
        do not enforce their capacity, or whose capacity is above
        ``max_records_per_owner``, decline.
    quorum : owners that must contribute; collection closes as soon as this many
        uploaded. None (default): every owner the proxy accepts (``fit`` asks the proxy
        and states the number in the signed query). A smaller quorum lets a result cover
        fewer owners: ``fit`` then warns
        (:class:`~fedpca.analyst.estimators.MissingOwnersWarning`).
    deadline_seconds : seconds the proxy collects uploads.
    wait_for_owners : submit even when fewer owners than the quorum are connected to
        the proxy (they may connect before the deadline). False (default): ``fit``
        waits up to :data:`~fedpca.analyst.owner_wait.OWNERS_CONNECT_SECONDS` for them,
        then refuses, submitting nothing: a query that fails for want of its quorum
        after an owner began an upload stays charged in full.
    max_records_per_owner, max_owners : public bounds that size packed slots; an owner
        with more records contributes a uniform sample of this many.
    frac_bits : fixed-point fractional bits.
    proxy, ca, cert, key, insecure, server_name_override : the proxy and the analyst's
        mutual-TLS material.
    private_key_path : the analyst's Paillier private key file (or its key directory).
    n_jobs, verbose, on_status : decryption processes; progress bars; status callback.
"""


# ------------------------------------------------------------------ combined
class FederatedQuery(_Settings):
    """Several aggregates in one release: one round trip, one composed budget.

    Parameters
    ----------
    estimators : the aggregate estimators to fit (fitted in place, as a scikit-learn
        Pipeline fits its steps); only their aggregate and post-processing parameters
        are used, the privacy and connection parameters are this object's.
    weights : relative budget share of each estimator (default equal); inside an
        estimator its ``budget_split`` divides the share among its sections.
    Other parameters: :data:`COMMON_PARAMETERS_DOC`.

    Attributes
    ----------
    estimators_ : the fitted estimators (the same objects).
    release_, epsilon_, delta_, not_private_, query_id_, timings_ : provenance.
    n_owners_, n_owners_registered_, quorum_ : owners aggregated, owners the proxy
        accepts (None for ``from_result`` without it), the quorum the query stated.
    """

    def __init__(
        self,
        estimators: Sequence[AggregateEstimator] = (),
        *,
        weights: Sequence[float] | None = None,
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
        self.estimators = estimators
        self.weights = weights
        self._store_settings(locals())

    def noise_weights(self) -> list[float]:
        """One weight per released section: estimator share x its section split."""
        estimators = list(self.estimators)
        if not estimators:
            raise ConfigError("FederatedQuery needs at least one estimator")
        shares = [1.0] * len(estimators) if self.weights is None else list(self.weights)
        if len(shares) != len(estimators) or not all(math.isfinite(w) and w > 0 for w in shares):
            raise ConfigError(f"weights: one positive weight per estimator, got {self.weights!r}")
        total = math.fsum(shares)
        return [
            share / total * w
            for share, estimator in zip(shares, estimators, strict=True)
            for w in estimator.section_weights()
        ]

    def fit(self, X: Any = None, y: Any = None) -> Self:
        """Run one private query for every estimator and fit each from its aggregate.

        Returns
        -------
        self
        """
        if X is not None or y is not None:
            raise ConfigError("FederatedQuery.fit() takes no data: the rows stay with their owners")
        estimators = list(self.estimators)
        for estimator in estimators:
            estimator.check_post_processing()
            self._refuse_settings_of(estimator)
        weights = self.noise_weights()
        parts = [e.aggregate() for e in estimators]
        required_epsilon(self.epsilon)  # before keys and the network
        release, timings, registered = self._run(parts, weights)
        with charged_release(release.query.query_id):
            self._fit_release(estimators, release, timings, registered)
        warn_if_owners_missing(release, registered)
        return self

    def _refuse_settings_of(self, estimator: AggregateEstimator) -> None:
        """Refuse an estimator whose own privacy or connection parameters would be
        ignored: this query's apply (``FederatedQuery([FederatedStatistics(...,
        epsilon=5.0)], epsilon=0.5)`` spent 0.5 without a word; found by an analyst's
        walkthrough)."""
        defaults = inspect.signature(type(estimator).__init__).parameters
        ignored = [
            f"{name}={getattr(estimator, name)!r}"
            for name in PRIVACY_PARAMETERS
            if differs(getattr(estimator, name), defaults[name].default)
            and differs(getattr(estimator, name), getattr(self, name))
        ]
        if ignored:
            raise ConfigError(
                f"{type(estimator).__name__}({', '.join(ignored)}): inside a FederatedQuery "
                "only an estimator's aggregate and post-processing parameters are used; "
                "set privacy and connection parameters on the FederatedQuery"
            )

    def _fit_release(
        self,
        estimators: list[AggregateEstimator],
        release: DecodedRelease,
        timings: Mapping[str, float],
        owners_registered: int | None,
    ) -> None:
        for index, estimator in enumerate(estimators):
            estimator._fit_release(release, index, timings, owners_registered)
        query = release.query
        self.estimators_ = estimators
        self.release_ = release
        self.epsilon_ = query.epsilon
        self.delta_ = query.delta if release.private else 0.0
        self.not_private_ = not release.private
        self.query_id_ = query.query_id
        self.n_owners_ = release.n_owners
        self.n_owners_registered_ = owners_registered
        self.quorum_ = query.quorum
        self.timings_ = dict(timings)

    estimators_: list[AggregateEstimator]
    release_: DecodedRelease
    epsilon_: float
    delta_: float
    not_private_: bool
    query_id_: str
    n_owners_: int
    n_owners_registered_: int | None
    quorum_: int
    timings_: dict[str, float]
