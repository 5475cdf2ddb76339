"""What one connected owner costs a gRPC server in memory, before any fedpca code.

Claim measured: issue 13 asks for a proxy whose peak memory grows by at most 64 KiB per
extra owner. Every connected owner holds one mutual-TLS connection with one open
server stream (its task stream). This script measures what that alone costs a bare
``grpc.aio`` server with fedpca's server options and no fedpca state at all: a
servicer whose ``StreamTasks`` only waits. The difference to the proxy's figure in
``benchmarks/scale_owners.py`` is fedpca's own per-owner state.

One run starts, for each transport (mutual TLS as deployed, and plaintext HTTP/2 for
comparison), a server process and a client process on loopback. The client opens
``--connections`` channels (one subchannel each, so one TCP and TLS connection each)
and one ``StreamTasks`` call on each. The server's resident memory (VmRSS of
``/proc/<pid>/status``) is read before the clients connect and once every stream is
open; the growth divided by the connections is the cost of one connected owner.

Usage::

    python benchmarks/connection_memory.py [--connections 400]

The last line reads ``mtls_kib_per_connection=… plaintext_kib_per_connection=…``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from grpc import aio

from fedpca.transport import channels
from fedpca.transport.certs import TlsFiles, TlsMaterial, init_certificates
from fedpca.v1 import owner_service_pb2 as owner_pb
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc

READY = "ready"
SETTLE_SECONDS = 3.0


def _tls(certs: Path, role: str, name: str) -> TlsMaterial:
    folder = certs / role / name
    return TlsMaterial.load(
        TlsFiles(certs / "ca" / "ca.pem", folder / "cert.pem", folder / "key.pem")
    )


class _WaitingOwnerService(owner_grpc.OwnerServiceServicer):
    """Holds every task stream open and sends nothing: an idle connected owner."""

    async def StreamTasks(self, request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        await context.send_initial_metadata(())
        await asyncio.Event().wait()
        yield owner_pb.TaskEvent()  # pragma: no cover - never reached


async def _serve(certs: Path, port: int, secure: bool) -> None:
    server = aio.server(options=channels.server_options())
    owner_grpc.add_OwnerServiceServicer_to_server(_WaitingOwnerService(), server)
    address = f"127.0.0.1:{port}"
    if secure:
        tls = _tls(certs, "proxy", "proxy")
        server.add_secure_port(address, channels.server_credentials(tls))
    else:
        server.add_insecure_port(address)
    await server.start()
    print(READY, flush=True)
    await server.wait_for_termination()


async def _connect(certs: Path, port: int, secure: bool, connections: int) -> None:
    address = f"127.0.0.1:{port}"
    # A private subchannel pool per channel: otherwise gRPC shares one connection
    # between channels to the same target, and a deployment's owners never share one.
    options = [*channels.client_options(), ("grpc.use_local_subchannel_pool", 1)]
    calls = []
    open_channels = []
    tls = _tls(certs, "owner", "owner-1") if secure else None
    for _ in range(connections):
        if tls is not None:
            channel = aio.secure_channel(
                address,
                channels.channel_credentials(tls),
                options=[*options, ("grpc.ssl_target_name_override", "localhost")],
            )
        else:
            channel = aio.insecure_channel(address, options=options)
        await asyncio.wait_for(channel.channel_ready(), timeout=60)
        stub = owner_grpc.OwnerServiceStub(channel)
        call = stub.StreamTasks(owner_pb.TaskStreamRequest())
        await call.wait_for_connection()
        calls.append(call)
        open_channels.append(channel)
    print(READY, flush=True)
    await asyncio.Event().wait()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise SystemExit(f"no VmRSS for process {pid}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(process: subprocess.Popen[str], what: str, timeout: float) -> None:
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if line.strip() == READY:
            return
        if not line and process.poll() is not None:
            raise SystemExit(f"the {what} process exited ({process.returncode})")
    raise SystemExit(f"the {what} process was not ready after {timeout:.0f} s")


def measure(certs: Path, secure: bool, connections: int) -> tuple[int, int]:
    """(server VmRSS KiB before the clients, after every stream is open)."""
    port = _free_port()
    flag = "--secure" if secure else "--plaintext"
    me = [sys.executable, __file__, "--certs", str(certs), "--port", str(port), flag]
    server = subprocess.Popen([*me, "--role", "server"], stdout=subprocess.PIPE, text=True)
    client: subprocess.Popen[str] | None = None
    try:
        _wait_ready(server, "server", 60)
        time.sleep(SETTLE_SECONDS)
        before = _rss_kib(server.pid)
        client = subprocess.Popen(
            [*me, "--role", "client", "--connections", str(connections)],
            stdout=subprocess.PIPE,
            text=True,
        )
        _wait_ready(client, "client", 600)
        time.sleep(SETTLE_SECONDS)
        return before, _rss_kib(server.pid)
    finally:
        for process in (client, server):
            if process is not None:
                process.kill()
                process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=400)
    parser.add_argument("--role", choices=("server", "client"), help=argparse.SUPPRESS)
    parser.add_argument("--certs", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    transport = parser.add_mutually_exclusive_group()
    transport.add_argument("--secure", action="store_true", help=argparse.SUPPRESS)
    transport.add_argument("--plaintext", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "server":
        asyncio.run(_serve(args.certs, args.port, args.secure))
        return
    if args.role == "client":
        asyncio.run(_connect(args.certs, args.port, args.secure, args.connections))
        return
    with tempfile.TemporaryDirectory(prefix="fedpca-connmem-") as tmp:
        certs = Path(tmp) / "certs"
        init_certificates(certs, ["owner-1"], ["analyst"])
        print(
            f"bare grpc.aio server, fedpca's server options, {args.connections} connections "
            f"each with one open server stream (pid {os.getpid()})"
        )
        results = {}
        for name, secure in (("mtls", True), ("plaintext", False)):
            before, after = measure(certs, secure, args.connections)
            per = (after - before) / args.connections
            results[name] = per
            print(
                f"  {name:9s}  VmRSS {before / 1024:7.1f} -> {after / 1024:7.1f} MiB   "
                f"{per:6.1f} KiB per connection"
            )
    print(
        f"mtls_kib_per_connection={results['mtls']:.1f} "
        f"plaintext_kib_per_connection={results['plaintext']:.1f}"
    )


if __name__ == "__main__":
    main()
