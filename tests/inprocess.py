"""A whole deployment in one process, for fast tests of what the analyst observes.

The real :class:`~fedpca.proxy.server.ProxyServer` and real
:class:`~fedpca.owner.node.OwnerNode` daemons (one thread each) talk gRPC over mutual
TLS on loopback with certificates from :func:`fedpca.transport.certs.init_certificates`;
the analyst uses the real :class:`~fedpca.analyst.client.AnalystClient` and signs its
queries. Only the Paillier key is small (TEST-ONLY 512 bits) and the proxy's noise
sampler is seeded, so a run takes well under a second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from fedpca.analyst.client import AnalystClient
from fedpca.codec import CryptoPool, key_fingerprint
from fedpca.dp.accounting import Accountant
from fedpca.dp.mechanisms import PrivacyParams
from fedpca.dp.noise import TestOnlySeededSampler
from fedpca.errors import FedpcaError
from fedpca.messages import (
    UPLOAD_ACCEPTED_METADATA,
    QueryStatus,
    UploadReceipt,
    UploadStatus,
)
from fedpca.owner.config import (
    CryptoConfig,
    DataConfig,
    NodeConfig,
    OwnerConfig,
    PrivacyConfig,
    TlsConfig,
)
from fedpca.owner.node import OwnerNode
from fedpca.owner.policy_config import PolicyConfig
from fedpca.owner.retry import RetryPolicy
from fedpca.proxy.config import (
    AnalystsConfig,
    BudgetConfig,
    OwnersConfig,
    PrivacySection,
    ProxyConfig,
    ProxySection,
)
from fedpca.proxy.config import CryptoConfig as ProxyCryptoConfig
from fedpca.proxy.config import TlsConfig as ProxyTlsConfig
from fedpca.proxy.limits import PeerLimits
from fedpca.proxy.server import ProxyServer
from fedpca.query import Neighbouring, QuerySpec
from fedpca.transport import serde
from fedpca.transport.certs import (
    CertificateDirectory,
    NodeIdentity,
    Role,
    TlsMaterial,
    init_certificates,
    read_certificate,
)
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
from helpers import SECOND_TEST_SIGNER, TEST_SIGNER, TEST_SIGNING_KEY, QueryBuilder, query_builder

FAST_RETRY = RetryPolicy(
    upload_attempts=3,
    backoff_initial=0.05,
    backoff_max=0.2,
    reconnect_initial=0.05,
    reconnect_max=0.2,
    call_timeout=5.0,
    upload_timeout=30.0,
)
ONE_ATTEMPT = replace(FAST_RETRY, upload_attempts=1)
"""An owner that gives an upload up after its first failed attempt."""


def unit_box_queries(m: int) -> QueryBuilder:
    """Queries over ``m`` features bounded to [-1, 1]: one component, epsilon 1, delta 1e-6."""
    return query_builder(
        n_features=m,
        n_components=1,
        epsilon=1.0,
        delta=1e-6,
        feature_lower=(-1.0,) * m,
        feature_upper=(1.0,) * m,
    )


def accepting_upload(messages: Iterator[Any]) -> tuple[Any, Any, Any]:
    """Read a whole upload as a proxy that accepts it would: (header, payload, the
    ACCEPTED receipt message to answer with)."""
    header, payload = serde.read_upload(messages)
    receipt = UploadReceipt(
        header.query_id,
        header.upload_id,
        UploadStatus.ACCEPTED,
        header.total_chunks,
        payload.total_ciphertexts,
    )
    return header, payload, serde.upload_receipt_to_proto(receipt)


def acknowledging(request_iterator: Iterable[Any], context: Any) -> Iterator[Any]:
    """An Upload servicer's messages, acknowledging the header as the proxy does
    (initial metadata ``UPLOAD_ACCEPTED_METADATA: yes`` once it is read): owners of
    protocol version 3 send no chunk before it."""
    messages = iter(request_iterator)
    for index, message in enumerate(messages):
        yield message
        if index == 0:
            context.send_initial_metadata(((UPLOAD_ACCEPTED_METADATA, "yes"),))


class StubUpload:
    """A fake stub's ``Upload``: owners call ``stub.Upload.future(messages, timeout)``
    and wait for the call's initial metadata before their first chunk. ``handler`` is
    called as ``handler(messages, timeout)`` on a thread, like a server; the header
    counts as accepted once the handler asks for the message after it (a handler that
    refuses after reading the header alone never acknowledges it). ``cancellable``: the
    owner's ``cancel`` ends the call at once with FutureCancelledError, as gRPC's does
    (the handler runs on, unheard)."""

    def __init__(
        self, handler: Callable[[Iterator[Any], float | None], Any], *, cancellable: bool = False
    ) -> None:
        self.handler = handler
        self.cancellable = cancellable

    def future(self, messages: Iterable[Any], timeout: float | None = None) -> _StubUploadCall:
        return _StubUploadCall(self.handler, messages, timeout, cancellable=self.cancellable)

    def __call__(self, messages: Iterable[Any], timeout: float | None = None) -> Any:
        return self.future(messages, timeout).result()


class _StubUploadCall:
    def __init__(
        self,
        handler: Callable[[Iterator[Any], float | None], Any],
        messages: Iterable[Any],
        timeout: float | None,
        *,
        cancellable: bool = False,
    ) -> None:
        self._cancellable = cancellable
        self._accepted = threading.Event()
        self._answered = threading.Event()  # accepted, or the handler ended without it
        self._ended = threading.Event()
        self._outcome: tuple[bool, Any] = (False, None)
        self._callbacks: list[Callable[[Any], None]] = []
        self._lock = threading.Lock()

        def server_side() -> Iterator[Any]:
            source = iter(messages)
            header = next(source, None)
            if header is None:
                return
            yield header
            self._accepted.set()
            self._answered.set()
            yield from source

        def run() -> None:
            outcome: tuple[bool, Any]
            try:
                outcome = (True, handler(server_side(), timeout))
            except BaseException as exc:
                outcome = (False, exc)
            self._answered.set()
            self._end(outcome)

        threading.Thread(target=run, name="stub-upload", daemon=True).start()

    def _end(self, outcome: tuple[bool, Any]) -> None:
        with self._lock:
            if self._ended.is_set():
                return  # cancelled first: the handler's outcome is not heard
            self._outcome = outcome
            self._ended.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        with self._lock:
            if not self._ended.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def cancel(self) -> bool:
        """As grpc's future. A fake server's handler cannot be interrupted: it runs to
        its end; unless the stub is ``cancellable``, the call is reported as not
        cancelled and ends with the handler."""
        if not self._cancellable:
            return False
        self._answered.set()
        self._end((False, grpc.FutureCancelledError()))
        return True

    def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        self._answered.wait()
        return ((UPLOAD_ACCEPTED_METADATA, "yes"),) if self._accepted.is_set() else ()

    def result(self, timeout: float | None = None) -> Any:
        self._ended.wait(timeout)
        succeeded, value = self._outcome
        if not succeeded:
            raise value
        return value


def unreachable_proxy() -> owner_grpc.OwnerServiceStub:
    """A proxy that cannot be reached: an upload begins (recorded, share kept), then fails."""
    return owner_grpc.OwnerServiceStub(grpc.insecure_channel("127.0.0.1:1"))


def standalone_owner_config(folder: Path, public_key: Any, m: int = 3) -> OwnerConfig:
    """An owner of 30 records of ``m`` features (label in column 0) that never connects:
    the tests hand its node their own stub."""
    data = folder / "owner.csv"
    rows = np.random.default_rng(3).uniform(-0.9, 0.9, size=(30, m))
    np.savetxt(data, labelled(rows), delimiter=",", fmt="%.17g")
    return OwnerConfig(
        owner=NodeConfig("owner-1", "127.0.0.1:1", folder / "state"),
        tls=TlsConfig(None, None, None, insecure=True),
        data=DataConfig(data, header=False, label_column=0, max_records=100, n_columns=m + 1),
        policy=PolicyConfig(
            (key_fingerprint(public_key),),
            10.0,
            False,
            accepted_query_signers=(TEST_SIGNER,),
            min_quorum=1,
        ),
        budget=PrivacyParams(10.0, 1e-5),
        crypto=CryptoConfig(processes=1),
    )


@dataclass(frozen=True)
class Outcome:
    """Everything the analyst can observe about one query (besides the noised numbers)."""

    state: str
    owners_contributed: int
    owners_declined: int
    declines: tuple[tuple[str, str, str], ...]
    failure_reason: str | None
    error: str | None
    seconds: float

    def without_timing(self) -> Outcome:
        return replace(self, seconds=0.0)


@dataclass
class InProcessDeployment:
    """One proxy and one owner node per table, on loopback with mutual TLS.

    Parameters
    ----------
    workdir : a fresh folder for certificates, data, ledgers and the proxy database.
    tables : owner id -> its table (label in column 0, features after it).
    pool : the crypto pool every node encrypts on (a test fixture).
    capacity : each owner's declared ``data.max_records``.
    owner_budget, analyst_budget : total budgets.
    policy : overrides of every owner's :class:`PolicyConfig` fields.
    """

    workdir: Path
    tables: Mapping[str, np.ndarray]
    pool: CryptoPool
    public_key: Any
    capacity: int = 1000
    owner_budget: PrivacyParams = field(default_factory=lambda: PrivacyParams(100.0, 1e-5))
    analyst_budget: PrivacyParams = field(default_factory=lambda: PrivacyParams(100.0, 1e-5))
    policy: dict[str, Any] = field(default_factory=dict)
    owner_policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-owner overrides of ``policy``."""
    allowed: tuple[str, ...] | None = None
    """The proxy's allow-list (default: every owner in ``tables``)."""
    running: tuple[str, ...] | None = None
    """Owners whose node is started (default: all)."""
    revoked: tuple[str, ...] = ()
    """Owners whose certificate the proxy lists as revoked."""
    analysts: tuple[str, ...] = ("alice",)
    """Analysts with a certificate of the deployment's CA."""
    allowed_analysts: tuple[str, ...] | None = None
    """The proxy's ``[analysts] allowed`` (default: none, any certified analyst)."""
    limits: PeerLimits = field(default_factory=PeerLimits)
    """The proxy's per-peer bounds."""
    accountant: Accountant = Accountant.ZCDP
    """The accountant of the proxy's and every owner's ledger."""
    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE
    """The deployment's relation (proxy and owners); replace-one also lets owners take
    part in masked-mode queries."""
    proxy: ProxyServer | None = None
    nodes: dict[str, OwnerNode] = field(default_factory=dict)
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def certs(self) -> CertificateDirectory:
        return CertificateDirectory(self.workdir / "certs")

    def tls(self, role: Role, node_id: str) -> Any:
        return self.certs.node_files(NodeIdentity(role, node_id))

    def owner_config(self, owner_id: str, data_path: Path) -> OwnerConfig:
        files = self.tls(Role.OWNER, owner_id)
        policy: dict[str, Any] = {
            "accepted_analyst_keys": (key_fingerprint(self.public_key),),
            "accepted_query_signers": (TEST_SIGNER, SECOND_TEST_SIGNER),
            "max_epsilon_per_query": 10.0,
            "allow_masked_mode": self.neighbouring is Neighbouring.REPLACE_ONE,
            "min_quorum": 1,  # tests run single-owner queries
        }
        policy.update(self.policy)
        policy.update(self.owner_policies.get(owner_id, {}))
        assert self.proxy is not None
        return OwnerConfig(
            owner=NodeConfig(owner_id, self.proxy.address, self.workdir / "state" / owner_id),
            tls=TlsConfig(files.ca_certificate, files.certificate, files.private_key),
            data=DataConfig(
                data_path,
                header=False,
                label_column=0,
                max_records=self.capacity,
                n_columns=int(np.asarray(self.tables[owner_id]).shape[1]),
            ),
            policy=PolicyConfig(**policy),
            budget=self.owner_budget,
            crypto=CryptoConfig(processes=1),
            privacy=PrivacyConfig(accountant=self.accountant, neighbouring=self.neighbouring),
        )

    def write_owner_config(self, owner_id: str) -> OwnerConfig:
        """Write the owner's table to ``data/<owner_id>.csv``; its configuration."""
        path = self.workdir / "data" / f"{owner_id}.csv"
        path.parent.mkdir(exist_ok=True)
        np.savetxt(path, self.tables[owner_id], delimiter=",", fmt="%.17g")
        return self.owner_config(owner_id, path)

    def start_owner(self, config: OwnerConfig, retry: RetryPolicy = FAST_RETRY) -> OwnerNode:
        """Run a node for ``config`` on a thread (also a restart: it replaces the node
        of that owner); stopped with the deployment."""
        owner_id = config.owner.id
        node = OwnerNode(config, pool=self.pool, retry=retry)
        thread = threading.Thread(target=node.run_forever, name=owner_id, daemon=True)
        thread.start()
        self.nodes[owner_id] = node
        self.threads.append(thread)
        return node

    def start(self) -> InProcessDeployment:
        owner_ids = list(self.tables)
        init_certificates(self.workdir / "certs", owner_ids, list(self.analysts), force=True)
        files = self.tls(Role.PROXY, "proxy")
        revoked = frozenset(
            read_certificate(self.tls(Role.OWNER, owner_id).certificate).serial_number
            for owner_id in self.revoked
        )
        config = ProxyConfig(
            proxy=ProxySection(
                id="proxy",
                listen="127.0.0.1:0",
                database=self.workdir / "proxy.sqlite3",
                heartbeat_seconds=1.0,
            ),
            tls=ProxyTlsConfig(
                files.ca_certificate, files.certificate, files.private_key, revoked_serials=revoked
            ),
            budget=BudgetConfig(self.analyst_budget),
            crypto=ProxyCryptoConfig(processes=1, allow_insecure_test_keys=True),
            owners=OwnersConfig(frozenset(self.allowed if self.allowed else owner_ids)),
            analysts=AnalystsConfig(
                None if self.allowed_analysts is None else frozenset(self.allowed_analysts)
            ),
            limits=self.limits,
            privacy=PrivacySection(accountant=self.accountant, neighbouring=self.neighbouring),
        )
        self.proxy = ProxyServer(config, noise_sampler=TestOnlySeededSampler(5), pool=self.pool)
        self.proxy.start()
        for owner_id in self.tables:
            if self.running is None or owner_id in self.running:
                self.start_owner(self.write_owner_config(owner_id))
        for owner_id, node in self.nodes.items():
            if not node.connected.wait(30.0):
                raise RuntimeError(f"owner {owner_id} did not connect")
        return self

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()
        for thread in self.threads:
            thread.join(timeout=30.0)
        if self.proxy is not None:
            self.proxy.stop(0)

    def stop_owner(self, owner_id: str) -> None:
        """Stop one owner's node (its task stream closes; it answers nothing more)."""
        self.nodes[owner_id].stop()
        for thread in self.threads:
            if thread.name == owner_id:
                thread.join(timeout=30.0)

    @contextmanager
    def analyst(self, analyst_id: str = "alice") -> Iterator[AnalystClient]:
        files = self.tls(Role.ANALYST, analyst_id)
        assert self.proxy is not None
        with AnalystClient(self.proxy.address, TlsMaterial.load(files), timeout=30.0) as client:
            yield client

    def run(self, spec: QuerySpec, timeout: float = 60.0) -> Outcome:
        """Submit ``spec`` as the analyst, follow it to the end; what the analyst saw."""
        started = time.monotonic()
        error: str | None = None
        status: QueryStatus | None = None
        with self.analyst() as client:
            try:
                client.submit(spec, TEST_SIGNING_KEY)
                status = client.wait(spec.query_id, timeout=timeout)
            except FedpcaError as exc:
                error = type(exc).__name__
                try:
                    status = client.status(spec.query_id)
                except FedpcaError:
                    status = None
        seconds = time.monotonic() - started
        if status is None:
            return Outcome("unknown", 0, 0, (), None, error, seconds)
        return Outcome(
            state=status.state.value,
            owners_contributed=status.owners_contributed,
            owners_declined=status.owners_declined,
            declines=tuple((d.owner_id, d.reason, d.detail) for d in status.declines),
            failure_reason=status.failure_reason,
            error=error,
            seconds=seconds,
        )


@contextmanager
def deployment(**kwargs: Any) -> Iterator[InProcessDeployment]:
    running = InProcessDeployment(**kwargs)
    try:
        yield running.start()
    finally:
        running.stop()


def labelled(features: np.ndarray, labels: np.ndarray | float = 1.0) -> np.ndarray:
    """A table as owners store it: the label in column 0, then the features."""
    column = np.broadcast_to(np.asarray(labels, dtype=np.float64), (features.shape[0],))
    return np.column_stack([column, features])
