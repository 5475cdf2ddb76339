"""gRPC servers and channels for fedpca: mutual TLS by default, insecure only by name.

The proxy serves both services on one port that *requires and verifies* a client
certificate issued by the fedpca CA; owners and analysts dial it with their own
certificate. Servicers then read the caller's role and node id with
:func:`fedpca.transport.certs.require_role`.

Keepalive is tuned for the owners' long-lived task stream, which can sit idle
for hours behind NATs and firewalls that drop silent TCP flows:

* clients ping every :data:`CLIENT_KEEPALIVE_TIME_MS` even without active calls
  and without data frames, so a dead proxy is noticed within ~40 s and the
  owner reconnects;
* the server accepts pings that often (its default minimum interval is 5 min and
  it would answer faster pings with GOAWAY ``too_many_pings``) and pings clients
  itself, so it drops vanished owners' streams and frees their worker threads.

Message size limits: clients send and receive up to :data:`DEFAULT_MAX_MESSAGE_BYTES`
(result pages reach the analyst in chunks well below it); the proxy sends up to the same
but *receives* at most :data:`PROXY_MAX_RECEIVE_BYTES`, since gRPC reads a message whole
before any handler can refuse it (see :mod:`fedpca.transport.serde` for the chunking).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from fedpca.errors import ConfigError
from fedpca.transport.certs import TlsMaterial, validate_node_id
from fedpca.transport.ports import bind_error, check_bindable
from fedpca.version import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

INSECURE_IDENTITY_METADATA = "fedpca-node-id"
"""Request metadata in which a client names itself on an insecure channel.

Without TLS there is no certificate to identify a caller; the proxy in insecure
mode then reads the node id from this key (and ignores it with TLS)."""

PROTOCOL_VERSION_METADATA = "fedpca-protocol-version"
"""Request metadata in which every call of an owner or analyst states the wire protocol
version of its build (:data:`fedpca.version.PROTOCOL_VERSION`), so that the proxy
refuses, and logs, a peer of another one instead of leaving only the peer to notice.
Builds before it existed send nothing, and the proxy cannot tell their version."""

DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
PROXY_MAX_RECEIVE_BYTES = 2 * 1024 * 1024
"""Largest message the proxy reads.

What peers legitimately send it is at most a submitted query (its specification is
refused beyond 1 MiB, :data:`fedpca.transport.serde.query.MAX_QUERY_BYTES`, plus a
signature and key of a few KiB) or an upload chunk (cut at
:data:`fedpca.messages.chunks.UPLOAD_CHUNK_BYTES`, 256 KiB). gRPC in Python reads each
message whole, with one limit for every method, before a handler can refuse it: at the
earlier 8 MiB, one owner's ``max_calls_per_peer`` concurrent oversized calls held about
2 GiB of the proxy's memory (review). Owners learn the limit from ``ProxyInfo``."""
CLIENT_KEEPALIVE_TIME_MS = 30_000
CLIENT_KEEPALIVE_TIMEOUT_MS = 10_000
SERVER_KEEPALIVE_TIME_MS = 60_000
SERVER_KEEPALIVE_TIMEOUT_MS = 20_000
SERVER_HANDSHAKE_TIMEOUT_MS = 10_000
SERVER_MAX_CONNECTION_IDLE_MS = 300_000
# Must not exceed the clients' keepalive interval, or the server treats their
# pings as abuse and closes the connection.
SERVER_MIN_PING_INTERVAL_MS = 10_000

ChannelOptions = list[tuple[str, Any]]


def _size_options(max_send_bytes: int, max_receive_bytes: int) -> ChannelOptions:
    for name, value in (("send", max_send_bytes), ("receive", max_receive_bytes)):
        if value < 1:
            raise ConfigError(f"max {name} message bytes must be >= 1, got {value}")
    return [
        ("grpc.max_send_message_length", max_send_bytes),
        ("grpc.max_receive_message_length", max_receive_bytes),
    ]


def client_options(
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    server_name_override: str | None = None,
) -> ChannelOptions:
    """Channel options for owners and analysts.

    Parameters
    ----------
    max_message_bytes : send and receive limit.
    server_name_override : verify the proxy certificate against this name instead
        of the host in the target (e.g. when dialling an IP not in the certificate).
    """
    options = [
        *_size_options(max_message_bytes, max_message_bytes),
        ("grpc.keepalive_time_ms", CLIENT_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", CLIENT_KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        # 0 = unlimited: an idle task stream sends no data frames, and the
        # default limit of 2 would stop keepalive pings on exactly that stream.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", 1_000),
        ("grpc.max_reconnect_backoff_ms", 30_000),
        # Bounded read-ahead per stream, as at the proxy (server_options): an analyst
        # decrypts a result far slower than the proxy sends it, and with bandwidth-delay
        # probing gRPC widened the window until much of the result waited in its
        # buffers (benchmarks/high_dimension.py).
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
    ]
    if server_name_override is not None:
        options.append(("grpc.ssl_target_name_override", server_name_override))
    return options


STREAM_WINDOW_BYTES = 1024 * 1024
"""HTTP/2 flow-control window of each stream the proxy receives (see server_options)."""


def server_options(
    max_receive_bytes: int = PROXY_MAX_RECEIVE_BYTES,
    max_send_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> ChannelOptions:
    """Server options for the proxy."""
    return [
        *_size_options(max_send_bytes, max_receive_bytes),
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", SERVER_KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS: the least time
        # between client pings the server tolerates before counting a strike.
        ("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.http2.max_pings_without_data", 0),
        # A connection must finish its TLS handshake within this time (gRPC's default is
        # 120 s): a review locked every new peer out with 1,000 plain TCP connections
        # that never began one, held without any certificate.
        ("grpc.server_handshake_timeout_ms", SERVER_HANDSHAKE_TIMEOUT_MS),
        # A connection without any call for this long is closed (clients reconnect on
        # their next call; an owner's open task stream keeps its connection busy).
        ("grpc.max_connection_idle_ms", SERVER_MAX_CONNECTION_IDLE_MS),
        # gRPC enables SO_REUSEPORT by default: a second proxy on the same port
        # would bind silently and split owners between two separate states.
        ("grpc.so_reuseport", 0),
        # Bounded read-ahead per stream. With bandwidth-delay probing on, gRPC
        # widened an upload stream's HTTP/2 window until it had buffered a whole
        # upload (16.7 MiB at M = 1500) while the proxy was still folding earlier
        # chunks, so peak memory grew with owners x upload size again
        # (benchmarks/proxy_memory.py). A fixed 1 MiB window bounds what waits per
        # stream and still allows ~20 MB/s per stream at 50 ms round trip.
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
    ]


def server_credentials(tls: TlsMaterial) -> grpc.ServerCredentials:
    """Server credentials that require a client certificate signed by the fedpca CA."""
    return grpc.ssl_server_credentials(
        [(tls.private_key, tls.certificate_chain)],
        root_certificates=tls.root_certificates,
        require_client_auth=True,
    )


def channel_credentials(tls: TlsMaterial) -> grpc.ChannelCredentials:
    """Client credentials: trust only the fedpca CA and present this node's certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=tls.root_certificates,
        private_key=tls.private_key,
        certificate_chain=tls.certificate_chain,
    )


def secure_channel(
    target: str,
    tls: TlsMaterial,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    server_name_override: str | None = None,
    extra_options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A mutual-TLS channel to the proxy at ``target`` (``host:port``); every call states
    this build's wire protocol (:data:`PROTOCOL_VERSION_METADATA`)."""
    options = client_options(max_message_bytes, server_name_override) + list(extra_options)
    logger.debug("opening mTLS channel to %s as %s", target, tls.identity)
    # Call credentials, not an interceptor: grpc's interceptor keeps a refused unary
    # call's request in a reference cycle with its error (until the cyclic collector
    # runs), which a refused 1 MiB query would make costly.
    stated = grpc.metadata_call_credentials(_StateProtocol(), name=PROTOCOL_VERSION_METADATA)
    credentials = grpc.composite_channel_credentials(channel_credentials(tls), stated)
    return grpc.secure_channel(target, credentials, options=options)


def _protocol_entry() -> tuple[str, str]:
    return (PROTOCOL_VERSION_METADATA, str(PROTOCOL_VERSION))


class _StateProtocol(grpc.AuthMetadataPlugin):
    """Adds :data:`PROTOCOL_VERSION_METADATA` to every call of a mutual-TLS channel."""

    def __call__(
        self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback
    ) -> None:
        callback((_protocol_entry(),), None)


def create_async_server(
    max_receive_bytes: int = PROXY_MAX_RECEIVE_BYTES,
    *,
    maximum_concurrent_rpcs: int | None = None,
    extra_options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> grpc.aio.Server:
    """An asynchronous (grpc.aio) server with fedpca's options: no thread per stream.

    Calls beyond ``maximum_concurrent_rpcs`` are answered RESOURCE_EXHAUSTED by gRPC.
    """
    return grpc.aio.server(
        options=server_options(max_receive_bytes) + list(extra_options),
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
        interceptors=list(interceptors) or None,
    )


def add_secure_port(
    server: grpc.Server | grpc.aio.Server,
    address: str,
    tls: TlsMaterial,
    *,
    setting: str = "the listening address",
) -> int:
    """Bind ``address`` with mutual TLS; return the bound port (useful with port 0).

    Raises
    ------
    ConfigError
        If the address cannot be bound: one line saying why (a port in use is named as
        such) and naming ``setting``, what the operator changes (e.g. a config key).
    """
    port = _bind(address, lambda: server.add_secure_port(address, server_credentials(tls)), setting)
    logger.info("listening on %s with mutual TLS as %s", address, tls.identity)
    return port


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    """The details of one call, as grpc's interceptors pass them on."""


class _MetadataInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``entries`` (key, value) to the metadata of every call, in place of any
    the caller gave under the same keys."""

    def __init__(self, entries: Sequence[tuple[str, str]]) -> None:
        self._entries = list(entries)
        self._keys = {key for key, _ in entries}

    def _with_entries(self, details: Any) -> grpc.ClientCallDetails:
        metadata = [m for m in details.metadata or () if m[0] not in self._keys]
        metadata.extend(self._entries)
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_entries(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_entries(details), request)

    def intercept_stream_unary(
        self, continuation: Any, details: Any, request_iterator: Iterator[Any]
    ) -> Any:
        return continuation(self._with_entries(details), request_iterator)

    def intercept_stream_stream(
        self, continuation: Any, details: Any, request_iterator: Iterator[Any]
    ) -> Any:
        return continuation(self._with_entries(details), request_iterator)


def insecure_channel(
    target: str,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    extra_options: Sequence[tuple[str, Any]] = (),
    node_id: str | None = None,
) -> grpc.Channel:
    """A plaintext channel. NOT for deployments: no encryption, no identities.

    Logs a WARNING every time it is used so it cannot go unnoticed.

    Every call states this build's wire protocol (:data:`PROTOCOL_VERSION_METADATA`).

    Parameters
    ----------
    node_id : if given, every call names the caller with
        :data:`INSECURE_IDENTITY_METADATA` metadata, which an insecure proxy takes
        as the caller's id (a claim, not a proof: nothing is authenticated). Owners
        must send it to keep one identity across reconnections.

    Raises
    ------
    ConfigError
        If ``node_id`` is not a valid node id.
    """
    if node_id is not None:
        validate_node_id(node_id)
    logger.warning("INSECURE channel to %s: no TLS, traffic and identities are unprotected", target)
    options = client_options(max_message_bytes) + list(extra_options)
    channel = grpc.insecure_channel(target, options=options)
    entries = [_protocol_entry()]
    if node_id is not None:
        entries.append((INSECURE_IDENTITY_METADATA, node_id))
    return grpc.intercept_channel(channel, _MetadataInterceptor(entries))


def add_insecure_port(
    server: grpc.Server | grpc.aio.Server,
    address: str,
    *,
    setting: str = "the listening address",
) -> int:
    """Bind ``address`` without TLS. NOT for deployments; logs a WARNING every time.

    Servicers cannot identify callers on such a port:
    :func:`fedpca.transport.certs.identity_from_context` raises AuthenticationError.
    """
    logger.warning("INSECURE port %s: no TLS, callers cannot be authenticated", address)
    return _bind(address, lambda: server.add_insecure_port(address), setting)


def _bind(address: str, add_port: Callable[[], int], setting: str) -> int:
    # gRPC says neither why a bind failed nor which setting to change, and prints a
    # C-core error line of its own: a port in use is found first, with its reason.
    check_bindable(address, setting)
    # Depending on the version, grpc reports a failed bind as port 0 or RuntimeError.
    try:
        port = add_port()
    except RuntimeError as exc:
        raise bind_error(address, setting) from exc
    if port == 0:
        raise bind_error(address, setting)
    return port
