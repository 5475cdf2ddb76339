"""A real gRPC server over mutual TLS on 127.0.0.1 with a tiny OwnerService servicer."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest

from fedpca.errors import AuthenticationError, ConfigError, FedpcaError, ProtocolError
from fedpca.messages import (
    DEFAULT_CHUNK_MESSAGE_BYTES,
    CiphertextBlock,
    CiphertextPayload,
    Heartbeat,
    OwnerHello,
    ProxyInfo,
    Task,
    TaskCancellation,
    TaskEvent,
    UploadReceipt,
    UploadStatus,
)
from fedpca.messages.chunks import UPLOAD_CHUNK_BYTES
from fedpca.query import QueryKind, QuerySpec
from fedpca.transport import certs, channels, serde
from fedpca.transport.cert_requests import (
    certify_request,
    create_request,
    read_request,
    write_request,
)
from fedpca.transport.certs import NodeIdentity, Role, TlsMaterial
from fedpca.transport.serde.query import MAX_QUERY_BYTES
from fedpca.v1 import owner_service_pb2 as owner_pb
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
from helpers import sync_test_server
from inprocess import accepting_upload

TIMEOUT = 10.0
OWNER = NodeIdentity(Role.OWNER, "owner-1")
ANALYST = NodeIdentity(Role.ANALYST, "analyst-1")
PROXY = NodeIdentity(Role.PROXY, "proxy")
NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
SPEC = QuerySpec(
    query_id="q1",
    kind=QueryKind.PCA,
    n_features=4,
    epsilon=1.0,
    delta=1e-6,
    n_components=2,
    analyst_public_key_n=(1 << 511) + 1,
    analyst_key_fingerprint="fp",
)


def _status_for(exc: FedpcaError) -> grpc.StatusCode:
    if isinstance(exc, AuthenticationError):
        return grpc.StatusCode.PERMISSION_DENIED
    return grpc.StatusCode.INVALID_ARGUMENT


class _Servicer(owner_grpc.OwnerServiceServicer):  # type: ignore[misc]
    """Thin, as real servicers should be: authenticate, translate, map errors."""

    def Hello(self, request: owner_pb.OwnerHello, context: Any) -> owner_pb.ProxyInfo:
        try:
            identity = certs.require_role(context, Role.OWNER)
            serde.owner_hello_from_proto(request)
        except FedpcaError as exc:
            context.abort(_status_for(exc), str(exc))
        info = ProxyInfo("proxy", "test", identity.node_id, 5.0, 1 << 20, NOW)
        return serde.proxy_info_to_proto(info)

    def StreamTasks(
        self, request: owner_pb.TaskStreamRequest, context: Any
    ) -> Iterator[owner_pb.TaskEvent]:
        certs.require_role(context, Role.OWNER)
        events: list[TaskEvent] = [
            Heartbeat(NOW),
            Task(SPEC, NOW + timedelta(minutes=5)),
            TaskCancellation("q0", "superseded"),
        ]
        for event in events:
            yield serde.task_event_to_proto(event)

    def Upload(
        self, request_iterator: Iterator[owner_pb.UploadMessage], context: Any
    ) -> owner_pb.UploadReceipt:
        try:
            certs.require_role(context, Role.OWNER)
            _, _, receipt = accepting_upload(request_iterator)
        except FedpcaError as exc:
            context.abort(_status_for(exc), str(exc))
        return receipt


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsMaterial]:
    root = tmp_path_factory.mktemp("pki")
    ours = certs.init_certificates(root / "ours", ["owner-1"], ["analyst-1"])
    rogue = certs.init_certificates(root / "rogue", ["owner-1"], [])
    # Same CA, but the proxy certificate names a host the client does not dial.
    layout = certs.CertificateDirectory(root / "ours")
    wrong_host = certs.issue_node_certificate(
        layout.load_ca(), NodeIdentity(Role.PROXY, "elsewhere"), hosts=["proxy.example.org"]
    )
    # An owner whose key never left its host: certified from its request (CSR).
    requested = NodeIdentity(Role.OWNER, "owner-csr")
    key = certs.generate_private_key()
    write_request(root / "owner-csr.pem", create_request(requested, key))
    request = read_request(root / "owner-csr.pem")
    certificate = certify_request(layout.load_ca(), request, requested)
    requested_files = certs.TlsFiles(
        ours[OWNER].ca_certificate, root / "owner-csr-cert.pem", root / "owner-csr-key.pem"
    )
    certs.write_certificate(requested_files.certificate, certificate)
    certs.write_private_key(requested_files.private_key, key)
    return {
        "requested_owner": TlsMaterial.load(requested_files),
        "proxy": TlsMaterial.load(ours[PROXY]),
        "owner": TlsMaterial.load(ours[OWNER]),
        "analyst": TlsMaterial.load(ours[ANALYST]),
        "rogue_owner": _trusting_our_ca(TlsMaterial.load(rogue[OWNER]), ours[OWNER]),
        "wrong_host_proxy": TlsMaterial.load(layout.write_node(wrong_host)),
    }


def _trusting_our_ca(client: TlsMaterial, ours: certs.TlsFiles) -> TlsMaterial:
    # The rogue client must trust OUR proxy; otherwise the handshake would fail
    # on the client side and the test would not show the server's rejection.
    return dataclasses.replace(client, root_certificates=ours.ca_certificate.read_bytes())


def _serve(tls: TlsMaterial | None) -> tuple[grpc.Server, int]:
    server = sync_test_server(max_workers=4)
    owner_grpc.add_OwnerServiceServicer_to_server(_Servicer(), server)
    if tls is None:
        port = channels.add_insecure_port(server, "127.0.0.1:0")
    else:
        port = channels.add_secure_port(server, "127.0.0.1:0", tls)
    server.start()
    return server, port


@pytest.fixture(scope="module")
def proxy(pki: dict[str, TlsMaterial]) -> Iterator[str]:
    server, port = _serve(pki["proxy"])
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture
def stub_for(proxy: str) -> Iterator[Callable[..., Any]]:
    opened: list[grpc.Channel] = []

    def make(tls: TlsMaterial, **kwargs: Any) -> Any:
        channel = channels.secure_channel(proxy, tls, **kwargs)
        opened.append(channel)
        return owner_grpc.OwnerServiceStub(channel)

    yield make
    for channel in opened:
        channel.close()


def _hello() -> owner_pb.OwnerHello:
    return serde.owner_hello_to_proto(OwnerHello("claimed-id", "test"))


def test_mtls_with_valid_certificates_sees_the_caller(
    stub_for: Callable[..., Any], pki: dict[str, TlsMaterial]
) -> None:
    reply = stub_for(pki["owner"]).Hello(_hello(), timeout=TIMEOUT)
    info = serde.proxy_info_from_proto(reply)
    # The node id comes from the certificate, not from the message's claim.
    assert info.authenticated_node_id == "owner-1"


def test_a_certificate_signed_from_a_request_connects_as_its_id(
    stub_for: Callable[..., Any], pki: dict[str, TlsMaterial]
) -> None:
    reply = stub_for(pki["requested_owner"]).Hello(_hello(), timeout=TIMEOUT)
    assert serde.proxy_info_from_proto(reply).authenticated_node_id == "owner-csr"


def test_wrong_role_is_refused_by_the_servicer(
    stub_for: Callable[..., Any], pki: dict[str, TlsMaterial]
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub_for(pki["analyst"]).Hello(_hello(), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "analyst/analyst-1 may not call" in err.value.details()


def test_client_certificate_from_another_ca_is_rejected(
    stub_for: Callable[..., Any], pki: dict[str, TlsMaterial]
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub_for(pki["rogue_owner"]).Hello(_hello(), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_missing_client_certificate_is_rejected(proxy: str, pki: dict[str, TlsMaterial]) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=pki["owner"].root_certificates)
    with grpc.secure_channel(proxy, credentials) as channel, pytest.raises(grpc.RpcError) as err:
        owner_grpc.OwnerServiceStub(channel).Hello(_hello(), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_verifies_the_proxy_host_name(
    stub_for: Callable[..., Any], pki: dict[str, TlsMaterial]
) -> None:
    # Our proxy's certificate names localhost/127.0.0.1, so verifying it against
    # another name must fail: a CA-signed certificate alone is not enough.
    with pytest.raises(grpc.RpcError) as err:
        stub_for(pki["owner"], server_name_override="proxy.example.org").Hello(
            _hello(), timeout=TIMEOUT
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_proxy_with_other_host_name_is_not_trusted(pki: dict[str, TlsMaterial]) -> None:
    server, port = _serve(pki["wrong_host_proxy"])
    try:
        channel = channels.secure_channel(f"127.0.0.1:{port}", pki["owner"])
        with channel, pytest.raises(grpc.RpcError) as err:
            owner_grpc.OwnerServiceStub(channel).Hello(_hello(), timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        override = channels.secure_channel(
            f"127.0.0.1:{port}", pki["owner"], server_name_override="proxy.example.org"
        )
        with override as channel:
            owner_grpc.OwnerServiceStub(channel).Hello(_hello(), timeout=TIMEOUT)
    finally:
        server.stop(grace=None)


def test_task_server_stream(stub_for: Callable[..., Any], pki: dict[str, TlsMaterial]) -> None:
    stream = stub_for(pki["owner"]).StreamTasks(owner_pb.TaskStreamRequest(), timeout=TIMEOUT)
    events = [serde.task_event_from_proto(message) for message in stream]
    assert events == [
        Heartbeat(NOW),
        Task(SPEC, NOW + timedelta(minutes=5)),
        TaskCancellation("q0", "superseded"),
    ]


def _payload(n: int) -> CiphertextPayload:
    block = CiphertextBlock("scatter", 2048, 72, 28, 28 * n, n)
    return CiphertextPayload((block,), {"scatter": [(7 << 4000) + i for i in range(n)]})


def test_chunked_upload_over_mtls(
    stub_for: Callable[..., Any], pki: dict[str, TlsMaterial]
) -> None:
    # 3000 x 512 B = 1.5 MiB, cut into 64 KiB chunks -> 24 chunk messages.
    messages = serde.encode_upload("q1", "fp", "u1", _payload(3000), max_message_bytes=1 << 16)
    assert len(messages) == 25
    receipt = serde.upload_receipt_from_proto(
        stub_for(pki["owner"]).Upload(iter(messages), timeout=TIMEOUT)
    )
    assert receipt == UploadReceipt("q1", "u1", UploadStatus.ACCEPTED, 24, 3000)


def test_default_sized_chunks_pass_the_channel_limits(
    stub_for: Callable[..., Any], pki: dict[str, TlsMaterial]
) -> None:
    messages = serde.encode_upload("q1", "fp", "u2", _payload(14000))  # ~6.8 MiB
    assert len(messages) == 29 and max(m.ByteSize() for m in messages) > 250_000
    reply = stub_for(pki["owner"]).Upload(iter(messages), timeout=TIMEOUT)
    assert reply.ciphertexts_received == 14000
    # A result page's chunk size is more than the proxy reads: refused unread.
    too_big = serde.encode_upload(
        "q1", "fp", "u3", _payload(14000), max_message_bytes=DEFAULT_CHUNK_MESSAGE_BYTES
    )
    with pytest.raises(grpc.RpcError) as err:
        stub_for(pki["owner"]).Upload(iter(too_big), timeout=TIMEOUT)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_broken_upload_maps_to_invalid_argument(
    stub_for: Callable[..., Any], pki: dict[str, TlsMaterial]
) -> None:
    messages = serde.encode_upload("q1", "fp", "u3", _payload(10), max_message_bytes=2048)
    del messages[2]
    with pytest.raises(grpc.RpcError) as err:
        stub_for(pki["owner"]).Upload(iter(messages), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chunk index 2 arrived, expected 1" in err.value.details()
    with pytest.raises(ProtocolError):  # the same message, raised locally
        serde.read_upload(messages)


def test_insecure_path_warns_every_time_and_has_no_identity(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="fedpca.transport.channels"):
        server, port = _serve(None)
        try:
            for _ in range(2):
                channel = channels.insecure_channel(f"127.0.0.1:{port}")
                with channel, pytest.raises(grpc.RpcError) as err:
                    owner_grpc.OwnerServiceStub(channel).Hello(_hello(), timeout=TIMEOUT)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "no client certificate" in err.value.details()
        finally:
            server.stop(grace=None)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage().split()[:2] for r in warnings] == [
        ["INSECURE", "port"],
        ["INSECURE", "channel"],
        ["INSECURE", "channel"],
    ]


def test_options() -> None:
    client = dict(channels.client_options(server_name_override="x"))
    server = dict(channels.server_options())
    assert client["grpc.max_receive_message_length"] == channels.DEFAULT_MAX_MESSAGE_BYTES
    assert server["grpc.max_receive_message_length"] == channels.PROXY_MAX_RECEIVE_BYTES
    assert server["grpc.max_send_message_length"] == channels.DEFAULT_MAX_MESSAGE_BYTES
    # A connection that never completes its handshake, or holds no call, is closed.
    assert server["grpc.server_handshake_timeout_ms"] <= 10_000
    assert server["grpc.max_connection_idle_ms"] >= 60_000
    # The proxy reads every message a peer legitimately sends it: a query at its cap
    # (plus signature and signer) and an upload chunk.
    assert MAX_QUERY_BYTES + 64 * 1024 <= channels.PROXY_MAX_RECEIVE_BYTES
    assert UPLOAD_CHUNK_BYTES <= channels.PROXY_MAX_RECEIVE_BYTES
    assert client["grpc.ssl_target_name_override"] == "x"
    # The server must tolerate the clients' keepalive pings or it sends GOAWAY.
    assert (
        server["grpc.http2.min_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"]
    )
    assert client["grpc.http2.max_pings_without_data"] == 0
    assert DEFAULT_CHUNK_MESSAGE_BYTES < channels.DEFAULT_MAX_MESSAGE_BYTES
    # Both ends bound what waits per stream: a fixed window, no bandwidth-delay probing.
    for options in (client, server):
        assert options["grpc.http2.bdp_probe"] == 0
        assert options["grpc.http2.lookahead_bytes"] == channels.STREAM_WINDOW_BYTES


def test_port_in_use_is_a_config_error(pki: dict[str, TlsMaterial]) -> None:
    server, port = _serve(pki["proxy"])
    try:
        other = sync_test_server(max_workers=1)
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}: port {port} is already in use"):
            channels.add_secure_port(other, f"127.0.0.1:{port}", pki["proxy"])
    finally:
        server.stop(grace=None)
