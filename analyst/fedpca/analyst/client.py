"""The analyst's gRPC client for the proxy's AnalystService.

A thin layer: every message is translated by :mod:`fedpca.transport.serde`, and
every gRPC failure becomes a :class:`~fedpca.errors.FedpcaError` subclass whose
message is the proxy's own explanation, so callers (the estimators, the CLI)
never see ``grpc.RpcError``.

Status code -> error (the proxy's servicer maps domain errors the other way):

=====================  ==============================================
RESOURCE_EXHAUSTED     BudgetExceededError when the proxy's trailing
                       metadata says ``fedpca-refusal: budget``, else
                       OverloadError (a per-peer bound; retry later)
INVALID_ARGUMENT       ConfigError (the proxy refused the query)
PERMISSION_DENIED,     AuthenticationError
UNAUTHENTICATED
NOT_FOUND              NotFoundError
FAILED_PRECONDITION,   QueryStateError
ALREADY_EXISTS,
ABORTED
UNAVAILABLE,           ProxyUnavailableError
DEADLINE_EXCEEDED
anything else          ProxyError
=====================  ==============================================
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import grpc

from fedpca.analyst.result_checks import check_result
from fedpca.analyst.rpc_errors import ProxyError, ProxyUnavailableError, error_from_rpc
from fedpca.errors import (
    AuthenticationError,
    ConfigError,
    DeclinedForBudgetError,
    FedpcaError,
    LayoutError,
    ProtocolError,
    QueryStateError,
    UntrustedKeyError,
)
from fedpca.messages import (
    BudgetStatus,
    CancelReceipt,
    Charge,
    CiphertextPayload,
    DeclineReason,
    DecodedChunk,
    DeploymentInfo,
    QueryResult,
    QueryState,
    QueryStatus,
    QuerySummary,
    ResultHeader,
    SignedQuery,
)
from fedpca.query import QuerySpec, stamped
from fedpca.signing import Ed25519PrivateKey, sign_query, signer_id, verify_query
from fedpca.transport import serde
from fedpca.transport.certs import TlsMaterial
from fedpca.transport.channels import insecure_channel, secure_channel
from fedpca.transport.diagnose import ConnectionDiagnosis, diagnose_connection
from fedpca.v1 import analyst_service_pb2 as analyst_pb
from fedpca.v1 import analyst_service_pb2_grpc as analyst_grpc

__all__ = [
    "DEFAULT_INSECURE_ANALYST_ID",
    "AnalystClient",
    "FetchedResult",
    "ResultStream",
]

logger = logging.getLogger(__name__)

_RECONNECT_DELAYS = (1.0, 2.0, 4.0, 8.0, 15.0, *(30.0,) * 10)
"""Seconds between re-opening a call the proxy did not answer: about 5.5 minutes in
all, as long as a proxy's recovery after a restart may take (30 s once left an analyst
waiting on a restarting proxy with an error)."""
_Reply = TypeVar("_Reply")

DEFAULT_INSECURE_ANALYST_ID = "analyst"
"""The id an insecure client claims (``fedpca-node-id`` metadata) unless told otherwise."""


def _status_of(query_id: str, status: QueryStatus, action: str) -> QueryStatus:
    """``status`` if it is of ``query_id``; a proxy's status of another query was taken
    for the one asked about (found by review)."""
    if status.query_id != query_id:
        raise ProtocolError(
            f"{action} {query_id!r}: the proxy answered with the status of {status.query_id[:80]!r}"
        )
    return status


@dataclass(frozen=True)
class ResultStream:
    """An encrypted result being received.

    Attributes
    ----------
    header : the validated header (query, owner count, noise, layout, page count).
    chunks : the result's pages, each checked (hash chain, size) as it arrives.
    """

    header: ResultHeader
    chunks: Iterator[DecodedChunk]


@dataclass(frozen=True)
class FetchedResult:
    """An encrypted result as fetched.

    Attributes
    ----------
    result : the validated stream (header, layout, ciphertexts; in masked mode
        also the public record count N, ``ResultHeader.public_record_count``).
    """

    result: QueryResult

    @property
    def query(self) -> QuerySpec:
        return self.result.query

    @property
    def public_count(self) -> int | None:
        """Masked mode: the public record count N the result carries; None in stats mode."""
        return self.result.public_record_count


class AnalystClient:
    """Client of the proxy's AnalystService.

    Parameters
    ----------
    proxy_address : ``host:port`` of the proxy.
    tls : the analyst's TLS material (mutual TLS); required unless ``insecure``.
    insecure : dial without TLS (tests and local demos only; logs a warning).
    server_name_override : verify the proxy certificate against this name.
    timeout : seconds for unary calls and for each fetch.
    insecure_node_id : insecure channels only: the analyst id claimed in
        ``fedpca-node-id`` metadata, under which an insecure proxy keeps this
        analyst's queries and budget (with TLS the certificate names the analyst).

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        proxy_address: str,
        tls: TlsMaterial | None,
        insecure: bool = False,
        *,
        server_name_override: str | None = None,
        timeout: float = 60.0,
        insecure_node_id: str = DEFAULT_INSECURE_ANALYST_ID,
        retry_delays: Sequence[float] = _RECONNECT_DELAYS,
    ) -> None:
        if not proxy_address:
            raise ConfigError("the proxy address (host:port) is required")
        if tls is None and not insecure:
            raise ConfigError(
                "TLS material (--ca/--cert/--key) is required to reach the proxy; "
                "pass insecure=True (--insecure) only for local tests"
            )
        if tls is not None and insecure:
            raise ConfigError("give either TLS material or insecure=True, not both")
        self.proxy_address = proxy_address
        self.timeout = timeout
        self.retry_delays = tuple(retry_delays)
        self._root_certificates = None if tls is None else tls.root_certificates
        self._server_name = server_name_override
        self._diagnosis: ConnectionDiagnosis | None = None
        self._reached_proxy = False
        if tls is not None:
            self._channel = secure_channel(
                proxy_address, tls, server_name_override=server_name_override
            )
        else:
            self._channel = insecure_channel(proxy_address, node_id=insecure_node_id)
        self._stub = analyst_grpc.AnalystServiceStub(self._channel)

    def __enter__(self) -> AnalystClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    # ------------------------------------------------------------------ calls
    def _unary(self, action: str, call: Callable[[], _Reply]) -> _Reply:
        """Run one call, retrying with back-off while the proxy is unreachable.

        Every analyst call is idempotent at the proxy: a query id chosen here is
        accepted once (a resubmission of the same spec is the same query and is not
        charged again), and reads change nothing. So a call that failed because the
        proxy was restarting is simply sent again.
        """
        failures = 0
        while True:
            try:
                reply = call()
            except grpc.RpcError as error:
                mapped = error_from_rpc(error, action)
                retry = False
                if error.code() is grpc.StatusCode.UNAVAILABLE:
                    mapped, retry = self._explain_unavailable(action, mapped)
                elif error.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    # The proxy did not answer in time, but may still act on the call
                    # (a submission it commits after the client gave up): the very same
                    # request is sent again (found by review: one timed-out submission
                    # failed at once, and the analyst's next fit() charged a new query).
                    retry = True
                if not retry or failures >= len(self.retry_delays):
                    raise mapped from None
                delay = self.retry_delays[failures]
                failures += 1
                logger.warning("%s; retrying in %.0f s", mapped, delay)
                time.sleep(delay)
            else:
                self._reached()
                return reply

    def _reached(self) -> None:
        self._reached_proxy = True
        self._diagnosis = None  # a later outage is looked at afresh

    def _explain_unavailable(self, action: str, error: FedpcaError) -> tuple[FedpcaError, bool]:
        """UNAVAILABLE, looked at (:mod:`fedpca.transport.diagnose`); returns the error
        to raise and whether retrying may help.

        A TLS failure no retry fixes becomes an AuthenticationError saying what is
        wrong. A proxy that no address of the target accepts connections for, and that
        this client never reached, fails at once (a wrong address or a proxy not
        started: half a minute of retries would only delay the message). A proxy that
        was reached before is retried: it may be restarting.
        """
        diagnosis = self._diagnosis
        # An outage seen as unreachable is looked at once (each look may wait for a
        # timeout per address); one that looked reachable is looked at again, since
        # a proxy shutting down for a restart still answers the first look.
        if diagnosis is None or diagnosis.reachable:
            diagnosis = self._diagnosis = diagnose_connection(
                self.proxy_address,
                self._root_certificates,
                self._server_name,
                can_override_name=True,
            )
        if diagnosis.problem is not None:
            return AuthenticationError(f"{action}: {diagnosis.problem}"), False
        explained = ProxyUnavailableError(f"{error} [{self.proxy_address}: {diagnosis.summary()}]")
        return explained, diagnosis.reachable or self._reached_proxy

    def submit(self, spec: QuerySpec, signing_key: Ed25519PrivateKey) -> QueryStatus:
        """Sign a query and submit it; the proxy checks the budget before accepting it.

        Raises
        ------
        BudgetExceededError
            The release would exceed the analyst's privacy budget.
        ConfigError
            The proxy refused the query (its message says why).
        """
        # Signed now: owners answer it only until issued_at + deadline_seconds.
        spec = stamped(spec)
        signed = SignedQuery(spec, sign_query(spec, signing_key), signer_id(signing_key))
        request = serde.submit_query_request_to_proto(signed)
        try:
            message = self._unary(
                f"submit query {spec.query_id!r}",
                lambda: self._stub.SubmitQuery(request, timeout=self.timeout),
            )
        except ProxyUnavailableError as exc:
            raise ProxyUnavailableError(
                f"{exc} (if the proxy received query {spec.query_id} it goes on there, "
                f"charged: `fedpca analyst status {spec.query_id}` says whether it did, "
                f"and `fedpca analyst cancel {spec.query_id}` withdraws it)"
            ) from exc
        return serde.query_status_from_proto(message)

    def status(self, query_id: str, *, action: str = "status of query") -> QueryStatus:
        """The current status of one query (``action`` names the step in errors)."""
        request = serde.query_ref_to_proto(query_id)
        message = self._unary(
            f"{action} {query_id!r}",
            lambda: self._stub.GetQueryStatus(request, timeout=self.timeout),
        )
        return _status_of(query_id, serde.query_status_from_proto(message), action)

    def watch(self, query_id: str, timeout: float | None = None) -> Iterator[QueryStatus]:
        """Status updates until the query is done or failed (the last one is terminal).

        A watch stream that breaks (proxy restart, network) is re-opened with
        back-off; the proxy's durable store keeps the query's progress.

        Parameters
        ----------
        query_id : the query.
        timeout : give up after this many seconds in total (None = never).
        """
        action = f"watch query {query_id!r}"
        give_up = None if timeout is None else time.monotonic() + timeout
        failures = 0
        while True:
            remaining = None if give_up is None else max(give_up - time.monotonic(), 0.001)
            try:
                stream = self._stub.WatchQueryStatus(
                    serde.query_ref_to_proto(query_id), timeout=remaining
                )
                try:
                    for message in stream:
                        status = _status_of(
                            query_id, serde.query_status_from_proto(message), action
                        )
                        self._reached()
                        failures = 0
                        yield status
                        if status.terminal:
                            return
                finally:
                    stream.cancel()  # also when the caller stops early
            except grpc.RpcError as error:
                mapped = error_from_rpc(error, action)
                retry = isinstance(mapped, ProxyUnavailableError)
                if error.code() is grpc.StatusCode.UNAVAILABLE:
                    mapped, retry = self._explain_unavailable(action, mapped)
                if not retry or error.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise mapped from None
                if failures >= len(self.retry_delays):
                    raise mapped from None
                delay = self.retry_delays[failures]
                if give_up is not None:  # not past the caller's timeout (review)
                    delay = min(delay, max(give_up - time.monotonic(), 0.0))
                failures += 1
                logger.warning("%s; reconnecting in %.0f s", mapped, delay)
                time.sleep(delay)
                continue
            # The stream ended without a terminal status: ask once, then re-watch, after
            # a pause (a proxy ending every stream at once made this loop spin).
            status = self.status(query_id)
            if status.terminal:
                yield status
                return
            if failures >= len(self.retry_delays):
                raise ProxyUnavailableError(
                    f"{action}: the proxy keeps ending the status stream before the query finishes"
                )
            pause = self.retry_delays[failures]
            if give_up is not None:
                left = give_up - time.monotonic()
                if left <= 0:
                    raise ProxyUnavailableError(
                        f"{action}: timed out: no final status within {timeout:g} s"
                    )
                pause = min(pause, left)
            time.sleep(pause)
            failures += 1

    def fetch_stream(self, query_id: str, timeout: float | None = None) -> ResultStream:
        """Open a query's result: its header once the contributors are fixed, then its
        pages, each as soon as the proxy made it final.

        Call it once the contributors are fixed (:meth:`wait_for_contributors`; the
        proxy refuses it before). The proxy holds the call open while later pages are
        still being folded, so decrypting the first pages overlaps the owners'
        encryption of the last ones. A stream that breaks (proxy restart) is re-opened
        with back-off; the pages it had already delivered must come back identical.

        Parameters
        ----------
        query_id : the query.
        timeout : give up after this many seconds in total (None = never).

        Raises
        ------
        ProtocolError
            The stream is malformed (framing, hash chain, layout) or names another query.
        QueryStateError
            The query failed (before or while its pages were being released), or it
            is still collecting.
        """
        action = f"fetch result of query {query_id!r}"
        messages = self._result_messages(query_id, timeout, action)
        header, chunks = serde.read_result_stream(messages)
        if header.query.query_id != query_id:
            raise ProtocolError(
                f"{action}: the proxy returned the result of query {header.query.query_id!r}"
            )
        return ResultStream(header, chunks)

    def _result_messages(self, query_id: str, timeout: float | None, action: str) -> Iterator[Any]:
        """FetchResult messages, re-opening the stream after a break; messages seen before
        the break are compared (not yielded twice) when it is re-opened.

        Only the SHA-256 of each message is kept for that comparison, not the message:
        a whole result's pages would otherwise stay in memory until it is decrypted.
        """
        request = serde.query_ref_to_proto(query_id)
        give_up = None if timeout is None else time.monotonic() + timeout
        seen: list[bytes] = []
        failures = 0
        while True:
            remaining = None if give_up is None else max(give_up - time.monotonic(), 0.001)
            index = 0
            try:
                for message in self._stub.FetchResult(request, timeout=remaining):
                    digest = hashlib.sha256(message.SerializeToString(deterministic=True)).digest()
                    if index < len(seen):
                        if seen[index] != digest:
                            raise ProtocolError(
                                f"{action}: message {index} differs from the one received "
                                "before the stream was re-opened"
                            )
                    else:
                        seen.append(digest)
                        self._reached()
                        failures = 0
                        yield message
                    index += 1
                return
            except grpc.RpcError as error:
                mapped = error_from_rpc(error, action)
                retry = False
                if error.code() is grpc.StatusCode.UNAVAILABLE:
                    mapped, retry = self._explain_unavailable(action, mapped)
                if not retry or failures >= len(self.retry_delays):
                    raise mapped from None
                delay = self.retry_delays[failures]
                failures += 1
                logger.warning("%s; re-opening in %.0f s", mapped, delay)
                time.sleep(delay)

    def fetch(
        self,
        query_id: str,
        timeout: float | None = None,
        *,
        public_key: Any,
        signer: str,
    ) -> FetchedResult:
        """Download and validate the whole encrypted result of a query.

        Before any page is read, the result's header is checked: against the analyst's
        ``public_key`` (and the layout of the query it names), and, with the analyst's
        ``signer`` id, that the query is one this analyst signed (the header carries the
        signature it was submitted with). A proxy can then make the analyst hold pages
        only of a query it asked for, of the size that query has. Both are required:
        with defaults that skipped the checks, a library caller held every page a proxy
        declared (found by review).

        Raises
        ------
        ProtocolError
            The stream is malformed (framing, hash chain, layout), or names another
            query.
        UntrustedKeyError, LayoutError
            The header is for another key or its layout is not the plan's.
        QueryStateError
            The query failed.
        """
        stream = self.fetch_stream(query_id, timeout=timeout if timeout else self.timeout)
        if stream.header.query.query_id != query_id:
            raise ProtocolError(
                f"fetch result of query {query_id!r}: the proxy sent the result of "
                f"{stream.header.query.query_id!r}"
            )
        header = stream.header
        if header.query_signer != signer:
            raise UntrustedKeyError(
                f"fetch result of query {query_id!r}: the query is signed by "
                f"{header.query_signer[:80] or 'nobody'}, not by you ({signer}): if you "
                "asked it, --key-dir (or key_dir in --config) names another key folder "
                "than the one you asked it with"
            )
        verify_query(header.query, header.query_signature, header.query_signer)
        check_result(header, public_key)
        flat: list[int] = []
        for chunk in stream.chunks:
            flat.extend(chunk.ciphertexts)
        header = stream.header
        try:
            result = QueryResult(
                query=header.query,
                n_owners=header.n_owners,
                noise=header.noise,
                payload=CiphertextPayload.from_wire_order(header.blocks, flat),
                masked_mean_block=header.masked_mean_block,
                public_record_count=header.public_record_count,
            )
        except LayoutError as exc:
            raise ProtocolError(f"fetch result of query {query_id!r}: {exc}") from exc
        return FetchedResult(result)

    def budget(self, delta: float | None = None, query_delta: float | None = None) -> BudgetStatus:
        """The analyst's cumulative privacy loss (epsilons reported at ``delta``) and the
        largest epsilon a next query stating ``query_delta`` may ask for (``next_query``;
        None: the proxy's default query delta)."""
        request = serde.budget_request_to_proto(delta, query_delta)
        message = self._unary("budget", lambda: self._stub.GetBudget(request, timeout=self.timeout))
        return serde.budget_status_from_proto(message)

    def describe(self, with_owner_terms: bool = False) -> DeploymentInfo:
        """The deployment's public facts: owners registered, relation, delta cap, budget;
        ``with_owner_terms``: also the terms each connected owner stated."""
        request = analyst_pb.DescribeDeploymentRequest(with_owner_terms=with_owner_terms)
        message = self._unary(
            "describe the deployment",
            lambda: self._stub.DescribeDeployment(request, timeout=self.timeout),
        )
        return serde.deployment_info_from_proto(message)

    def list_queries(self, limit: int = 0, query_id: str | None = None) -> list[QuerySummary]:
        """This analyst's queries, newest first (``limit`` 0: the proxy's default), or
        only its query ``query_id`` (NotFoundError unless it is one of them; empty if
        the proxy cannot read the query's statement, or is older and did not list it)."""
        if query_id is not None:
            # A proxy older than the filter ignores it: ask for as many as it lists.
            limit = serde.MAX_LISTED_QUERIES
        request = serde.list_queries_request_to_proto(limit, query_id)
        message = self._unary(
            "list queries", lambda: self._stub.ListQueries(request, timeout=self.timeout)
        )
        listed = serde.query_list_from_proto(message)
        if query_id is None:
            return listed
        # A proxy older than the filter lists every query: keep the one asked for.
        return [item for item in listed if item.status.query_id == query_id]

    def cancel(self, query_id: str) -> CancelReceipt:
        """Cancel a query that is still collecting uploads (it fails; see CancelReceipt).

        Raises
        ------
        QueryStateError
            Collection has closed: the result is being or has been released.
        NotFoundError
            No such query of this analyst.
        """
        request = serde.query_ref_to_proto(query_id)
        action = f"cancel query {query_id!r}"
        message = self._unary(action, lambda: self._stub.CancelQuery(request, timeout=self.timeout))
        receipt = serde.cancel_receipt_from_proto(message)
        _status_of(query_id, receipt.status, "cancel query")
        return receipt

    def wait_for_contributors(
        self,
        query_id: str,
        on_status: Callable[[QueryStatus], None] | None = None,
        timeout: float | None = None,
    ) -> QueryStatus:
        """Follow a query until its contributors are fixed (its pages may then be
        fetched as they become final) or it ends.

        Raises
        ------
        QueryStateError
            The query failed at the proxy (the message carries its reason).
        """
        last: QueryStatus | None = None
        for status in self.watch(query_id, timeout=timeout):
            last = status
            if on_status is not None:
                on_status(status)
            if status.state is not QueryState.COLLECTING:
                break
        if last is None:  # pragma: no cover - watch always yields a status
            raise ProxyError(f"watch of query {query_id!r} ended without a status")
        if last.state is QueryState.FAILED:
            raise _failed(query_id, last)
        return last

    def wait(
        self,
        query_id: str,
        on_status: Callable[[QueryStatus], None] | None = None,
        timeout: float | None = None,
    ) -> QueryStatus:
        """Follow a query to its terminal status.

        Raises
        ------
        QueryStateError
            The query failed at the proxy (the message carries its reason).
        """
        last: QueryStatus | None = None
        for status in self.watch(query_id, timeout=timeout):
            last = status
            if on_status is not None:
                on_status(status)
        if last is None:  # pragma: no cover - watch always yields a terminal status
            raise ProxyError(f"watch of query {query_id!r} ended without a status")
        if last.state is QueryState.FAILED:
            raise _failed(query_id, last)
        return last


def _failed(query_id: str, status: QueryStatus) -> QueryStateError:
    """The error of a query that failed: its reason, and whether its epsilon stays charged."""
    message = f"query {query_id!r} failed at the proxy: {status.failure_reason or 'no reason'}"
    if status.charge is not Charge.UNKNOWN:
        message += f"; its epsilon is {status.charge.describe(status.state)}"
    budget = DeclineReason.BUDGET_EXHAUSTED.value
    if status.declines and all(decline.reason == budget for decline in status.declines):
        return DeclinedForBudgetError(message)
    return QueryStateError(message)
