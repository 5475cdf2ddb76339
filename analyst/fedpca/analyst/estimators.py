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
import multiprocessing
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from fedpca.analyst.decode import DecodedRelease, decrypt_stream
from fedpca.analyst.keys import load_analyst_private_key, load_analyst_signing_key
from fedpca.analyst.params import SklearnParams
from fedpca.codec.keys import key_fingerprint
from fedpca.codec.paillier import CryptoPool
from fedpca.errors import ConfigError, DataError, FedpcaError, QueryStateError
from fedpca.messages import DeploymentInfo
from fedpca.preprocess import FeatureBounds, preprocess
from fedpca.query import Calibration, Neighbouring, ProtocolMode, QueryKind, QuerySpec
from fedpca.transport.certs import TlsFiles, TlsMaterial

__all__ = [
    "DeclineLog",
    "FederatedDCA",
    "FederatedPCA",
    "MissingOwnersWarning",
    "NotFittedError",
    "new_query_id",
    "resolve_quorum",
    "run_query",
    "warn_if_owners_missing",
]

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
StatusCallback = Callable[[Any], None]
BoundsParam = str | tuple[Any, Any] | FeatureBounds | None


class NotFittedError(FedpcaError, ValueError, AttributeError):
    """An estimator was used before ``fit`` (same bases as scikit-learn's)."""


class MissingOwnersWarning(UserWarning):
    """A result covers fewer owners than the proxy accepts (an explicit quorum below
    the number of registered owners let collection close early)."""


def missing_owners_message(query_id: str, contributed: int, registered: int, quorum: int) -> str:
    """The warning for a result that covers ``contributed`` of ``registered`` owners."""
    return (
        f"query {query_id}: only {contributed} of {registered} registered owners contributed "
        f"(quorum {quorum}); the result covers their records only. Leave the quorum unset "
        "to wait for every registered owner."
    )


def _refuse_in_bootstrapping_child() -> None:
    # A worker process that is still importing its parent's main script (spawn or
    # forkserver start, a script without `if __name__ == "__main__":`) must not submit
    # a query: it would be a second, unintended release charged to the analyst.
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise ConfigError(
            "fit() was called while a worker process was importing the main script; a "
            'script that starts processes needs `if __name__ == "__main__":` around its '
            "top-level code. Refusing to submit a second query from a worker."
        )


def resolve_quorum(quorum: int | None, deployment: DeploymentInfo | None) -> int:
    """The quorum a query states: ``quorum``, or (None) every owner the proxy accepts.

    Raises
    ------
    ConfigError
        ``quorum=None`` without a deployment to count the owners of, or a deployment
        that accepts no owners.
    """
    if quorum is not None:
        return int(quorum)
    if deployment is None:
        raise ConfigError(
            "quorum=None waits for every owner the proxy accepts: fit() asks the "
            "proxy for their number; give quorum=N to build a query without it"
        )
    if deployment.owners_registered < 1:
        raise ConfigError(f"proxy {deployment.proxy_id!r} accepts no owners")
    return deployment.owners_registered


def warn_if_owners_missing(
    release: DecodedRelease, owners_registered: int | None, stacklevel: int = 3
) -> None:
    """:class:`MissingOwnersWarning` when fewer owners contributed than are registered."""
    if owners_registered is not None and release.n_owners < owners_registered:
        query = release.query
        message = missing_owners_message(
            query.query_id, release.n_owners, owners_registered, query.quorum
        )
        warnings.warn(message, MissingOwnersWarning, stacklevel=stacklevel + 1)


class DeclineLog:
    """Logs each owner's decline once (the status callback when there is no display)."""

    def __init__(self) -> None:
        self._declined: set[str] = set()

    def status(self, status: Any) -> None:
        for decline in status.declines:
            if decline.owner_id not in self._declined:
                self._declined.add(decline.owner_id)
                logger.warning("query %s: owner declined: %s", status.query_id, decline.line())


def new_query_id() -> str:
    """A fresh, unguessable query id."""
    return f"q-{uuid.uuid4().hex}"


def run_query(
    spec: QuerySpec,
    client: Any,
    private_key: Any,
    signing_key: Any,
    *,
    on_status: StatusCallback | None = None,
    on_submitted: StatusCallback | None = None,
    decrypt_progress: Callable[[int], None] | None = None,
    on_fetched: Callable[[int], None] | None = None,
    pool: CryptoPool | None = None,
    wait_timeout: float | None = None,
) -> tuple[DecodedRelease, dict[str, float]]:
    """Submit ``spec``, follow it, and decrypt its result page by page as it is released.

    Parameters
    ----------
    spec : the query (its key must be ``private_key``'s).
    client : an :class:`~fedpca.analyst.client.AnalystClient` (or anything with
        ``submit``, ``wait_for_contributors`` and ``fetch_stream``).
    private_key : the analyst's phe private key.
    signing_key : the analyst's Ed25519 query-signing key (owners answer only signed
        queries).
    on_status : called with every status update until the contributors are fixed.
    on_submitted : called with the status returned by the submission.
    decrypt_progress : called with the number of ciphertexts decrypted so far.
    on_fetched : called with the number of ciphertexts to decrypt, once the result's
        header arrived.
    pool : crypto pool for decryption (default: a temporary one on all cores,
        closed before returning). Its workers are started before the submission, so
        a pool that cannot start fails the call before anything is charged.
    wait_timeout : give up waiting after this many seconds (None = never).

    Returns
    -------
    (DecodedRelease, timings) with timings in seconds for "start workers" (none
    when the pool was already running), "submit", "wait" (until the
    contributors are fixed and the result's header arrived), "decrypt" (from then on
    until the last page is decrypted; it overlaps the owners' encryption and the
    proxy's folding of later pages), "tail" (from the last page's arrival until
    it is decrypted) and "decrypt_cpu" (CPU seconds the decryption workers spent, as
    they measured it: the decryption's share of the crypto floor).
    """
    if spec.analyst_public_key_n != private_key.public_key.n:
        raise ConfigError("the query is not addressed to this private key")
    owned = pool is None
    active = CryptoPool() if pool is None else pool
    try:
        timings: dict[str, float] = {}
        # The decryption workers start before anything is charged: a pool that cannot
        # start fails the call while the budget is still untouched.
        start = time.perf_counter()
        active.start()
        timings["start workers"] = time.perf_counter() - start
        start = time.perf_counter()
        submitted = client.submit(spec, signing_key)
        timings["submit"] = time.perf_counter() - start
        logger.info("submitted query %s (state %s)", spec.query_id, submitted.state.value)
        if on_submitted is not None:
            on_submitted(submitted)
        start = time.perf_counter()
        deadline = None if wait_timeout is None else time.monotonic() + wait_timeout
        _wait_or_cancel(
            lambda: client.wait_for_contributors(
                spec.query_id, on_status=on_status, timeout=wait_timeout
            ),
            client,
            spec.query_id,
        )
        try:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            stream = client.fetch_stream(spec.query_id, timeout=remaining)
            timings["wait"] = time.perf_counter() - start
            total = sum(block.n_ciphertexts for block in stream.header.blocks)
            if on_fetched is not None:
                on_fetched(total)
            arrived = [0.0]

            def batches() -> Iterator[list[int]]:
                for chunk in stream.chunks:
                    arrived[0] = time.perf_counter()
                    yield chunk.ciphertexts

            cpu_before = _decryption_cpu(active)
            start = time.perf_counter()
            release = decrypt_stream(
                stream.header,
                batches(),
                private_key,
                expected_query=spec,
                pool=active,
                progress=decrypt_progress,
            )
            finished = time.perf_counter()
            timings["decrypt"] = finished - start
            timings["tail"] = finished - arrived[0] if arrived[0] else 0.0
            timings["decrypt_cpu"] = _decryption_cpu(active) - cpu_before
        except FedpcaError as exc:
            # The release happened and is paid for; it stays stored at the proxy.
            raise type(exc)(
                f"{exc} (the result of query {spec.query_id} stays stored at the proxy: "
                f"fetch it again with `fedpca analyst fetch {spec.query_id}`)"
            ) from exc
    finally:
        if owned:
            active.close()
    return release, timings


def _wait_or_cancel(wait: Callable[[], object], client: Any, query_id: str) -> None:
    """Run ``wait`` (following the query); on Ctrl-C cancel it at the proxy, then re-raise.

    A cancelled query fails at once; its charge is refunded if no owner had begun an
    upload (the proxy's refund rule), and owners receive a cancellation.
    """
    try:
        wait()
    except KeyboardInterrupt:
        try:
            receipt = client.cancel(query_id)
        except QueryStateError as exc:
            logger.warning("interrupted; query %s could not be cancelled: %s", query_id, exc)
        except FedpcaError as exc:
            logger.warning(
                "interrupted; cancelling query %s failed (%s): it may still be collecting; "
                "`fedpca analyst cancel %s` stops it",
                query_id,
                exc,
                query_id,
            )
        else:
            logger.warning(
                "interrupted: query %s cancelled; %s",
                query_id,
                "its charge was refunded"
                if receipt.refunded
                else "an upload had begun, so its charge stands",
            )
        raise


# -------------------------------------------------------------------- helpers
def _decryption_cpu(pool: CryptoPool) -> float:
    """CPU seconds the pool's workers have spent decrypting so far."""
    return sum(cpu for name, (_, cpu) in pool.work_done().items() if "decrypt" in name)


def _resolve_bounds(bounds: BoundsParam, n_features: int) -> FeatureBounds | None:
    if bounds is None:
        return None
    if isinstance(bounds, FeatureBounds):
        bounds = bounds
    elif isinstance(bounds, str):
        if bounds.strip().lower() == "none":
            return None
        bounds = FeatureBounds.parse(bounds, n_features)
    else:
        try:
            lower, upper = bounds
        except (TypeError, ValueError):
            raise ConfigError(
                "bounds must be None, 'LO:HI', a (lower, upper) pair of numbers "
                f"or of length-M sequences, got {bounds!r}"
            ) from None
        if np.ndim(lower) == 0 and np.ndim(upper) == 0:
            bounds = FeatureBounds((float(lower),) * n_features, (float(upper),) * n_features)
        else:
            bounds = FeatureBounds.from_arrays(lower, upper)
    if bounds.n_features != n_features:
        raise ConfigError(f"bounds cover {bounds.n_features} features, not {n_features}")
    return bounds


def _bounds_length(bounds: BoundsParam) -> int | None:
    """M implied by per-feature bounds, if they are given per feature."""
    if isinstance(bounds, FeatureBounds):
        return bounds.n_features
    if isinstance(bounds, str):
        pairs = [p for p in bounds.split(",") if p.strip()]
        return len(pairs) if len(pairs) > 1 else None
    if bounds is not None:
        try:
            lower, _ = bounds
        except (TypeError, ValueError):
            return None
        if np.ndim(lower) == 1:
            return len(lower)
    return None


def _check_schema(n_features: Any, bounds: BoundsParam) -> int:
    if n_features is not None and not isinstance(n_features, int | np.integer):
        raise ConfigError(
            "fit() takes the public schema, not data: the rows stay with their owners. "
            f"Call fit(n_features=M); got {type(n_features).__name__}"
        )
    implied = _bounds_length(bounds)
    if n_features is None:
        if implied is None:
            raise ConfigError("give n_features (or per-feature bounds that imply it)")
        return implied
    if implied is not None and implied != n_features:
        raise ConfigError(f"n_features={n_features} but bounds cover {implied} features")
    return int(n_features)


class _ProgressDisplay:
    """tqdm bars for the owners' uploads and for decryption (``verbose=True``)."""

    def __init__(self) -> None:
        from tqdm.auto import tqdm

        self._tqdm = tqdm
        self._owners: Any = None
        self._decrypt: Any = None
        self._declined: set[str] = set()

    def status(self, status: Any) -> None:
        for decline in status.declines:
            if decline.owner_id not in self._declined:
                self._declined.add(decline.owner_id)
                self._tqdm.write(f"owner declined: {decline.line()}", file=sys.stderr)
        if self._owners is None:
            # Owners arrive minutes apart: a rate would mislead, elapsed time does not.
            self._owners = self._tqdm(
                total=max(status.quorum, 1),
                desc="owners",
                bar_format="{desc} {n}/{total} |{bar}| [{elapsed}]",
            )
        bar = self._owners
        bar.total = max(status.quorum, status.owners_contributed, 1)
        if status.owners_registered:
            bar.total = max(bar.total, status.owners_registered)
        bar.n = status.owners_contributed
        declined = f", {status.owners_declined} declined" if status.owners_declined else ""
        uploading = f", {status.owners_uploading} uploading" if status.owners_uploading else ""
        bar.set_description_str(
            f"{status.state.value}{uploading}{declined}: owners (quorum {status.quorum})",
            refresh=False,
        )
        bar.refresh()
        if status.terminal:
            bar.close()

    def fetched(self, total: int) -> None:
        self._decrypt = self._tqdm(total=total, desc="decrypt", unit="ct")

    def decrypted(self, done: int) -> None:
        if self._decrypt is not None:
            self._decrypt.n = done
            self._decrypt.refresh()
            if done >= self._decrypt.total:
                self._decrypt.close()


# ---------------------------------------------------------------------- base
class _FederatedEstimator(SklearnParams):
    """Shared parameters, query building and the fit pipeline."""

    _kind: QueryKind

    def __init__(
        self,
        n_components: int = 2,
        *,
        epsilon: float = 1.0,
        delta: float = 1e-6,
        mode: str = ProtocolMode.STATS.value,
        calibration: str = Calibration.ZCDP.value,
        neighbouring: str | None = None,
        bounds: BoundsParam = None,
        clip_norm: float = 1.0,
        quorum: int | None = None,
        deadline_seconds: float = 300.0,
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
        self.bounds = bounds
        self.clip_norm = clip_norm
        self.quorum = quorum
        self.deadline_seconds = deadline_seconds
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
        m = _check_schema(n_features, self.bounds)
        bounds = _resolve_bounds(self.bounds, m)
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
            epsilon=float(self.epsilon),
            delta=float(self.delta),
            n_components=int(self.n_components),
            analyst_public_key_n=public_key.n,
            analyst_key_fingerprint=key_fingerprint(public_key),
            feature_lower=() if bounds is None else bounds.lower,
            feature_upper=() if bounds is None else bounds.upper,
            clip_norm=float(self.clip_norm),
            calibration=calibration,
            neighbouring=neighbouring,
            mode=mode,
            quorum=int(quorum),
            deadline_seconds=float(self.deadline_seconds),
            max_records_per_owner=int(self.max_records_per_owner),
            max_owners=int(self.max_owners),
            frac_bits=int(self.frac_bits),
            noise_weights=tuple(self.noise_weights or ()),
            **self._query_extras(),
        )

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
            The proxy refused the release: the analyst's budget is exhausted.
        QueryStateError
            The query failed at the proxy (e.g. quorum not reached by the deadline).
        UntrustedKeyError, LayoutError, ProtocolError
            The result is not what the analyst's own plan expects.
        """
        from fedpca.analyst.client import AnalystClient

        _refuse_in_bootstrapping_child()
        # Refuse data passed as the schema before touching keys or the network.
        _check_schema(n_features, self.bounds)
        if self.proxy is None:
            raise ConfigError("set proxy='host:port' to fit against a proxy")
        if self.private_key_path is None:
            raise ConfigError(
                "set private_key_path to the analyst's key file (or its key directory)"
            )
        private_key = load_analyst_private_key(self.private_key_path)
        signing_key = load_analyst_signing_key(self.private_key_path)
        tls = self._tls_material()
        display = _ProgressDisplay() if self.verbose else None
        declines = DeclineLog()

        def on_status(status: Any) -> None:
            if self.on_status is not None:
                self.on_status(status)
            # Each decline is one line: on the progress display, else in the log.
            if display is not None:
                display.status(status)
            else:
                declines.status(status)

        with (
            AnalystClient(
                self.proxy,
                tls,
                insecure=self.insecure,
                server_name_override=self.server_name_override,
            ) as client,
            CryptoPool(self.n_jobs) as pool,
        ):
            deployment = client.describe()
            spec = self.build_query(n_features, private_key.public_key, deployment)
            if not spec.private:
                logger.warning("epsilon = inf: the release is NOT PRIVATE (no noise at all)")
            release, timings = run_query(
                spec,
                client,
                private_key,
                signing_key,
                on_status=on_status,
                on_submitted=on_status,
                on_fetched=None if display is None else display.fetched,
                decrypt_progress=None if display is None else display.decrypted,
                pool=pool,
            )
        self._fit_release(release, timings, owners_registered=deployment.owners_registered)
        return self

    def _tls_material(self) -> TlsMaterial | None:
        paths = (self.ca, self.cert, self.key)
        if not any(paths):
            return None
        if not all(paths):
            raise ConfigError("ca, cert and key must be given together")
        return TlsMaterial.load(TlsFiles(Path(self.ca), Path(self.cert), Path(self.key)))  # type: ignore[arg-type]

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
        release : the decrypted release.
        owners_registered : owners the proxy accepts, if known (for
            ``n_owners_registered_`` and the warning when fewer contributed).
        timings : phase -> seconds already spent (e.g. "fetch", "decrypt").
        **params : constructor parameters beyond those the query fixes
            (e.g. ``rho`` for DCA, ``proxy``); query parameters are taken from
            the release and may not be overridden.
        """
        if release.kind is not cls._kind:
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
            "bounds": ((query.feature_lower, query.feature_upper) if query.has_bounds else None),
            "clip_norm": query.clip_norm,
            "quorum": query.quorum,
            "deadline_seconds": query.deadline_seconds,
            "max_records_per_owner": query.max_records_per_owner,
            "max_owners": query.max_owners,
            "frac_bits": query.frac_bits,
            "noise_weights": query.noise_weights or None,
            **cls._params_from_query(query),
        }
        clash = sorted(set(params) & set(from_query))
        if clash:
            raise ConfigError(f"{clash} are fixed by the release's query")
        estimator = cls(**from_query, **params)
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


# ----------------------------------------------------------------------- PCA
class FederatedPCA(_FederatedEstimator):
    """Differentially private PCA over rows held by several owners.

    Parameters
    ----------
    n_components : k, components to compute (1 <= k <= M).
    epsilon, delta : privacy parameters of the release (``epsilon=inf``: no
        noise, NOT PRIVATE, verification only).
    mode : "stats" (noisy sufficient statistics, default) or "masked"
        (corrected Wang & Chang: the mean is never released).
    calibration : "zcdp" (default: proven for the discrete Gaussian fedpca samples),
        or the continuous Gaussian's "analytic" (Balle & Wang) or "classic" (epsilon < 1).
    neighbouring : the relation (epsilon, delta) are stated for, "add-remove" or
        "replace-one"; it must be the deployment's. Default: replace-one for masked
        mode (the only relation it has a finite epsilon under), else add-remove.
    bounds : public per-feature bounds: None (raw values, only the row
        clip applies), "LO:HI" or (lo, hi) for every feature, "LO:HI,LO:HI,…" or
        (lower, upper) sequences of length M.  Never derive them from private data.
    clip_norm : rows are clipped to ‖x‖₂ <= clip_norm before summing.
    quorum : owners that must contribute; collection closes as soon as this many
        uploaded. None (default): every owner the proxy accepts (``fit`` asks the
        proxy and states the number in the signed query). A smaller quorum lets a
        result cover fewer owners: ``fit`` then warns (:class:`MissingOwnersWarning`).
    deadline_seconds : seconds the proxy collects uploads.
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
    n_components_ : k.
    n_features_in_ : M.
    n_owners_ : owners aggregated.
    n_owners_registered_ : owners the proxy accepts (None for ``from_result``).
    quorum_ : the quorum the query stated.
    epsilon_, delta_ : privacy parameters of the release (delta_ = 0 without noise).
    not_private_ : True for epsilon = inf.
    noise_sigmas_ : section -> Gaussian sigma in real units.
    timings_ : phase -> seconds ("start workers", "submit", "wait", "decrypt", "tail",
        "decrypt_cpu", "solve"; see :func:`run_query`).
    query_id_, key_fingerprint_, mode_ : provenance.
    release_ : the decrypted :class:`~fedpca.analyst.decode.DecodedRelease`.
    """

    _kind = QueryKind.PCA

    explained_variance_: FloatArray
    explained_variance_ratio_: FloatArray
    singular_values_: FloatArray
    noise_variance_: float
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
        self.n_components_ = result.n_components

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
class FederatedDCA(_FederatedEstimator):
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
        epsilon: float = 1.0,
        delta: float = 1e-6,
        mode: str = ProtocolMode.STATS.value,
        calibration: str = Calibration.ZCDP.value,
        neighbouring: str | None = None,
        bounds: BoundsParam = None,
        clip_norm: float = 1.0,
        quorum: int | None = None,
        deadline_seconds: float = 300.0,
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
            bounds=bounds,
            clip_norm=clip_norm,
            quorum=quorum,
            deadline_seconds=deadline_seconds,
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

    def _solve(self, release: DecodedRelease) -> None:
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
