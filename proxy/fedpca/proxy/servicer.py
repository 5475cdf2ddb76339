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
RequestTimeoutError                                          DEADLINE_EXCEEDED
ProtocolError, LayoutError, CiphertextError, ConfigError,   INVALID_ARGUMENT
EncodingOverflowError (and every other FedpcaError)
anything else                                               INTERNAL (generic text)
==========================================================  ======================

A RESOURCE_EXHAUSTED carries trailing metadata saying which it was
(:data:`fedpca.messages.REFUSAL_METADATA`: ``budget`` or ``overload``).
An upload refused because its query no longer takes it (QueryClosedError, a
FAILED_PRECONDITION) carries :data:`fedpca.messages.SHARE_RELEASED_METADATA` (``yes``
or ``no``), and no other refusal does: the owner tells it from a fault of its own.

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
import logging
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import grpc
from grpc import aio

from fedpca.errors import ProtocolError
from fedpca.messages import (
    SHARE_RELEASED_METADATA,
    UPLOAD_ACCEPTED_METADATA,
    ChunkAssembler,
    ChunkChain,
    Heartbeat,
    ProxyInfo,
    QueryStatus,
    Task,
    UploadHeader,
    UploadReceipt,
    UploadStatus,
)
from fedpca.owner_terms import OwnerTerms
from fedpca.proxy import catalog
from fedpca.proxy.limits import PeerRate, RefusalLog, TaskStreams
from fedpca.proxy.owner_tasks import SentTasks
from fedpca.proxy.servicer_support import (
    ChangeFeed,
    LenientRegistration,
    PeerSlot,
    RequestTimeoutError,
    ServicerBase,
    streaming_errors,
    unary_errors,
)
from fedpca.proxy.store_records import QueryClosedError, UploadCompletion
from fedpca.transport import channels, serde
from fedpca.transport.certs import Role
from fedpca.v1 import analyst_service_pb2 as analyst_pb
from fedpca.v1 import analyst_service_pb2_grpc as analyst_grpc
from fedpca.v1 import owner_service_pb2 as owner_pb
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
from fedpca.version import __version__

__all__ = ["AnalystServicer", "OwnerServicer", "register_services"]

logger = logging.getLogger(__name__)

RESULT_PAGES_PER_READ = 4
"""Result pages a fetch reads from the database at a time (1 MiB at 2048 bits): an
analyst that decrypts slower than the proxy finalises would otherwise have the proxy
hold every final page of the result in memory until the stream drains."""


# ------------------------------------------------------------------- owners
class OwnerServicer(ServicerBase, owner_grpc.OwnerServiceServicer):
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
        self.streams = TaskStreams(self.limits.max_task_stream_opens_per_minute)
        self.hellos = PeerRate(self.limits.max_task_stream_opens_per_minute, "said hello")
        self.upload_starts = PeerRate(self.limits.max_upload_starts_per_minute, "began an upload")

    @unary_errors
    async def Hello(
        self, request: owner_pb.OwnerHello, context: aio.ServicerContext
    ) -> owner_pb.ProxyInfo:
        owner = self._caller(context, Role.OWNER)
        self.hellos.admit(owner.node_id)  # before the database write it makes
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
                    max_message_bytes=channels.PROXY_MAX_RECEIVE_BYTES,
                    server_time=datetime.now(UTC),
                )
            )

    @streaming_errors
    async def StreamTasks(
        self, request: owner_pb.TaskStreamRequest, context: aio.ServicerContext
    ) -> AsyncIterator[owner_pb.TaskEvent]:
        caller = self._caller(context, Role.OWNER)
        owner = caller.node_id
        # Openings per owner and minute are bounded before anything is written.
        self.streams.admit(owner)
        # Opening writes (enrol) and answers in-flight uploads: bounded per owner like
        # every other call, so that reopening streams in a loop cannot fill the backlog
        # of the proxy's workers. The open stream itself is one per owner (below).
        with self._call_slot(caller):
            # The claimed node id is informational only; the in-flight uploads are answered.
            _, in_flight = serde.task_stream_request_from_proto(request)
            terms = self._stated_terms(owner, request)
            await self.work.run(self.coordinator.enroll, owner)
            answers = (
                await self.work.run(self.coordinator.in_flight_answers, owner, in_flight)
                if in_flight
                else []
            )
        # One stream per owner: this one supersedes any older one, which is woken to end.
        superseded = asyncio.Event()
        generation = self.streams.open(owner, superseded.set, terms)
        logger.info("task stream opened by owner %s", owner)
        coordinator = self.coordinator
        sent = SentTasks(answer for answer in answers if isinstance(answer, Task))
        try:
            # A heartbeat first tells the owner the stream is live.
            yield serde.task_event_to_proto(Heartbeat(sent_at=datetime.now(UTC)))
            for answer in answers:
                yield serde.task_event_to_proto(answer)
            next_beat = time.monotonic() + self.heartbeat_seconds
            while not coordinator.stopping and not superseded.is_set():
                changed = self.feed.event
                # Asked again at every wake: a reload that revokes the owner's
                # certificate or takes it off the allow-list ends its open stream.
                self._caller(context, Role.OWNER)
                tasks = await self.work.run(coordinator.pending_tasks, owner)
                for task in sent.unsent(tasks):
                    yield serde.task_event_to_proto(task)
                closed = sent.closed(tasks)
                if closed:
                    withdrawn = await self.work.run(coordinator.withdrawn_tasks, owner, closed)
                    sent.withdrawn(cancellation.query_id for cancellation in withdrawn)
                    for cancellation in withdrawn:
                        yield serde.task_event_to_proto(cancellation)
                # From memory, no read: an answered task whose query failed since.
                for cancellation in sent.failed(coordinator.store.recent_failure, time.time()):
                    yield serde.task_event_to_proto(cancellation)
                now = time.monotonic()
                if now >= next_beat:
                    yield serde.task_event_to_proto(Heartbeat(sent_at=datetime.now(UTC)))
                    next_beat = now + self.heartbeat_seconds
                await ChangeFeed.wait(
                    changed, max(0.0, next_beat - time.monotonic()), also=superseded
                )
        finally:
            self.streams.close(owner, generation)
            replaced = superseded.is_set() and not coordinator.stopping
            # Here, not after: an owner that goes away cancels the stream, which skipped
            # a line after the block (the log showed owners connecting, never leaving:
            # an operator's walkthrough, stop 42).
            logger.info(
                "task stream of owner %s %s",
                owner,
                "replaced by a newer one" if replaced else "closed",
            )
        if replaced:
            # Said to the owner too: a second node run with this owner's certificate had
            # the two take the stream from each other, each told only that the proxy
            # closed it (found by review). A node that reconnected after a broken
            # connection never reads this on its old stream. Set, not abort(): as every
            # other refusal here (abort's exception holds the frame: a reference cycle).
            context.set_code(grpc.StatusCode.ABORTED)
            context.set_details(
                f"a newer task stream of owner {owner} replaced this one: if this repeats, "
                "two nodes run with this owner's certificate (stop one)"
            )

    def _stated_terms(self, owner: str, request: owner_pb.TaskStreamRequest) -> OwnerTerms | None:
        """The owner's terms, or None if it states none or terms this proxy cannot read
        (a newer owner may name a release kind this version does not know): its stream
        is served either way, only analysts do not see them."""
        try:
            return serde.stated_terms_from_proto(request)
        except ProtocolError as exc:
            # A line per opening at most, and openings are bounded per owner and minute.
            logger.warning("owner %s: its terms are not passed on to analysts: %s", owner, exc)
            return None

    @unary_errors
    async def Upload(
        self, request_iterator: AsyncIterator[Any], context: aio.ServicerContext
    ) -> owner_pb.UploadReceipt:
        owner = self._caller(context, Role.OWNER).node_id
        self.upload_starts.admit(owner)
        with PeerSlot(self.slots, "uploads", owner, self.limits.max_uploads_per_owner):
            deadline = time.monotonic() + self.limits.upload_total_seconds
            messages = aiter(request_iterator)
            first = await self._next(messages, deadline)
            if first is None:
                raise ProtocolError("upload stream is empty (expected an UploadHeader)")
            header = serde.upload_header_from_message(first)
            try:
                receipt, assembler = await self._receive(owner, header, messages, deadline, context)
            except QueryClosedError:
                # The query ended or no longer takes this owner (none of its doing: the
                # key tells it so) and whether any result can hold its share.
                released = await self.work.run(
                    self.coordinator.share_released, header.query_id, owner
                )
                answer = "yes" if released else "no"
                context.set_trailing_metadata(((SHARE_RELEASED_METADATA, answer),))
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
        self,
        owner: str,
        header: UploadHeader,
        messages: AsyncIterator[Any],
        deadline: float,
        context: aio.ServicerContext,
    ) -> tuple[UploadCompletion, ChunkAssembler]:
        # A foreign-key or wrongly shaped upload, or one from an owner the query no
        # longer takes, is refused before any chunk is read; the header's layout equals
        # the plan, so the assembler caps the size.
        upload = await self.work.run(self.coordinator.begin_upload, owner, header)
        assembler = header.assembler()
        # The fold of one chunk (a durable write) overlaps reading the next one.
        folding: asyncio.Future[None] | None = None
        try:
            # The upload is recorded as begun (the analyst's charge stands): only now
            # does the owner send chunks (protocol version 3).
            await context.send_initial_metadata(((UPLOAD_ACCEPTED_METADATA, "yes"),))
            while (message := await self._next(messages, deadline)) is not None:
                self._caller(context, Role.OWNER)  # still accepted (a reload may revoke)
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
            raise RequestTimeoutError(
                f"the upload took longer than {self.limits.upload_total_seconds:g} s"
            )
        try:
            return await asyncio.wait_for(anext(messages), timeout)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise RequestTimeoutError(
                f"no upload message for {timeout:g} s (limits.upload_idle_seconds = "
                f"{self.limits.upload_idle_seconds:g}, upload_total_seconds = "
                f"{self.limits.upload_total_seconds:g})"
            ) from None

    @unary_errors
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
class AnalystServicer(ServicerBase, analyst_grpc.AnalystServiceServicer):
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
        self.listings = PeerRate(
            self.limits.max_listings_per_analyst_per_minute, "listed its queries"
        )

    @unary_errors
    async def SubmitQuery(
        self, request: analyst_pb.SubmitQueryRequest, context: aio.ServicerContext
    ) -> analyst_pb.QueryStatus:
        analyst = self._caller(context, Role.ANALYST)
        limit = self.limits.max_submissions_per_analyst
        with self._call_slot(analyst), PeerSlot(self.slots, "submissions", analyst.node_id, limit):
            # A query may be up to 1 MiB: decoded off the event loop (about 0.3 s), which
            # keeps answering every other peer meanwhile.
            signed = await self.work.run(serde.submit_query_request_from_proto, request)
            await self.work.run(self.coordinator.submit, analyst.node_id, signed)
            status = await self.work.run(
                self.coordinator.status, analyst.node_id, signed.spec.query_id
            )
            return serde.query_status_to_proto(status)

    @unary_errors
    async def GetQueryStatus(
        self, request: analyst_pb.QueryRef, context: aio.ServicerContext
    ) -> analyst_pb.QueryStatus:
        analyst = self._caller(context, Role.ANALYST)
        with self._call_slot(analyst):
            query_id = serde.query_ref_from_proto(request)
            status = await self.work.run(self.coordinator.status, analyst.node_id, query_id)
            return serde.query_status_to_proto(status)

    @streaming_errors
    async def WatchQueryStatus(
        self, request: analyst_pb.QueryRef, context: aio.ServicerContext
    ) -> AsyncIterator[analyst_pb.QueryStatus]:
        analyst = self._caller(context, Role.ANALYST).node_id
        query_id = serde.query_ref_from_proto(request)
        coordinator = self.coordinator
        with PeerSlot(self.slots, "watches", analyst, self.limits.max_watches_per_analyst):
            last: QueryStatus | None = None
            while not coordinator.stopping:
                changed = self.feed.event
                self._caller(context, Role.ANALYST)  # still accepted (a reload may revoke)
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
        # Set, not abort(): with the client gone, abort() raised inside gRPC and the
        # shutdown logged it as an ERROR with a traceback.
        context.set_code(grpc.StatusCode.UNAVAILABLE)
        context.set_details("the proxy is shutting down; reconnect to keep watching")

    @streaming_errors
    async def FetchResult(
        self, request: analyst_pb.QueryRef, context: aio.ServicerContext
    ) -> AsyncIterator[analyst_pb.ResultMessage]:
        """The result header (once the contributors are fixed; refused before), then
        every page the moment it is final (the analyst decrypts while later pages are
        being folded)."""
        analyst = self._caller(context, Role.ANALYST).node_id
        query_id = serde.query_ref_from_proto(request)
        coordinator = self.coordinator
        with PeerSlot(self.slots, "watches", analyst, self.limits.max_watches_per_analyst):
            header = await self.work.run(coordinator.result_header, analyst, query_id)
            yield serde.result_header_message(header)
            chain = ChunkChain()
            sent = 0
            while sent < header.total_chunks:
                changed = self.feed.event
                self._caller(context, Role.ANALYST)  # still accepted (a reload may revoke)
                pages = await self.work.run(
                    coordinator.result_pages, analyst, query_id, sent, RESULT_PAGES_PER_READ
                )
                for data in pages:
                    yield serde.result_chunk_message(chain.next(data))
                    sent += 1
                if sent < header.total_chunks and not pages:
                    if coordinator.stopping:  # set, not abort(): as in WatchQueryStatus
                        context.set_code(grpc.StatusCode.UNAVAILABLE)
                        context.set_details(
                            "the proxy is shutting down; fetch again after it restarts"
                        )
                        return
                    await ChangeFeed.wait(changed, self.watch_poll_seconds)
            logger.info("result of query %s fetched by %s", query_id, analyst)

    @unary_errors
    async def GetBudget(
        self, request: analyst_pb.BudgetRequest, context: aio.ServicerContext
    ) -> analyst_pb.BudgetStatus:
        analyst = self._caller(context, Role.ANALYST)
        with self._call_slot(analyst):
            delta, query_delta = serde.budget_request_from_proto(request)
            status = await self.work.run(
                self.coordinator.budget, analyst.node_id, delta, query_delta
            )
            return serde.budget_status_to_proto(status)

    @unary_errors
    async def DescribeDeployment(
        self, request: analyst_pb.DescribeDeploymentRequest, context: aio.ServicerContext
    ) -> analyst_pb.DeploymentInfo:
        analyst = self._caller(context, Role.ANALYST)
        with self._call_slot(analyst):
            # One reading of both: an analyst counts the owners stating no terms from them.
            connected, stated = self.task_streams.connected_and_terms()
            info = catalog.describe_deployment(
                self.coordinator,
                analyst.node_id,
                proxy_id=self.proxy_id,
                connected=connected,
                stated_terms=stated if request.with_owner_terms else {},
            )
            return serde.deployment_info_to_proto(info)

    @unary_errors
    async def ListQueries(
        self, request: analyst_pb.ListQueriesRequest, context: aio.ServicerContext
    ) -> analyst_pb.QueryList:
        analyst = self._caller(context, Role.ANALYST)
        with self._call_slot(analyst):
            limit = serde.list_queries_request_from_proto(request)
            only = serde.listed_query_from_proto(request)
            # A listing reads every listed query's status: one at a time, and bounded a
            # minute. One query's lookup (`analyst status ID`) reads one: not bounded
            # beyond every call (review, stop 42: a dashboard polling status hit it).
            listing = (
                PeerSlot(self.slots, "listings", analyst.node_id, 1)
                if only is None
                else contextlib.nullcontext()
            )
            with listing:
                if only is None:
                    self.listings.admit(analyst.node_id)  # once it holds the slot
                queries = await self.work.run(
                    catalog.list_queries, self.coordinator, analyst.node_id, limit, only
                )
            return serde.query_list_to_proto(queries)

    @unary_errors
    async def CancelQuery(
        self, request: analyst_pb.QueryRef, context: aio.ServicerContext
    ) -> analyst_pb.CancelReceipt:
        analyst = self._caller(context, Role.ANALYST)
        with self._call_slot(analyst):
            query_id = serde.query_ref_from_proto(request)
            receipt = await self.work.run(self.coordinator.cancel, analyst.node_id, query_id)
            return serde.cancel_receipt_to_proto(receipt)


def register_services(server: aio.Server, owner: OwnerServicer, analyst: AnalystServicer) -> None:
    """Serve both services on ``server``, refusing undecodable requests precisely."""
    registration: Any = LenientRegistration(
        server, RefusalLog(owner.limits.logged_refusals_per_minute), owner.slots, owner.limits
    )
    owner_grpc.add_OwnerServiceServicer_to_server(owner, registration)
    analyst_grpc.add_AnalystServiceServicer_to_server(analyst, registration)
