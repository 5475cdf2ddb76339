"""The proxy over real gRPC with mutual TLS on 127.0.0.1.

Certificates come from ``init_certificates`` (EC keys, fast); Paillier keys are
TEST-ONLY 512-bit moduli. Owners and the analyst below speak the wire protocol
directly through generated stubs and :mod:`fedpca.transport.serde`, as the real
owner node and analyst client do. The proxy accepts owner-1, owner-2 and owner-3
(``[owners] allowed``) and refuses two certificates its CA signed: owner-3's and the
analyst mallory's (``[tls] revoked_serials``); "intruder" holds a valid owner
certificate but is not on the allow-list.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from fedpca.analyst.client import AnalystClient
from fedpca.codec import CryptoPool, unpack_slots
from fedpca.dp.mechanisms import PrivacyParams
from fedpca.dp.noise import TestOnlySeededSampler
from fedpca.errors import (
    AuthenticationError,
    BudgetExceededError,
    CalibrationError,
    CiphertextError,
    ConfigError,
    EncodingOverflowError,
    LayoutError,
    NotFoundError,
    PolicyError,
    ProtocolError,
    QueryStateError,
    UntrustedKeyError,
)
from fedpca.messages import (
    SHARE_RELEASED_METADATA,
    CiphertextPayload,
    DeclineReason,
    Heartbeat,
    NoiseMechanism,
    OwnerDecline,
    OwnerHello,
    QueryState,
    QueryStatus,
    Task,
    TaskDecline,
    UploadStatus,
    ciphertexts_per_chunk,
)
from fedpca.protocol import MASKED_SUM, SHARES, ReleasePlan
from fedpca.proxy.config import (
    BudgetConfig,
    CryptoConfig,
    OwnersConfig,
    PrivacySection,
    ProxyConfig,
    ProxySection,
    TlsConfig,
)
from fedpca.proxy.coordinator import task_id
from fedpca.proxy.server import ProxyServer
from fedpca.proxy.servicer_support import status_code_for
from fedpca.query import Neighbouring, ProtocolMode, QuerySpec
from fedpca.signing import verify_query
from fedpca.transport import channels, serde
from fedpca.transport.certs import (
    NodeIdentity,
    Role,
    TlsFiles,
    TlsMaterial,
    init_certificates,
    load_certificate,
)
from fedpca.transport.channels import INSECURE_IDENTITY_METADATA, PROTOCOL_VERSION_METADATA
from fedpca.v1 import analyst_service_pb2 as analyst_pb
from fedpca.v1 import analyst_service_pb2_grpc as analyst_grpc
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
from fedpca.version import PROTOCOL_VERSION
from helpers import (
    TEST_SIGNER,
    TEST_SIGNING_KEY,
    encrypted_upload,
    query_builder,
    submit_request,
    unit_ball_rows,
)

TIMEOUT = 30.0
M = 6
ALLOWED = frozenset({"owner-1", "owner-2", "owner-3"})
"""The proxy's ``[owners] allowed``; owner-3's certificate is revoked."""


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[NodeIdentity, TlsFiles]:
    return init_certificates(
        tmp_path_factory.mktemp("certs"),
        owner_ids=["owner-1", "owner-2", "owner-3", "intruder"],
        analyst_ids=["alice", "mallory"],
    )


def serial(tls_files: dict[NodeIdentity, TlsFiles], role: Role, node_id: str) -> int:
    """The serial number of a node's certificate (what ``[tls] revoked_serials`` lists)."""
    pem = tls_files[NodeIdentity(role, node_id)].certificate.read_bytes()
    return int(load_certificate(pem).serial_number)


def proxy_config(
    tls_files: dict[NodeIdentity, TlsFiles],
    database: Path,
    *,
    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE,
    **sections: Any,
) -> ProxyConfig:
    """The test proxy: mutual TLS, the allow-list, owner-3 and mallory revoked."""
    proxy = tls_files[NodeIdentity(Role.PROXY, "proxy")]
    revoked = frozenset(
        {serial(tls_files, Role.OWNER, "owner-3"), serial(tls_files, Role.ANALYST, "mallory")}
    )
    fields: dict[str, Any] = {
        "proxy": ProxySection(listen="127.0.0.1:0", database=database, heartbeat_seconds=0.2),
        "tls": TlsConfig(
            ca=proxy.ca_certificate,
            cert=proxy.certificate,
            key=proxy.private_key,
            revoked_serials=revoked,
        ),
        "budget": BudgetConfig(
            PrivacyParams(math.inf, 1e-5), {"alice": PrivacyParams(math.inf, 1e-5)}
        ),
        "crypto": CryptoConfig(processes=1, allow_insecure_test_keys=True),
        "owners": OwnersConfig(ALLOWED),
        "privacy": PrivacySection(neighbouring=neighbouring),
    }
    fields.update(sections)
    return ProxyConfig(**fields)


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
    tls_files: dict[NodeIdentity, TlsFiles],
    pool: CryptoPool,
) -> Iterator[ProxyServer]:
    config = proxy_config(tls_files, tmp_path_factory.mktemp("proxy") / "proxy.sqlite3")
    running = ProxyServer(config, noise_sampler=TestOnlySeededSampler(3), pool=pool)
    running.start()
    yield running
    running.stop(grace=1.0)


def channel_for(
    server: ProxyServer, tls_files: dict[NodeIdentity, TlsFiles], role: Role, node_id: str
) -> grpc.Channel:
    material = TlsMaterial.load(tls_files[NodeIdentity(role, node_id)])
    return channels.secure_channel(server.address, material)


make_spec = query_builder(n_features=M, quorum=2, deadline_seconds=120.0)


def owner_share(
    spec: QuerySpec, seed: int, public_key: Any, pool: CryptoPool
) -> tuple[CiphertextPayload, dict[str, np.ndarray], int]:
    """An owner's encrypted upload for ``spec`` (rows drawn with ``seed``)."""
    rows = unit_ball_rows(seed, 25, M)
    payload, encoded = encrypted_upload(spec, rows, public_key, pool)
    return payload, encoded, len(rows)


def first_task(stub: owner_grpc.OwnerServiceStub) -> tuple[Task, list[str]]:
    """Open a task stream, read events until a task arrives; return it and the kinds seen."""
    call = stub.StreamTasks(serde.task_stream_request_to_proto("ignored"), timeout=TIMEOUT)
    kinds: list[str] = []
    try:
        for message in call:
            event = serde.task_event_from_proto(message)
            kinds.append(type(event).__name__)
            if isinstance(event, Task):
                return event, kinds
    finally:
        call.cancel()
    raise AssertionError(f"task stream ended without a task: {kinds}")


# ------------------------------------------------------------------ roles
def test_an_analyst_certificate_cannot_upload(
    server: ProxyServer, tls_files: dict[NodeIdentity, TlsFiles]
) -> None:
    with channel_for(server, tls_files, Role.ANALYST, "alice") as channel:
        stub = owner_grpc.OwnerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Upload(iter([]), timeout=TIMEOUT)
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "requires owner" in (info.value.details() or "")
        with pytest.raises(grpc.RpcError) as info:
            next(stub.StreamTasks(serde.task_stream_request_to_proto("x"), timeout=TIMEOUT))
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED


def test_an_owner_certificate_cannot_submit_a_query(
    server: ProxyServer, tls_files: dict[NodeIdentity, TlsFiles], test_only_keypair_512: Any
) -> None:
    public_key, _ = test_only_keypair_512
    with channel_for(server, tls_files, Role.OWNER, "owner-1") as channel:
        stub = analyst_grpc.AnalystServiceStub(channel)
        request = submit_request(make_spec(public_key, "sneaky"))
        with pytest.raises(grpc.RpcError) as info:
            stub.SubmitQuery(request, timeout=TIMEOUT)
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
    for stored in ("sneaky", task_id("owner-1", "sneaky")):
        with pytest.raises(NotFoundError):
            server.coordinator.store.query(stored)


def test_owners_off_the_allow_list_and_revoked_certificates_are_refused(
    tmp_path: Path,
    tls_files: dict[NodeIdentity, TlsFiles],
    pool: CryptoPool,
    test_only_keypair_512: Any,
) -> None:
    server = ProxyServer(proxy_config(tls_files, tmp_path / "p.sqlite3"), pool=pool)
    server.start()
    try:
        _refuse_strangers(server, tls_files, pool, test_only_keypair_512[0])
    finally:
        server.stop(grace=1.0)


def _refuse_strangers(
    server: ProxyServer, tls_files: dict[NodeIdentity, TlsFiles], pool: CryptoPool, public_key: Any
) -> None:
    spec = make_spec(public_key, "for-allowed-owners")
    with channel_for(server, tls_files, Role.ANALYST, "alice") as channel:
        analyst_grpc.AnalystServiceStub(channel).SubmitQuery(submit_request(spec), timeout=TIMEOUT)
    key = task_id("alice", spec.query_id)
    store = server.coordinator.store

    def refused(call: Any) -> str:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
        return info.value.details() or ""

    # A certificate the CA signed, for an owner the proxy does not accept.
    with channel_for(server, tls_files, Role.OWNER, "intruder") as channel:
        stub = owner_grpc.OwnerServiceStub(channel)
        hello = serde.owner_hello_to_proto(OwnerHello("intruder", "test"))
        assert "not in this proxy's [owners] allowed list" in refused(
            lambda: stub.Hello(hello, timeout=TIMEOUT)
        )
        refused(lambda: next(stub.StreamTasks(serde.task_stream_request_to_proto("x"))))
        payload, _, _ = owner_share(spec, 7, public_key, pool)
        upload = serde.encode_upload(key, spec.analyst_key_fingerprint, "i", payload)
        refused(lambda: stub.Upload(iter(upload), timeout=TIMEOUT))
        decline = TaskDecline(key, DeclineReason.POLICY_REFUSAL, "forged")
        refused(lambda: stub.DeclineTask(serde.task_decline_to_proto(decline), timeout=TIMEOUT))
    # Revoked certificates, of an allowed owner and of an analyst.
    with channel_for(server, tls_files, Role.OWNER, "owner-3") as channel:
        stub = owner_grpc.OwnerServiceStub(channel)
        hello = serde.owner_hello_to_proto(OwnerHello("owner-3", "test"))
        # Named, with its serial, as the proxy logs it (review: "the peer's certificate").
        why = refused(lambda: stub.Hello(hello, timeout=TIMEOUT))
        assert re.search(r"the certificate of owner/owner-3 \(serial [0-9a-f]+\) is revoked", why)
        refused(lambda: next(stub.StreamTasks(serde.task_stream_request_to_proto("x"))))
    with channel_for(server, tls_files, Role.ANALYST, "mallory") as channel:
        stub_a = analyst_grpc.AnalystServiceStub(channel)
        assert "revoked" in refused(
            lambda: stub_a.GetBudget(serde.budget_request_to_proto(), timeout=TIMEOUT)
        )
        other = make_spec(public_key, "by-mallory")
        refused(lambda: stub_a.SubmitQuery(submit_request(other), timeout=TIMEOUT))
    assert store.query(key).n_contributed == 0 and store.declines(key) == {}
    assert store.uploads(key) == [] and not store.query(key).uploads_begun
    assert "intruder" not in store.owners() and "owner-3" not in store.owners()
    assert all(q.analyst_id != "mallory" for q in store.queries())


def test_a_peer_of_another_wire_protocol_is_refused_and_logged_once_per_peer(
    server: ProxyServer,
    tls_files: dict[NodeIdentity, TlsFiles],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by an operator's walkthrough: an owner of another wire protocol refused the
    proxy at Hello and said so in its own log, while the proxy's log showed nothing and
    /readyz only "0 owners connected". Peers state their build's version in request
    metadata; the proxy refuses another one with both versions, and logs a WARNING
    naming the peer and both versions once, not at every reconnection."""
    caplog.set_level(logging.WARNING, logger="fedpca.proxy")

    def raw_channel(role: Role, node_id: str) -> grpc.Channel:
        # Not channels.secure_channel, which states this build's version on every call.
        material = TlsMaterial.load(tls_files[NodeIdentity(role, node_id)])
        credentials = channels.channel_credentials(material)
        return grpc.secure_channel(server.address, credentials, options=channels.client_options())

    def refused(call: Any) -> str:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        return info.value.details() or ""

    hello = serde.owner_hello_to_proto(OwnerHello("owner-2", "0.2.0"))
    with raw_channel(Role.OWNER, "owner-2") as channel, raw_channel(Role.ANALYST, "alice") as other:
        stub = owner_grpc.OwnerServiceStub(channel)
        stated_3 = ((PROTOCOL_VERSION_METADATA, "3"),)
        for _ in range(5):  # an owner node reconnecting
            details = refused(lambda: stub.Hello(hello, metadata=stated_3, timeout=TIMEOUT))
            assert f"owner/owner-2 speaks wire protocol 3, this proxy {PROTOCOL_VERSION}" in details
        assert "fedpca --version" in details
        analyst = analyst_grpc.AnalystServiceStub(other)
        request = analyst_pb.DescribeDeploymentRequest()
        for _ in range(3):
            details = refused(
                lambda: analyst.DescribeDeployment(
                    request, metadata=((PROTOCOL_VERSION_METADATA, "7"),), timeout=TIMEOUT
                )
            )
        assert f"analyst/alice speaks wire protocol 7, this proxy {PROTOCOL_VERSION}" in details
        # The same peers stating this build's version (or, as builds before the
        # metadata, none) are served.
        same = ((PROTOCOL_VERSION_METADATA, str(PROTOCOL_VERSION)),)
        stub.Hello(hello, metadata=same, timeout=TIMEOUT)
        stub.Hello(hello, timeout=TIMEOUT)
        analyst.DescribeDeployment(request, metadata=same, timeout=TIMEOUT)
    lines = [r for r in caplog.records if "speaks wire protocol" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.WARNING, logging.WARNING]
    owner_line, analyst_line = (r.getMessage() for r in lines)
    assert f"owner/owner-2 speaks wire protocol 3, this proxy {PROTOCOL_VERSION}" in owner_line
    assert owner_line.startswith("Hello refused (INVALID_ARGUMENT)")
    assert f"analyst/alice speaks wire protocol 7, this proxy {PROTOCOL_VERSION}" in analyst_line


def test_domain_errors_map_to_status_codes() -> None:
    expected = {
        NotFoundError("x"): grpc.StatusCode.NOT_FOUND,
        BudgetExceededError("x"): grpc.StatusCode.RESOURCE_EXHAUSTED,
        AuthenticationError("x"): grpc.StatusCode.PERMISSION_DENIED,
        PolicyError("x"): grpc.StatusCode.PERMISSION_DENIED,
        UntrustedKeyError("x"): grpc.StatusCode.PERMISSION_DENIED,
        QueryStateError("x"): grpc.StatusCode.FAILED_PRECONDITION,
        ProtocolError("x"): grpc.StatusCode.INVALID_ARGUMENT,
        LayoutError("x"): grpc.StatusCode.INVALID_ARGUMENT,
        CiphertextError("x"): grpc.StatusCode.INVALID_ARGUMENT,
        ConfigError("x"): grpc.StatusCode.INVALID_ARGUMENT,
        EncodingOverflowError("x"): grpc.StatusCode.INVALID_ARGUMENT,
        # e.g. a huge epsilon below the PLD accountant's floor (fedpca.dp.accounting)
        CalibrationError("x"): grpc.StatusCode.INVALID_ARGUMENT,
    }
    for error, code in expected.items():
        assert status_code_for(error) is code, type(error).__name__


# ------------------------------------------------------------------ round trip
def test_stats_round_trip_over_grpc(
    server: ProxyServer,
    tls_files: dict[NodeIdentity, TlsFiles],
    pool: CryptoPool,
    test_only_keypair_512: Any,
) -> None:
    public_key, private_key = test_only_keypair_512
    analyst_channel = channel_for(server, tls_files, Role.ANALYST, "alice")
    analyst = analyst_grpc.AnalystServiceStub(analyst_channel)
    owners = {
        node_id: owner_grpc.OwnerServiceStub(channel_for(server, tls_files, Role.OWNER, node_id))
        for node_id in ("owner-1", "owner-2")
    }

    info = serde.proxy_info_from_proto(
        owners["owner-1"].Hello(
            serde.owner_hello_to_proto(OwnerHello("owner-1", "test")), timeout=TIMEOUT
        )
    )
    assert info.authenticated_node_id == "owner-1" and info.proxy_id == "proxy"

    spec = make_spec(public_key, "round-trip")
    key = task_id("alice", "round-trip")
    status = serde.query_status_from_proto(
        analyst.SubmitQuery(submit_request(spec), timeout=TIMEOUT)
    )
    assert status.state is QueryState.COLLECTING and status.quorum == 2
    assert status.query_id == "round-trip" and status.owners_registered == len(ALLOWED)

    watched: list[QueryStatus] = []
    watcher = threading.Thread(
        target=lambda: watched.extend(
            serde.query_status_from_proto(m)
            for m in analyst.WatchQueryStatus(
                serde.query_ref_to_proto("round-trip"), timeout=TIMEOUT
            )
        )
    )
    watcher.start()

    expected: np.ndarray | None = None
    for seed, (node_id, stub) in enumerate(owners.items()):
        task, kinds = first_task(stub)
        assert kinds[0] == "Heartbeat" and task.query == spec
        # The task names the proxy's key and carries the analyst's signature unchanged.
        assert task.task_id == task.key == key and task.query_signer == TEST_SIGNER
        verify_query(task.query, task.query_signature, task.query_signer)
        payload, encoded, _ = owner_share(task.query, seed, public_key, pool)
        messages = serde.encode_upload(
            task.key, spec.analyst_key_fingerprint, f"u-{node_id}", payload
        )
        receipt = serde.upload_receipt_from_proto(stub.Upload(iter(messages), timeout=TIMEOUT))
        assert receipt.status is UploadStatus.ACCEPTED
        assert receipt.ciphertexts_received == payload.total_ciphertexts
        if node_id == "owner-1":
            # A retry after a lost acknowledgement: answered DUPLICATE, counted once.
            again = stub.Upload(iter(messages), timeout=TIMEOUT)
            assert serde.upload_receipt_from_proto(again).status is UploadStatus.DUPLICATE
        share = encoded[SHARES].astype(object)
        expected = share if expected is None else expected + share

    watcher.join(timeout=TIMEOUT)
    assert not watcher.is_alive()
    assert watched[-1].state is QueryState.DONE and watched[-1].owners_contributed == 2
    assert [s.state for s in watched].count(QueryState.DONE) == 1

    result = serde.decode_result(
        analyst.FetchResult(serde.query_ref_to_proto("round-trip"), timeout=TIMEOUT)
    )
    assert result.n_owners == 2 and result.query == spec
    assert result.public_record_count is None  # stats mode: the proxy never learns N
    assert result.noise.mechanism is NoiseMechanism.NONE
    plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    block = plan.result_block(SHARES)
    plaintexts = pool.decrypt(private_key, list(result.payload[SHARES]))
    assert expected is not None
    assert unpack_slots(plaintexts, block.layout, public_key.n) == list(expected)

    budget = serde.budget_status_from_proto(
        analyst.GetBudget(serde.budget_request_to_proto(), timeout=TIMEOUT)
    )
    assert budget.analyst_id == "alice" and budget.n_releases == 1
    assert math.isinf(budget.epsilon_spent)  # epsilon = inf released: NOT PRIVATE

    # Another upload of a contributor, a late owner and a foreign query are refused
    # with the mapped codes; the late owner learns that nothing of it can be released.
    late = serde.encode_upload(key, spec.analyst_key_fingerprint, "late", payload)
    with pytest.raises(grpc.RpcError) as info:
        owners["owner-2"].Upload(iter(late), timeout=TIMEOUT)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "already contributed a different upload" in (info.value.details() or "")
    # A fault of the upload itself: not marked as the query's doing.
    assert SHARE_RELEASED_METADATA not in dict(info.value.trailing_metadata() or ())
    solo = make_spec(public_key, "solo", quorum=1)
    analyst.SubmitQuery(submit_request(solo), timeout=TIMEOUT)
    solo_key = task_id("alice", "solo")
    first_share, _, _ = owner_share(solo, 0, public_key, pool)
    owners["owner-1"].Upload(
        iter(serde.encode_upload(solo_key, solo.analyst_key_fingerprint, "u1", first_share)),
        timeout=TIMEOUT,
    )
    second = serde.encode_upload(solo_key, solo.analyst_key_fingerprint, "u2", first_share)
    with pytest.raises(grpc.RpcError) as info:
        owners["owner-2"].Upload(iter(second), timeout=TIMEOUT)
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "uploads are no longer accepted" in (info.value.details() or "")
    assert dict(info.value.trailing_metadata() or ())[SHARE_RELEASED_METADATA] == "no"
    with pytest.raises(grpc.RpcError) as info:
        analyst.GetQueryStatus(serde.query_ref_to_proto("nope"), timeout=TIMEOUT)
    assert info.value.code() is grpc.StatusCode.NOT_FOUND
    analyst_channel.close()


def test_an_upload_refused_by_a_closed_query_is_always_marked(
    server: ProxyServer,
    tls_files: dict[NodeIdentity, TlsFiles],
    pool: CryptoPool,
    test_only_keypair_512: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every refusal of an upload its query no longer takes carries
    SHARE_RELEASED_METADATA, ``yes`` as well as ``no``: owners tell it from a fault of
    their own by the key, not the text (before, a refusal whose share may have been
    released carried nothing, like an invalid upload, and its owner logged an ERROR)."""
    public_key, _ = test_only_keypair_512
    spec = make_spec(public_key, "closed-marked", quorum=1)
    key = task_id("alice", spec.query_id)
    share, _, _ = owner_share(spec, 1, public_key, pool)
    with channel_for(server, tls_files, Role.ANALYST, "alice") as channel:
        analyst_grpc.AnalystServiceStub(channel).SubmitQuery(submit_request(spec), timeout=TIMEOUT)
    with (
        channel_for(server, tls_files, Role.OWNER, "owner-1") as first,
        channel_for(server, tls_files, Role.OWNER, "owner-2") as second,
    ):
        owner_grpc.OwnerServiceStub(first).Upload(
            iter(serde.encode_upload(key, spec.analyst_key_fingerprint, "c1", share)),
            timeout=TIMEOUT,
        )
        # As if the refused owner's share could be in the result (a contributor of a
        # query that failed after pages were released).
        monkeypatch.setattr(server.coordinator, "share_released", lambda *_: True)
        with pytest.raises(grpc.RpcError) as info:
            owner_grpc.OwnerServiceStub(second).Upload(
                iter(serde.encode_upload(key, spec.analyst_key_fingerprint, "c2", share)),
                timeout=TIMEOUT,
            )
    assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert dict(info.value.trailing_metadata() or ())[SHARE_RELEASED_METADATA] == "yes"


def test_bad_uploads_are_refused_before_their_chunks(
    server: ProxyServer,
    tls_files: dict[NodeIdentity, TlsFiles],
    pool: CryptoPool,
    test_only_keypair_512: Any,
) -> None:
    public_key, _ = test_only_keypair_512
    spec = make_spec(public_key, "bad-uploads")
    key = task_id("alice", spec.query_id)
    with (
        channel_for(server, tls_files, Role.ANALYST, "alice") as analyst_channel,
        channel_for(server, tls_files, Role.OWNER, "owner-1") as owner_channel,
    ):
        analyst = analyst_grpc.AnalystServiceStub(analyst_channel)
        analyst.SubmitQuery(submit_request(spec), timeout=TIMEOUT)
        stub = owner_grpc.OwnerServiceStub(owner_channel)
        payload, _, _ = owner_share(spec, 5, public_key, pool)
        fingerprint = spec.analyst_key_fingerprint

        def refused(messages: list[Any]) -> grpc.StatusCode:
            with pytest.raises(grpc.RpcError) as info:
                stub.Upload(iter(messages), timeout=TIMEOUT)
            return info.value.code()

        wrong_key = serde.encode_upload(key, "sha256:00", "a", payload)
        assert refused(wrong_key) is grpc.StatusCode.INVALID_ARGUMENT
        counted = serde.encode_upload(key, fingerprint, "b", payload, public_record_count=3)
        assert refused(counted) is grpc.StatusCode.INVALID_ARGUMENT  # stats mode: no count
        # Only the header: refused at the header, so no chunk was ever needed.
        block = payload.blocks[0]
        short = replace(block, value_count=block.value_count - 1)
        messages = serde.encode_upload(
            key,
            fingerprint,
            "c",
            CiphertextPayload((short,), {block.name: payload[block.name]}),
        )
        assert refused(messages[:1]) is grpc.StatusCode.INVALID_ARGUMENT
        # Unknown tasks, the analyst's bare query id among them (owners use task ids).
        for name in ("no-such-query", spec.query_id, task_id("bob", spec.query_id)):
            unknown = serde.encode_upload(name, fingerprint, "d", payload)
            assert refused(unknown) is grpc.StatusCode.NOT_FOUND
        # A truncated stream (missing chunks) is a protocol error, nothing folded.
        good = serde.encode_upload(key, fingerprint, "e", payload)
        assert refused(good[:1]) is grpc.StatusCode.INVALID_ARGUMENT
        stub.DeclineTask(
            serde.task_decline_to_proto(TaskDecline(key, DeclineReason.POLICY_REFUSAL)),
            timeout=TIMEOUT,
        )
        status = serde.query_status_from_proto(
            analyst.GetQueryStatus(serde.query_ref_to_proto(spec.query_id), timeout=TIMEOUT)
        )
    record = server.coordinator.store.query(key)
    assert record.n_contributed == 0 and server.coordinator.store.aggregate(key) == b""
    assert server.coordinator.store.declines(key) == {"owner-1": "policy_refusal"}
    # The decline's public reason reaches the analyst; one of three owners declined,
    # two remain for the quorum of two: still collecting.
    assert status.declines == (OwnerDecline("owner-1", "policy_refusal", ""),)
    assert status.state is QueryState.COLLECTING and status.owners_declined == 1


def test_masked_round_trip_carries_the_public_count(
    tmp_path: Path,
    server: ProxyServer,
    tls_files: dict[NodeIdentity, TlsFiles],
    pool: CryptoPool,
    test_only_keypair_512: Any,
) -> None:
    public_key, _ = test_only_keypair_512
    replace_one = Neighbouring.REPLACE_ONE
    spec = make_spec(
        public_key, "masked", mode=ProtocolMode.MASKED, quorum=1, neighbouring=replace_one
    )
    # Masked mode publishes N: only a deployment stated for replace-one serves it.
    with channel_for(server, tls_files, Role.ANALYST, "alice") as channel:
        with pytest.raises(grpc.RpcError) as info:
            analyst_grpc.AnalystServiceStub(channel).SubmitQuery(
                submit_request(spec), timeout=TIMEOUT
            )
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "replace-one" in (info.value.details() or "")
    masked_server = ProxyServer(
        proxy_config(tls_files, tmp_path / "p.sqlite3", neighbouring=replace_one),
        noise_sampler=TestOnlySeededSampler(3),
        pool=pool,
    )
    masked_server.start()
    try:
        messages, metadata, count = _masked_round_trip(
            masked_server, tls_files, pool, spec, public_key
        )
        public_n = masked_server.coordinator.result_meta("alice", "masked")["public_n"]
    finally:
        masked_server.stop(grace=1.0)
    # The analyst needs N to unmask: it is a field of the result header, not metadata.
    assert messages[0].header.public_record_count == count
    result = serde.decode_result(messages)
    assert result.public_record_count == count
    assert not any(key.startswith("fedpca-") for key in metadata)
    assert result.masked_mean_block == MASKED_SUM
    assert public_n == count
    assert {b.name for b in result.payload.blocks} == {"scatter_rows", MASKED_SUM}


def _masked_round_trip(
    server: ProxyServer,
    tls_files: dict[NodeIdentity, TlsFiles],
    pool: CryptoPool,
    spec: QuerySpec,
    public_key: Any,
) -> tuple[list[Any], dict[str, Any], int]:
    """Submit ``spec``, upload owner-2's share with its count; the result's messages,
    the call's metadata and the count."""
    with (
        channel_for(server, tls_files, Role.ANALYST, "alice") as analyst_channel,
        channel_for(server, tls_files, Role.OWNER, "owner-2") as owner_channel,
    ):
        analyst = analyst_grpc.AnalystServiceStub(analyst_channel)
        analyst.SubmitQuery(submit_request(spec), timeout=TIMEOUT)
        stub = owner_grpc.OwnerServiceStub(owner_channel)
        payload, _, count = owner_share(spec, 11, public_key, pool)
        messages = serde.encode_upload(
            task_id("alice", spec.query_id),
            spec.analyst_key_fingerprint,
            "m",
            payload,
            public_record_count=count,
        )
        stub.Upload(iter(messages), timeout=TIMEOUT)
        statuses = [
            serde.query_status_from_proto(m)
            for m in analyst.WatchQueryStatus(serde.query_ref_to_proto("masked"), timeout=TIMEOUT)
        ]
        assert statuses[-1].state is QueryState.DONE
        call = analyst.FetchResult(serde.query_ref_to_proto("masked"), timeout=TIMEOUT)
        result_messages = list(call)
        metadata = dict(call.initial_metadata())
    return result_messages, metadata, count


def test_stop_ends_open_task_streams_promptly(
    tmp_path: Path,
    tls_files: dict[NodeIdentity, TlsFiles],
    pool: CryptoPool,
) -> None:
    proxy = tls_files[NodeIdentity(Role.PROXY, "proxy")]
    config = ProxyConfig(
        proxy=ProxySection(listen="127.0.0.1:0", database=tmp_path / "p.sqlite3"),
        tls=TlsConfig(ca=proxy.ca_certificate, cert=proxy.certificate, key=proxy.private_key),
        owners=OwnersConfig(frozenset({"owner-1"})),
    )
    running = ProxyServer(config, pool=pool)
    running.start()
    channel = channel_for(running, tls_files, Role.OWNER, "owner-1")
    stream = owner_grpc.OwnerServiceStub(channel).StreamTasks(
        serde.task_stream_request_to_proto("owner-1"), timeout=TIMEOUT
    )
    assert isinstance(serde.task_event_from_proto(next(stream)), Heartbeat)
    started = time.monotonic()
    running.stop(grace=1.0)
    assert time.monotonic() - started < 5.0
    # The stream has ended (cleanly, or cancelled by the stopping server): draining it
    # returns at once instead of waiting for the 30 s call timeout.
    try:
        for _ in stream:
            pass
    except grpc.RpcError as error:
        assert error.code() is not grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5.0
    channel.close()


def test_stop_tells_watching_analysts_to_reconnect(
    tmp_path: Path,
    tls_files: dict[NodeIdentity, TlsFiles],
    pool: CryptoPool,
    test_only_keypair_512: Any,
) -> None:
    # A graceful restart must not end an open watch as if there were nothing more to
    # come: the analyst client would give up instead of following the query on the
    # restarted proxy. UNAVAILABLE is the status it reconnects on.
    proxy = tls_files[NodeIdentity(Role.PROXY, "proxy")]
    config = ProxyConfig(
        proxy=ProxySection(listen="127.0.0.1:0", database=tmp_path / "p.sqlite3"),
        tls=TlsConfig(ca=proxy.ca_certificate, cert=proxy.certificate, key=proxy.private_key),
        budget=BudgetConfig(PrivacyParams(math.inf, 1e-5)),
        crypto=CryptoConfig(processes=1, allow_insecure_test_keys=True),
        owners=OwnersConfig(ALLOWED),
    )
    running = ProxyServer(config, pool=pool)
    running.start()
    public_key, _ = test_only_keypair_512
    channel = channel_for(running, tls_files, Role.ANALYST, "alice")
    analyst = analyst_grpc.AnalystServiceStub(channel)
    analyst.SubmitQuery(submit_request(make_spec(public_key, "open")), timeout=TIMEOUT)
    watch = analyst.WatchQueryStatus(serde.query_ref_to_proto("open"), timeout=TIMEOUT)
    first = serde.query_status_from_proto(next(watch))
    assert first.state is QueryState.COLLECTING
    running.stop(grace=1.0)
    with pytest.raises(grpc.RpcError) as ended:
        for _ in watch:
            pass
    assert ended.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in (ended.value.details() or "")
    channel.close()


def test_insecure_mode_identifies_callers_by_metadata(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: Any
) -> None:
    config = ProxyConfig(
        proxy=ProxySection(listen="127.0.0.1:0", database=tmp_path / "p.sqlite3"),
        tls=TlsConfig(insecure=True),
        crypto=CryptoConfig(processes=1, allow_insecure_test_keys=True),
        owners=OwnersConfig(frozenset({"owner-1", "owner-2"})),
    )
    running = ProxyServer(config, pool=pool)
    running.start()
    try:
        with channels.insecure_channel(running.address) as channel:
            stub = analyst_grpc.AnalystServiceStub(channel)
            anonymous = stub.GetBudget(serde.budget_request_to_proto(), timeout=TIMEOUT)
            named = stub.GetBudget(
                serde.budget_request_to_proto(),
                metadata=((INSECURE_IDENTITY_METADATA, "bob"),),
                timeout=TIMEOUT,
            )
            with pytest.raises(grpc.RpcError) as info:
                stub.GetBudget(
                    serde.budget_request_to_proto(),
                    metadata=((INSECURE_IDENTITY_METADATA, "../etc"),),
                    timeout=TIMEOUT,
                )
        # fedpca's own analyst client names itself on insecure channels (every call:
        # unary and streamed alike), "analyst" unless configured otherwise.
        with AnalystClient(running.address, None, insecure=True) as client:
            default_id = client.budget().analyst_id
        with AnalystClient(running.address, None, insecure=True, insecure_node_id="carol") as carol:
            assert carol.budget().analyst_id == "carol"
            carol.submit(
                make_spec(test_only_keypair_512[0], "carols", epsilon=1.0), TEST_SIGNING_KEY
            )
            first = next(iter(carol.watch("carols", timeout=5.0)))  # a streamed call
            assert first.state is QueryState.COLLECTING
        record = running.coordinator.store.query(task_id("carol", "carols"))
        assert record.analyst_id == "carol" and record.signer == TEST_SIGNER
        with pytest.raises(ConfigError, match="node id"):
            AnalystClient(running.address, None, insecure=True, insecure_node_id="../etc")
    finally:
        running.stop(grace=1.0)
    assert serde.budget_status_from_proto(anonymous).analyst_id == "insecure-analyst"
    assert serde.budget_status_from_proto(named).analyst_id == "bob"
    assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert default_id == "analyst"


def test_chunks_fold_as_they_arrive_and_a_broken_stream_is_taken_out(
    server: ProxyServer,
    tls_files: dict[NodeIdentity, TlsFiles],
    pool: CryptoPool,
    test_only_keypair_512: Any,
) -> None:
    public_key, private_key = test_only_keypair_512
    store = server.coordinator.store
    spec = make_spec(public_key, "chunk-folds")
    key = task_id("alice", spec.query_id)
    # One ciphertext per chunk message, so an upload is a stream of several chunks.
    width = 2 * public_key.n.bit_length() // 8
    one_per_chunk = width + 1
    while True:
        try:
            if ciphertexts_per_chunk(width, one_per_chunk) == 1:
                break
        except ConfigError:  # too small for one ciphertext and the framing
            pass
        one_per_chunk += 1
    with (
        channel_for(server, tls_files, Role.ANALYST, "alice") as analyst_channel,
        channel_for(server, tls_files, Role.OWNER, "owner-1") as channel_1,
        channel_for(server, tls_files, Role.OWNER, "owner-2") as channel_2,
    ):
        analyst = analyst_grpc.AnalystServiceStub(analyst_channel)
        analyst.SubmitQuery(submit_request(spec), timeout=TIMEOUT)
        uploads = []
        for seed in (1, 2):
            payload, encoded, _ = owner_share(spec, seed, public_key, pool)
            messages = serde.encode_upload(
                key, spec.analyst_key_fingerprint, f"u{seed}", payload, one_per_chunk
            )
            uploads.append((messages, encoded[SHARES].astype(object)))
        first_messages = uploads[0][0]
        assert len(first_messages) >= 3  # header and at least two chunks

        def breaks_off_after_two_chunks() -> Iterator[Any]:
            yield from first_messages[:3]
            # Chunks are folded into the aggregate as they arrive, not buffered
            # until the upload is complete.
            deadline = time.monotonic() + TIMEOUT
            while store.partial_uploads(key) != {"owner-1": 2}:
                assert time.monotonic() < deadline, store.partial_uploads(key)
                time.sleep(0.01)
            assert store.aggregate(key) != b""
            raise ConnectionError("TEST: the owner's connection drops mid-upload")

        owner_1 = owner_grpc.OwnerServiceStub(channel_1)
        with pytest.raises(grpc.RpcError):
            owner_1.Upload(breaks_off_after_two_chunks(), timeout=TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while store.partial_uploads(key):
            assert time.monotonic() < deadline, "the broken stream's chunks stayed folded"
            time.sleep(0.01)
        assert store.aggregate(key) == b""  # taken out, byte for byte
        assert store.query(key).n_contributed == 0

        # The owner resends the same upload: folded once, like everything else.
        for stub, (messages, _) in zip(
            (owner_1, owner_grpc.OwnerServiceStub(channel_2)), uploads, strict=True
        ):
            receipt = serde.upload_receipt_from_proto(stub.Upload(iter(messages), timeout=TIMEOUT))
            assert receipt.status is UploadStatus.ACCEPTED
        deadline = time.monotonic() + TIMEOUT
        while store.query(key).state is not QueryState.DONE:
            assert time.monotonic() < deadline, store.query(key).state
            time.sleep(0.01)
        result = serde.decode_result(
            analyst.FetchResult(serde.query_ref_to_proto(spec.query_id), timeout=TIMEOUT)
        )
    plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    plaintexts = pool.decrypt(private_key, list(result.payload[SHARES]))
    expected = uploads[0][1] + uploads[1][1]
    assert unpack_slots(plaintexts, plan.result_block(SHARES).layout, public_key.n) == list(
        expected
    )


def test_a_task_stream_replaced_by_a_newer_one_is_told_why(
    server: ProxyServer, tls_files: dict[NodeIdentity, TlsFiles]
) -> None:
    """Found by review: two nodes run with one owner's certificate took the task stream
    from each other, each told only that the proxy had closed it. The replaced stream
    now ends ABORTED, saying what replaced it and what that likely means."""
    with (
        channel_for(server, tls_files, Role.OWNER, "owner-1") as first_channel,
        channel_for(server, tls_files, Role.OWNER, "owner-1") as second_channel,
    ):
        request = serde.task_stream_request_to_proto("owner-1")
        first = owner_grpc.OwnerServiceStub(first_channel).StreamTasks(request, timeout=TIMEOUT)
        next(first)  # the heartbeat: the stream is open
        second = owner_grpc.OwnerServiceStub(second_channel).StreamTasks(request, timeout=TIMEOUT)
        next(second)
        with pytest.raises(grpc.RpcError) as ended:
            for _ in first:
                pass
        assert ended.value.code() is grpc.StatusCode.ABORTED
        assert "a newer task stream of owner owner-1 replaced this one" in (
            ended.value.details() or ""
        )
        assert "two nodes run with this owner's certificate" in (ended.value.details() or "")
        second.cancel()


def test_terms_the_proxy_cannot_read_are_not_passed_on_and_the_stream_is_served(
    server: ProxyServer,
    tls_files: dict[NodeIdentity, TlsFiles],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An owner's terms out of range (or of a newer version) cost it nothing but their
    display: its stream is served, analysts see no terms of it, the proxy says why."""
    caplog.set_level(logging.WARNING, logger="fedpca.proxy")
    request = serde.task_stream_request_to_proto("owner-2")
    request.terms.n_columns = 0
    request.terms.min_quorum = 2
    owner = channel_for(server, tls_files, Role.OWNER, "owner-2")
    analyst = channel_for(server, tls_files, Role.ANALYST, "alice")
    try:
        stream = owner_grpc.OwnerServiceStub(owner).StreamTasks(request, timeout=TIMEOUT)
        assert isinstance(serde.task_event_from_proto(next(stream)), Heartbeat)
        asked = analyst_pb.DescribeDeploymentRequest(with_owner_terms=True)
        info = serde.deployment_info_from_proto(
            analyst_grpc.AnalystServiceStub(analyst).DescribeDeployment(asked, timeout=TIMEOUT)
        )
        assert info.owners_connected >= 1 and "owner-2" not in dict(info.owner_terms)
        stream.cancel()
    finally:
        owner.close()
        analyst.close()
    assert (
        "owner owner-2: its terms are not passed on to analysts: "
        "TaskStreamRequest.terms.n_columns = 0" in caplog.text
    )
