"""The proxy process: store, crypto pool, coordinator, deadline timer and gRPC server,
plus the standard gRPC health service and the opt-in monitoring port.

:class:`ProxyServer` wires the pieces together in the order that keeps crash
recovery sound: the store and the pool come first, then the coordinator finishes
every query a previous run left in NOISING (:meth:`Coordinator.recover`), and only
then does the gRPC port open. The gRPC server is asynchronous (:mod:`grpc.aio`) and
runs its event loop on a thread of its own, so :meth:`ProxyServer.start` and
:meth:`ProxyServer.stop` (and :meth:`ProxyServer.reload`) can be called from ordinary
code and tests. Signal handling lives in the CLI entry point (:mod:`fedpca.proxy.cli`), not here.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedpca.codec import CryptoPool
from fedpca.dp.noise import NoiseSampler
from fedpca.errors import ConfigError
from fedpca.files import ExclusiveUse
from fedpca.formatting import first_of
from fedpca.monitoring import MonitoringServer, free_space_problem
from fedpca.proxy.config import ProxyConfig, reload_changes
from fedpca.proxy.coordinator import Coordinator
from fedpca.proxy.limits import PeerSlots, RefusalLog
from fedpca.proxy.metrics import ProxyMetrics
from fedpca.proxy.servicer import AnalystServicer, OwnerServicer, register_services
from fedpca.proxy.servicer_support import ChangeFeed, LenientRegistration, WorkerPool
from fedpca.proxy.store import ProxyStore
from fedpca.proxy.store_database import use_database
from fedpca.transport import channels
from fedpca.transport.certs import Role, TlsMaterial
from fedpca.version import build_description

__all__ = ["HEALTH_SERVICES", "ProxyServer"]

logger = logging.getLogger(__name__)

DEFAULT_GRACE_SECONDS = 5.0

HEALTH_SERVICES = ("fedpca.v1.OwnerService", "fedpca.v1.AnalystService")
"""Services the health service reports besides the server as a whole ("")."""

_T = TypeVar("_T")


class ProxyServer:
    """One running proxy.

    Parameters
    ----------
    config : the proxy configuration (flags already applied).
    noise_sampler : TEST ONLY override of the discrete Gaussian sampler.
    pool : an existing crypto pool to use (not closed by :meth:`stop`); by
        default the server starts its own with ``crypto.processes`` workers.

    Examples
    --------
    >>> server = ProxyServer(load_config("proxy.toml"))  # doctest: +SKIP
    >>> server.start()                                   # doctest: +SKIP
    '127.0.0.1:50051'
    >>> server.stop()                                    # doctest: +SKIP
    """

    def __init__(
        self,
        config: ProxyConfig,
        *,
        noise_sampler: NoiseSampler | None = None,
        pool: CryptoPool | None = None,
    ) -> None:
        self.config = config
        self._noise_sampler = noise_sampler
        self._external_pool = pool
        self._pool: CryptoPool | None = None
        self._store: ProxyStore | None = None
        self._database_lock: ExclusiveUse | None = None
        self._coordinator: Coordinator | None = None
        self._server: aio.Server | None = None
        self._work: WorkerPool | None = None
        self.peer_slots = PeerSlots()
        """What each peer holds of its per-peer bounds (calls, uploads, watches)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._timer_stop = threading.Event()
        self._timer: threading.Thread | None = None
        self._address: str | None = None
        self._terminated = threading.Event()
        self.metrics = ProxyMetrics()
        """Prometheus metrics of this proxy (served when ``[monitoring] listen`` is set)."""
        self._health: Any = None
        self._monitoring: MonitoringServer | None = None
        self._task_streams: Any = None

    @property
    def address(self) -> str:
        """``host:port`` actually bound (the port resolved if 0 was configured)."""
        if self._address is None:
            raise RuntimeError("the proxy server is not started")
        return self._address

    @property
    def coordinator(self) -> Coordinator:
        if self._coordinator is None:
            raise RuntimeError("the proxy server is not started")
        return self._coordinator

    def _on_loop(self, coroutine: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def start(self) -> str:
        """Open the store, start the pool, recover, bind and serve; return the address.

        Raises
        ------
        ConfigError
            Unusable TLS material (or not a proxy certificate), or the address
            cannot be bound.
        """
        config = self.config
        tls = None
        if config.tls.insecure:
            logger.warning(
                "INSECURE proxy: no TLS; traffic is unencrypted and callers are not "
                "authenticated (tls.insecure = true is for local experiments only)"
            )
        else:
            tls = TlsMaterial.load(config.tls.files())
            if tls.identity.role is not Role.PROXY:
                raise ConfigError(
                    f"{config.tls.cert} certifies {tls.identity}, not a proxy; the proxy "
                    "needs a certificate issued with role proxy"
                )
            if tls.identity.node_id != config.proxy.id:
                logger.warning(
                    "proxy.id is %r but the certificate says %r; using the configured id",
                    config.proxy.id,
                    tls.identity.node_id,
                )
        try:
            self._database_lock = use_database(config.proxy.database)
            self._store = ProxyStore(
                config.proxy.database, neighbouring=config.privacy.neighbouring
            )
            taken = self._store.restore_pending_since()
            if taken is not None:
                raise ConfigError(
                    f"{config.proxy.database} is a backup taken on {taken} by `fedpca proxy "
                    "backup`: it forgets the releases made since, which the analysts could "
                    "spend again. Re-enter them from every owner's ledger first: `fedpca "
                    "proxy import-releases --config PROXY.toml OWNER-EXPORTS...` (with "
                    "--no-owner-exports if no owner answered a query since the backup; "
                    "docs/operations.md, Backup and restore)"
                )
            self._pool = self._external_pool or CryptoPool(config.crypto.pool_processes)
            self._pool.start()
            self._coordinator = Coordinator(
                self._store, config, self._pool, noise_sampler=self._noise_sampler
            )
            self._coordinator.observer = self.metrics
            recovered = self._coordinator.recover()
            if recovered:
                logger.warning("recovered %d queries: %s", len(recovered), ", ".join(recovered))
            self._timer = threading.Thread(
                target=self._coordinator.run_timers,
                args=(self._timer_stop,),
                name="fedpca-deadlines",
                daemon=True,
            )
            self._timer.start()
            self._loop = asyncio.new_event_loop()
            self._loop_thread = threading.Thread(
                target=self._loop.run_forever, name="fedpca-grpc", daemon=True
            )
            self._loop_thread.start()
            port = self._on_loop(self._serve(tls))
            if config.monitoring.listen is not None:
                self._monitoring = MonitoringServer(
                    config.monitoring.listen,
                    self.metrics.registry,
                    live=self._live,
                    ready=self._ready,
                )
                self._monitoring.start()
        except BaseException:
            self.stop(0)
            raise
        host = config.proxy.listen.rpartition(":")[0]
        self._address = f"{host}:{port}"
        logger.info(
            "proxy %s serving on %s (fedpca %s)",
            config.proxy.id,
            self._address,
            build_description(),
        )
        return self._address

    def reload(self, config: ProxyConfig) -> list[str]:
        """Serve with ``config``'s allow-lists and revoked certificates from now on.

        Returns the changes, one line each (empty: the same lists). The calls of peers
        no longer accepted end at their next message or wake, refused as at their start.

        Raises
        ------
        ConfigError
            ``config`` also changes a setting read only at start; nothing is applied.
        """
        changes = reload_changes(self.config, config)
        if changes:
            owners_changed = config.owners.allowed != self.config.owners.allowed
            self.coordinator.reconfigure(config)  # raises if not serving: nothing swapped
            self.config = config
            if owners_changed and self._task_streams:
                changes.extend(_absent_owners(config, self._task_streams.connected_owners()))
        return changes

    @property
    def monitoring_port(self) -> int | None:
        """The bound monitoring port, or None without ``[monitoring] listen``."""
        return None if self._monitoring is None else self._monitoring.port

    def _live(self) -> tuple[bool, str]:
        loop = self._loop
        if loop is None or not loop.is_running():
            return False, "the gRPC event loop is not running"
        try:
            self._on_loop(asyncio.sleep(0), timeout=5.0)
        except TimeoutError:
            return False, "the gRPC event loop did not answer within 5 s"
        return True, "event loop answering"

    def _ready(self) -> tuple[bool, str]:
        coordinator = self._coordinator
        if self._server is None or coordinator is None or coordinator.stopping:
            return False, "not serving (starting or stopping)"
        database = self.config.proxy.database.parent
        if (problem := free_space_problem(database, "the database's folder")) is not None:
            return False, problem
        return True, f"serving; {self._task_streams.connected()} owners connected"

    async def _serve(self, tls: TlsMaterial | None) -> int:
        config = self.config
        coordinator = self.coordinator
        limits = config.limits
        feed = ChangeFeed(asyncio.get_running_loop())
        coordinator.add_listener(feed.notify)
        self._work = WorkerPool(limits)
        slots = self.peer_slots = PeerSlots()
        common: dict[str, Any] = {"insecure": tls is None}
        server = channels.create_async_server(
            maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
            interceptors=[self.metrics.interceptor()],
        )
        owners = OwnerServicer(
            coordinator,
            self._work,
            feed,
            slots,
            limits,
            proxy_id=config.proxy.id,
            heartbeat_seconds=config.proxy.heartbeat_seconds,
            **common,
        )
        register_services(
            server,
            owners,
            AnalystServicer(
                coordinator,
                self._work,
                feed,
                slots,
                limits,
                watch_poll_seconds=config.proxy.heartbeat_seconds,
                proxy_id=config.proxy.id,
                task_streams=owners.streams,
                **common,
            ),
        )
        self._task_streams = owners.streams
        self.metrics.watch(coordinator, owners.streams.connected_owners, tls)
        # The standard gRPC health service (grpc.health.v1.Health) on the same port.
        self._health = health.aio.HealthServicer()
        # Through the same guard, each call holding a slot of its peer: a Watch stream
        # lasts as long as the peer likes.
        health_pb2_grpc.add_HealthServicer_to_server(
            self._health,
            LenientRegistration(
                server,
                RefusalLog(limits.logged_refusals_per_minute),
                slots,
                limits,
                bound_calls=True,
            ),
        )
        for service in ("", *HEALTH_SERVICES):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        listen, setting = config.proxy.listen, "proxy.listen (or --listen)"
        if tls is None:
            port = channels.add_insecure_port(server, listen, setting=setting)
        else:
            port = channels.add_secure_port(server, listen, tls, setting=setting)
        await server.start()
        self._server = server
        return port

    def stop(self, grace: float | None = DEFAULT_GRACE_SECONDS) -> None:
        """Stop serving and release everything; safe to call twice.

        Open streams get ``grace`` seconds. A noise step still running is cut short
        and its query stays NOISING, to be finished by the next start.
        """
        monitoring, self._monitoring = self._monitoring, None
        if monitoring is not None:
            monitoring.stop()
        health_servicer, self._health = self._health, None
        if health_servicer is not None and self._loop is not None:
            self._on_loop(health_servicer.enter_graceful_shutdown())
        coordinator, self._coordinator = self._coordinator, None
        if coordinator is not None:
            coordinator.shutdown(wait=False)  # wakes task and watch streams
        server, self._server = self._server, None
        if server is not None and grace:
            # Let the woken streams answer (watches end with "reconnect") before
            # gRPC cancels whatever is still open.
            self._on_loop(asyncio.sleep(min(grace, 0.2)))
        if server is not None:
            self._on_loop(server.stop(grace))
            # The calls gRPC cut at the grace's end are still unwinding (an upload's
            # stream hands its unfinished chunks back on a worker thread): let them
            # finish before the loop closes. Closed under them, they were logged as
            # "Task was destroyed but it is pending!" and tracebacks (an operator's
            # walkthrough, stop 42).
            self._on_loop(_settle(SETTLE_SECONDS))
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            if self._loop_thread is not None:
                self._loop_thread.join()
            loop.close()
            self._loop_thread = None
        work, self._work = self._work, None
        if work is not None:
            work.shutdown()
        self._timer_stop.set()
        if self._timer is not None:
            self._timer.join()
            self._timer = None
        pool, self._pool = self._pool, None
        if pool is not None and pool is not self._external_pool:
            pool.close()
        if coordinator is not None:
            coordinator.shutdown(wait=True)
        store, self._store = self._store, None
        if store is not None:
            store.close()
        database_lock, self._database_lock = self._database_lock, None
        if database_lock is not None:
            database_lock.release()
        self._terminated.set()
        if server is not None:
            logger.info("proxy stopped")

    def wait(self) -> None:
        """Block until the server is stopped (by :meth:`stop` from another thread)."""
        self._terminated.wait()


SETTLE_SECONDS = 10.0
"""How long a stopping proxy lets the calls it cut finish unwinding (:func:`_settle`)."""


async def _settle(timeout: float) -> None:
    """Wait up to ``timeout`` seconds for every other task of the loop to finish; cancel
    the ones left (and give them a second to unwind), saying how many."""
    current = asyncio.current_task()
    pending = [task for task in asyncio.all_tasks() if task is not current]
    if not pending:
        return
    _, left = await asyncio.wait(pending, timeout=timeout)
    if left:
        for task in left:
            task.cancel()
        await asyncio.wait(left, timeout=1.0)
        logger.info("stopping: %d call(s) cut while still unwinding", len(left))


def _absent_owners(config: ProxyConfig, connected: frozenset[str]) -> list[str]:
    """A line naming the allowed owners not connected, if any: an owner added before it
    runs made every analyst's default query (quorum: every allowed owner) wait 40 s and
    refuse, and nothing said which owner was missing (a new user's walkthrough)."""
    absent = sorted(config.owners.allowed - connected)
    if not absent:
        return []
    return [
        f"allowed owners not connected now: {first_of(absent, 20)} (an analyst's query asks "
        f"for all {len(config.owners.allowed)} allowed owners unless given a smaller --quorum, "
        "and waits for them)"
    ]
