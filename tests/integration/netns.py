"""Hosts on one machine: one Linux network namespace per host, joined by a bridge.

Every host gets its own network stack (interfaces, loopback, ports, routing) and its
own ``/etc/hosts`` (``ip netns exec`` bind-mounts ``/etc/netns/<namespace>/hosts``
over it), so processes started in it see the other hosts only by the addresses and
names a real network would give them: a proxy on one host, each owner on another.
Addresses come from 198.18.0.0/15, the range RFC 2544 sets aside for testing network
equipment, so they never clash with a real network.

Needs root (``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``) and iproute2's ``ip``;
:func:`namespaces_unavailable` says why not when they are missing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

SUBNET = "198.18.0"
"""First three octets of the test network (a /24 of the RFC 2544 range)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def namespaces_unavailable() -> str | None:
    """None if namespaces can be made here, else why not (for a skip message)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install -y iproute2)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"fedpca-probe-{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    namespace: str
    address: str


@dataclass
class Network:
    """Hosts ``names`` on a private bridge; each name resolves in every host's /etc/hosts.

    Use as a context manager: everything created (namespaces, links, /etc/netns
    entries, processes) is removed on exit.
    """

    names: Sequence[str]
    aliases: Mapping[str, Sequence[str]] = field(default_factory=dict)
    """Extra host names of a host (e.g. the DNS name in a certificate)."""
    hosts: dict[str, Host] = field(default_factory=dict)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _tag: str = field(default_factory=lambda: secrets.token_hex(2))

    @property
    def switch(self) -> str:
        return f"fedpca-{self._tag}-switch"

    def __enter__(self) -> Network:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for index, name in enumerate(self.names, start=1):
            namespace = f"fedpca-{self._tag}-{name}"
            host = Host(name, namespace, f"{SUBNET}.{index}")
            self.hosts[name] = host
            _ip("netns", "add", namespace)
            inner, outer = f"fp{self._tag}h{index}", f"fp{self._tag}s{index}"
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", inner, "netns", namespace)
            _ip("link", "set", outer, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", outer, "master", "br0")
            _ip("-n", self.switch, "link", "set", outer, "up")
            _ip("-n", namespace, "addr", "add", f"{host.address}/24", "dev", inner)
            _ip("-n", namespace, "link", "set", inner, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        for host in self.hosts.values():
            lines.append(" ".join([host.address, host.name, *self.aliases.get(host.name, ())]))
        for host in self.hosts.values():
            folder = Path("/etc/netns") / host.namespace
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join(lines) + "\n")

    def popen(
        self,
        host: str,
        argv: Sequence[str],
        *,
        log: IO[bytes] | None = None,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (its own process group, stopped by :meth:`close`)."""
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts[host].namespace, *argv],
            stdout=log if log is not None else subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def run(
        self, host: str, argv: Sequence[str], *, timeout: float = 300.0, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``host`` to completion; stdout and stderr captured."""
        return subprocess.run(
            ["ip", "netns", "exec", self.hosts[host].namespace, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(process.pid, signal.SIGTERM)
                    process.wait(15)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # crypto workers left behind
            process.wait()
        self.processes.clear()
        for host in self.hosts.values():
            _ip("netns", "del", host.namespace, check=False)
            shutil.rmtree(Path("/etc/netns") / host.namespace, ignore_errors=True)
        _ip("netns", "del", self.switch, check=False)
        self.hosts.clear()
