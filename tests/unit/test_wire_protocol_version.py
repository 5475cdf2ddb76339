"""Telling builds apart by their wire protocol: ``fedpca --version`` prints it, every
call of an owner or analyst states it, and a node refuses a peer of another one naming
both versions (the proxy's side: ``test_proxy_servicer.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from click.testing import CliRunner

from fedpca.app.cli import main
from fedpca.errors import ProtocolError, ProtocolVersionError
from fedpca.messages import PROTOCOL_VERSION, OwnerHello
from fedpca.transport import channels, serde
from fedpca.transport.certs import NodeIdentity, Role, TlsMaterial, init_certificates
from fedpca.v1 import owner_service_pb2 as owner_pb
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
from fedpca.version import __version__, check_peer_protocol
from helpers import sync_test_server


def test_version_prints_the_wire_protocol() -> None:
    """Two builds of one release spoke wire protocols 3 and 4 and both printed
    "fedpca, version 0.2.0"."""
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == (
        f"fedpca, version {__version__} (wire protocol {PROTOCOL_VERSION})"
    )


def test_a_stated_protocol_is_checked_against_this_build() -> None:
    check_peer_protocol("owner/a", None, "this proxy")  # a build before the metadata
    check_peer_protocol("owner/a", str(PROTOCOL_VERSION), "this proxy")
    with pytest.raises(ProtocolVersionError) as info:
        check_peer_protocol("owner/a", "3", "this proxy")
    assert isinstance(info.value, ProtocolError)  # answered INVALID_ARGUMENT
    assert str(info.value).startswith(
        f"owner/a speaks wire protocol 3, this proxy {PROTOCOL_VERSION}"
    )
    assert (info.value.peer, info.value.theirs, info.value.ours) == (
        "owner/a",
        "3",
        PROTOCOL_VERSION,
    )
    with pytest.raises(ProtocolVersionError) as info:
        check_peer_protocol("owner/a", "x" * 10_000, "this proxy")
    assert len(str(info.value)) < 200  # a peer's text is cut before it is logged


@pytest.mark.parametrize("secure", [True, False], ids=["mutual-tls", "insecure"])
def test_every_call_states_this_builds_wire_protocol(tmp_path: Path, secure: bool) -> None:
    """The owner node, its probe and the analyst client all dial with these channels."""
    seen: list[dict[str, Any]] = []

    def hello(request: owner_pb.OwnerHello, context: grpc.ServicerContext) -> Any:
        seen.append(dict(context.invocation_metadata()))
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "test: metadata recorded")

    handler = grpc.method_handlers_generic_handler(
        "fedpca.v1.OwnerService",
        {
            "Hello": grpc.unary_unary_rpc_method_handler(
                hello,
                request_deserializer=owner_pb.OwnerHello.FromString,
                response_serializer=owner_pb.ProxyInfo.SerializeToString,
            )
        },
    )
    server = sync_test_server(max_workers=2)
    server.add_generic_rpc_handlers((handler,))
    if secure:
        files = init_certificates(tmp_path, owner_ids=["owner-1"], analyst_ids=["alice"])
        proxy = TlsMaterial.load(files[NodeIdentity(Role.PROXY, "proxy")])
        port = channels.add_secure_port(server, "127.0.0.1:0", proxy)
        owner = TlsMaterial.load(files[NodeIdentity(Role.OWNER, "owner-1")])
        channel = channels.secure_channel(f"localhost:{port}", owner)
    else:
        port = channels.add_insecure_port(server, "127.0.0.1:0")
        channel = channels.insecure_channel(f"127.0.0.1:{port}", node_id="owner-1")
    server.start()
    try:
        with channel:
            stub = owner_grpc.OwnerServiceStub(channel)
            request = serde.owner_hello_to_proto(OwnerHello("owner-1", "test"))
            # A caller's own entry under the key does not hide the build's (read last).
            for metadata in ((), ((channels.PROTOCOL_VERSION_METADATA, "99"),)):
                with pytest.raises(grpc.RpcError):
                    stub.Hello(request, metadata=metadata, timeout=10)
    finally:
        server.stop(None)
    assert [m.get(channels.PROTOCOL_VERSION_METADATA) for m in seen] == [str(PROTOCOL_VERSION)] * 2
    if not secure:
        assert all(m.get(channels.INSECURE_IDENTITY_METADATA) == "owner-1" for m in seen)
