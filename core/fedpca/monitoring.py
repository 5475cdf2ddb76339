"""The opt-in monitoring port of the proxy and the owner node: metrics and health.

``[monitoring] listen = "0.0.0.0:9464"`` in a node's configuration (or ``serve
--monitoring-listen``) starts a small HTTP server next to the node's real work:

* ``/metrics`` - Prometheus text exposition (prometheus_client) of the node's registry;
* ``/healthz`` - 200 while the process is alive and its main loop answers (liveness);
* ``/readyz``  - 200 when the node can do its job (the proxy serves gRPC; an owner
  has its task stream to the proxy open), 503 with the reason otherwise (readiness).

The port is plain HTTP without authentication, like every Prometheus exporter: bind it
to an address only the monitoring system reaches. Nothing served here is derived from
records (the metrics count queries, uploads, bytes and seconds, and report budgets).
"""

from __future__ import annotations

import logging
import shutil
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily

from fedpca.errors import ConfigError
from fedpca.transport.ports import bind_error

if TYPE_CHECKING:
    from fedpca.transport.certs import TlsMaterial

__all__ = [
    "LOW_FREE_SPACE_BYTES",
    "Check",
    "MonitoringServer",
    "certificate_expiry",
    "free_space",
    "free_space_problem",
    "parse_listen",
]

logger = logging.getLogger(__name__)

Check = Callable[[], tuple[bool, str]]
"""A health check: (ok, one line saying why)."""


def parse_listen(value: str, key: str) -> tuple[str, int]:
    """``host:port`` of a listening address (port 0 = any free port).

    Raises
    ------
    ConfigError
        Naming ``key``.
    """
    host, sep, port = value.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit() and len(port) <= 5):
        raise ConfigError(f"{key} must be 'host:port', got {value!r}")
    number = int(port)
    if number > 65535:
        raise ConfigError(f"{key}: port {number} is out of range")
    return host.strip("[]"), number


def certificate_expiry(role: str, tls: TlsMaterial | None) -> GaugeMetricFamily | None:
    """``fedpca_<role>_certificate_expiry_timestamp_seconds{certificate}``: when the
    certificate this process serves with (``node``) and its CA's (``ca``) stop being
    valid, in POSIX seconds (None without TLS). Peers refuse an expired one, and a
    renewed file is read only at the next start: alert well before (deploy/prometheus)."""
    if tls is None:
        return None
    from fedpca.transport.certs import load_certificate

    family = GaugeMetricFamily(
        f"fedpca_{role}_certificate_expiry_timestamp_seconds",
        "When the certificate this process uses (node) and its CA's (ca) expire, POSIX "
        "seconds (the files as read at start).",
        labels=["certificate"],
    )
    for name, pem in (("node", tls.certificate_chain), ("ca", tls.root_certificates)):
        family.add_metric([name], load_certificate(pem).not_valid_after_utc.timestamp())
    return family


LOW_FREE_SPACE_BYTES = 100 * 2**20
"""Below this much free space in the folder of its state a node reports itself not
ready: writes to its database (ledger, uploads, results) are about to fail. Alert
earlier on the free-space metric (deploy/prometheus/alerts.yaml)."""


def free_space_problem(folder: Path, what: str) -> str | None:
    """Why ``folder`` (``what``: e.g. "the state folder") is too full for the node to
    work, or None. A full disk had read as the node's other symptoms (review)."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError as exc:
        return f"cannot read the free space of {what} {folder}: {exc}"
    if free < LOW_FREE_SPACE_BYTES:
        return (
            f"{what} {folder} has {free / 2**20:.0f} MiB free (less than "
            f"{LOW_FREE_SPACE_BYTES // 2**20} MiB): its database writes are about to fail"
        )
    return None


def free_space(role: str, folder: Path) -> GaugeMetricFamily:
    """``fedpca_<role>_state_free_bytes``: free space in the folder of the node's database
    (NaN if it cannot be read)."""
    try:
        free = float(shutil.disk_usage(folder).free)
    except OSError:
        free = float("nan")
    return GaugeMetricFamily(
        f"fedpca_{role}_state_free_bytes",
        "Bytes free in the file system of the folder that holds this node's database.",
        value=free,
    )


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        # Scrapes every few seconds would drown the node's own log.
        logger.debug("monitoring: " + format, *args)


class MonitoringServer:
    """HTTP ``/metrics``, ``/healthz`` and ``/readyz`` on a thread of its own.

    Parameters
    ----------
    listen : ``host:port`` to bind (port 0: any free port, see :attr:`port`).
    registry : the node's Prometheus registry.
    live, ready : the liveness and readiness checks.
    setting : what an operator changes to move the port (named when it cannot be bound).
    """

    def __init__(
        self,
        listen: str,
        registry: CollectorRegistry,
        *,
        live: Check,
        ready: Check,
        setting: str = "monitoring.listen (or --monitoring-listen)",
    ) -> None:
        self.host, self.requested_port = parse_listen(listen, "monitoring.listen")
        self._listen = listen
        self._setting = setting
        self._metrics = make_wsgi_app(registry)
        self._checks: Mapping[str, Check] = {"/healthz": live, "/readyz": ready}
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the monitoring server is not started")
        return int(self._server.server_port)

    def _app(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        check = self._checks.get(path)
        if check is not None:
            try:
                ok, reason = check()
            except Exception as exc:  # a failing check is an unhealthy node, not a crash
                ok, reason = False, f"check failed: {type(exc).__name__}: {exc}"
            body = f"{'ok' if ok else 'not ok'}: {reason}\n".encode()
            start_response(
                "200 OK" if ok else "503 Service Unavailable",
                [("Content-Type", "text/plain; charset=utf-8")],
            )
            return [body]
        if path in ("/metrics", "/"):
            result: Iterable[bytes] = self._metrics(environ, start_response)
            return result
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: try /metrics, /healthz or /readyz\n"]

    def start(self) -> int:
        """Bind and serve; return the port.

        Raises
        ------
        ConfigError
            The address cannot be bound.
        """
        try:
            server = make_server(
                self.host,
                self.requested_port,
                self._app,
                server_class=_ThreadingServer6 if ":" in self.host else _ThreadingServer,
                handler_class=_QuietHandler,
            )
        except OSError as exc:
            raise bind_error(self._listen, self._setting, exc) from exc
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name="fedpca-monitoring", daemon=True
        )
        self._thread.start()
        logger.info(
            "monitoring on http://%s:%d (/metrics, /healthz, /readyz)", self.host, self.port
        )
        return self.port

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
