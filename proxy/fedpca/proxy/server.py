"""The proxy process: store, crypto pool, coordinator, deadline timer and gRPC server.

:class:`ProxyServer` wires the pieces together in the order that keeps crash
recovery sound: the store and the pool come first, then the coordinator finishes
every query a previous run left in NOISING (:meth:`Coordinator.recover`), and only
then does the gRPC port open. Signal handling lives in the CLI entry point
(:mod:`fedpca.proxy.cli`), not here, so tests can run servers in threads.
"""

from __future__ import annotations

import logging
import threading

import grpc

from fedpca.codec import CryptoPool
from fedpca.dp.noise import NoiseSampler
from fedpca.errors import ConfigError
from fedpca.proxy.config import ProxyConfig
from fedpca.proxy.coordinator import Coordinator
from fedpca.proxy.servicer import AnalystServicer, OwnerServicer, register_services
from fedpca.proxy.store import ProxyStore
from fedpca.transport import channels
from fedpca.transport.certs import Role, TlsMaterial

__all__ = ["ProxyServer"]

logger = logging.getLogger(__name__)

DEFAULT_GRACE_SECONDS = 5.0


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
        self._coordinator: Coordinator | None = None
        self._server: grpc.Server | None = None
        self._timer_stop = threading.Event()
        self._timer: threading.Thread | None = None
        self._address: str | None = None

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
        listen = config.proxy.listen
        try:
            self._store = ProxyStore(config.proxy.database)
            self._pool = self._external_pool or CryptoPool(config.crypto.pool_processes)
            self._pool.start()
            self._coordinator = Coordinator(
                self._store, config, self._pool, noise_sampler=self._noise_sampler
            )
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
            server = channels.create_server()
            register_services(
                server,
                OwnerServicer(
                    self._coordinator,
                    config.proxy.id,
                    config.proxy.heartbeat_seconds,
                    insecure=tls is None,
                ),
                AnalystServicer(
                    self._coordinator, config.proxy.heartbeat_seconds, insecure=tls is None
                ),
            )
            if tls is None:
                port = channels.add_insecure_port(server, listen)
            else:
                port = channels.add_secure_port(server, listen, tls)
            server.start()
            self._server = server
        except BaseException:
            self.stop(0)
            raise
        host = listen.rpartition(":")[0]
        self._address = f"{host}:{port}"
        logger.info("proxy %s serving on %s", config.proxy.id, self._address)
        return self._address

    def stop(self, grace: float | None = DEFAULT_GRACE_SECONDS) -> None:
        """Stop serving and release everything; safe to call twice.

        Open streams get ``grace`` seconds. A noise step still running is cut short
        and its query stays NOISING, to be finished by the next start.
        """
        coordinator, self._coordinator = self._coordinator, None
        if coordinator is not None:
            coordinator.shutdown(wait=False)  # wakes task and watch streams
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace).wait()
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
        if server is not None:
            logger.info("proxy stopped")

    def wait(self) -> None:
        """Block until the gRPC server terminates."""
        if self._server is not None:
            self._server.wait_for_termination()
