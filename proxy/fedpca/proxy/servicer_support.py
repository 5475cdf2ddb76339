"""What the proxy's servicers stand on: domain errors mapped to gRPC status codes, the
bounded worker pool that runs the synchronous coordinator off the event loop, the
coordinator's change feed on the loop, the caller's identity and per-peer call slots,
and a registration that answers undecodable requests with INVALID_ARGUMENT.

The servicers themselves, and the full table of status codes, are in
:mod:`fedpca.proxy.servicer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import re
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from typing import Any, TypeVar

import grpc
from grpc import aio

from fedpca.errors import (
    AuthenticationError,
    BudgetExceededError,
    FedpcaError,
    NotFoundError,
    OverloadError,
    PolicyError,
    ProtocolError,
    ProtocolVersionError,
    QueryStateError,
    UntrustedKeyError,
)
from fedpca.messages import REFUSAL_METADATA, Refusal
from fedpca.proxy.coordinator import Coordinator
from fedpca.proxy.limits import REPEATED_REFUSAL_SECONDS, PeerLimits, PeerSlots, RefusalLog
from fedpca.proxy.store_database import storage_unavailable
from fedpca.transport import certs
from fedpca.transport.certs import NodeIdentity, Role
from fedpca.transport.channels import INSECURE_IDENTITY_METADATA, PROTOCOL_VERSION_METADATA
from fedpca.version import check_peer_protocol

__all__ = [
    "CALLER",
    "INSECURE_ANALYST_ID",
    "ChangeFeed",
    "LenientRegistration",
    "PeerSlot",
    "RequestTimeoutError",
    "ServicerBase",
    "WorkerPool",
    "refuse",
    "status_code_for",
    "streaming_errors",
    "unary_errors",
]

logger = logging.getLogger("fedpca.proxy.servicer")

INSECURE_ANALYST_ID = "insecure-analyst"
"""Analyst id in insecure mode when the caller sends no ``fedpca-node-id``."""

_T = TypeVar("_T")


class RequestTimeoutError(FedpcaError, TimeoutError):
    """A peer's request stream stalled longer than the proxy allows (an upload's idle or
    total time, or ``limits.request_read_seconds`` for a call's one request)."""


_STATUS_CODES: tuple[
    tuple[type[BaseException] | tuple[type[BaseException], ...], grpc.StatusCode], ...
]
_STATUS_CODES = (
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    # Before the permission errors: BudgetExceededError is also a PermissionError.
    ((BudgetExceededError, OverloadError), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ((AuthenticationError, PolicyError, UntrustedKeyError), grpc.StatusCode.PERMISSION_DENIED),
    (QueryStateError, grpc.StatusCode.FAILED_PRECONDITION),
    (RequestTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def status_code_for(error: FedpcaError) -> grpc.StatusCode:
    """The gRPC status a domain error is reported with (see the module table)."""
    for kinds, code in _STATUS_CODES:
        if isinstance(error, kinds):
            return code
    # ProtocolError, LayoutError, CiphertextError, ConfigError, EncodingOverflowError,
    # CalibrationError, KeyFileError, DataError: the request itself is at fault.
    return grpc.StatusCode.INVALID_ARGUMENT


MAX_REFUSAL_TEXT = 2000
"""Characters of a refusal's message kept in the log line and the status details."""


def _answer(
    context: aio.ServicerContext,
    code: grpc.StatusCode,
    text: str,
    trailing: tuple[tuple[str, str], ...] = (),
) -> None:
    # Not context.abort: grpc keeps the AbortError it raises on the call's state, and its
    # traceback holds the handler frames (the request, the context, which holds the
    # state): a reference cycle that kept every refused request, 8 MiB each, alive until
    # the cyclic garbage collector ran (review: 7 GiB from one owner's refused Hellos).
    context.set_code(code)
    context.set_details(text)
    if trailing:
        context.set_trailing_metadata(trailing)


def _log_refusal(
    refusals: RefusalLog, method: str, level: int, message: str, *args: Any, **kwargs: Any
) -> None:
    logged, summaries = refusals.admit(method)
    for summary in summaries:
        logger.warning("%s", summary)
    if logged:
        logger.log(level, message, *args, **kwargs)


async def refuse(
    context: aio.ServicerContext,
    method: str,
    error: Exception,
    refusals: RefusalLog,
    repeated: RefusalLog | None = None,
) -> None:
    """Answer a failed call with its status (and log it, within ``refusals``' bounds).

    ``repeated`` bounds the lines of refusals a peer repeats at every reconnection
    (another wire protocol version): one line per peer and method in its window.
    """
    if isinstance(error, FedpcaError):
        code = status_code_for(error)
        # Cut: a refusal may quote what a peer sent, and refusals are logged.
        text = str(error)
        if len(text) > MAX_REFUSAL_TEXT:
            text = text[:MAX_REFUSAL_TEXT] + f"... ({len(text)} characters)"
        if repeated is not None and isinstance(error, ProtocolVersionError):
            log, key = repeated, f"{method} by {error.peer}"
        else:
            log, key = refusals, method
        _log_refusal(log, key, logging.WARNING, "%s refused (%s): %s", method, code.name, text)
        trailing: tuple[tuple[str, str], ...] = ()
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            refusal = Refusal.BUDGET if isinstance(error, BudgetExceededError) else Refusal.OVERLOAD
            trailing = ((REFUSAL_METADATA, refusal.value),)
        _answer(context, code, text, trailing)
    elif isinstance(error, grpc.RpcError | aio.AioRpcError):
        # Reading the request stream failed: the client cancelled or the connection
        # dropped mid-stream. Routine on a network; nobody is left to answer.
        _log_refusal(
            refusals,
            method,
            logging.WARNING,
            "%s ended: the client's request stream broke off",
            method,
        )
        _answer(context, grpc.StatusCode.CANCELLED, "the request stream broke off")
    elif storage_unavailable(error):
        # The transaction rolled back: nothing was half written, and the same call
        # (an upload resumes after its mark) goes through once the storage is back.
        _log_refusal(
            refusals,
            method,
            logging.ERROR,
            "%s failed: the proxy's database is unavailable: %s",
            method,
            error,
        )
        _answer(
            context,
            grpc.StatusCode.UNAVAILABLE,
            "the proxy's database is unavailable for now (locked, full or failing); "
            "this step was not recorded, retry later",
        )
    else:
        # Internal details (paths, values) stay in the log, not in the reply.
        _log_refusal(
            refusals, method, logging.ERROR, "%s failed unexpectedly", method, exc_info=error
        )
        _answer(context, grpc.StatusCode.INTERNAL, "internal error in the proxy; see its log")


_Method = TypeVar("_Method", bound=Callable[..., Any])


def unary_errors(method: _Method) -> _Method:
    """Map errors of a unary-response coroutine to status codes."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except asyncio.CancelledError:
            raise
        except aio.AbortError:
            raise
        except Exception as error:
            await refuse(
                context, method.__name__, error, self.refusal_log, self.repeated_refusal_log
            )
            return None

    return wrapper  # type: ignore[return-value]


def streaming_errors(method: _Method) -> _Method:
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
        except Exception as error:
            # Not BaseException: the GeneratorExit of a stream the client cancelled
            # must close the generator, not be reported as a failure of the call.
            await refuse(
                context, method.__name__, error, self.refusal_log, self.repeated_refusal_log
            )
            return

    return wrapper  # type: ignore[return-value]


CALLER: ContextVar[str | None] = ContextVar("fedpca_proxy_caller", default=None)
"""The peer a call's handler serves (set by :meth:`ServicerBase._caller`), read by
:class:`WorkerPool` to take that peer's turn; None outside a call."""


class WorkerPool:
    """Runs the coordinator's blocking calls off the event loop, with a bounded backlog.

    A call beyond ``limits.max_pending_work`` waiting jobs is refused with
    :class:`OverloadError` instead of queueing without end. At most
    ``limits.max_worker_jobs_per_peer`` jobs of the calling peer (:data:`CALLER`), and
    never more than half the threads, are on the threads at once; its further jobs wait
    on the event loop, so that the other peers' jobs find a free thread.
    """

    def __init__(self, limits: PeerLimits) -> None:
        self._executor = ThreadPoolExecutor(
            max_workers=limits.worker_threads, thread_name_prefix="fedpca-proxy-work"
        )
        self._limit = limits.max_pending_work
        self._per_peer = max(1, min(limits.max_worker_jobs_per_peer, limits.worker_threads // 2))
        self._pending = 0
        self._lock = threading.Lock()
        # Peer -> (its turns, jobs holding or awaiting one); touched on the loop only.
        self._turns: dict[str, tuple[asyncio.Semaphore, int]] = {}

    async def run(self, function: Callable[..., _T], *args: Any) -> _T:
        with self._lock:
            if self._pending >= self._limit:
                raise OverloadError(
                    f"the proxy has {self._pending} calls waiting for a worker; try again later"
                )
            self._pending += 1
        peer = CALLER.get()
        try:
            if peer is None:
                return await self._on_a_thread(function, *args)
            turns, users = self._turns.get(peer) or (asyncio.Semaphore(self._per_peer), 0)
            self._turns[peer] = (turns, users + 1)
            try:
                async with turns:
                    return await self._on_a_thread(function, *args)
            finally:
                turns, users = self._turns[peer]
                if users == 1:
                    del self._turns[peer]
                else:
                    self._turns[peer] = (turns, users - 1)
        finally:
            with self._lock:
                self._pending -= 1

    async def _on_a_thread(self, function: Callable[..., _T], *args: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(function, *args))

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
    async def wait(event: asyncio.Event, timeout: float, also: asyncio.Event | None = None) -> None:
        """Until ``event`` (or ``also``, if given) is set, or ``timeout`` seconds pass."""
        if also is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout)
            return
        waiters = [asyncio.ensure_future(e.wait()) for e in (event, also)]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()


_PEER_RE = re.compile(r"[^A-Za-z0-9._-]+")


class ServicerBase:
    """What both servicers hold: the coordinator, the worker pool, the change feed, the
    per-peer slots and limits, and the insecure switch; and how they know the caller."""

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
        self.refusal_log = RefusalLog(limits.logged_refusals_per_minute)
        # Per peer only where a certificate names the peer: in insecure mode a caller
        # names itself, and made-up names would each get a line (and a counter).
        self.repeated_refusal_log = (
            None if insecure else RefusalLog(1, REPEATED_REFUSAL_SECONDS, per="peer and method")
        )

    def _caller(self, context: aio.ServicerContext, role: Role) -> NodeIdentity:
        identity = self._identity(context, role)
        # A peer of another wire protocol is refused at its first call (an owner's Hello),
        # naming both versions, in the proxy's log as well as the peer's.
        stated = dict(context.invocation_metadata() or ()).get(PROTOCOL_VERSION_METADATA)
        check_peer_protocol(str(identity), stated, "this proxy")
        # Before anything else of the call (an upload's first message included): a peer
        # off its allow-list holds no slot and waits for nothing.
        if role is Role.OWNER:
            self.coordinator.require_owner(identity.node_id)
        elif role is Role.ANALYST:
            self.coordinator.require_analyst(identity.node_id)
        CALLER.set(str(identity))  # the worker pool's turns are per peer
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

    def _call_slot(self, peer: NodeIdentity) -> PeerSlot:
        return PeerSlot(self.slots, "calls", str(peer), self.limits.max_calls_per_peer)


class PeerSlot:
    """One per-peer slot held for the duration of a ``with`` block."""

    def __init__(self, slots: PeerSlots, kind: str, peer: str, limit: int) -> None:
        self._slots, self._kind, self._peer = slots, kind, peer
        slots.acquire(kind, peer, limit)

    def __enter__(self) -> PeerSlot:
        return self

    def __exit__(self, *exc: object) -> None:
        self._slots.release(self._kind, self._peer)


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


async def _checked(requests: AsyncIterator[Any]) -> AsyncGenerator[Any, None]:
    iterator = aiter(requests)
    try:
        async for request in iterator:
            if isinstance(request, _Undecodable):
                raise request.protocol_error()  # the servicer maps it to INVALID_ARGUMENT
            yield request
    finally:
        await close_stream(iterator)


async def close_stream(iterator: Any) -> None:
    """Close a request stream a handler left unread: gRPC's receiver is in a reference
    cycle with the generator that holds the last message read, so a refused upload's
    header (up to 8 MiB) stayed in memory until the cyclic garbage collector ran."""
    close = getattr(iterator, "aclose", None)
    if close is not None:
        await close()


def _requesting_peer(context: aio.ServicerContext) -> str:
    """Who sent a call, before any servicer looked at it: the certificate's identity, or
    the network address on an insecure port (no identity to key on)."""
    identities = context.peer_identities()
    if identities:
        return b"/".join(identities).decode("utf-8", "replace")[:512]
    return str(context.peer())


class _RequestReader:
    """Reads the one request of a single-request method itself, under per-peer bounds.

    gRPC starts a single-request handler only once the whole message arrived, so the
    servicer's per-peer slots never saw calls whose message does not finish: a review
    held 2.3 GiB of the proxy with one certificate's 1,000 calls that each sent a 2 MiB
    message but its last byte, and locked every other peer out by holding gRPC's 20,000
    call places with 16-byte ones. Registered as request-streaming (the same wire
    format), a call counts against its peer from its first byte: at most
    ``max_calls_per_peer`` of a peer's calls may wait for their request, each for at
    most ``request_read_seconds``. With ``bound_calls``, the call then holds one of its
    peer's slots until it ends (for a service whose servicer takes none, such as
    health: its Watch streams last as long as a peer likes).
    """

    def __init__(
        self, slots: PeerSlots, limits: PeerLimits, refusals: RefusalLog, bound_calls: bool
    ) -> None:
        self._slots, self._limits, self._refusals = slots, limits, refusals
        self._bound_calls = bound_calls

    async def open(
        self, requests: AsyncIterator[Any], context: aio.ServicerContext, method: str
    ) -> tuple[Any, contextlib.AbstractContextManager[Any]] | None:
        """The request and what the call holds while it runs (enter it at once), or
        None once the call was refused (its status is set)."""
        iterator = aiter(requests)
        peer = _requesting_peer(context)
        limit = self._limits.max_calls_per_peer
        seconds = self._limits.request_read_seconds
        try:
            with PeerSlot(self._slots, "requests being read", peer, limit):
                try:
                    request = await asyncio.wait_for(anext(iterator), seconds)
                except StopAsyncIteration:
                    raise ProtocolError(f"{method}: the call carried no request") from None
                except TimeoutError:
                    raise RequestTimeoutError(
                        f"{method}: the request did not arrive within {seconds:g} s "
                        "(limits.request_read_seconds)"
                    ) from None
            if isinstance(request, _Undecodable):
                raise request.protocol_error()
            held: contextlib.AbstractContextManager[Any] = (
                PeerSlot(self._slots, "health calls", peer, limit)
                if self._bound_calls
                else contextlib.nullcontext()
            )
        except FedpcaError as error:
            await refuse(context, method, error, self._refusals)
            return None
        finally:
            await close_stream(iterator)
        return request, held


def _guard(handler: Any, method: str, reader: _RequestReader) -> Any:
    """The same handler, with undecodable requests refused as INVALID_ARGUMENT and the
    one request of a single-request method read under per-peer bounds
    (:class:`_RequestReader`)."""
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
            checked = _checked(requests)
            try:
                return await collect(checked, context)
            finally:
                await checked.aclose()

        return handler._replace(request_deserializer=lenient, stream_unary=streamed)
    single_request = {"request_streaming": True, "request_deserializer": lenient}
    if handler.response_streaming and inspect.iscoroutinefunction(handler.unary_stream):
        # A handler that writes its responses with context.write (grpcio's health Watch)
        # rather than yielding them: it stays a coroutine.
        writer = handler.unary_stream

        async def single_writer(requests: AsyncIterator[Any], context: aio.ServicerContext) -> None:
            opened = await reader.open(requests, context, method)
            if opened is not None:
                request, held = opened
                with held:
                    await writer(request, context)

        return handler._replace(**single_request, unary_stream=None, stream_stream=single_writer)
    if handler.response_streaming:
        behaviour = handler.unary_stream

        async def single_stream(
            requests: AsyncIterator[Any], context: aio.ServicerContext
        ) -> AsyncIterator[Any]:
            opened = await reader.open(requests, context, method)
            if opened is not None:
                request, held = opened
                with held:
                    async for message in behaviour(request, context):
                        yield message

        return handler._replace(**single_request, unary_stream=None, stream_stream=single_stream)
    answer = handler.unary_unary

    async def single(requests: AsyncIterator[Any], context: aio.ServicerContext) -> Any:
        opened = await reader.open(requests, context, method)
        if opened is None:
            return None
        request, held = opened
        with held:
            return await answer(request, context)

    return handler._replace(**single_request, unary_unary=None, stream_unary=single)


class LenientRegistration:
    """The ``server`` argument of the generated ``add_*_to_server`` functions.

    It receives the generated method handlers and registers guarded copies on the
    real server, so the generated code stays the single description of each service.
    With ``bound_calls``, every call also holds one of its peer's ``max_calls_per_peer``
    slots while it lasts (for a service whose servicer takes none, such as health).
    """

    def __init__(
        self,
        server: aio.Server,
        refusals: RefusalLog,
        slots: PeerSlots,
        limits: PeerLimits,
        *,
        bound_calls: bool = False,
    ) -> None:
        self._server = server
        self._reader = _RequestReader(slots, limits, refusals, bound_calls)

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Ignored: the registered handlers below carry the same methods."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        guarded = {name: _guard(handler, name, self._reader) for name, handler in handlers.items()}
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, guarded),)
        )
