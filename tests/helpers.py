"""Helpers shared by the test modules (importable as ``helpers``: pytest puts tests/ on
the path, see ``pythonpath`` in pyproject.toml). Fixtures shared by several modules
are in conftest.py."""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import grpc
import numpy as np
from hypothesis import HealthCheck, settings

from fedpca.codec import CryptoPool, key_fingerprint
from fedpca.data import dataset_path
from fedpca.dp.mechanisms import PrivacyParams
from fedpca.exact_statistics import fixed_point_statistics
from fedpca.messages import CiphertextPayload, SignedQuery, Task, blocks_of
from fedpca.owner.config import DataConfig, NodeConfig, OwnerConfig, PrivacyConfig, TlsConfig
from fedpca.owner.policy_config import PolicyConfig
from fedpca.owner_terms import OwnerTerms
from fedpca.protocol import ReleasePlan
from fedpca.query import RELEASE_KINDS, Neighbouring, QueryKind, QuerySpec, stamped
from fedpca.signing import Ed25519PrivateKey, generate_signing_key, sign_query, signer_id
from fedpca.table_schema import TableSchema
from fedpca.transport.channels import server_options

TEST_SIGNING_KEY = generate_signing_key()
"""The analyst's query-signing key in tests (owners' test policies pin TEST_SIGNER)."""
TEST_SIGNER = signer_id(TEST_SIGNING_KEY)
SECOND_TEST_SIGNING_KEY = generate_signing_key()
"""A second analyst's signing key (a proxy binds a signing key to the first analyst that
submits with it); owners' test policies pin it too."""
SECOND_TEST_SIGNER = signer_id(SECOND_TEST_SIGNING_KEY)


def sync_test_server(max_workers: int) -> grpc.Server:
    """A synchronous gRPC server with the proxy's options, for the fake proxies of tests
    (the proxy itself runs on ``grpc.aio``); add ports and servicers to it."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="test-grpc"),
        options=server_options(),
        maximum_concurrent_rpcs=None,
    )


@contextmanager
def fake_analyst_service(servicer: Any, max_workers: int = 4) -> Iterator[str]:
    """``servicer`` (a fake proxy's AnalystService) served on a free loopback port,
    plaintext; yields its address and stops it afterwards."""
    from fedpca.transport.channels import add_insecure_port
    from fedpca.v1 import analyst_service_pb2_grpc as analyst_grpc

    server = sync_test_server(max_workers=max_workers)
    analyst_grpc.add_AnalystServiceServicer_to_server(servicer, server)
    port = add_insecure_port(server, "127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def signed(spec: QuerySpec, key: Ed25519PrivateKey = TEST_SIGNING_KEY) -> SignedQuery:
    """``spec`` signed with ``key`` (default :data:`TEST_SIGNING_KEY`), as the analyst
    submits it: stamped with the time of signing unless it carries one."""
    spec = stamped(spec)
    return SignedQuery(spec, sign_query(spec, key), signer_id(key))


def submit_request(spec: QuerySpec, key: Ed25519PrivateKey = TEST_SIGNING_KEY) -> Any:
    """The SubmitQuery request of ``spec`` signed with ``key``, as the analyst client sends it."""
    from fedpca.transport import serde

    return serde.submit_query_request_to_proto(signed(spec, key))


def signed_task(
    spec: QuerySpec,
    upload_deadline: datetime,
    analyst: str = "alice",
    key: Ed25519PrivateKey = TEST_SIGNING_KEY,
) -> Task:
    """The task a proxy delivers for analyst ``analyst``'s signed query ``spec``.

    It carries the signature by ``key`` (default :data:`TEST_SIGNING_KEY`) and the
    proxy's task id ``analyst/query_id``.
    """
    query = signed(spec, key)
    return Task(
        spec,
        upload_deadline,
        query_signature=query.signature,
        query_signer=query.signer,
        task_id=f"{analyst}/{spec.query_id}",
    )


def owner_policy_config(
    public_key: Any, data: DataConfig | None = None, **policy: Any
) -> OwnerConfig:
    """An owner's configuration for policy tests: it pins ``public_key`` and
    :data:`TEST_SIGNER`, answers up to epsilon 1.5 per query of a budget (10, 1e-5), and
    declares 100 records (not enforced) unless ``data`` says otherwise."""
    fields: dict[str, Any] = {
        "accepted_analyst_keys": (key_fingerprint(public_key),),
        "accepted_query_signers": (TEST_SIGNER,),
        "max_epsilon_per_query": 1.5,
        **policy,
    }
    return OwnerConfig(
        owner=NodeConfig("owner-1", "127.0.0.1:1", Path("state")),
        tls=TlsConfig(None, None, None, insecure=True),
        data=data or DataConfig(Path("data.csv"), max_records=100),
        policy=PolicyConfig(**fields),
        budget=PrivacyParams(10.0, 1e-5),
        privacy=PrivacyConfig(),
    )


def example_owner_terms(**changes: Any) -> OwnerTerms:
    """An owner's stated terms: 4 columns, no label column, every kind, epsilon 10 per
    query at delta 1e-5 (zcdp), delta 1e-5, quorum 1; ``changes`` replace fields."""
    terms = OwnerTerms(
        schema=TableSchema(4),
        neighbouring=Neighbouring.ADD_REMOVE,
        allowed_kinds=RELEASE_KINDS,
        allowed_columns=None,
        allow_masked_mode=False,
        allow_not_private=False,
        max_delta_per_query=1e-5,
        max_epsilon_per_query=10.0,
        budget_delta=1e-5,
        accountant="zcdp",
        min_quorum=1,
        max_tasks_per_day=100,
    )
    return replace(terms, **changes)


def dataset_table(name: str) -> np.ndarray:
    """A bundled dataset as one array: the label in column 0, the raw features after it."""
    return np.loadtxt(dataset_path(name), delimiter=",")


def fuzz_settings(max_examples: int) -> settings:
    """Bounded and reproducible: fixed seed per test, no example database."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ---------------------------------------------------------------------- queries
QUERY_TIME = [time.time()]
"""The signing time :func:`make_query` stamps: the start of the running test (set by
an autouse fixture in conftest.py), so that the queries one test builds twice are equal
and every test's queries are fresh for the owners that check it."""


def make_query(public_key: Any, **fields: Any) -> QuerySpec:
    """A query encrypted to ``public_key``; ``fields`` override the defaults.

    Defaults: query_id "q1", PCA, 3 features, 2 components, epsilon = inf (no
    noise, so results can be compared exactly), delta 1e-5 and ``issued_at`` the start
    of the running test (:data:`QUERY_TIME`; the analyst's client stamps a query it
    signs); everything else is the :class:`~fedpca.query.QuerySpec` default.
    """
    values: dict[str, Any] = {
        "query_id": "q1",
        "kind": QueryKind.PCA,
        "n_features": 3,
        "epsilon": math.inf,
        "delta": 1e-5,
        "n_components": 2,
        "analyst_public_key_n": public_key.n,
        "analyst_key_fingerprint": key_fingerprint(public_key),
        "issued_at": QUERY_TIME[0],
    }
    values.update(fields)
    return QuerySpec(**values)


class QueryBuilder(Protocol):
    def __call__(
        self, public_key: Any, query_id: str | None = None, **overrides: Any
    ) -> QuerySpec: ...


def query_builder(**defaults: Any) -> QueryBuilder:
    """A test module's own :func:`make_query`: ``defaults`` first, then the call's overrides.

    The query id may be given positionally: ``spec(public_key, "q2", quorum=1)``.
    """

    def build(public_key: Any, query_id: str | None = None, **overrides: Any) -> QuerySpec:
        fields = {**defaults, **overrides}
        if query_id is not None:
            fields["query_id"] = query_id
        return make_query(public_key, **fields)

    return build


# ----------------------------------------------------------------------- owners
def unit_ball_rows(seed: int, n_rows: int, n_features: int) -> np.ndarray:
    """Uniform rows on [-1, 1]^M scaled into the unit ball (clip norm 1 leaves them be)."""
    rng = np.random.default_rng(seed)
    rows = rng.uniform(-1, 1, size=(n_rows, n_features))
    rows /= np.maximum(1.0, np.linalg.norm(rows, axis=1))[:, None]
    return rows


def encrypted_upload(
    spec: QuerySpec, rows: np.ndarray, public_key: Any, pool: CryptoPool
) -> tuple[CiphertextPayload, dict[str, np.ndarray]]:
    """What an owner uploads for ``spec``, and the fixed-point integers it encrypted.

    The rows' exact statistics (:func:`fedpca.exact_statistics.fixed_point_statistics`) in every
    owner block of the plan, encrypted under ``public_key``.
    """
    plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    encoded = plan.owner_integers(fixed_point_statistics(rows, None, spec))
    ciphertexts = {
        block.name: list(
            pool.encrypt_packed(
                public_key, encoded[block.name], block.layout, block.bound
            ).ciphertexts
        )
        for block in plan.owner_blocks
    }
    return CiphertextPayload(blocks_of(plan.owner_blocks), ciphertexts), encoded


def reference_statistics(rows: Any, labels: Any, spec: QuerySpec) -> Any:
    """Plain float64 statistics of already preprocessed rows (the tests' reference).

    Owners release exact integer statistics of quantised rows
    (:func:`fedpca.exact_statistics.fixed_point_statistics`); this is what those approximate to
    within the quantisation step.
    """
    from fedpca.stats import SufficientStatistics

    x = np.asarray(rows, dtype=np.float64)
    scatter = x.T @ x
    if spec.kind is QueryKind.PCA:
        return SufficientStatistics(scatter, x.sum(axis=0), float(len(x)))
    y = np.asarray(labels, dtype=np.float64)
    classes = spec.class_labels
    class_sums = np.array([x[y == c].sum(axis=0) for c in classes])
    class_counts = np.array([float(np.sum(y == c)) for c in classes])
    return SufficientStatistics.for_classes(scatter, class_sums, class_counts)


def plaintext_release(spec: QuerySpec, rows: Any, labels: Any = None) -> Any:
    """A stats-mode :class:`~fedpca.analyst.decode.DecodedRelease` of already
    preprocessed rows without noise (no crypto), with the sigmas its plan states."""
    from fedpca.analyst.decode import DecodedRelease

    plan = ReleasePlan.for_query(spec, 512)
    statistics = reference_statistics(rows, labels, spec)
    return DecodedRelease(
        query=spec,
        plan=plan,
        n_owners=2,
        key_fingerprint="sha256:test",
        values=statistics.to_vector(plan.statistics),
        centred_scatter=None,
        public_count=None,
        sigmas={s.name: s.sigma for s in plan.sections},
    )


def quantisation_step(frac_bits: int = 32) -> float:
    """The grid owners quantise every coordinate of a (clip-unit) row to
    (:func:`fedpca.exact_statistics.row_bits`): the largest difference between a coordinate and
    what the exact statistics are computed from."""
    from fedpca.exact_statistics import row_bits

    return 2.0 ** -row_bits(frac_bits)


QUANTISATION_STEP = quantisation_step(32)
"""2^-16: the quantisation step at the default frac_bits 32."""


def exact_statistics(rows: Any, labels: Any, spec: QuerySpec) -> Any:
    """The exact statistics owners release for raw ``rows``, decoded to real units (stats
    mode).

    :func:`fedpca.exact_statistics.fixed_point_statistics` (quantised rows, exact integers) read
    back with the query's plan: what a noiseless release decodes to, bit for bit.
    """
    plan = ReleasePlan.for_query(spec, spec.analyst_public_key_n.bit_length())
    integers = fixed_point_statistics(rows, labels, spec).to_vector(plan.statistics)
    return plan.statistics_from_integers(integers)


# ---------------------------------------------------- clusters of real processes
def cluster_keys(cluster: Any) -> tuple[Any, Ed25519PrivateKey]:
    """The analyst's TEST-ONLY Paillier public key and query-signing key of a
    :class:`~fedpca.app.cluster.LocalCluster` (after ``prepare``)."""
    from fedpca.analyst.keys import load_analyst_public_key, load_analyst_signing_key

    public_key = load_analyst_public_key(cluster.key_dir, allow_insecure_test_key=True)
    return public_key, load_analyst_signing_key(cluster.key_dir)


def cluster_analyst(cluster: Any, analyst_id: str | None = None, timeout: float = 30.0) -> Any:
    """An :class:`~fedpca.analyst.client.AnalystClient` of the cluster's proxy process,
    with ``analyst_id``'s certificate (default: the cluster's first analyst)."""
    from fedpca.analyst.client import AnalystClient
    from fedpca.transport.certs import TlsMaterial

    tls = TlsMaterial.load(cluster.analyst_tls(analyst_id))
    return AnalystClient(cluster.proxy_address, tls, timeout=timeout, retry_delays=())


def cluster_stub(cluster: Any, role: str, node_id: str) -> tuple[Any, Any]:
    """``(channel, stub)`` of the cluster's proxy process with ``node_id``'s certificate:
    an OwnerService stub for ``role`` "owner", an AnalystService stub for "analyst".

    The raw stub sends whatever a hostile peer would (no client-side validation).
    """
    from fedpca.transport.certs import TlsMaterial
    from fedpca.transport.channels import secure_channel
    from fedpca.v1 import analyst_service_pb2_grpc, owner_service_pb2_grpc

    channel = secure_channel(
        cluster.proxy_address, TlsMaterial.load(cluster.node_tls(role, node_id))
    )
    module = owner_service_pb2_grpc if role == "owner" else analyst_service_pb2_grpc
    stub_class = module.OwnerServiceStub if role == "owner" else module.AnalystServiceStub
    return channel, stub_class(channel)


def rpc_refusal(call: Any) -> Any:
    """The ``grpc.RpcError`` that ``call()`` raises; an AssertionError if it succeeds."""
    import grpc

    try:
        reply = call()
    except grpc.RpcError as error:
        return error
    raise AssertionError(f"the call was expected to be refused, it answered {reply!r}")


def timed(call: Any) -> tuple[Any, float]:
    """``call()``'s result (or the RpcError it raised) and the seconds it took."""
    import time

    import grpc

    started = time.monotonic()
    try:
        result = call()
    except grpc.RpcError as error:
        result = error
    return result, time.monotonic() - started


def proxy_database_rows(cluster: Any, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` on the cluster proxy's SQLite file, opened read-only (the proxy
    process may be running)."""
    import sqlite3

    path = cluster.workdir / "state" / "proxy.sqlite3"
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30.0)
    try:
        return [tuple(row) for row in connection.execute(sql, args).fetchall()]
    finally:
        connection.close()


def owner_releases(cluster: Any, owner_id: str) -> list[str]:
    """The task ids in the budget ledger of the cluster's owner ``owner_id``: the releases
    it spent budget on (read while its process may be running)."""
    from fedpca.owner.config import load_config
    from fedpca.owner.ledger import owner_ledger

    ledger = owner_ledger(load_config(cluster.owner_config(owner_id)))
    return [entry.event.query_id for entry in ledger.events()]


def wait_until(condition: Any, what: str, timeout: float = 60.0) -> Any:
    """Poll ``condition()`` every 50 ms until it returns something truthy (returned)."""
    import time

    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)
    return result


def wait_for_log(process: Any, log: Any, marker: str, timeout: float = 60.0) -> None:
    """Wait until the running ``process`` has written ``marker`` to ``log`` (a Path); a
    process that ends first fails the test with its log."""

    def written() -> bool:
        assert process.poll() is None, log.read_text()
        return marker in log.read_text()

    wait_until(written, f"{marker!r} in {log}", timeout)


def sqlite_error(folder: Path, kind: str) -> sqlite3.OperationalError:
    """An OperationalError as SQLite raises it, with its result code: ``"locked"``
    (another connection holds the write lock) or ``"full"`` (the database may not grow)."""
    path = folder / f"{kind}.sqlite3"
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("CREATE TABLE t (x BLOB)")
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        if kind == "locked":
            holder.execute("BEGIN EXCLUSIVE")
            other.execute("INSERT INTO t VALUES (1)")
        else:  # a database that may not grow: SQLite's "database or disk is full"
            other.execute("PRAGMA max_page_count = 2")
            other.execute("INSERT INTO t VALUES (zeroblob(100000))")
    except sqlite3.OperationalError as error:
        return error
    finally:
        other.close()
        holder.close()
    raise AssertionError(f"no {kind} error")


def resign_certificate(layout: Any, target: Path, not_before: Any, not_after: Any) -> None:
    """Replace the certificate at ``target`` (a node's or the CA's own, in the
    :class:`~fedpca.transport.certs.CertificateDirectory` ``layout``) by the same one
    valid only from ``not_before`` to ``not_after``, signed by the layout's CA: an
    expired or not yet valid certificate, which the CA commands never issue."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    from fedpca.transport import certs

    original = certs.read_certificate(target)
    builder = (
        x509.CertificateBuilder()
        .subject_name(original.subject)
        .issuer_name(certs.read_certificate(layout.ca_certificate).subject)
        .public_key(original.public_key())
        .serial_number(original.serial_number)
        .not_valid_before(not_before)
        .not_valid_after(not_after)
    )
    for extension in original.extensions:
        builder = builder.add_extension(extension.value, extension.critical)
    ca_key = certs.read_private_key(layout.ca_key)
    certs.write_certificate(target, builder.sign(ca_key, hashes.SHA256()))


def record_exact_draws(monkeypatch: Any) -> list[tuple[float, int]]:
    """Record every (sigma_int, size) drawn through the production exact sampler, which
    still draws: the list fills as noise is drawn (for checks that the production
    sampler, not a test one, is the default)."""
    from fedpca.dp import noise as noise_module

    calls: list[tuple[float, int]] = []
    real = noise_module.sample_discrete_gaussian

    def recorded(sigma_int: float, size: int) -> Any:
        calls.append((sigma_int, size))
        return real(sigma_int, size)

    monkeypatch.setattr(noise_module, "sample_discrete_gaussian", recorded)
    return calls


LINREG_AGGREGATE = """
[[aggregate]]
kind = "linreg"
columns = [6, 8]
bounds = [[0, 70], [20, 90]]
target = 2
target_bounds = [0, 200]
"""
"""A regression of the diabetes table's glucose on BMI and age, as an ``[[aggregate]]``
table of a ``fedpca analyst combined`` file."""
