"""FederatedPCA / FederatedDCA conventions, the fit pipeline (fake proxy), and reports."""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import fedpca.analyst.client as client_module
import fedpca.analyst.federated_estimator as estimators_module
import fedpca.analyst.owner_wait as owner_wait
import fedpca.files as files
from fedpca.analyst import FederatedStatistics
from fedpca.analyst.aggregate_estimators import aggregate_query
from fedpca.analyst.client import ResultStream
from fedpca.analyst.decode import DecodedRelease, result_from_packed
from fedpca.analyst.estimators import FederatedDCA, FederatedPCA, WeakClassWarning
from fedpca.analyst.params import NotFittedError
from fedpca.analyst.querying import MissingOwnersWarning, resolve_quorum
from fedpca.analyst.report import result_document, write_plots, write_report, write_result
from fedpca.analyst.solvers import dca_from_statistics, pca_from_statistics
from fedpca.codec import CryptoPool, key_fingerprint
from fedpca.errors import (
    ConfigError,
    DataError,
    NotFoundError,
    OverloadError,
    OwnersNotConnectedError,
    OwnersWouldDeclineError,
    QueryStateError,
)
from fedpca.exact_statistics import fixed_point_statistics
from fedpca.messages import (
    CancelReceipt,
    DeploymentInfo,
    QueryState,
    QueryStatus,
)
from fedpca.owner_terms import OwnerTerms
from fedpca.preprocess import FeatureBounds, preprocess_for_query
from fedpca.protocol import SHARES, ReleasePlan
from fedpca.query import Aggregate, Calibration, Neighbouring, QueryKind, QuerySpec
from fedpca.signing import signer_id
from fedpca.stats import SufficientStatistics
from fedpca.transport import serde
from helpers import (
    TEST_SIGNER,
    TEST_SIGNING_KEY,
    exact_statistics,
    example_owner_terms,
    plaintext_release,
)

RNG = np.random.default_rng(0)
ROWS = RNG.uniform(-3.0, 3.0, size=(60, 4)) @ np.diag([1.0, 0.6, 0.3, 0.1])
LABELS = np.where(ROWS[:, 0] > 0, 1.0, -1.0)


def deployment(owners: int = 3, neighbouring: Neighbouring = Neighbouring.ADD_REMOVE) -> Any:
    """What DescribeDeployment reports for a proxy accepting ``owners`` owners."""
    return DeploymentInfo(
        proxy_id="proxy",
        software_version="test",
        protocol_version=1,
        owners_registered=owners,
        owners_connected=owners,
        neighbouring=neighbouring,
        max_delta_per_query=1e-5,
        accountant="zcdp",
        analyst_id="alice",
        budget_epsilon=10.0,
        budget_delta=1e-5,
        server_time=datetime.now(UTC),
    )


def release_for(
    kind: QueryKind = QueryKind.PCA,
    n_components: int = 2,
    epsilon: float = math.inf,
    **extra: Any,
) -> DecodedRelease:
    """A decoded release built directly from plaintext statistics (no crypto needed)."""
    if kind is QueryKind.DCA:
        extra = {"label_column": 0, "class_labels": (-1.0, 1.0)} | extra
    spec = QuerySpec(
        query_id="q-est",
        kind=kind,
        n_features=4,
        epsilon=epsilon,
        delta=1e-6,
        n_components=n_components,
        analyst_public_key_n=(1 << 511) + 1,
        analyst_key_fingerprint="sha256:test",
        feature_lower=(-3.0,) * 4,
        feature_upper=(3.0,) * 4,
        **extra,
    )
    rows = preprocess_for_query(ROWS, spec)
    return plaintext_release(spec, rows, LABELS if kind is QueryKind.DCA else None)


# ----------------------------------------------------------- sklearn conventions
def test_constructor_only_stores_parameters() -> None:
    estimator = FederatedPCA(3, epsilon=0.5, bounds=(-1, 1), proxy="nowhere:1")
    assert not [name for name in vars(estimator) if name.endswith("_")]
    params = estimator.get_params()
    assert params["n_components"] == 3 and params["epsilon"] == 0.5
    assert params["bounds"] == (-1, 1) and params["proxy"] == "nowhere:1"
    assert set(params) == set(vars(estimator))
    assert "epsilon=0.5" in repr(estimator)


def test_sklearn_clone_and_set_params() -> None:
    from sklearn.base import clone

    estimator = FederatedDCA(1, classes=(0.0, 1.0), rho=0.1)
    copy = clone(estimator)
    assert copy.get_params() == estimator.get_params() and copy is not estimator
    assert estimator.set_params(epsilon=2.0) is estimator and estimator.epsilon == 2.0
    with pytest.raises(ConfigError, match="no parameter"):
        estimator.set_params(n_clusters=3)


def test_unfitted_estimator_refuses_transform() -> None:
    with pytest.raises(NotFittedError, match="not fitted"):
        FederatedPCA().transform(ROWS)
    with pytest.raises(AttributeError):  # the sklearn way to probe fittedness
        FederatedPCA().transform(ROWS)


def test_fit_takes_the_public_schema_not_data() -> None:
    estimator = FederatedPCA(proxy="nowhere:1", private_key_path="/nonexistent")
    with pytest.raises(ConfigError, match="public schema"):
        estimator.fit(ROWS)  # type: ignore[arg-type]


def test_n_components_is_checked_not_truncated(test_only_keypair_512: Any) -> None:
    """Found by an analyst's walkthrough: n_components=2.5 was submitted as 2 and
    charged, and None (all components) raised a bare TypeError."""
    public_key, _ = test_only_keypair_512
    for wrong in (2.5, "2", 0, 6, True):
        with pytest.raises(ConfigError, match="n_components must be"):
            FederatedPCA(wrong, quorum=1, epsilon=1.0).build_query(5, public_key)  # type: ignore[arg-type]
    assert FederatedPCA(None, quorum=1, epsilon=1.0).build_query(5, public_key).n_components == 5
    assert (
        FederatedPCA(np.int64(3), quorum=1, epsilon=1.0).build_query(5, public_key).n_components
        == 3
    )


def test_scikit_learn_helpers_work_on_the_estimators() -> None:
    """Found by an analyst's walkthrough: scikit-learn 1.6+ asks every estimator for
    __sklearn_tags__, so check_is_fitted raised AttributeError on ours."""
    from sklearn.base import clone
    from sklearn.exceptions import NotFittedError as SklearnNotFitted
    from sklearn.utils.validation import check_is_fitted

    with pytest.raises(SklearnNotFitted):
        check_is_fitted(FederatedPCA(2, epsilon=0.5))
    check_is_fitted(FederatedPCA.from_result(release_for(n_components=2)))
    stats = FederatedStatistics([1, 2], bounds="0:1", ddof=1, epsilon=1.0)
    assert clone(stats).get_params() == stats.get_params()
    with pytest.raises(SklearnNotFitted):
        check_is_fitted(stats)


def test_build_query_from_parameters(test_only_keypair_512: Any) -> None:
    public_key, _ = test_only_keypair_512
    spec = FederatedPCA(2, epsilon=0.7, bounds="0:10", quorum=3).build_query(5, public_key)
    assert spec.feature_lower == (0.0,) * 5 and spec.feature_upper == (10.0,) * 5
    assert spec.quorum == 3 and spec.epsilon == 0.7 and spec.kind is QueryKind.PCA
    assert spec.analyst_key_fingerprint == key_fingerprint(public_key)
    # Per-feature bounds imply M; a conflicting M is refused.
    per_feature = FederatedPCA(1, bounds=([0, 0, 0], [1, 2, 3]), epsilon=1.0)
    assert per_feature.build_query(None, public_key, deployment()).n_features == 3
    with pytest.raises(ConfigError, match="cover 3 features"):
        per_feature.build_query(4, public_key, deployment())
    dca = FederatedDCA(1, classes=(1, 2, 3), label_column=4, epsilon=1.0)
    spec = dca.build_query(4, public_key, deployment())
    assert spec.class_labels == (1.0, 2.0, 3.0) and spec.label_column == 4
    with pytest.raises(ConfigError, match="stats mode"):
        FederatedDCA(1, mode="masked", epsilon=1.0).build_query(4, public_key, deployment())
    assert (
        not FederatedPCA(2, epsilon=1.0)
        .build_query(4, public_key, deployment())
        .bounded_owner_tables
    )
    bounded = FederatedDCA(1, bounded_owner_tables=True, epsilon=1.0).build_query(
        4, public_key, deployment()
    )
    assert bounded.bounded_owner_tables and bounded.neighbouring is Neighbouring.ADD_REMOVE
    assert FederatedPCA(2, bounded_owner_tables=True, epsilon=1.0).get_params()[
        "bounded_owner_tables"
    ]
    # Named feature columns give M and travel in the query; a release read back keeps them.
    named = FederatedPCA(2, epsilon=1.0, columns=(4, 1, 7), bounds="0:1")
    spec = named.build_query(None, public_key, deployment())
    assert spec.feature_columns == (4, 1, 7) and spec.n_features == 3
    assert named.build_query(3, public_key, deployment()).feature_columns == (4, 1, 7)
    with pytest.raises(ConfigError, match="n_features=5 but columns names 3"):
        named.build_query(5, public_key, deployment())
    with pytest.raises(ConfigError, match="fit\\(\\) takes the public schema, not data"):
        named.set_params(proxy="fake:1", private_key_path="k").fit(np.ones((4, 3)))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="columns names no column"):
        FederatedPCA(2, epsilon=1.0, columns=()).build_query(None, public_key, deployment())
    rows = np.random.default_rng(0).uniform(-1, 1, (50, 3))
    back = FederatedPCA.from_result(plaintext_release(spec, rows))
    assert back.get_params()["columns"] == (4, 1, 7)
    assert FederatedPCA(2, epsilon=1.0).get_params()["columns"] is None
    # A release read back states the calibration it was made with.
    fitted = FederatedPCA.from_result(release_for(epsilon=1.0, bounded_owner_tables=True))
    assert fitted.bounded_owner_tables and fitted.neighbouring == "add-remove"
    document = result_document(fitted)
    assert document["bounded_owner_tables"] is True and document["neighbouring"] == "add-remove"
    stats = FederatedStatistics([0], bounds=[(0.0, 1.0)], bounded_owner_tables=True, epsilon=1.0)
    settings = stats._query_settings(deployment())
    aggregate = aggregate_query(
        [Aggregate.statistics((0,), (0.0,), (1.0,))], public_key, **settings
    )
    assert aggregate.bounded_owner_tables and stats.get_params()["bounded_owner_tables"]


def test_default_quorum_is_every_registered_owner(test_only_keypair_512: Any) -> None:
    public_key, _ = test_only_keypair_512
    estimator = FederatedPCA(2, epsilon=1.0)
    assert estimator.quorum is None
    # The query states the number explicitly (owners and the proxy see it, signed).
    assert estimator.build_query(4, public_key, deployment(7)).quorum == 7
    # An explicit quorum wins; without a deployment the default cannot be resolved.
    assert (
        FederatedPCA(2, quorum=2, epsilon=1.0).build_query(4, public_key, deployment(7)).quorum == 2
    )
    with pytest.raises(ConfigError, match="every owner the proxy accepts"):
        estimator.build_query(4, public_key)
    with pytest.raises(ConfigError, match="accepts no owners"):
        estimator.build_query(4, public_key, deployment(0))
    # The relation defaults to the deployment's (masked mode: replace-one).
    replace_one = deployment(3, Neighbouring.REPLACE_ONE)
    assert estimator.build_query(4, public_key, replace_one).neighbouring is (
        Neighbouring.REPLACE_ONE
    )
    assert FederatedPCA(2, epsilon=1.0).build_query(4, public_key, deployment()).neighbouring is (
        Neighbouring.ADD_REMOVE
    )
    masked = FederatedPCA(2, mode="masked", epsilon=1.0).build_query(4, public_key, deployment())
    assert masked.neighbouring is Neighbouring.REPLACE_ONE


def test_the_default_calibration_is_the_proven_zcdp(test_only_keypair_512: Any) -> None:
    public_key, _ = test_only_keypair_512
    assert QuerySpec.__dataclass_fields__["calibration"].default is Calibration.ZCDP
    for estimator in (FederatedPCA(2, epsilon=0.7), FederatedDCA(1, classes=(1, 2), epsilon=1.0)):
        assert estimator.build_query(4, public_key, deployment()).calibration is Calibration.ZCDP


def test_every_estimator_takes_the_same_bounds_forms(test_only_keypair_512: Any) -> None:
    """FederatedPCA refused the per-feature pairs FederatedStatistics and
    FederatedLinearRegression take (a reviewer's bounds=[(0, 17), (0, 200), ...]); one
    parser reads every form for every estimator."""
    public_key, _ = test_only_keypair_512
    lower, upper = (0.0, 0.0, 20.0), (17.0, 200.0, 90.0)
    forms: list[Any] = [
        "0:17,0:200,20:90",
        [(0, 17), (0, 200), (20, 90)],
        np.array([[0, 17], [0, 200], [20, 90]]),
        (list(lower), list(upper)),
        FeatureBounds(lower, upper),
    ]
    for bounds in forms:
        spec = FederatedPCA(1, bounds=bounds, epsilon=1.0).build_query(
            None, public_key, deployment()
        )
        assert (spec.n_features, spec.feature_lower, spec.feature_upper) == (3, lower, upper)
        dca = FederatedDCA(1, bounds=bounds, epsilon=1.0).build_query(3, public_key, deployment())
        assert (dca.feature_lower, dca.feature_upper) == (lower, upper)
        part = FederatedStatistics([1, 2, 8], bounds=bounds, epsilon=1.0).aggregate()
        assert (part.lower, part.upper) == (lower, upper)
    for bounds in ("0:1", (0, 1), [0.0, 1.0]):
        spec = FederatedPCA(1, bounds=bounds, epsilon=1.0).build_query(3, public_key, deployment())
        assert spec.feature_lower == (0.0,) * 3 and spec.feature_upper == (1.0,) * 3
        assert (
            FederatedStatistics([1, 2, 8], bounds=bounds, epsilon=1.0).aggregate().upper
            == (1.0,) * 3
        )
    # Two features: a 2 x 2 is one pair per feature, for PCA as for the aggregates.
    two = FederatedPCA(1, bounds=[(0, 17), (0, 200)], epsilon=1.0).build_query(
        None, public_key, deployment()
    )
    assert (two.feature_lower, two.feature_upper) == ((0.0, 0.0), (17.0, 200.0))
    with pytest.raises(ConfigError, match="one \\(lo, hi\\) pair per feature; give"):
        FederatedPCA(1, bounds=([-1, -2], [1, 2]), epsilon=1.0).build_query(
            2, public_key, deployment()
        )
    # What is no form is refused, naming the forms; so are bounds for other features.
    with pytest.raises(ConfigError, match="one \\(lo, hi\\) pair per feature"):
        FederatedPCA(1, bounds=[(0, 1, 2)] * 3, epsilon=1.0).build_query(
            3, public_key, deployment()
        )
    with pytest.raises(ConfigError, match="cover 3 features"):
        FederatedPCA(1, bounds=forms[1], epsilon=1.0).build_query(4, public_key, deployment())
    # A release read back gives its bounds in the same form, and they read back alike.
    fitted = FederatedPCA.from_result(release_for())
    again = FederatedPCA(**fitted.get_params()).build_query(4, public_key, deployment())
    query = fitted.release_.query
    assert (again.feature_lower, again.feature_upper) == (query.feature_lower, query.feature_upper)


def test_from_result_sets_learned_attributes_and_transforms() -> None:
    estimator = FederatedPCA.from_result(release_for(n_components=4))
    assert estimator.components_.shape == (4, 4)
    assert estimator.n_features_in_ == 4 and estimator.n_components_ == 4
    assert estimator.n_samples_ == 60 and estimator.n_owners_ == 2
    assert set(estimator.timings_) == {"solve"}
    rows = estimator.preprocess(ROWS[:10])
    # (-3, 3) bounds map x to x / 3; rows beyond norm 1 are clipped.
    np.testing.assert_allclose(rows, preprocess_for_query(ROWS[:10], estimator.release_.query))
    scores = estimator.transform(rows)
    assert scores.shape == (10, 4)
    # With all M components the projection is an orthogonal change of basis.
    np.testing.assert_allclose(estimator.inverse_transform(scores), rows, atol=1e-12)
    np.testing.assert_allclose(scores, (rows - estimator.mean_) @ estimator.components_.T)
    with pytest.raises(DataError, match="shape"):
        estimator.transform(rows[:, :3])
    with pytest.raises(ConfigError, match="fixed by the release"):
        FederatedPCA.from_result(release_for(), epsilon=1.0)


def test_from_result_takes_any_number_of_components_of_the_release() -> None:
    """Found in review: the components kept were fixed by the query (n_components was
    refused as "fixed by the release"), though choosing them is post-processing of
    the one release: the analyst had to ask, and pay, again for another number."""
    release = release_for(n_components=4)
    every = FederatedPCA.from_result(release)
    two = FederatedPCA.from_result(release, n_components=2)
    assert two.n_components_ == 2 and two.components_.shape == (2, 4)
    np.testing.assert_allclose(two.components_, every.components_[:2])
    np.testing.assert_allclose(two.explained_variance_, every.explained_variance_[:2])
    assert (
        FederatedPCA.from_result(release_for(n_components=1), n_components=None).n_components_ == 4
    )
    for wrong in (0, 5, 2.5, True):
        with pytest.raises(ConfigError, match="n_components must be"):
            FederatedPCA.from_result(release, n_components=wrong)
    with pytest.raises(ConfigError, match="needs a dca release"):
        FederatedDCA.from_result(release_for())


# -------------------------------------------------------- fit with a fake proxy
class FakeClient:
    """Stands in for AnalystClient: encrypts the owners' shares as a proxy would."""

    instances: ClassVar[list[FakeClient]] = []
    key: ClassVar[Any] = None

    registered: ClassVar[int] = 2
    contributed: ClassVar[int] = 2

    def __init__(self, proxy: str, tls: Any, insecure: bool = False, **_: Any) -> None:
        self.proxy, self.tls, self.insecure = proxy, tls, insecure
        self.submitted: list[QuerySpec] = []
        self.signers: list[str] = []
        self.cancelled: list[str] = []
        FakeClient.instances.append(self)

    def describe(self, with_owner_terms: bool = False) -> DeploymentInfo:
        return deployment(self.registered)  # type: ignore[no-any-return]

    def cancel(self, query_id: str) -> CancelReceipt:
        self.cancelled.append(query_id)
        status = QueryStatus(query_id, QueryState.FAILED, 0, 2, failure_reason="cancelled")
        return CancelReceipt(status, refunded=True)

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *args: Any) -> None:
        pass

    def submit(self, spec: QuerySpec, signing_key: Any) -> QueryStatus:
        self.submitted.append(spec)
        self.signers.append(signer_id(signing_key))
        return QueryStatus(spec.query_id, QueryState.COLLECTING, 0, spec.quorum)

    def wait_for_contributors(
        self, query_id: str, on_status: Any = None, timeout: Any = None
    ) -> QueryStatus:
        fixed = QueryStatus(query_id, QueryState.AGGREGATING, 0, 1)
        if on_status is not None:
            on_status(fixed)
        return fixed

    def fetch_stream(self, query_id: str, timeout: Any = None) -> ResultStream:
        """The result as the proxy streams it: header, then chained pages of one page
        ciphertext each (through the real stream reader)."""
        (spec,) = self.submitted
        public_key = self.key.public_key
        plan = ReleasePlan.for_query(spec, 512)
        block = plan.owner_block(SHARES)
        share = fixed_point_statistics(ROWS, None, spec)
        values = plan.owner_integers(share)[SHARES]
        with CryptoPool(1) as pool:
            packed = pool.encrypt_packed(public_key, values, block.layout, block.bound)
        result = result_from_packed(spec, self.contributed, {SHARES: packed})
        messages = serde.encode_result(result, max_message_bytes=64 + 128)
        header, chunks = serde.read_result_stream(messages)
        assert header.total_chunks > 1  # several pages, decrypted as they arrive
        return ResultStream(header, chunks)


def test_fit_runs_the_query_and_returns_self(
    monkeypatch: pytest.MonkeyPatch, test_only_keypair_512: Any
) -> None:
    from sklearn.decomposition import PCA

    _, private_key = test_only_keypair_512
    FakeClient.key = private_key
    monkeypatch.setattr(client_module, "AnalystClient", FakeClient)
    monkeypatch.setattr(estimators_module, "load_analyst_private_key", lambda path: private_key)
    signing_keys_from: list[Any] = []

    def load_signing_key(path: Any) -> Any:
        signing_keys_from.append(path)
        return TEST_SIGNING_KEY

    monkeypatch.setattr(estimators_module, "load_analyst_signing_key", load_signing_key)
    statuses: list[QueryStatus] = []
    estimator = FederatedPCA(
        2,
        epsilon=math.inf,
        bounds=(-3, 3),
        proxy="fake:1",
        insecure=True,
        private_key_path="key.json",
        n_jobs=1,
        on_status=statuses.append,
    )

    assert estimator.fit(4) is estimator

    (client,) = FakeClient.instances[-1:]
    assert client.proxy == "fake:1" and client.insecure
    assert estimator.query_id_ == client.submitted[0].query_id
    # Signed with the signing key found next to the private key.
    assert signing_keys_from == ["key.json"] and client.signers == [TEST_SIGNER]
    assert [s.state for s in statuses] == [QueryState.COLLECTING, QueryState.AGGREGATING]
    assert set(estimator.timings_) == {
        "prepare",
        "start workers",
        "submit",
        "wait",
        "decrypt",
        "tail",
        "decrypt_cpu",
        "solve",
    }
    spec = client.submitted[0]
    # Quorum unset: the query waited for every registered owner, and the result says so.
    assert spec.quorum == 2 and estimator.quorum_ == 2
    assert estimator.n_owners_ == 2 and estimator.n_owners_registered_ == 2
    # Exactly the PCA of the owners' exact statistics (quantised rows) ...
    exact = pca_from_statistics(exact_statistics(ROWS, None, spec), n_components=2)
    np.testing.assert_allclose(
        np.abs(estimator.components_), np.abs(exact.components), rtol=0, atol=1e-9
    )
    # ... which is sklearn's on the float rows to within the quantisation (2^-16).
    reference = PCA(2, svd_solver="covariance_eigh").fit(preprocess_for_query(ROWS, spec))
    np.testing.assert_allclose(
        np.abs(estimator.components_), np.abs(reference.components_), rtol=0, atol=1e-4
    )


def test_failed_query_raises_with_the_proxy_reason(
    monkeypatch: pytest.MonkeyPatch, test_only_keypair_512: Any
) -> None:
    _, private_key = test_only_keypair_512

    class Failing(FakeClient):
        def wait_for_contributors(
            self, query_id: str, on_status: Any = None, timeout: Any = None
        ) -> QueryStatus:
            raise QueryStateError(f"query {query_id!r} failed at the proxy: quorum not reached")

    monkeypatch.setattr(client_module, "AnalystClient", Failing)
    monkeypatch.setattr(estimators_module, "load_analyst_private_key", lambda path: private_key)
    monkeypatch.setattr(
        estimators_module, "load_analyst_signing_key", lambda path: TEST_SIGNING_KEY
    )
    estimator = FederatedPCA(
        proxy="fake:1", insecure=True, private_key_path="k", n_jobs=1, epsilon=1.0
    )
    with pytest.raises(QueryStateError, match="quorum not reached"):
        estimator.fit(4)
    assert not hasattr(estimator, "components_")


def _fake_fit(monkeypatch: pytest.MonkeyPatch, private_key: Any, client: type[FakeClient]) -> None:
    FakeClient.key = private_key
    monkeypatch.setattr(client_module, "AnalystClient", client)
    monkeypatch.setattr(estimators_module, "load_analyst_private_key", lambda path: private_key)
    monkeypatch.setattr(
        estimators_module, "load_analyst_signing_key", lambda path: TEST_SIGNING_KEY
    )


def test_a_result_of_fewer_owners_than_registered_warns(
    monkeypatch: pytest.MonkeyPatch, test_only_keypair_512: Any, tmp_path: Path
) -> None:
    class Partial(FakeClient):
        registered = 3
        contributed = 1

    _fake_fit(monkeypatch, test_only_keypair_512[1], Partial)
    estimator = FederatedPCA(
        2,
        epsilon=math.inf,
        bounds=(-3, 3),
        quorum=1,
        proxy="fake:1",
        insecure=True,
        private_key_path="k",
        n_jobs=1,
    )
    with pytest.warns(MissingOwnersWarning, match="only 1 of 3 registered owners"):
        estimator.fit(4)
    assert estimator.n_owners_ == 1 and estimator.n_owners_registered_ == 3
    assert estimator.quorum_ == 1
    document = _strict_json(write_result(tmp_path / "r.json", estimator))
    assert document["owners"] == {
        "contributed": 1,
        "registered": 3,
        "quorum": 1,
        "all_registered": False,
        "summary": "1 of 3 registered",
    }
    # Every registered owner contributed: no warning.
    _fake_fit(monkeypatch, test_only_keypair_512[1], FakeClient)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingOwnersWarning)
        FederatedPCA(
            2,
            epsilon=math.inf,
            bounds=(-3, 3),
            proxy="fake:1",
            insecure=True,
            private_key_path="k",
            n_jobs=1,
        ).fit(4)


def test_interrupting_the_wait_cancels_the_query(
    monkeypatch: pytest.MonkeyPatch, test_only_keypair_512: Any
) -> None:
    class Interrupted(FakeClient):
        def wait_for_contributors(
            self, query_id: str, on_status: Any = None, timeout: Any = None
        ) -> Any:
            raise KeyboardInterrupt

    _fake_fit(monkeypatch, test_only_keypair_512[1], Interrupted)
    estimator = FederatedPCA(
        proxy="fake:1", insecure=True, private_key_path="k", n_jobs=1, epsilon=1.0
    )
    with pytest.raises(KeyboardInterrupt):
        estimator.fit(4)
    client = FakeClient.instances[-1]
    assert client.cancelled == [client.submitted[0].query_id]


def test_an_interrupt_during_the_submission_cancels_the_query_if_it_arrived(
    monkeypatch: pytest.MonkeyPatch,
    test_only_keypair_512: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The proxy may have accepted a query whose submission was interrupted (a SIGTERM
    came in that window in a test of the command line): it is cancelled as well; one
    the proxy does not know is said to cost nothing."""

    class InterruptedSubmission(FakeClient):
        def submit(self, spec: QuerySpec, signing_key: Any) -> QueryStatus:
            super().submit(spec, signing_key)
            raise KeyboardInterrupt

    class NeverArrived(InterruptedSubmission):
        def cancel(self, query_id: str) -> CancelReceipt:
            raise NotFoundError(f"unknown query {query_id!r}")

    _fake_fit(monkeypatch, test_only_keypair_512[1], InterruptedSubmission)
    estimator = FederatedPCA(
        proxy="fake:1", insecure=True, private_key_path="k", n_jobs=1, epsilon=1.0
    )
    with pytest.raises(KeyboardInterrupt):
        estimator.fit(4)
    client = FakeClient.instances[-1]
    assert client.cancelled == [client.submitted[0].query_id]
    _fake_fit(monkeypatch, test_only_keypair_512[1], NeverArrived)
    with (
        caplog.at_level("WARNING", logger="fedpca.analyst.estimators"),
        pytest.raises(KeyboardInterrupt),
    ):
        estimator.fit(4)
    assert "is not at the proxy, so nothing is charged for it" in caplog.text


def test_interrupting_the_decryption_names_fetch_and_does_not_cancel(
    monkeypatch: pytest.MonkeyPatch,
    test_only_keypair_512: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Past the wait the query is released and charged: Ctrl-C says so and how to get the
    result back (a reviewer's Ctrl-C during decryption printed only "Aborted!")."""

    class InterruptedFetch(FakeClient):
        def fetch_stream(self, query_id: str, timeout: Any = None) -> ResultStream:
            raise KeyboardInterrupt

    _fake_fit(monkeypatch, test_only_keypair_512[1], InterruptedFetch)
    estimator = FederatedPCA(
        proxy="fake:1", insecure=True, private_key_path="k", n_jobs=1, epsilon=1.0
    )
    with (
        caplog.at_level("WARNING", logger="fedpca.analyst.estimators"),
        pytest.raises(KeyboardInterrupt),
    ):
        estimator.fit(4)
    client = FakeClient.instances[-1]
    query_id = client.submitted[0].query_id
    assert client.cancelled == []
    assert f"fedpca analyst fetch {query_id}" in caplog.text
    assert "charge stands" in caplog.text


def test_a_query_needing_owners_that_are_not_connected_is_not_submitted(
    monkeypatch: pytest.MonkeyPatch,
    test_only_keypair_512: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """DescribeDeployment says how many owners are connected. Found by a new user's
    walkthrough: with one owner offline, a query of the default quorum was submitted
    with a warning, the others began their uploads at once, and it failed at its
    deadline charged in full. Now ``fit`` waits a little for them, then refuses,
    submitting nothing; ``wait_for_owners=True`` submits anyway, with the warning."""
    sleeps: list[float] = []
    monkeypatch.setattr(owner_wait, "_pause", sleeps.append)
    monkeypatch.setattr(owner_wait, "OWNERS_CONNECT_SECONDS", 0.0)

    class Disconnected(FakeClient):
        def describe(self, with_owner_terms: bool = False) -> DeploymentInfo:
            return dataclasses.replace(
                deployment(self.registered),
                owners_connected=0,
                owners_absent=("hospital-a", "hospital-b"),
            )

    fitted: list[FederatedPCA] = []

    def fit(client: type[FakeClient], **params: Any) -> FakeClient:
        _fake_fit(monkeypatch, test_only_keypair_512[1], client)
        estimator = FederatedPCA(
            proxy="fake:1", insecure=True, private_key_path="k", n_jobs=1, epsilon=1.0
        )
        fitted.append(estimator)
        estimator.set_params(**params).fit(4)
        return FakeClient.instances[-1]

    with pytest.raises(ConfigError, match=r"only 0 of the 2 owners .* nothing was submitted") as e:
        fit(Disconnected)
    # Named, as the proxy names them: what an operator needs to bring them back.
    assert "registered) are connected to the proxy (not connected: hospital-a, hospital-b)" in (
        str(e.value)
    )
    assert FakeClient.instances[-1].submitted == []
    # Retry later, as a proxy limit (the CLI's exit code 4; it was 1: an operator's
    # walkthrough, stop 42), and still a ConfigError for code that caught that.
    assert isinstance(e.value, OwnersNotConnectedError) and isinstance(e.value, OverloadError)

    # Owners still starting: asked again each second until they are connected, saying
    # so whenever one comes (a walkthrough waited 40 s in silence).
    class Connecting(FakeClient):
        asked = 0

        def describe(self, with_owner_terms: bool = False) -> DeploymentInfo:
            Connecting.asked += 1
            absent = [("a", "b"), ("b",), ("b",), ()][min(Connecting.asked, 4) - 1]
            return dataclasses.replace(
                deployment(self.registered), owners_connected=2 - len(absent), owners_absent=absent
            )

    monkeypatch.setattr(owner_wait, "OWNERS_CONNECT_SECONDS", 60.0)
    with caplog.at_level("WARNING", logger="fedpca.analyst.estimators"):
        connected = fit(Connecting)
    assert len(connected.submitted) == 1 and sleeps == [1.0, 1.0, 1.0]
    assert (
        "only 0 of the 2 owners this query needs are connected to the proxy (not connected: "
        "a, b); waiting up to 60 s" in caplog.text
    )
    assert caplog.text.count("1 of the 2 owners connected (not connected: b); still waiting") == 1
    assert "connected to the proxy now" not in caplog.text

    with caplog.at_level("WARNING", logger="fedpca.analyst.estimators"):
        waiting = fit(Disconnected, wait_for_owners=True)
    assert len(waiting.submitted) == 1
    assert "only 0 of the 2 owners this query needs" in caplog.text
    # ... and what that wait may cost: the proxy's refund rule, stated as it is.
    assert (
        "If it fails there after any owner began an upload (the connected ones may begin at "
        "once), its epsilon stays charged in full although nothing is released; it is "
        "refunded only if no owner began one" in caplog.text
    )
    assert "owners connect" not in fitted[-1].timings_  # it did not wait

    # The wait for owners is a timing of its own; it was counted as "prepare".
    Connecting.asked = 0
    monkeypatch.setattr(owner_wait, "_pause", lambda seconds: time.sleep(0.25))
    fit(Connecting)
    timings = fitted[-1].timings_
    assert timings["owners connect"] >= 0.75 and timings["prepare"] < 0.5


def _terms(*kinds: QueryKind) -> OwnerTerms:
    """Terms of an owner of 4 feature columns answering ``kinds``."""
    return example_owner_terms(allowed_kinds=kinds)


def test_a_query_the_owners_stated_terms_refuse_is_not_submitted(
    monkeypatch: pytest.MonkeyPatch, test_only_keypair_512: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The connected owners' terms judge the query before it is submitted: an owner that
    would decline it is named with its reason, and a query too few owners would accept
    is refused with nothing submitted (it would fail for want of its quorum, charged in
    full once the others began their uploads)."""

    class Stating(FakeClient):
        registered = 3
        connected = 3
        asked_terms: ClassVar[list[bool]] = []

        def describe(self, with_owner_terms: bool = False) -> DeploymentInfo:
            Stating.asked_terms.append(with_owner_terms)
            stated = (
                ("hospital-a", _terms(QueryKind.PCA, QueryKind.DCA)),
                ("hospital-b", _terms(QueryKind.DCA)),
                ("hospital-c", _terms(QueryKind.DCA)),
            )[: self.connected]
            return dataclasses.replace(
                deployment(self.registered),
                owners_connected=self.connected,
                owner_terms=stated if with_owner_terms else (),
            )

    def fit(quorum: int, **params: Any) -> FakeClient:
        _fake_fit(monkeypatch, test_only_keypair_512[1], Stating)
        estimator = FederatedPCA(
            proxy="fake:1", insecure=True, private_key_path="k", n_jobs=1, epsilon=1.0
        )
        estimator.set_params(quorum=quorum, **params).fit(4)
        return FakeClient.instances[-1]

    refusal = "pca queries are not in policy.allowed_kinds (dca)"
    with (
        caplog.at_level("WARNING", logger="fedpca.analyst.estimators"),
        pytest.raises(OwnersWouldDeclineError) as refused,
    ):
        fit(2)
    assert FakeClient.instances[-1].submitted == []
    assert Stating.asked_terms[0] is True
    assert (
        "2 of the 3 connected owners would decline this query (reasons above), which "
        "leaves 1 for its quorum of 2: nothing was submitted" in str(refused.value)
    )
    for owner in ("hospital-b", "hospital-c"):
        assert f"owner {owner} states terms this query does not meet: {refusal}" in caplog.text
    assert "hospital-a states" not in caplog.text

    # One owner accepting is enough for a quorum of 1: submitted, the others named.
    caplog.clear()
    with (
        caplog.at_level("WARNING", logger="fedpca.analyst.estimators"),
        pytest.warns(MissingOwnersWarning),  # 2 of the 3 contribute here
    ):
        assert len(fit(1).submitted) == 1
    assert f"owner hospital-b states terms this query does not meet: {refusal}" in caplog.text

    # Waiting for owners not connected yet: they may accept (no terms known), so a
    # quorum the connected ones cannot meet alone is submitted to wait for them.
    Stating.connected = 2  # hospital-c absent; hospital-b declines
    with pytest.warns(MissingOwnersWarning):
        assert len(fit(2, wait_for_owners=True).submitted) == 1
    with pytest.raises(OwnersWouldDeclineError, match="leaves 2 for its quorum of 3"):
        fit(3, wait_for_owners=True)


def test_fit_refuses_to_submit_from_a_bootstrapping_worker(
    monkeypatch: pytest.MonkeyPatch, test_only_keypair_512: Any
) -> None:
    import multiprocessing

    _fake_fit(monkeypatch, test_only_keypair_512[1], FakeClient)
    before = len(FakeClient.instances)
    # What multiprocessing sets while a spawned worker imports its parent's script.
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    estimator = FederatedPCA(
        proxy="fake:1", insecure=True, private_key_path="k", n_jobs=1, epsilon=1.0
    )
    with pytest.raises(ConfigError, match="worker process was importing the main script"):
        estimator.fit(4)
    assert len(FakeClient.instances) == before  # never connected, nothing submitted


# --------------------------------------------------------------------- reports
def _strict_json(path: Path) -> dict[str, Any]:
    def refuse(constant: str) -> None:
        raise AssertionError(f"non-standard JSON constant {constant}")

    document: dict[str, Any] = json.loads(path.read_text(), parse_constant=refuse)
    return document


def _is_png(path: Path) -> bool:
    return (
        path.is_file()
        and path.stat().st_size > 100
        and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    )


def test_report_writes_json_and_plots(tmp_path: Path) -> None:
    estimator = FederatedPCA.from_result(release_for())
    sample = estimator.preprocess(ROWS)
    files = write_report(tmp_path / "out" / "result.json", estimator, sample=sample, labels=LABELS)

    document = _strict_json(files.json)
    for key in (
        "components",
        "explained_variance",
        "explained_variance_ratio",
        "mean",
        "n_samples",
        "n_samples_noisy",
        "n_owners",
        "epsilon",
        "delta",
        "mechanism",
        "calibration",
        "mode",
        "timings",
        "not_private",
        "key_fingerprint",
        "query_id",
    ):
        assert key in document, key
    assert np.asarray(document["components"]).shape == (2, 4)
    assert document["epsilon"] is None and document["not_private"] is True
    assert document["mechanism"] == "none" and document["query_id"] == "q-est"
    assert document["plots"] == {
        "scree": "result.scree.png",
        "projection": "result.projection.png",
    }
    assert files.projection is not None
    assert _is_png(files.scree) and _is_png(files.projection)
    assert files.scree.parent == files.json.parent


def test_private_dca_report_and_separate_writers(tmp_path: Path) -> None:
    estimator = FederatedDCA.from_result(release_for(QueryKind.DCA, 1, epsilon=1.0))
    path = write_result(tmp_path / "dca.json", estimator, extra={"note": "x", "ratio": math.nan})
    document = _strict_json(path)
    assert document["eigenvalues"] and document["classes"] == [-1.0, 1.0]
    assert document["epsilon"] == 1.0 and document["not_private"] is False
    assert document["mechanism"] == "gaussian" and document["ratio"] is None
    assert document["note"] == "x"
    plots = write_plots(tmp_path / "plots", estimator, sample=estimator.preprocess(ROWS))
    assert [p.name for p in plots] == ["scree.png", "projection.png"]
    assert all(_is_png(p) for p in plots)


def test_a_result_write_cut_short_leaves_the_earlier_file_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by review: result.json was written in place, so a fetch killed while
    writing truncated it, the earlier copy included, and the proxy deletes results
    after keep_results_days. Now the new file replaces the old only once on disk."""
    estimator = FederatedPCA.from_result(release_for(QueryKind.PCA, 1, epsilon=1.0))
    path = write_result(tmp_path / "result.json", estimator)
    earlier = path.read_bytes()

    def killed(*args: Any) -> None:
        raise KeyboardInterrupt  # the process interrupted before the file is replaced

    monkeypatch.setattr(files.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_result(path, estimator, extra={"note": "second"})
    assert path.read_bytes() == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]  # no temporary


def test_report_of_unfitted_estimator_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not fitted"):
        write_result(tmp_path / "r.json", FederatedPCA())


def test_statistics_helper_matches_shapes() -> None:
    # Guard for the helper above: DCA statistics carry per-class sums.
    statistics = release_for(QueryKind.DCA, 1).statistics
    assert isinstance(statistics, SufficientStatistics) and statistics.n_classes == 2


# ----------------------------------------------------------------------- plots
def _overlaps(figure: Any, legend: Any, axes: Any) -> bool:
    renderer = figure.canvas.get_renderer()
    figure.draw(renderer)
    box, area = legend.get_window_extent(renderer), axes.get_window_extent(renderer)
    return bool(box.overlaps(area))


def test_scree_shows_the_spectrum_with_the_computed_components_marked() -> None:
    from fedpca.analyst.report import scree_figure

    estimator = FederatedPCA.from_result(release_for(n_components=2))
    figure = scree_figure(estimator)
    (axes,) = figure.axes
    bars = axes.patches
    # All M = 4 eigenvalues of the release, not just the k = 2 computed.
    assert len(bars) == 4
    colours = [bar.get_facecolor() for bar in bars]
    assert colours[0] == colours[1] != colours[2] == colours[3]
    heights = np.array([bar.get_height() for bar in bars])
    np.testing.assert_allclose(heights[:2], estimator.explained_variance_ratio_)
    assert heights.sum() == pytest.approx(1.0)
    (legend,) = figure.legends
    assert not _overlaps(figure, legend, axes)
    assert axes.get_ylabel() and axes.get_xlabel() == "component"


def test_projection_labels_its_axes_and_keeps_the_legend_off_the_points() -> None:
    from fedpca.analyst.report import projection_figure

    dca = FederatedDCA.from_result(release_for(QueryKind.DCA, 1, epsilon=1.0))
    figure = projection_figure(dca, dca.preprocess(ROWS), LABELS, title="Pooled rows")
    (axes,) = figure.axes
    # One component: a strip per label, and the y axis says so.
    assert axes.get_ylabel().startswith("label")
    assert [t.get_text() for t in axes.get_yticklabels()] == ["-1", "1"]
    assert axes.get_title().startswith("Pooled rows projected (60 rows)")
    (legend,) = figure.legends
    assert not _overlaps(figure, legend, axes)
    pca = FederatedPCA.from_result(release_for())
    plain = projection_figure(pca, pca.preprocess(ROWS))
    assert plain.axes[0].get_ylabel() == "component 2" and not plain.legends
    assert plain.axes[0].get_title().startswith("Own sample projected")


def test_the_demo_warns_when_bounds_none_meets_unscaled_data() -> None:
    from fedpca.app.demo import unscaled_warning
    from helpers import dataset_table

    ionosphere = dataset_table("ionosphere")[:, 1:]
    german = dataset_table("german")[:, 1:]
    assert unscaled_warning(ionosphere, None) is None  # already on [-1, 1]
    assert unscaled_warning(german, (0.0, 184.0)) is None  # bounds given
    message = unscaled_warning(german, None)
    assert message is not None and "--bounds 0:184" in message


def test_progress_off_a_terminal_is_plain_lines_and_says_when_contributors_are_fixed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Piped, the bars came out as fragments joined by carriage returns, and their last
    state ("aggregating, 2 uploading: owners 0/2") read as owners missing. Then, without
    bars, nothing at all was shown while a query waited (review): a line per change."""
    from fedpca.analyst.querying import ProgressDisplay

    display = ProgressDisplay()
    display.status(QueryStatus("q1", QueryState.COLLECTING, 0, 2, owners_registered=2))
    display.status(QueryStatus("q1", QueryState.COLLECTING, 0, 2, owners_registered=2))
    display.status(
        QueryStatus("q1", QueryState.AGGREGATING, 0, 2, owners_registered=2, owners_uploading=2)
    )
    display.fetched(10)
    for done in (4, 10):
        display.decrypted(done)
    err = capsys.readouterr().err
    assert "\r" not in err and "0/2" not in err
    assert err.splitlines() == [
        "collecting: 0 owner(s) contributed; quorum 2",  # once: the second is no change
        "aggregating: 0 owner(s) contributed, 2 uploading; quorum 2",
        "contributors fixed: 2 owners; decrypting pages as they arrive",
        "decrypted 4/10 ciphertexts",
        "decrypted 10/10 ciphertexts",
    ]


def test_an_unreachable_proxy_after_submission_says_how_to_follow_the_query(
    test_only_keypair_512: tuple[Any, Any], pool: CryptoPool
) -> None:
    """An operator's review: the analyst gave up on a restarting proxy with only
    "proxy unavailable", though its query went on at the proxy."""
    from fedpca.analyst.querying import run_query
    from fedpca.analyst.rpc_errors import ProxyUnavailableError
    from helpers import query_builder

    public_key, private_key = test_only_keypair_512
    spec = query_builder(n_features=3, n_components=1, epsilon=1.0, delta=1e-6)(
        public_key, "q-away"
    )

    class AwayProxy:
        def submit(self, *_: Any) -> Any:
            return QueryStatus("q-away", QueryState.COLLECTING, 0, 1)

        def wait_for_contributors(self, *_: Any, **__: Any) -> None:
            raise ProxyUnavailableError("watch query 'q-away': proxy unavailable (UNAVAILABLE)")

    with pytest.raises(ProxyUnavailableError) as raised:
        run_query(spec, AwayProxy(), private_key, TEST_SIGNING_KEY, pool=pool)
    message = str(raised.value)
    assert "goes on at the proxy" in message
    assert "fedpca analyst status q-away" in message and "fedpca analyst fetch q-away" in message


@pytest.mark.parametrize("state", [QueryState.FAILED, QueryState.AGGREGATING])
def test_fetching_again_is_suggested_only_where_a_result_is_stored(
    test_only_keypair_512: tuple[Any, Any], pool: CryptoPool, state: QueryState
) -> None:
    """An operator's walkthrough (stop 42): a query that failed after its contributors
    were fixed ended with "fetch it again with `fedpca analyst fetch`", which then said
    only a DONE query has a result."""
    from fedpca.analyst.querying import run_query
    from helpers import query_builder

    public_key, private_key = test_only_keypair_512
    spec = query_builder(n_features=3, n_components=1, epsilon=1.0, delta=1e-6)(
        public_key, "q-late"
    )

    class FailingProxy:
        def submit(self, *_: Any) -> Any:
            return QueryStatus("q-late", QueryState.COLLECTING, 0, 1)

        def wait_for_contributors(self, *_: Any, **__: Any) -> None:
            return None

        def fetch_stream(self, *_: Any, **__: Any) -> Any:
            raise QueryStateError("fetch result of query 'q-late': query failed: deadline")

        def status(self, query_id: str) -> Any:
            return QueryStatus(query_id, state, 1, 1)

    with pytest.raises(QueryStateError) as raised:
        run_query(spec, FailingProxy(), private_key, TEST_SIGNING_KEY, pool=pool)
    hinted = "fetch it again with `fedpca analyst fetch q-late`" in str(raised.value)
    assert hinted == (state is not QueryState.FAILED), str(raised.value)


def test_a_dca_class_the_labels_do_not_hold_is_warned_of() -> None:
    """Found by review: ``--classes 0,1`` on labels -1/1 gave a result (class 0's count
    8.6 of noise) without a word. A class whose noisy count is within 3 sigma of zero
    is named; classes the owners hold are not."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", WeakClassWarning)
        FederatedDCA.from_result(release_for(QueryKind.DCA, 1, epsilon=1.0))
    release = release_for(QueryKind.DCA, 1, epsilon=1.0, class_labels=(-1.0, 0.0, 1.0))
    assert release.statistics is not None and release.statistics.class_counts is not None
    assert release.statistics.class_counts[1] == 0.0  # no label is 0
    with pytest.warns(WeakClassWarning, match=r"class\(es\) 0 \(0\) are within 3 sigma"):
        FederatedDCA.from_result(release)
    # Named with every digit: "class 1" read as the label 1, which the owners hold
    # (a walkthrough's --classes -1,1.0000000001).
    classes = (-1.0, 1.0, 1.0000000001)
    release = release_for(QueryKind.DCA, 1, epsilon=1.0, class_labels=classes)
    with pytest.warns(WeakClassWarning, match=r"class\(es\) 1\.0000000001 \("):
        FederatedDCA.from_result(release)


def test_a_singular_within_class_scatter_names_the_ridge_to_change() -> None:
    """A walkthrough's --rho 0 was told "no variance to regularise against ... pass a
    positive rho explicitly", though it had passed one and the classes varied."""
    rng = np.random.default_rng(3)
    rows, labels = rng.normal(size=(40, 3)), np.repeat([0, 1], 20)
    rows[:, 2] = 0.5  # a constant feature: S_W is singular without a ridge
    sums = np.stack([rows[labels == c].sum(axis=0) for c in (0, 1)])
    statistics = SufficientStatistics.for_classes(rows.T @ rows, sums, np.array([20.0, 20.0]))
    with pytest.raises(DataError, match=r"\(rho = 0\.0\): pass a larger rho \(`--rho` of"):
        dca_from_statistics(statistics, 1, rho=0.0)
    assert dca_from_statistics(statistics, 1, rho=0.1).rho == 0.1
    flat = SufficientStatistics.for_classes(
        np.zeros((3, 3)), np.zeros((2, 3)), np.array([20.0, 20.0])
    )
    with pytest.raises(DataError, match="has no variance to regularise against"):
        dca_from_statistics(flat, 1)


def test_a_quorum_above_the_owners_the_proxy_accepts_is_refused_before_anything() -> None:
    """Found by review: ``--quorum 5`` against 3 registered owners first printed a long
    warning about owners not connected, then the proxy's refusal."""
    with pytest.raises(ConfigError, match=r"quorum 5 is more than the 3 owners proxy"):
        resolve_quorum(5, deployment(owners=3))
    assert resolve_quorum(3, deployment(owners=3)) == 3
    assert resolve_quorum(None, deployment(owners=3)) == 3


def test_epsilon_is_required_where_a_query_is_built(test_only_keypair_512: Any) -> None:
    """It defaulted to 1: an estimator built without it spent 1 of the analyst's
    budget unasked, where the CLI requires --epsilon (a new analyst's walkthrough)."""
    public_key, _ = test_only_keypair_512
    with pytest.raises(ConfigError, match="epsilon is required"):
        FederatedPCA(2).build_query(4, public_key, deployment())
    with pytest.raises(ConfigError, match="epsilon is required"):
        FederatedStatistics([1], bounds=[(0, 1)])._query_settings(deployment())
    assert FederatedPCA(2).get_params()["epsilon"] is None
    # fit says so before keys or the network (no proxy listens at nowhere:1).
    pca = FederatedPCA(2, proxy="nowhere:1", private_key_path="/nonexistent")
    with pytest.raises(ConfigError, match="epsilon is required"):
        pca.fit(n_features=4)
    stats = FederatedStatistics([1], bounds=[(0, 1)], proxy="nowhere:1")
    with pytest.raises(ConfigError, match="epsilon is required"):
        stats.fit()
    spec = FederatedPCA(2, epsilon=0.25).build_query(4, public_key, deployment())
    assert spec.epsilon == 0.25
