"""The ``fedpca`` command keeps gRPC's C-core chatter off stderr: a peer refused at the
TLS handshake printed an "I1124 ... Handshake failed" line outside the JSON log format,
once for every ``fedpca owner probe`` used as a startup probe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# A server that requires client certificates and a client that presents none: the
# server's handshake fails. Importing fedpca.app.cli first, as the console script does.
_SCRIPT = """
import sys
from pathlib import Path
import fedpca.app.cli  # noqa: F401  (the console entry point's module)
import grpc
from concurrent import futures
from fedpca.transport.certs import init_certificates

files = init_certificates(Path(sys.argv[1]), owner_ids=["owner-1"], analyst_ids=["alice"])
proxy = next(tls for node, tls in files.items() if "proxy" in str(node))
read = lambda path: Path(path).read_bytes()
server = grpc.server(futures.ThreadPoolExecutor(1))
credentials = grpc.ssl_server_credentials(
    [(read(proxy.private_key), read(proxy.certificate))],
    root_certificates=read(proxy.ca_certificate),
    require_client_auth=True,
)
port = server.add_secure_port("localhost:0", credentials)
server.start()
channel = grpc.secure_channel(
    f"localhost:{port}", grpc.ssl_channel_credentials(read(proxy.ca_certificate))
)
try:
    grpc.channel_ready_future(channel).result(timeout=1.5)
except grpc.FutureTimeoutError:
    print("refused", flush=True)
server.stop(0)
"""


@pytest.mark.parametrize("preset", [None, "INFO"])
def test_refused_handshakes_are_not_printed_unless_asked_for(
    tmp_path: Path, preset: str | None
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    if preset is not None:
        env["GRPC_VERBOSITY"] = preset  # an operator's own setting wins
    completed = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path / "certs")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    assert completed.stdout.strip() == "refused"
    assert ("Handshake failed" in completed.stderr) is (preset == "INFO"), completed.stderr
