"""What the PCA and DCA estimators share: their common parameters, building and
submitting the query, ``fit``, ``from_result``, ``preprocess`` and ``transform``.

The estimators themselves, and how they are used, are in :mod:`fedpca.analyst.estimators`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from fedpca.analyst.component_noise import ComponentNoise, component_noise, release_seed
from fedpca.analyst.decode import DecodedRelease
from fedpca.analyst.keys import load_analyst_private_key, load_analyst_signing_key
from fedpca.analyst.params import NotFittedError, SklearnParams, required_epsilon
from fedpca.analyst.querying import (
    charged_release,
    new_query_id,
    refuse_in_bootstrapping_child,
    resolve_quorum,
    run_estimator_query,
    warn_if_owners_missing,
)
from fedpca.analyst.schema import FeatureBoundsParam, check_schema, resolve_bounds
from fedpca.analyst.solvers import Covariance, check_n_components
from fedpca.codec.keys import key_fingerprint
from fedpca.errors import ConfigError, DataError
from fedpca.messages import DeploymentInfo
from fedpca.preprocess import FeatureBounds, preprocess
from fedpca.query import (
    DEFAULT_QUERY_DELTA,
    Calibration,
    Neighbouring,
    ProtocolMode,
    QueryKind,
    QuerySpec,
)
from fedpca.query_checks import column_indices

__all__ = ["FederatedEstimator"]

logger = logging.getLogger("fedpca.analyst.estimators")

FloatArray = npt.NDArray[np.float64]
StatusCallback = Callable[[Any], None]


class FederatedEstimator(SklearnParams):
    """Shared parameters, query building and the fit pipeline."""

    _kind: QueryKind
    _also_fits_from: tuple[QueryKind, ...] = ()
    """Kinds of release beside ``_kind`` whose statistics :meth:`from_result` can fit
    this estimator from (post-processing of what they released)."""

    def __init__(
        self,
        n_components: int = 2,
        *,
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
        self.n_components = n_components
        self.epsilon = epsilon
        self.delta = delta
        self.mode = mode
        self.calibration = calibration
        self.neighbouring = neighbouring
        self.bounded_owner_tables = bounded_owner_tables
        self.bounds = bounds
        self.columns = columns
        self.clip_norm = clip_norm
        self.quorum = quorum
        self.deadline_seconds = deadline_seconds
        self.wait_for_owners = wait_for_owners
        self.max_records_per_owner = max_records_per_owner
        self.max_owners = max_owners
        self.frac_bits = frac_bits
        self.noise_weights = noise_weights
        self.proxy = proxy
        self.ca = ca
        self.cert = cert
        self.key = key
        self.insecure = insecure
        self.server_name_override = server_name_override
        self.private_key_path = private_key_path
        self.n_jobs = n_jobs
        self.verbose = verbose
        self.on_status = on_status

    # ------------------------------------------------------------ the query
    def _query_extras(self) -> dict[str, Any]:
        return {}

    def build_query(
        self,
        n_features: int | None,
        public_key: Any,
        deployment: DeploymentInfo | None = None,
    ) -> QuerySpec:
        """The public query ``fit`` submits, addressed to ``public_key``.

        Parameters
        ----------
        n_features : M (or None when per-feature bounds imply it).
        public_key : the analyst's phe public key.
        deployment : the proxy's public facts (``fit`` asks for them). They fill in
            what the parameters leave open: ``quorum=None`` becomes every owner the
            proxy accepts, ``neighbouring=None`` the deployment's relation (masked
            mode: replace-one, the only relation it has a finite epsilon under).
            The query states both explicitly, so the owners see what they sign up for.

        Raises
        ------
        ConfigError
            ``quorum=None`` without a deployment to count the owners of, or a
            deployment that accepts no owners.
        """
        m = check_schema(self._n_features(n_features), self.bounds)
        bounds = resolve_bounds(self.bounds, m)
        quorum = resolve_quorum(self.quorum, deployment)
        try:
            mode = ProtocolMode(self.mode)
            calibration = Calibration(self.calibration)
            # Masked mode has a finite epsilon only under replace-one adjacency.
            if self.neighbouring is not None:
                neighbouring = Neighbouring(self.neighbouring)
            elif mode is ProtocolMode.MASKED:
                neighbouring = Neighbouring.REPLACE_ONE
            elif deployment is not None:
                neighbouring = deployment.neighbouring
            else:
                neighbouring = Neighbouring.ADD_REMOVE
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return QuerySpec(
            query_id=new_query_id(),
            kind=self._kind,
            n_features=m,
            epsilon=required_epsilon(self.epsilon),
            delta=float(self.delta),
            n_components=check_n_components(self.n_components, m),
            analyst_public_key_n=public_key.n,
            analyst_key_fingerprint=key_fingerprint(public_key),
            feature_lower=() if bounds is None else bounds.lower,
            feature_upper=() if bounds is None else bounds.upper,
            clip_norm=float(self.clip_norm),
            calibration=calibration,
            neighbouring=neighbouring,
            bounded_owner_tables=bool(self.bounded_owner_tables),
            mode=mode,
            quorum=int(quorum),
            deadline_seconds=float(self.deadline_seconds),
            max_records_per_owner=int(self.max_records_per_owner),
            max_owners=int(self.max_owners),
            frac_bits=int(self.frac_bits),
            noise_weights=tuple(self.noise_weights or ()),
            feature_columns=() if self.columns is None else tuple(self.columns),
            # Signed with this time: a resubmission of the same query (after a proxy
            # restart) is then the same query, and owners answer it only until
            # issued_at + deadline_seconds.
            issued_at=time.time(),
            **self._query_extras(),
        )

    def _n_features(self, n_features: int | None) -> int | None:
        """M: ``n_features``, or the number of ``columns`` named (which it must match)."""
        if self.columns is None or not isinstance(n_features, int | np.integer | None):
            return n_features  # data passed as the schema: check_schema says so
        columns = column_indices(self.columns, "columns")
        if not columns:
            raise ConfigError("columns names no column: give at least one, or None for all")
        if n_features is not None and n_features != len(columns):
            raise ConfigError(
                f"n_features={n_features} but columns names {len(columns)}: {list(columns)}"
            )
        return len(columns)

    # ------------------------------------------------------------------ fit
    def fit(self, n_features: int | None = None) -> Self:
        """Run one private query over the federated rows and solve it.

        Parameters
        ----------
        n_features : M, the number of feature columns of the public schema
            (labels excluded).  May be omitted when ``bounds`` gives
            per-feature bounds.  There is no X: the rows stay with their owners.

        Returns
        -------
        self

        Raises
        ------
        BudgetExceededError
            The proxy refused the release: it does not fit what is left of the
            analyst's budget (the message says how much does, or how to find out).
        QueryStateError
            The query failed at the proxy (e.g. quorum not reached by the deadline).
        UntrustedKeyError, LayoutError, ProtocolError
            The result is not what the analyst's own plan expects.
        """
        refuse_in_bootstrapping_child()
        fit_started = time.perf_counter()
        # Refuse data passed as the schema before touching keys or the network.
        check_schema(self._n_features(n_features), self.bounds)
        if self.proxy is None:
            raise ConfigError("set proxy='host:port' to fit against a proxy")
        if self.private_key_path is None:
            raise ConfigError(
                "set private_key_path to the analyst's key file (or its key directory)"
            )
        self.check_post_processing()
        required_epsilon(self.epsilon)  # before keys and the network
        private_key = load_analyst_private_key(self.private_key_path)
        signing_key = load_analyst_signing_key(self.private_key_path)
        checked = time.perf_counter() - fit_started
        run = run_estimator_query(
            self,
            private_key,
            signing_key,
            lambda deployment: self.build_query(n_features, private_key.public_key, deployment),
        )
        with charged_release(run.release.query.query_id):
            self._fit_release(
                run.release,
                {"prepare": checked + run.prepare_seconds, **run.timings},
                owners_registered=run.owners_registered,
            )
        return self

    @classmethod
    def from_result(
        cls,
        release: DecodedRelease,
        *,
        owners_registered: int | None = None,
        timings: Mapping[str, float] | None = None,
        **params: Any,
    ) -> Self:
        """A fitted estimator from a decrypted release, without any network.

        Parameters
        ----------
        release : the decrypted release (for :class:`FederatedPCA`, a DCA release too:
            the principal components of the records of its classes).
        owners_registered : owners the proxy accepts, if known (for
            ``n_owners_registered_`` and the warning when fewer contributed).
        timings : phase -> seconds already spent (e.g. "fetch", "decrypt").
        **params : constructor parameters beyond those the query fixes
            (e.g. ``rho`` for DCA, ``proxy``), and ``n_components``: how many
            components to take from the release (default the query's; None: all of
            them; any number is post-processing of the one release, charged nothing
            more). Other query parameters are taken from the release and may not be
            overridden.
        """
        if release.kind is not cls._kind and release.kind not in cls._also_fits_from:
            raise ConfigError(
                f"{cls.__name__} needs a {cls._kind.value} release, got {release.kind.value}"
            )
        query = release.query
        from_query = {
            "n_components": query.n_components,
            "epsilon": query.epsilon,
            "delta": query.delta,
            "mode": query.mode.value,
            "calibration": query.calibration.value,
            "neighbouring": query.neighbouring.value,
            "bounded_owner_tables": query.bounded_owner_tables,
            "bounds": (
                list(zip(query.feature_lower, query.feature_upper, strict=True))
                if query.has_bounds
                else None
            ),
            "clip_norm": query.clip_norm,
            "quorum": query.quorum,
            "deadline_seconds": query.deadline_seconds,
            "max_records_per_owner": query.max_records_per_owner,
            "max_owners": query.max_owners,
            "frac_bits": query.frac_bits,
            "noise_weights": query.noise_weights or None,
            "columns": query.feature_columns or None,
            **cls._params_from_query(query),
        }
        clash = sorted(set(params) & set(from_query) - {"n_components"})
        if clash:
            raise ConfigError(f"{clash} are fixed by the release's query")
        if "n_components" in params:
            params = {
                **params,
                "n_components": check_n_components(params["n_components"], query.n_features),
            }
        estimator = cls(**{**from_query, **params})
        estimator._fit_release(release, timings or {}, owners_registered=owners_registered)
        return estimator

    @classmethod
    def _params_from_query(cls, query: QuerySpec) -> dict[str, Any]:
        return {}

    def _fit_release(
        self,
        release: DecodedRelease,
        timings: Mapping[str, float],
        owners_registered: int | None = None,
    ) -> None:
        query = release.query
        start = time.perf_counter()
        self._solve(release)
        all_timings = dict(timings)
        all_timings["solve"] = time.perf_counter() - start
        self.release_ = release
        self.n_features_in_ = query.n_features
        self.n_owners_ = release.n_owners
        self.n_owners_registered_ = owners_registered
        self.quorum_ = query.quorum
        self.epsilon_ = query.epsilon
        self.delta_ = query.delta if release.private else 0.0
        self.not_private_ = not release.private
        self.mode_ = query.mode.value
        self.query_id_ = query.query_id
        self.key_fingerprint_ = release.key_fingerprint
        self.noise_sigmas_ = dict(release.sigmas)
        self.timings_ = all_timings
        warn_if_owners_missing(release, owners_registered, stacklevel=3)

    def _solve(self, release: DecodedRelease) -> None:
        raise NotImplementedError

    def _solution(self, release: DecodedRelease) -> tuple[FloatArray, FloatArray]:
        """The values and components of ``release`` solved as this fit was."""
        raise NotImplementedError

    def _released_solution(self) -> tuple[FloatArray, FloatArray]:
        """The fitted values and components."""
        raise NotImplementedError

    def _values_covariance(self) -> Callable[[DecodedRelease], Covariance] | None:
        """The symmetric matrix whose eigenvalues the values are (PCA's covariance), for
        their noise bound; None where there is none (DCA's generalized problem)."""
        return None

    def component_noise(
        self, draws: int | None = None, progress: Callable[[int], None] | None = None
    ) -> ComponentNoise:
        """How far the privacy noise alone moves each component and its value, by
        redrawing the noise of the release (:mod:`fedpca.analyst.component_noise`):
        post-processing of the release and its public sigmas, at no privacy charge.

        Parameters
        ----------
        draws : redraws of the noise; default 200 up to about 170 features, fewer
            above (each is one M x M eigendecomposition), at least 30.
        progress : called with 1 after each draw.

        Returns the :class:`~fedpca.analyst.component_noise.ComponentNoise`, also kept
        in ``component_noise_``. Seeded by the query id: the same release gives the
        same numbers every time.
        """
        release = self._check_fitted()
        spread = component_noise(
            release,
            self._solution,
            self._released_solution(),
            draws=draws,
            seed=release_seed(release.query.query_id, "components"),
            progress=progress,
            covariance=self._values_covariance(),
        )
        self.component_noise_ = spread
        return spread

    # ------------------------------------------------------------ projection
    def _check_fitted(self) -> DecodedRelease:
        release: DecodedRelease | None = getattr(self, "release_", None)
        if release is None:
            raise NotFittedError(
                f"this {type(self).__name__} is not fitted yet; call fit() or from_result()"
            )
        return release

    def preprocess(self, X: npt.ArrayLike) -> FloatArray:
        """Apply the query's public preprocessing (bounds scaling, row clip) to rows.

        Parameters
        ----------
        X : (n, M) rows in the raw units of the public schema.

        Returns
        -------
        (n, M) rows in the space the components live in.
        """
        query = self._check_fitted().query
        x = np.asarray(X, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != query.n_features:
            raise DataError(f"X must have shape (n, {query.n_features}), got {x.shape}")
        return preprocess(x, FeatureBounds.from_query(query), query.clip_norm)

    def transform(self, X: npt.ArrayLike) -> FloatArray:
        """Project rows onto the components: (X − mean_) @ components_ᵀ.

        Parameters
        ----------
        X : (n, M) rows in the preprocessed space (see :meth:`preprocess`).
            Masked mode does not release the mean; rows are then projected
            uncentred, which offsets every score by the constant components_ @ μ.

        Returns
        -------
        (n, k) scores.
        """
        query = self._check_fitted().query
        x = np.asarray(X, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != query.n_features:
            raise DataError(f"X must have shape (n, {query.n_features}), got {x.shape}")
        mean: FloatArray | None = self.mean_
        centred = x if mean is None else x - mean
        components: FloatArray = self.components_
        return np.asarray(centred @ components.T, dtype=np.float64)

    # Declared for type checkers; set by fit / from_result.
    components_: FloatArray
    mean_: FloatArray | None
    release_: DecodedRelease
    n_features_in_: int
    n_owners_: int
    n_owners_registered_: int | None
    quorum_: int
    epsilon_: float
    delta_: float
    not_private_: bool
    mode_: str
    query_id_: str
    key_fingerprint_: str
    noise_sigmas_: dict[str, float]
    timings_: dict[str, float]
    n_samples_: float
    component_noise_: ComponentNoise
