"""The proxy's Prometheus metrics (served on the opt-in monitoring port).

=========================================  ==========  ==================================
metric                                     type        what
=========================================  ==========  ==================================
``fedpca_proxy_queries{state}``            gauge       queries in each state (the store)
``fedpca_proxy_uploads_total{outcome}``    counter     Upload calls accepted / refused
``fedpca_proxy_upload_bytes_total``        counter     bytes of upload messages received
``fedpca_proxy_fold_seconds``              histogram   CPU time checking and folding a chunk
``fedpca_proxy_noise_seconds``             histogram   noise draws (stats) or noise step (masked)
``fedpca_proxy_rpcs_total{method,code}``   counter     every call, by method and status
``fedpca_proxy_owners_registered``         gauge       owners on the allow-list
``fedpca_proxy_owners_connected``          gauge       owners with a task stream open
``fedpca_proxy_owner_connected{owner}``    gauge       1 while that allowed owner's task
                                                       stream is open, else 0
``fedpca_proxy_oldest_open_query_age_``    gauge       seconds since the oldest query not
``seconds``                                            yet done or failed was created (0:
                                                       none)
``fedpca_proxy_certificate_expiry_``       gauge       when the proxy's certificate and
``timestamp_seconds{certificate}``                     its CA's expire (POSIX seconds)
``fedpca_proxy_state_free_bytes``          gauge       free space beside the database
``fedpca_proxy_analyst_epsilon_spent``     gauge       composed epsilon per analyst, at the
``{analyst}``                                          budget's delta
``fedpca_proxy_analyst_epsilon_limit``     gauge       the analyst's total epsilon
``{analyst}``
=========================================  ==========  ==================================

Calls and bytes are counted by a gRPC server interceptor, so the servicers stay as
they are; fold and noise times come from the coordinator (its ``observer``); states,
owners and budgets are read when Prometheus scrapes. None of it depends on records:
the proxy only ever sees ciphertexts, whose sizes the public query fixes.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from grpc import aio
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fedpca.messages import QueryState
from fedpca.monitoring import certificate_expiry, free_space

if TYPE_CHECKING:
    from fedpca.transport.certs import TlsMaterial

__all__ = ["ProxyMetrics"]

logger = logging.getLogger(__name__)

_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class ProxyMetrics:
    """Every metric of one proxy process, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.uploads = Counter(
            "fedpca_proxy_uploads",
            "Upload calls by outcome (accepted: stored and counted; refused: any error).",
            ["outcome"],
            registry=self.registry,
        )
        self.upload_bytes = Counter(
            "fedpca_proxy_upload_bytes",
            "Bytes of upload messages received (headers and ciphertext chunks).",
            registry=self.registry,
        )
        self.fold_seconds = Histogram(
            "fedpca_proxy_fold_seconds",
            "CPU seconds spent checking one chunk and folding it into its query's aggregate.",
            buckets=_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.noise_seconds = Histogram(
            "fedpca_proxy_noise_seconds",
            "Seconds drawing the noise (stats mode) or of the noise and mask step (masked mode).",
            buckets=_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.rpcs = Counter(
            "fedpca_proxy_rpcs",
            "gRPC calls by method and final status code.",
            ["method", "code"],
            registry=self.registry,
        )
        for outcome in ("accepted", "refused"):
            self.uploads.labels(outcome)  # both series exist from the start

    # ------------------------------------------------------- coordinator hooks
    def chunk_folded(self, cpu_seconds: float) -> None:
        self.fold_seconds.observe(cpu_seconds)

    def noise_added(self, seconds: float) -> None:
        self.noise_seconds.observe(seconds)

    # ---------------------------------------------------- read when scraped
    def watch(
        self,
        coordinator: Any,
        connected_owners: Callable[[], frozenset[str]],
        tls: TlsMaterial | None = None,
    ) -> None:
        """Report queries by state, owners and budgets of ``coordinator``, and the
        expiry of ``tls``'s certificates, at each scrape."""
        self.registry.register(_StateCollector(coordinator, connected_owners, tls))

    # ------------------------------------------------------------ interceptor
    def interceptor(self) -> aio.ServerInterceptor:
        """A server interceptor counting calls by status and upload bytes."""
        return _MetricsInterceptor(self)


class _StateCollector(Collector):
    def __init__(
        self,
        coordinator: Any,
        connected_owners: Callable[[], frozenset[str]],
        tls: TlsMaterial | None,
    ) -> None:
        self._coordinator = coordinator
        self._connected = connected_owners
        # The material is read once, at start: its expiry is parsed once too.
        self._expiry = certificate_expiry("proxy", tls)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        coordinator = self._coordinator
        counts = coordinator.store.state_counts()
        queries = GaugeMetricFamily(
            "fedpca_proxy_queries", "Queries in each state.", labels=["state"]
        )
        for state in QueryState:
            queries.add_metric([state.value], counts.get(state, 0))
        yield queries
        yield GaugeMetricFamily(
            "fedpca_proxy_owners_registered",
            "Owners on the allow-list ([owners] allowed).",
            value=len(coordinator.registered_owners),
        )
        connected = self._connected()
        yield GaugeMetricFamily(
            "fedpca_proxy_owners_connected",
            "Allowed owners with a task stream open.",
            value=len(connected),
        )
        # Every allowed owner, at 0 too: an alert names the one that is gone.
        each = GaugeMetricFamily(
            "fedpca_proxy_owner_connected",
            "1 while the allowed owner's task stream is open, else 0.",
            labels=["owner"],
        )
        for owner in sorted(coordinator.registered_owners):
            each.add_metric([owner], 1.0 if owner in connected else 0.0)
        yield each
        oldest = coordinator.store.oldest_open_query_created()
        yield GaugeMetricFamily(
            "fedpca_proxy_oldest_open_query_age_seconds",
            "Seconds since the oldest query not yet done or failed was created (0: none).",
            value=0.0 if oldest is None else max(0.0, coordinator.clock() - oldest),
        )
        if self._expiry is not None:
            yield self._expiry
        yield free_space("proxy", coordinator.store.path.parent)
        spent = GaugeMetricFamily(
            "fedpca_proxy_analyst_epsilon_spent",
            "Composed epsilon of each analyst's releases, at its budget's delta.",
            labels=["analyst"],
        )
        limit = GaugeMetricFamily(
            "fedpca_proxy_analyst_epsilon_limit",
            "Each analyst's total epsilon (+Inf: unlimited).",
            labels=["analyst"],
        )
        # Analysts given a budget of their own are listed from the start (at 0 spent),
        # not only once they have submitted a query: a dashboard sees them all.
        configured = coordinator.config.budget.analysts
        for analyst in sorted({*coordinator.store.analyst_ids(), *configured}):
            try:
                budget = coordinator.budget(analyst, next_query=False)
            except Exception:  # a scrape must not fail on one ledger
                logger.exception("metrics: cannot compose the budget of analyst %s", analyst)
                continue
            spent.add_metric([analyst], budget.epsilon_spent)
            limit.add_metric([analyst], budget.epsilon_limit)
        yield spent
        yield limit


def _code_of(context: aio.ServicerContext, error: BaseException | None) -> str:
    if error is None:
        code = context.code()
        return "OK" if code in (None, grpc.StatusCode.OK) else code.name
    if isinstance(error, aio.AbortError):
        code = context.code()
        return code.name if code is not None else "UNKNOWN"
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED.name
    return grpc.StatusCode.UNKNOWN.name


class _MetricsInterceptor(aio.ServerInterceptor):
    def __init__(self, metrics: ProxyMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = str(handler_call_details.method).rsplit("/", 1)[-1]
        return _counted(handler, method, self._metrics)


def _finish(metrics: ProxyMetrics, method: str, code: str) -> None:
    metrics.rpcs.labels(method, code).inc()
    if method == "Upload":
        metrics.uploads.labels("accepted" if code == "OK" else "refused").inc()


def _counted(handler: Any, method: str, metrics: ProxyMetrics) -> Any:
    """``handler`` with its calls counted (and, for Upload, its bytes)."""

    async def bytes_counted(requests: AsyncIterator[Any]) -> AsyncGenerator[Any, None]:
        from fedpca.proxy.servicer_support import close_stream

        iterator = aiter(requests)
        try:
            async for request in iterator:
                size = getattr(request, "ByteSize", None)
                if method == "Upload" and size is not None:
                    metrics.upload_bytes.inc(size())
                yield request
        finally:
            await close_stream(iterator)

    if handler.request_streaming and not handler.response_streaming:
        behaviour = handler.stream_unary

        async def stream_unary(requests: AsyncIterator[Any], context: Any) -> Any:
            error: BaseException | None = None
            counted = bytes_counted(requests)
            try:
                return await behaviour(counted, context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                await counted.aclose()
                _finish(metrics, method, _code_of(context, error))

        return handler._replace(stream_unary=stream_unary)
    if handler.request_streaming and inspect.iscoroutinefunction(handler.stream_stream):
        # Responses written with context.write, not yielded (grpcio's health Watch):
        # before, iterating its coroutine failed every Watch with UNKNOWN.
        writer = handler.stream_stream

        async def stream_writer(requests: AsyncIterator[Any], context: Any) -> None:
            error: BaseException | None = None
            try:
                await writer(bytes_counted(requests), context)
            except BaseException as exc:
                error = exc
                raise
            finally:
                _finish(metrics, method, _code_of(context, error))

        return handler._replace(stream_stream=stream_writer)
    if handler.request_streaming:
        both = handler.stream_stream

        async def stream_stream(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            error: BaseException | None = None
            try:
                async for reply in both(bytes_counted(requests), context):
                    yield reply
            except BaseException as exc:
                error = exc
                raise
            finally:
                _finish(metrics, method, _code_of(context, error))

        return handler._replace(stream_stream=stream_stream)
    # Every service is registered through fedpca.proxy.servicer_support.LenientRegistration,
    # which reads even a single request from a stream (its per-peer bounds need that).
    raise TypeError(f"{method}: a single-request handler was not registered as streaming")
