"""The proxy's gRPC servicers: translate, call the coordinator, map errors. Nothing else.

Every message is translated by :mod:`fedpca.transport.serde`; every decision is
the :class:`~fedpca.proxy.coordinator.Coordinator`'s. The caller's identity and
role come only from its verified client certificate
(:func:`fedpca.transport.certs.require_role`): OwnerService methods require the
owner role, AnalystService methods the analyst role.

Domain errors become status codes here and nowhere else:

==========================================================  ======================
error                                                       status
==========================================================  ======================
NotFoundError                                               NOT_FOUND
BudgetExceededError                                         RESOURCE_EXHAUSTED
AuthenticationError, PolicyError, UntrustedKeyError         PERMISSION_DENIED
QueryStateError                                             FAILED_PRECONDITION
ProtocolError, LayoutError, CiphertextError, ConfigError,   INVALID_ARGUMENT
EncodingOverflowError (and every other FedpcaError)
anything else                                               INTERNAL (generic text)
==========================================================  ======================

Insecure mode (``tls.insecure = true``, local experiments only) has no
certificates: the caller's node id is then taken from the ``fedpca-node-id``
request metadata (:data:`fedpca.transport.channels.INSECURE_IDENTITY_METADATA`,
which fedpca's owner node and analyst client send on insecure channels; failing
that: ``insecure-analyst`` for analysts, the network address of the connection for
owners) and its role from the service it calls. Nothing is authenticated; a
WARNING says so at start.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from typing import Any, NoReturn, TypeVar

import grpc

from fedpca.errors import (
    AuthenticationError,
    BudgetExceededError,
    FedpcaError,
    NotFoundError,
    PolicyError,
    ProtocolError,
    QueryStateError,
    UntrustedKeyError,
)
from fedpca.messages import (
    Heartbeat,
    ProxyInfo,
    QueryStatus,
    UploadReceipt,
    UploadStatus,
)
from fedpca.proxy.coordinator import Coordinator
from fedpca.transport import certs, channels, serde
from fedpca.transport.certs import NodeIdentity, Role
from fedpca.transport.channels import INSECURE_IDENTITY_METADATA
from fedpca.v1 import analyst_service_pb2 as analyst_pb
from fedpca.v1 import analyst_service_pb2_grpc as analyst_grpc
from fedpca.v1 import owner_service_pb2 as owner_pb
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
from fedpca.version import __version__

__all__ = [
    "INSECURE_ANALYST_ID",
    "INSECURE_IDENTITY_METADATA",
    "AnalystServicer",
    "OwnerServicer",
    "status_code_for",
]

logger = logging.getLogger(__name__)

INSECURE_ANALYST_ID = "insecure-analyst"
"""Analyst id in insecure mode when the caller sends no ``fedpca-node-id``."""

_STATUS_CODES: tuple[tuple[type[FedpcaError] | tuple[type[FedpcaError], ...], grpc.StatusCode], ...]
_STATUS_CODES = (
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    # Before the permission errors: BudgetExceededError is also a PermissionError.
    (BudgetExceededError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ((AuthenticationError, PolicyError, UntrustedKeyError), grpc.StatusCode.PERMISSION_DENIED),
    (QueryStateError, grpc.StatusCode.FAILED_PRECONDITION),
)

_Method = TypeVar("_Method", bound=Callable[..., Any])


def status_code_for(error: FedpcaError) -> grpc.StatusCode:
    """The gRPC status a domain error is reported with (see the module table)."""
    for kinds, code in _STATUS_CODES:
        if isinstance(error, kinds):
            return code
    # ProtocolError, LayoutError, CiphertextError, ConfigError, EncodingOverflowError,
    # CalibrationError, KeyFileError, DataError: the request itself is at fault.
    return grpc.StatusCode.INVALID_ARGUMENT


def _refuse(context: grpc.ServicerContext, method: str, error: Exception) -> NoReturn:
    if isinstance(error, FedpcaError):
        code = status_code_for(error)
        logger.warning("%s refused (%s): %s", method, code.name, error)
        context.abort(code, str(error))
    elif isinstance(error, grpc.RpcError):
        # Reading the request stream failed: the client cancelled or the connection
        # dropped mid-stream. Routine on a network; nobody is left to answer.
        logger.warning("%s ended: the client's request stream broke off", method)
        context.abort(grpc.StatusCode.CANCELLED, "the request stream broke off")
    else:
        # Internal details (paths, values) stay in the log, not in the reply.
        logger.error("%s failed unexpectedly", method, exc_info=error)
        context.abort(grpc.StatusCode.INTERNAL, "internal error in the proxy; see its log")
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def _unary(method: _Method) -> _Method:
    """Map errors of a unary-response method to status codes."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as error:
            _refuse(context, method.__name__, error)

    return wrapper  # type: ignore[return-value]


def _streaming(method: _Method) -> _Method:
    """Map errors of a server-streaming method (a generator) to status codes."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from method(self, request, context)
        except Exception as error:
            _refuse(context, method.__name__, error)

    return wrapper  # type: ignore[return-value]


_PEER_RE = re.compile(r"[^A-Za-z0-9._-]+")


class _Base:
    def __init__(self, coordinator: Coordinator, *, insecure: bool = False) -> None:
        self.coordinator = coordinator
        self.insecure = insecure

    def _caller(self, context: grpc.ServicerContext, role: Role) -> NodeIdentity:
        if not self.insecure:
            return certs.require_role(
                context, role, revoked_serials=self.coordinator.config.tls.revoked_serials
            )
        claimed = dict(context.invocation_metadata() or ()).get(INSECURE_IDENTITY_METADATA)
        if claimed is None and role is Role.ANALYST:
            # One anonymous analyst: its queries, results and budget stay together
            # across client processes.
            claimed = INSECURE_ANALYST_ID
        elif claimed is None:
            # Owners must stay distinct (each counts towards the quorum once): fall
            # back to the network address, which is stable for one connection.
            claimed = _PEER_RE.sub("-", context.peer()).strip("-.")[-63:] or "unknown"
        try:
            return NodeIdentity(role, str(claimed))
        except FedpcaError as error:
            raise AuthenticationError(f"insecure mode: bad node id: {error}") from error


# ------------------------------------------------------------------- owners
class OwnerServicer(_Base, owner_grpc.OwnerServiceServicer):
    """OwnerService: hello, the long-lived task stream, uploads, declines.

    Parameters
    ----------
    coordinator : the domain logic.
    proxy_id : this proxy's node id (reported in ProxyInfo).
    heartbeat_seconds : interval of heartbeats on the task stream.
    insecure : no TLS (see the module docstring).
    """

    def __init__(
        self,
        coordinator: Coordinator,
        proxy_id: str,
        heartbeat_seconds: float,
        *,
        insecure: bool = False,
    ) -> None:
        super().__init__(coordinator, insecure=insecure)
        self.proxy_id = proxy_id
        self.heartbeat_seconds = heartbeat_seconds

    @_unary
    def Hello(
        self, request: owner_pb.OwnerHello, context: grpc.ServicerContext
    ) -> owner_pb.ProxyInfo:
        owner = self._caller(context, Role.OWNER)
        hello = serde.owner_hello_from_proto(request)
        self.coordinator.enroll(
            owner.node_id,
            {"claimed_node_id": hello.node_id, "software_version": hello.software_version},
        )
        return serde.proxy_info_to_proto(
            ProxyInfo(
                proxy_id=self.proxy_id,
                software_version=__version__,
                authenticated_node_id=owner.node_id,
                heartbeat_interval_seconds=self.heartbeat_seconds,
                max_message_bytes=channels.DEFAULT_MAX_MESSAGE_BYTES,
                server_time=datetime.now(UTC),
            )
        )

    @_streaming
    def StreamTasks(
        self, request: owner_pb.TaskStreamRequest, context: grpc.ServicerContext
    ) -> Iterator[owner_pb.TaskEvent]:
        owner = self._caller(context, Role.OWNER).node_id
        serde.task_stream_request_from_proto(request)  # informational node id only
        self.coordinator.enroll(owner)
        logger.info("task stream opened by owner %s", owner)
        coordinator = self.coordinator
        delivered: set[str] = set()
        # A heartbeat first tells the owner the stream is live.
        yield serde.task_event_to_proto(Heartbeat(sent_at=datetime.now(UTC)))
        next_beat = time.monotonic() + self.heartbeat_seconds
        while context.is_active() and not coordinator.stopping:
            version = coordinator.version
            tasks = coordinator.pending_tasks(owner)
            for task in tasks:
                if task.key not in delivered:
                    delivered.add(task.key)
                    yield serde.task_event_to_proto(task)
            open_ids = {task.key for task in tasks}
            answered = sorted(delivered - open_ids)
            for cancellation in coordinator.withdrawn_tasks(owner, answered):
                yield serde.task_event_to_proto(cancellation)
            delivered &= open_ids
            now = time.monotonic()
            if now >= next_beat:
                yield serde.task_event_to_proto(Heartbeat(sent_at=datetime.now(UTC)))
                next_beat = now + self.heartbeat_seconds
            coordinator.wait_for_change(version, max(0.0, next_beat - time.monotonic()))
        logger.info("task stream of owner %s closed", owner)

    @_unary
    def Upload(
        self, request_iterator: Iterable[owner_pb.UploadMessage], context: grpc.ServicerContext
    ) -> owner_pb.UploadReceipt:
        owner = self._caller(context, Role.OWNER).node_id
        messages = iter(request_iterator)
        first = next(messages, None)
        if first is None:
            raise ProtocolError("upload stream is empty (expected an UploadHeader)")
        header = serde.upload_header_from_message(first)
        # A late, foreign-key or wrongly shaped upload is refused before any chunk is
        # read; the header's layout equals the plan, so the assembler caps the size.
        upload = self.coordinator.begin_upload(owner, header)
        assembler = header.assembler()
        try:
            for message in messages:
                chunk = assembler.add(serde.upload_chunk_from_message(message))
                upload.add(chunk.offset, chunk.ciphertexts)
            assembler.finish()
            receipt = upload.complete()
        except BaseException:
            upload.abandon()
            raise
        return serde.upload_receipt_to_proto(
            UploadReceipt(
                query_id=header.query_id,
                upload_id=header.upload_id,
                status=(UploadStatus.DUPLICATE if receipt.duplicate else UploadStatus.ACCEPTED),
                chunks_received=assembler.chunks_received,
                ciphertexts_received=assembler.ciphertexts_received,
            )
        )

    @_unary
    def DeclineTask(
        self, request: owner_pb.TaskDecline, context: grpc.ServicerContext
    ) -> owner_pb.DeclineReceipt:
        owner = self._caller(context, Role.OWNER).node_id
        decline = serde.task_decline_from_proto(request)
        self.coordinator.decline(owner, decline.query_id, decline.reason.value, decline.detail)
        return serde.decline_receipt_to_proto(decline.query_id)


# ------------------------------------------------------------------ analysts
class AnalystServicer(_Base, analyst_grpc.AnalystServiceServicer):
    """AnalystService: submit, status (unary and streamed), result, budget.

    Parameters
    ----------
    coordinator : the domain logic.
    watch_poll_seconds : longest wait between status checks of a watch stream
        (changes wake it at once; this only bounds how soon a vanished client or
        a passed deadline is noticed).
    insecure : no TLS (see the module docstring).
    """

    def __init__(
        self, coordinator: Coordinator, watch_poll_seconds: float = 5.0, *, insecure: bool = False
    ) -> None:
        super().__init__(coordinator, insecure=insecure)
        self.watch_poll_seconds = watch_poll_seconds

    @_unary
    def SubmitQuery(
        self, request: analyst_pb.SubmitQueryRequest, context: grpc.ServicerContext
    ) -> analyst_pb.QueryStatus:
        analyst = self._caller(context, Role.ANALYST).node_id
        signed = serde.submit_query_request_from_proto(request)
        self.coordinator.submit(analyst, signed)
        return serde.query_status_to_proto(self.coordinator.status(analyst, signed.spec.query_id))

    @_unary
    def GetQueryStatus(
        self, request: analyst_pb.QueryRef, context: grpc.ServicerContext
    ) -> analyst_pb.QueryStatus:
        analyst = self._caller(context, Role.ANALYST).node_id
        query_id = serde.query_ref_from_proto(request)
        return serde.query_status_to_proto(self.coordinator.status(analyst, query_id))

    @_streaming
    def WatchQueryStatus(
        self, request: analyst_pb.QueryRef, context: grpc.ServicerContext
    ) -> Iterator[analyst_pb.QueryStatus]:
        analyst = self._caller(context, Role.ANALYST).node_id
        query_id = serde.query_ref_from_proto(request)
        coordinator = self.coordinator
        last: QueryStatus | None = None
        while context.is_active() and not coordinator.stopping:
            version = coordinator.version
            status = coordinator.status(analyst, query_id)
            if status != last:
                yield serde.query_status_to_proto(status)
                last = status
            if status.terminal:
                return
            coordinator.wait_for_change(version, self.watch_poll_seconds)
        if coordinator.stopping:
            # Shutting down before the query ended. A clean end of the stream would
            # read as "nothing more to come" (the client then asks for the status once,
            # finds no proxy and gives up); UNAVAILABLE makes it reconnect to the
            # restarted proxy and keep watching, as after a crash.
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details("the proxy is shutting down; reconnect to keep watching")

    @_streaming
    def FetchResult(
        self, request: analyst_pb.QueryRef, context: grpc.ServicerContext
    ) -> Iterator[analyst_pb.ResultMessage]:
        analyst = self._caller(context, Role.ANALYST).node_id
        query_id = serde.query_ref_from_proto(request)
        result = self.coordinator.result(analyst, query_id)
        logger.info("result of query %s fetched by %s", query_id, analyst)
        yield from serde.encode_result(result)

    @_unary
    def GetBudget(
        self, request: analyst_pb.BudgetRequest, context: grpc.ServicerContext
    ) -> analyst_pb.BudgetStatus:
        analyst = self._caller(context, Role.ANALYST).node_id
        delta = serde.budget_request_from_proto(request)
        return serde.budget_status_to_proto(self.coordinator.budget(analyst, delta))


# ------------------------------------------------------------- registration
class _Undecodable:
    """Stands in for a request whose bytes are not a valid protobuf message."""

    def __init__(self, message_type: str, error: Exception) -> None:
        self.message_type = message_type
        self.error = error

    def protocol_error(self) -> ProtocolError:
        return ProtocolError(f"request is not a valid {self.message_type} message: {self.error}")


def _lenient(deserialize: Callable[[bytes], Any], message_type: str) -> Callable[[bytes], Any]:
    # grpc answers a deserializer's exception with INTERNAL before any servicer runs;
    # deferring the failure lets it become a precise INVALID_ARGUMENT instead.
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as error:  # protobuf raises DecodeError, and others on garbage
            return _Undecodable(message_type, error)

    return parse


def _checked(requests: Iterable[Any]) -> Iterator[Any]:
    for request in requests:
        if isinstance(request, _Undecodable):
            raise request.protocol_error()  # the servicer maps it to INVALID_ARGUMENT
        yield request


def _guard(handler: Any, method: str) -> Any:
    """The same handler, with undecodable requests refused as INVALID_ARGUMENT."""
    deserialize = handler.request_deserializer
    # Generated handlers deserialize with the bound classmethod <Message>.FromString.
    message_type = getattr(getattr(deserialize, "__self__", None), "__name__", "request")
    lenient = _lenient(deserialize, message_type)
    if handler.request_streaming:
        field = "stream_stream" if handler.response_streaming else "stream_unary"
        behaviour = getattr(handler, field)

        def streamed(requests: Iterable[Any], context: grpc.ServicerContext) -> Any:
            return behaviour(_checked(requests), context)

        return handler._replace(request_deserializer=lenient, **{field: streamed})
    field = "unary_stream" if handler.response_streaming else "unary_unary"
    behaviour = getattr(handler, field)

    def single(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            _refuse(context, method, request.protocol_error())
        return behaviour(request, context)

    return handler._replace(request_deserializer=lenient, **{field: single})


class _LenientRegistration:
    """The ``server`` argument of the generated ``add_*_to_server`` functions.

    It receives the generated method handlers and registers guarded copies on the
    real server, so the generated code stays the single description of each service.
    """

    def __init__(self, server: grpc.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Ignored: the registered handlers below carry the same methods."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        guarded = {name: _guard(handler, name) for name, handler in handlers.items()}
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, guarded),)
        )
        self._server.add_registered_method_handlers(service, guarded)


def register_services(server: grpc.Server, owner: OwnerServicer, analyst: AnalystServicer) -> None:
    """Serve both services on ``server``, refusing undecodable requests precisely."""
    registration: Any = _LenientRegistration(server)
    owner_grpc.add_OwnerServiceServicer_to_server(owner, registration)
    analyst_grpc.add_AnalystServiceServicer_to_server(analyst, registration)
