"""A proxy certificate that does not name the host dialled, or a foreign CA, is reported
at once and by name; a closed port is retried and reported per address."""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedpca.analyst.client import AnalystClient
from fedpca.analyst.rpc_errors import ProxyUnavailableError
from fedpca.app.cluster import free_loopback_port
from fedpca.codec import CryptoPool
from fedpca.errors import AuthenticationError
from fedpca.proxy.config import CryptoConfig, OwnersConfig, ProxyConfig, ProxySection, TlsConfig
from fedpca.proxy.server import ProxyServer
from fedpca.transport.certs import (
    CertificateDirectory,
    NodeIdentity,
    Role,
    TlsMaterial,
    init_certificates,
)
from fedpca.transport.diagnose import diagnose_connection, split_target
from helpers import resign_certificate


@pytest.fixture
def proxy(tmp_path: Path, pool: CryptoPool) -> Iterator[tuple[str, CertificateDirectory]]:
    """A proxy whose certificate names only proxy.test (not localhost, not 127.0.0.1)."""
    init_certificates(tmp_path / "certs", ["owner-1"], ["alice"], proxy_hosts=("proxy.test",))
    certs = CertificateDirectory(tmp_path / "certs")
    files = certs.node_files(NodeIdentity(Role.PROXY, "proxy"))
    config = ProxyConfig(
        proxy=ProxySection(listen="127.0.0.1:0", database=tmp_path / "proxy.sqlite3"),
        tls=TlsConfig(files.ca_certificate, files.certificate, files.private_key),
        owners=OwnersConfig(frozenset({"owner-1"})),
        crypto=CryptoConfig(processes=1),
    )
    server = ProxyServer(config, pool=pool)
    address = server.start()
    yield address, certs
    server.stop(0)


def _alice(certs: CertificateDirectory) -> TlsMaterial:
    return TlsMaterial.load(certs.node_files(NodeIdentity(Role.ANALYST, "alice")))


def test_a_certificate_for_another_name_is_reported_at_once(
    proxy: tuple[str, CertificateDirectory],
) -> None:
    address, certs = proxy
    port = split_target(address)[1]
    started = time.monotonic()
    with (
        AnalystClient(f"localhost:{port}", _alice(certs), retry_delays=(5.0,) * 5) as client,
        pytest.raises(AuthenticationError) as info,
    ):
        client.budget()
    # Not after the retries (5 x 5 s here): the cause is known after one attempt.
    assert time.monotonic() - started < 5.0
    message = str(info.value)
    assert "not valid for 'localhost'" in message and "proxy.test" in message
    assert "--proxy-host localhost" in message
    # The analyst can verify against another name (--server-name); an owner cannot,
    # so its diagnosis does not suggest it.
    assert "--server-name" in message
    owner_view = diagnose_connection(f"localhost:{port}", _alice(certs).root_certificates)
    assert owner_view.problem is not None and "--proxy-host localhost" in owner_view.problem
    assert "server-name" not in owner_view.problem
    # The name it carries, given as the name to verify against, works.
    with AnalystClient(
        f"127.0.0.1:{port}", _alice(certs), server_name_override="proxy.test"
    ) as client:
        assert client.budget().analyst_id == "alice"
    diagnosis = diagnose_connection(
        f"127.0.0.1:{port}", _alice(certs).root_certificates, "proxy.test"
    )
    assert diagnosis.reachable and diagnosis.problem is None
    assert diagnosis.addresses == ("127.0.0.1: reachable, certificate valid",)


def test_a_foreign_ca_is_named(proxy: tuple[str, CertificateDirectory], tmp_path: Path) -> None:
    address, _ = proxy
    init_certificates(tmp_path / "other", ["owner-1"], ["alice"], proxy_hosts=("proxy.test",))
    foreign = CertificateDirectory(tmp_path / "other")
    port = split_target(address)[1]
    with (
        AnalystClient(
            f"127.0.0.1:{port}",
            _alice(foreign),
            server_name_override="proxy.test",
            retry_delays=(5.0,),
        ) as client,
        pytest.raises(AuthenticationError, match="does not verify against your CA"),
    ):
        client.budget()


def test_a_proxy_never_reached_fails_at_once_with_each_address(
    proxy: tuple[str, CertificateDirectory],
) -> None:
    _, certs = proxy
    port = free_loopback_port()
    started = time.monotonic()
    with (
        AnalystClient(f"127.0.0.1:{port}", _alice(certs), retry_delays=(5.0,) * 5) as client,
        pytest.raises(ProxyUnavailableError, match=r"127\.0\.0\.1: connection refused"),
    ):
        client.budget()
    # Nothing listens and this client never reached a proxy there: a wrong address or a
    # proxy not started, not a restart; no half minute of retries.
    assert time.monotonic() - started < 5.0
    diagnosis = diagnose_connection(f"127.0.0.1:{port}", None)
    assert not diagnosis.reachable and diagnosis.problem is None


def test_a_proxy_reached_before_is_retried(
    tmp_path: Path, pool: CryptoPool, caplog: pytest.LogCaptureFixture
) -> None:
    init_certificates(tmp_path / "certs", ["owner-1"], ["alice"])
    certs = CertificateDirectory(tmp_path / "certs")
    files = certs.node_files(NodeIdentity(Role.PROXY, "proxy"))
    port = free_loopback_port()
    config = ProxyConfig(
        proxy=ProxySection(listen=f"127.0.0.1:{port}", database=tmp_path / "proxy.sqlite3"),
        tls=TlsConfig(files.ca_certificate, files.certificate, files.private_key),
        owners=OwnersConfig(frozenset({"owner-1"})),
        crypto=CryptoConfig(processes=1),
    )
    server = ProxyServer(config, pool=pool)
    server.start()
    with AnalystClient(f"127.0.0.1:{port}", _alice(certs), retry_delays=(0.05,) * 3) as client:
        assert client.budget().analyst_id == "alice"
        # What an outage that began while the proxy was still shutting down (port open)
        # left behind: a look that found it reachable. It is looked at again, not shown.
        client._diagnosis = diagnose_connection(
            f"127.0.0.1:{port}", _alice(certs).root_certificates
        )
        assert client._diagnosis.reachable
        server.stop(0)  # a restart, as far as this client can tell
        with pytest.raises(ProxyUnavailableError, match="connection refused") as info:
            client.budget()
        assert "reachable" not in str(info.value)
    assert sum("retrying in" in r.message for r in caplog.records) == 3


def test_an_expired_proxy_certificate_is_named_as_such(tmp_path: Path) -> None:
    """Found by review: a proxy serving an expired certificate sent the analyst to
    check its CA ("does not verify against your CA (certificate has expired): is tls.ca
    the CA of this deployment?"). The proxy now refuses to start with one; a TLS server
    that still serves one (another build, a proxy running since before it expired) is
    diagnosed as expired, not as a foreign CA."""
    init_certificates(tmp_path / "certs", ["owner-1"], ["alice"], proxy_hosts=("proxy.test",))
    layout = CertificateDirectory(tmp_path / "certs")
    files = layout.node_files(NodeIdentity(Role.PROXY, "proxy"))
    now = dt.datetime.now(dt.UTC)
    resign_certificate(
        layout, files.certificate, now - dt.timedelta(days=400), now - dt.timedelta(days=3)
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(files.certificate, files.private_key)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve() -> None:
            try:
                connection, _ = listener.accept()
                with context.wrap_socket(connection, server_side=True):
                    pass
            except (OSError, ssl.SSLError):
                pass  # the client gives up at the handshake

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        diagnosis = diagnose_connection(
            f"127.0.0.1:{port}", _alice(layout).root_certificates, "proxy.test"
        )
        server.join(10.0)
    assert diagnosis.reachable and diagnosis.problem is not None
    assert "outside its validity period" in diagnosis.problem
    assert "fedpca certs issue" in diagnosis.problem and "tls.ca" not in diagnosis.problem
