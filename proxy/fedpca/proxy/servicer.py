"""The proxy's gRPC servicers: translate, call the coordinator, map errors. Nothing else.

The servicers run on gRPC's asynchronous server (:mod:`grpc.aio`): an open task stream
or status watch is a coroutine waiting for a change, not a thread, so a thousand
connected owners cost no threads, and no peer can exhaust a thread pool by opening
streams. The coordinator and its store are synchronous; every call into them runs on a
bounded pool of worker threads (:class:`WorkerPool`). Per-peer bounds
(:mod:`fedpca.proxy.limits`) are checked before any work, and a call beyond one is
answered RESOURCE_EXHAUSTED at once.

Every message is translated by :mod:`fedpca.transport.serde`; every decision is the
:class:`~fedpca.proxy.coordinator.Coordinator`'s. The caller's identity and role come
only from its verified client certificate (:func:`fedpca.transport.certs.require_role`,
which also refuses revoked certificates): OwnerService methods require the owner role,
AnalystService methods the analyst role.

Domain errors become status codes here and nowhere else:

==========================================================  ======================
error                                                       status
==========================================================  ======================
NotFoundError                                               NOT_FOUND
BudgetExceededError, OverloadError                          RESOURCE_EXHAUSTED
AuthenticationError, PolicyError, UntrustedKeyError         PERMISSION_DENIED
QueryStateError                                             FAILED_PRECONDITION
UploadTimeoutError                                          DEADLINE_EXCEEDED
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

import asyncio
import contextlib
import functools
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, NoReturn, TypeVar

import grpc
from grpc import aio

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
    SHARE_RELEASED_METADATA,
    ChunkAssembler,
    ChunkChain,
    Heartbeat,
    ProxyInfo,
    QueryStatus,
    UploadHeader,
    UploadReceipt,
    UploadStatus,
)
from fedpca.proxy import catalog
from fedpca.proxy.coordinator import Coordinator
from fedpca.proxy.limits import OverloadError, PeerLimits, PeerSlots, TaskStreams
from fedpca.proxy.store_records import UploadCompletion
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
    "ChangeFeed",
    "OwnerServicer",
    "UploadTimeoutError",
    "WorkerPool",
    "register_services",
    "status_code_for",
]

logger = logging.getLogger(__name__)

INSECURE_ANALYST_ID = "insecure-analyst"
"""Analyst id in insecure mode when the caller sends no ``fedpca-node-id``."""

_T = TypeVar("_T")


class UploadTimeoutError(FedpcaError, TimeoutError):
    """An upload stalled longer than the proxy's idle or total upload time."""


_STATUS_CODES: tuple[
    tuple[type[BaseException] | tuple[type[BaseException], ...], grpc.StatusCode], ...
]
_STATUS_CODES = (
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    # Before the permission errors: BudgetExceededError is also a PermissionError.
    ((BudgetExceededError, OverloadError), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ((AuthenticationError, PolicyError, UntrustedKeyError), grpc.StatusCode.PERMISSION_DENIED),
    (QueryStateError, grpc.StatusCode.FAILED_PRECONDITION),
    (UploadTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def status_code_for(error: FedpcaError) -> grpc.StatusCode:
    """The gRPC status a domain error is reported with (see the module table)."""
    for kinds, code in _STATUS_CODES:
        if isinstance(error, kinds):
            return code
    # ProtocolError, LayoutError, CiphertextError, ConfigError, EncodingOverflowError,
    # CalibrationError, KeyFileError, DataError: the request itself is at fault.
    return grpc.StatusCode.INVALID_ARGUMENT


async def _refuse(context: aio.ServicerContext, method: str, error: BaseException) -> NoReturn:
    if isinstance(error, FedpcaError):
        code = status_code_for(error)
        logger.warning("%s refused (%s): %s", method, code.name, error)
        await context.abort(code, str(error))
    elif isinstance(error, grpc.RpcError | aio.AioRpcError):
        # Reading the request stream failed: the client cancelled or the connection
        # dropped mid-stream. Routine on a network; nobody is left to answer.
        logger.warning("%s ended: the client's request stream broke off", method)
        await context.abort(grpc.StatusCode.CANCELLED, "the request stream broke off")
    else:
        # Internal details (paths, values) stay in the log, not in the reply.
        logger.error("%s failed unexpectedly", method, exc_info=error)
        await context.abort(grpc.StatusCode.INTERNAL, "internal error in the proxy; see its log")
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _unary(method: _Method) -> _Method:
    """Map errors of a unary-response coroutine to status codes."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except asyncio.CancelledError:
            raise
        except aio.AbortError:
            raise
        except BaseException as error:
            await _refuse(context, method.__name__, error)

    return wrapper  # type: ignore[return-value]


def _streaming(method: _Method) -> _Method:
    """Map errors of a server-streaming method (an async generator) to status codes."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for message in method(self, request, context):
                yield message
        except asyncio.CancelledError:
            raise
        except aio.AbortError:
            raise
        except BaseException as error:
            await _refuse(context, method.__name__, error)

    return wrapper  # type: ignore[return-value]


class WorkerPool:
    """Runs the coordinator's blocking calls off the event loop, with a bounded backlog.

    A call beyond ``limits.max_pending_work`` waiting jobs is refused with
    :class:`OverloadError` instead of queueing without end.
    """

    def __init__(self, limits: PeerLimits) -> None:
        self._executor = ThreadPoolExecutor(
            max_workers=limits.worker_threads, thread_name_prefix="fedpca-proxy-work"
        )
        self._limit = limits.max_pending_work
        self._pending = 0
        self._lock = threading.Lock()

    async def run(self, function: Callable[..., _T], *args: Any) -> _T:
        with self._lock:
            if self._pending >= self._limit:
                raise OverloadError(
                    f"the proxy has {self._pending} calls waiting for a worker; try again later"
                )
            self._pending += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, functools.partial(function, *args))
        finally:
            with self._lock:
                self._pending -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


class ChangeFeed:
    """The coordinator's change notifications, awaited on the event loop.

    The coordinator calls :meth:`notify` from any thread whenever a query changes; a
    coroutine takes :attr:`event` *before* it reads the state it reacts to and then
    awaits it, so a change between the read and the wait is never missed.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.event = asyncio.Event()

    def notify(self) -> None:
        # A closed loop raises RuntimeError: then nothing is waiting any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        self.event.set()
        self.event = asyncio.Event()

    @staticmethod
    async def wait(event: asyncio.Event, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)


_PEER_RE = re.compile(r"[^A-Za-z0-9._-]+")


class _Base:
    def __init__(
        self,
        coordinator: Coordinator,
        work: WorkerPool,
        feed: ChangeFeed,
        slots: PeerSlots,
        limits: PeerLimits,
        *,
        insecure: bool = False,
    ) -> None:
        self.coordinator = coordinator
        self.work = work
        self.feed = feed
        self.slots = slots
        self.limits = limits
        self.insecure = insecure

    def _caller(self, context: aio.ServicerContext, role: Role) -> NodeIdentity:
        identity = self._identity(context, role)
        if role is Role.OWNER:
            # Before anything else of the call (an upload's first message included): an
            # owner off the allow-list holds no slot and waits for nothing.
            self.coordinator.require_owner(identity.node_id)
        return identity

    def _identity(self, context: aio.ServicerContext, role: Role) -> NodeIdentity:
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

    def _call_slot(self, peer: NodeIdentity) -> _Slot:
        return _Slot(self.slots, "calls", str(peer), self.limits.max_calls_per_peer)


class _Slot:
    """One per-peer slot held for the duration of a ``with`` block."""

    def __init__(self, slots: PeerSlots, kind: str, peer: str, limit: int) -> None:
        self._slots, self._kind, self._peer = slots, kind, peer
        slots.acquire(kind, peer, limit)

    def __enter__(self) -> _Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self._slots.release(self._kind, self._peer)


# ------------------------------------------------------------------- owners
class OwnerServicer(_Base, owner_grpc.OwnerServiceServicer):
    """OwnerService: hello, the long-lived task stream, uploads, declines.

    Parameters
    ----------
    proxy_id : this proxy's node id (reported in ProxyInfo).
    heartbeat_seconds : interval of heartbeats on the task stream.
    The others as for every servicer: the coordinator, the worker pool, the change
    feed, the per-peer slots and limits, and the insecure switch.
    """

    def __init__(self, *args: Any, proxy_id: str, heartbeat_seconds: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.proxy_id = proxy_id
        self.heartbeat_seconds = heartbeat_seconds
        self.streams = TaskStreams()

    @_unary
    async def Hello(
        self, request: owner_pb.OwnerHello, context: aio.ServicerContext
    ) -> owner_pb.ProxyInfo:
        owner = self._caller(context, Role.OWNER)
        with self._call_slot(owner):
            hello = serde.owner_hello_from_proto(request)
            await self.work.run(
                self.coordinator.enroll,
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
    async def StreamTasks(
        self, request: owner_pb.TaskStreamRequest, context: aio.ServicerContext
    ) -> AsyncIterator[owner_pb.TaskEvent]:
        owner = self._caller(context, Role.OWNER).node_id
        serde.task_stream_request_from_proto(request)  # informational node id only
        await self.work.run(self.coordinator.enroll, owner)
        # One stream per owner: this one supersedes any older one, which ends.
        generation = self.streams.open(owner)
        self.feed.notify()
        logger.info("task stream opened by owner %s", owner)
        coordinator = self.coordinator
        delivered: set[str] = set()
        try:
            # A heartbeat first tells the owner the stream is live.
            yield serde.task_event_to_proto(Heartbeat(sent_at=datetime.now(UTC)))
            next_beat = time.monotonic() + self.heartbeat_seconds
            while not coordinator.stopping and self.streams.is_current(owner, generation):
                changed = self.feed.event
                tasks = await self.work.run(coordinator.pending_tasks, owner)
                for task in tasks:
                    if task.key not in delivered:
                        delivered.add(task.key)
                        yield serde.task_event_to_proto(task)
                open_ids = {task.key for task in tasks}
                answered = sorted(delivered - open_ids)
                if answered:
                    for cancellation in await self.work.run(
                        coordinator.withdrawn_tasks, owner, answered
                    ):
                        yield serde.task_event_to_proto(cancellation)
                delivered &= open_ids
                now = time.monotonic()
                if now >= next_beat:
                    yield serde.task_event_to_proto(Heartbeat(sent_at=datetime.now(UTC)))
                    next_beat = now + self.heartbeat_seconds
                await ChangeFeed.wait(changed, max(0.0, next_beat - time.monotonic()))
        finally:
            self.streams.close(owner, generation)
        if not self.streams.is_current(owner, generation) and not coordinator.stopping:
            logger.info("task stream of owner %s replaced by a newer one", owner)
        else:
            logger.info("task stream of owner %s closed", owner)

    @_unary
    async def Upload(
        self, request_iterator: AsyncIterator[Any], context: aio.ServicerContext
    ) -> owner_pb.UploadReceipt:
        owner = self._caller(context, Role.OWNER).node_id
        with _Slot(self.slots, "uploads", owner, self.limits.max_uploads_per_owner):
            deadline = time.monotonic() + self.limits.upload_total_seconds
            messages = aiter(request_iterator)
            first = await self._next(messages, deadline)
            if first is None:
                raise ProtocolError("upload stream is empty (expected an UploadHeader)")
            header = serde.upload_header_from_message(first)
            try:
                receipt, assembler = await self._receive(owner, header, messages, deadline)
            except QueryStateError:
                # The query ended or no longer takes this owner: say whether any result
                # can hold this owner's share, so that it may refund its reservation.
                released = await self.work.run(
                    self.coordinator.share_released, header.query_id, owner
                )
                if not released:
                    context.set_trailing_metadata(((SHARE_RELEASED_METADATA, "no"),))
                raise
        return serde.upload_receipt_to_proto(
            UploadReceipt(
                query_id=header.query_id,
                upload_id=header.upload_id,
                status=UploadStatus.DUPLICATE if receipt.duplicate else UploadStatus.ACCEPTED,
                chunks_received=assembler.chunks_received,
                ciphertexts_received=assembler.ciphertexts_received,
            )
        )

    async def _receive(
        self, owner: str, header: UploadHeader, messages: AsyncIterator[Any], deadline: float
    ) -> tuple[UploadCompletion, ChunkAssembler]:
        # A foreign-key or wrongly shaped upload, or one from an owner the query no
        # longer takes, is refused before any chunk is read; the header's layout equals
        # the plan, so the assembler caps the size.
        upload = await self.work.run(self.coordinator.begin_upload, owner, header)
        assembler = header.assembler()
        # The fold of one chunk (a durable write) overlaps reading the next one.
        folding: asyncio.Future[None] | None = None
        try:
            while (message := await self._next(messages, deadline)) is not None:
                chunk = assembler.add(serde.upload_chunk_from_message(message))
                if folding is not None:
                    await folding
                folding = asyncio.ensure_future(self.work.run(upload.add, chunk))
            if folding is not None:
                await folding
                folding = None
            assembler.finish()
            receipt = await self.work.run(upload.complete, assembler.content_sha256)
        except BaseException:
            if folding is not None:
                await asyncio.gather(folding, return_exceptions=True)
            await asyncio.shield(self.work.run(upload.abandon))
            raise
        return receipt, assembler

    async def _next(self, messages: AsyncIterator[Any], deadline: float) -> Any:
        """The next upload message, None at the end; bounded by the idle and total times."""
        left = deadline - time.monotonic()
        timeout = min(self.limits.upload_idle_seconds, left)
        if timeout <= 0:
            raise UploadTimeoutError(
                f"the upload took longer than {self.limits.upload_total_seconds:g} s"
            )
        try:
            return await asyncio.wait_for(anext(messages), timeout)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise UploadTimeoutError(
                f"no upload message for {timeout:g} s (limits.upload_idle_seconds = "
                f"{self.limits.upload_idle_seconds:g}, upload_total_seconds = "
                f"{self.limits.upload_total_seconds:g})"
            ) from None

    @_unary
    async def DeclineTask(
        self, request: owner_pb.TaskDecline, context: aio.ServicerContext
    ) -> owner_pb.DeclineReceipt:
        owner = self._caller(context, Role.OWNER)
        with self._call_slot(owner):
            decline = serde.task_decline_from_proto(request)
            await self.work.run(
                self.coordinator.decline,
                owner.node_id,
                decline.query_id,
                decline.reason.value,
                decline.detail,
            )
            return serde.decline_receipt_to_proto(decline.query_id)


# ------------------------------------------------------------------ analysts
class AnalystServicer(_Base, analyst_grpc.AnalystServiceServicer):
    """AnalystService: submit, status (unary and streamed), result, budget, the
    deployment's public facts, the analyst's query list and cancellation.

    Parameters
    ----------
    proxy_id : this proxy's node id (reported by DescribeDeployment).
    task_streams : the owners' open task streams (the OwnerServicer's), for the
        number of connected owners.
    watch_poll_seconds : longest wait between status checks of a watch stream
        (changes wake it at once; this only bounds how soon a passed deadline is
        noticed).
    """

    def __init__(
        self,
        *args: Any,
        watch_poll_seconds: float = 5.0,
        proxy_id: str = "proxy",
        task_streams: TaskStreams | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.watch_poll_seconds = watch_poll_seconds
        self.proxy_id = proxy_id
        self.task_streams = task_streams if task_streams is not None else TaskStreams()

    @_unary
    async def SubmitQuery(
        self, request: analyst_pb.SubmitQueryRequest, context: aio.ServicerContext
    ) -> analyst_pb.QueryStatus:
        analyst = self._caller(context, Role.ANALYST)
        with self._call_slot(analyst):
            signed = serde.submit_query_request_from_proto(request)
            await self.work.run(self.coordinator.submit, analyst.node_id, signed)
            status = await self.work.run(
                self.coordinator.status, analyst.node_id, signed.spec.query_id
            )
            return serde.query_status_to_proto(status)

    @_unary
    async def GetQueryStatus(
        self, request: analyst_pb.QueryRef, context: aio.ServicerContext
    ) -> analyst_pb.QueryStatus:
        analyst = self._caller(context, Role.ANALYST)
        with self._call_slot(analyst):
            query_id = serde.query_ref_from_proto(request)
            status = await self.work.run(self.coordinator.status, analyst.node_id, query_id)
            return serde.query_status_to_proto(status)

    @_streaming
    async def WatchQueryStatus(
        self, request: analyst_pb.QueryRef, context: aio.ServicerContext
    ) -> AsyncIterator[analyst_pb.QueryStatus]:
        analyst = self._caller(context, Role.ANALYST).node_id
        query_id = serde.query_ref_from_proto(request)
        coordinator = self.coordinator
        with _Slot(self.slots, "watches", analyst, self.limits.max_watches_per_analyst):
            last: QueryStatus | None = None
            while not coordinator.stopping:
                changed = self.feed.event
                status = await self.work.run(coordinator.status, analyst, query_id)
                if status != last:
                    yield serde.query_status_to_proto(status)
                    last = status
                if status.terminal:
                    return
                await ChangeFeed.wait(changed, self.watch_poll_seconds)
        # Shutting down before the query ended. A clean end of the stream would read as
        # "nothing more to come" (the client then asks for the status once, finds no
        # proxy and gives up); UNAVAILABLE makes it reconnect to the restarted proxy.
        await context.abort(
            grpc.StatusCode.UNAVAILABLE, "the proxy is shutting down; reconnect to keep watching"
        )

    @_streaming
    async def FetchResult(
        self, request: analyst_pb.QueryRef, context: aio.ServicerContext
    ) -> AsyncIterator[analyst_pb.ResultMessage]:
        """The result header (once the contributors are fixed; refused before), then
        every page the moment it is final (the analyst decrypts while later pages are
        being folded)."""
        analyst = self._caller(context, Role.ANALYST).node_id
        query_id = serde.query_ref_from_proto(request)
        coordinator = self.coordinator
        with _Slot(self.slots, "watches", analyst, self.limits.max_watches_per_analyst):
            header = await self.work.run(coordinator.result_header, analyst, query_id)
            yield serde.result_header_message(header)
            chain = ChunkChain()
            sent = 0
            while sent < header.total_chunks:
                changed = self.feed.event
                pages = await self.work.run(coordinator.result_pages, analyst, query_id, sent)
                for data in pages:
                    yield serde.result_chunk_message(chain.next(data))
                    sent += 1
                if sent < header.total_chunks and not pages:
                    if coordinator.stopping:
                        await context.abort(
                            grpc.StatusCode.UNAVAILABLE,
                            "the proxy is shutting down; fetch again after it restarts",
                        )
                    await ChangeFeed.wait(changed, self.watch_poll_seconds)
            logger.info("result of query %s fetched by %s", query_id, analyst)

    @_unary
    async def GetBudget(
        self, request: analyst_pb.BudgetRequest, context: aio.ServicerContext
    ) -> analyst_pb.BudgetStatus:
        analyst = self._caller(context, Role.ANALYST)
        with self._call_slot(analyst):
            delta = serde.budget_request_from_proto(request)
            status = await self.work.run(self.coordinator.budget, analyst.node_id, delta)
            return serde.budget_status_to_proto(status)

    @_unary
    async def DescribeDeployment(
        self, request: analyst_pb.DescribeDeploymentRequest, context: aio.ServicerContext
    ) -> analyst_pb.DeploymentInfo:
        analyst = self._caller(context, Role.ANALYST)
        with self._call_slot(analyst):
            info = catalog.describe_deployment(
                self.coordinator,
                analyst.node_id,
                proxy_id=self.proxy_id,
                owners_connected=self.task_streams.connected(),
            )
            return serde.deployment_info_to_proto(info)

    @_unary
    async def ListQueries(
        self, request: analyst_pb.ListQueriesRequest, context: aio.ServicerContext
    ) -> analyst_pb.QueryList:
        analyst = self._caller(context, Role.ANALYST)
        with self._call_slot(analyst):
            limit = serde.list_queries_request_from_proto(request)
            queries = await self.work.run(
                catalog.list_queries, self.coordinator, analyst.node_id, limit
            )
            return serde.query_list_to_proto(queries)

    @_unary
    async def CancelQuery(
        self, request: analyst_pb.QueryRef, context: aio.ServicerContext
    ) -> analyst_pb.CancelReceipt:
        analyst = self._caller(context, Role.ANALYST)
        with self._call_slot(analyst):
            query_id = serde.query_ref_from_proto(request)
            receipt = await self.work.run(self.coordinator.cancel, analyst.node_id, query_id)
            return serde.cancel_receipt_to_proto(receipt)


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


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
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
        if handler.response_streaming:
            both = handler.stream_stream

            async def streams(
                requests: AsyncIterator[Any], context: aio.ServicerContext
            ) -> AsyncIterator[Any]:
                async for message in both(_checked(requests), context):
                    yield message

            return handler._replace(request_deserializer=lenient, stream_stream=streams)
        collect = handler.stream_unary

        async def streamed(requests: AsyncIterator[Any], context: aio.ServicerContext) -> Any:
            return await collect(_checked(requests), context)

        return handler._replace(request_deserializer=lenient, stream_unary=streamed)
    if handler.response_streaming:
        behaviour = handler.unary_stream

        async def single_stream(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await _refuse(context, method, request.protocol_error())
            async for message in behaviour(request, context):
                yield message

        return handler._replace(request_deserializer=lenient, unary_stream=single_stream)
    behaviour = handler.unary_unary

    async def single(request: Any, context: aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await _refuse(context, method, request.protocol_error())
        return await behaviour(request, context)

    return handler._replace(request_deserializer=lenient, unary_unary=single)


class _LenientRegistration:
    """The ``server`` argument of the generated ``add_*_to_server`` functions.

    It receives the generated method handlers and registers guarded copies on the
    real server, so the generated code stays the single description of each service.
    """

    def __init__(self, server: aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Ignored: the registered handlers below carry the same methods."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        guarded = {name: _guard(handler, name) for name, handler in handlers.items()}
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, guarded),)
        )


def register_services(server: aio.Server, owner: OwnerServicer, analyst: AnalystServicer) -> None:
    """Serve both services on ``server``, refusing undecodable requests precisely."""
    registration: Any = _LenientRegistration(server)
    owner_grpc.add_OwnerServiceServicer_to_server(owner, registration)
    analyst_grpc.add_AnalystServiceServicer_to_server(analyst, registration)
