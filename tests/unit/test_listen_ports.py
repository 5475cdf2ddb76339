"""A port that cannot be bound is one line naming the address, why, and the setting.

A new operator's review: ``fedpca proxy serve`` on a port in use printed gRPC's C-core
line ("E... add_port.cc ... Failed to add port") and then "cannot bind ...: Failed to
bind to address ...; set GRPC_VERBOSITY=debug ...", saying neither that the port was in
use nor what to change. Each test holds a real socket listening on a free port.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from fedpca.errors import ConfigError
from fedpca.monitoring import MonitoringServer
from fedpca.owner.init import write_owner_folder
from fedpca.proxy.init import write_proxy_folder
from fedpca.transport import channels
from fedpca.transport.certs import (
    CertificateDirectory,
    NodeIdentity,
    Role,
    TlsMaterial,
    init_certificates,
)
from fedpca.transport.ports import check_bindable
from helpers import TEST_SIGNER, sync_test_server

# The console script's module, so that gRPC's logging is set up as `fedpca` sets it.
_FEDPCA = (sys.executable, "-c", "from fedpca.app.cli import main; main()")


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A free port, then held: a socket listening on 127.0.0.1 there."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield int(held.getsockname()[1])


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    init_certificates(tmp_path / "certs", ["owner-1"], ["alice"])
    return tmp_path / "certs"


def _one_line_error(completed: subprocess.CompletedProcess[str]) -> str:
    assert completed.returncode == 1, completed.stderr
    assert "Traceback" not in completed.stderr, completed.stderr
    # gRPC never tried the port: none of its C-core lines.
    assert "add_port" not in completed.stderr and "GRPC_VERBOSITY" not in completed.stderr
    (line,) = [line for line in completed.stderr.splitlines() if line.startswith("Error: ")]
    return line


def test_proxy_serve_on_a_port_in_use_says_so(certs: Path, tmp_path: Path, busy_port: int) -> None:
    write_proxy_folder(tmp_path / "proxy", owners=["owner-1"], certs=certs, listen="127.0.0.1:0")
    config = str(tmp_path / "proxy" / "proxy.toml")
    address = f"127.0.0.1:{busy_port}"
    for option, setting in [
        ("--listen", "proxy.listen"),
        ("--monitoring-listen", "monitoring.listen"),
    ]:
        served = subprocess.run(
            [*_FEDPCA, "proxy", "serve", "--config", config, option, address],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert _one_line_error(served) == (
            f"Error: cannot start the proxy: cannot listen on {address}: port {busy_port} is "
            f"already in use; change {setting} (or {option})"
        )


def test_owner_serve_on_a_monitoring_port_in_use_says_so(
    certs: Path, tmp_path: Path, busy_port: int
) -> None:
    data = tmp_path / "owner.csv"
    np.savetxt(data, np.zeros((3, 4)), delimiter=",")
    address = f"127.0.0.1:{busy_port}"
    write_owner_folder(
        tmp_path / "owner-1",
        owner_id="owner-1",
        proxy="127.0.0.1:1",
        data=data,
        max_records=10,
        analyst_keys=["sha256:" + "a" * 64],
        signers=[TEST_SIGNER],
        certs=certs,
        monitoring_listen=address,
    )
    served = subprocess.run(
        [*_FEDPCA, "owner", "serve", "--config", str(tmp_path / "owner-1" / "owner.toml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert _one_line_error(served) == (
        f"Error: cannot listen on {address}: port {busy_port} is already in use; "
        "change monitoring.listen (or --monitoring-listen)"
    )


def test_a_bind_refusal_names_the_reason_and_the_setting(certs: Path, busy_port: int) -> None:
    address = f"127.0.0.1:{busy_port}"
    in_use = f"cannot listen on {address}: port {busy_port} is already in use; change key.x"
    with pytest.raises(ConfigError) as refused:
        check_bindable(address, "key.x")
    assert str(refused.value) == in_use
    server = sync_test_server(max_workers=1)
    tls = TlsMaterial.load(
        CertificateDirectory(certs).node_files(NodeIdentity(Role.PROXY, "proxy"))
    )
    with pytest.raises(ConfigError) as refused:
        channels.add_secure_port(server, address, tls, setting="key.x")
    assert str(refused.value) == in_use
    monitoring = MonitoringServer(
        address,
        CollectorRegistry(),
        live=lambda: (True, ""),
        ready=lambda: (True, ""),
        setting="key.x",
    )
    with pytest.raises(ConfigError) as refused:
        monitoring.start()
    assert str(refused.value) == in_use
    # An address that is not this machine's is named as such, before gRPC tries it.
    with pytest.raises(ConfigError, match=r"203\.0\.113\.7:50051: the host is not an address of"):
        check_bindable("203.0.113.7:50051", "key.x")
    # Port 0 (any free port) is the server's to choose.
    check_bindable("127.0.0.1:0", "key.x")
