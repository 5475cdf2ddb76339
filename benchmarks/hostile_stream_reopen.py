"""What one owner reopening its task stream in a loop costs the proxy and the other owners.

Claim measured: an allow-listed owner may open its task stream at any time (the newer
stream replaces the older), and each opening costs the proxy a database write, a log
line, and, before this change, a wake-up of *every* owner's task stream (each then read
its pending tasks from the database). A review found one owner reopening in a loop kept
a proxy core busy and wrote two log lines per reopening. The proxy now takes at most
``limits.max_task_stream_opens_per_minute`` openings of one owner in any minute (the
others are refused at once, RESOURCE_EXHAUSTED, before any database work), and an
opening wakes only the stream it replaces.

One run starts a real proxy process (``fedpca proxy serve``, mutual TLS on loopback,
fresh certificates and database, the shipped limits) and connects ``--bystanders``
allow-listed owners, each holding its task stream open on its own channel. Then, for
``--seconds`` each:

* ``quiet``: nothing else happens (the proxy's standing cost: heartbeats);
* ``attack``: the owner "attacker", on one channel, opens its task stream, reads its
  first event (or its refusal) and cancels it, again and again, as fast as it can.

Reported per window, from ``/proc/<pid>/stat`` and the proxy's log file: the proxy's CPU
seconds per wall second, the bytes its log grew per second, the median time a
bystander's ``Hello`` took (one every 0.1 s, or less often with few bystanders: they
take turns, each staying within the proxy's limit of Hello calls a minute), and the
attacker's openings by outcome.
The attacker runs in this process: on a machine of its own it could send more.

Usage::

    python benchmarks/hostile_stream_reopen.py [--bystanders 50] [--seconds 10]

The last line reads ``attack_attempts_per_second=<float> attack_opened=<int>
proxy_cpu_quiet=<float> proxy_cpu_attack=<float> log_kib_per_second_attack=<float>
hello_ms_quiet=<float> hello_ms_attack=<float>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from proxy_memory import log, start_proxy, write_proxy_config

from fedpca.app.cluster import PROXY_READY_MARKER, free_loopback_port
from fedpca.transport import channels
from fedpca.transport.certs import NodeIdentity, Role, TlsMaterial, init_certificates
from fedpca.v1 import owner_service_pb2 as owner_pb
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc

ATTACKER = "attacker"


def proxy_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Window:
    name: str
    seconds: float
    proxy_cpu: float
    log_bytes: int
    attempts: Counter[str]
    hello_ms: list[float]

    def line(self) -> str:
        return (
            f"{self.name:7} {self.seconds:6.1f} s  proxy CPU {self.proxy_cpu / self.seconds:5.2f} "
            f"s/s  log {self.log_bytes / self.seconds / 1024:7.1f} KiB/s  attacker "
            f"{sum(self.attempts.values()) / self.seconds:7.1f} openings/s {dict(self.attempts)}"
            f"  a bystander's Hello median {self.hello_median_ms:.1f} ms"
        )

    @property
    def hello_median_ms(self) -> float:
        return statistics.median(self.hello_ms)


class Bystander:
    """An allow-listed owner holding its task stream open (reading what it sends)."""

    def __init__(self, address: str, material: TlsMaterial) -> None:
        self.channel = channels.secure_channel(address, material)
        self._call = owner_grpc.OwnerServiceStub(self.channel).StreamTasks(
            owner_pb.TaskStreamRequest()
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for _ in self._call:
                pass
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._call.cancel()
        self.channel.close()


def reopen_in_a_loop(stub: Any, until: float) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    while time.monotonic() < until:
        call = stub.StreamTasks(owner_pb.TaskStreamRequest(), timeout=30.0)
        try:
            next(call)
            outcomes["opened"] += 1
        except grpc.RpcError as err:
            outcomes[err.code().name] += 1
        finally:
            call.cancel()
    return outcomes


HELLOS_PER_BYSTANDER_PER_MINUTE = 9
"""Hellos each bystander sends a minute: within the proxy's limit (20) over both windows."""


def time_hellos(stubs: list[Any], until: float, latencies: list[float]) -> None:
    """The bystanders' Hellos in turn until ``until``, one every 0.1 s or less often (each
    bystander within :data:`HELLOS_PER_BYSTANDER_PER_MINUTE`): milliseconds each took."""
    hello = owner_pb.OwnerHello(node_id="", software_version="1")
    interval = max(0.1, 60.0 / (len(stubs) * HELLOS_PER_BYSTANDER_PER_MINUTE))
    turn = 0
    while time.monotonic() < until:
        started = time.monotonic()
        stubs[turn % len(stubs)].Hello(hello, timeout=30.0)
        turn += 1
        latencies.append((time.monotonic() - started) * 1000)
        time.sleep(interval)


def measure(
    name: str,
    pid: int,
    log_path: Path,
    bystanders: list[Bystander],
    seconds: float,
    attacker: Any | None,
) -> Window:
    cpu_before = proxy_cpu_seconds(pid)
    log_before = log_path.stat().st_size
    started = time.monotonic()
    hello_ms: list[float] = []
    prober = threading.Thread(
        target=time_hellos,
        args=(
            [owner_grpc.OwnerServiceStub(b.channel) for b in bystanders],
            started + seconds,
            hello_ms,
        ),
    )
    prober.start()
    if attacker is None:
        time.sleep(seconds)
        attempts: Counter[str] = Counter()
    else:
        attempts = reopen_in_a_loop(attacker, started + seconds)
    prober.join()
    elapsed = time.monotonic() - started
    return Window(
        name,
        elapsed,
        proxy_cpu_seconds(pid) - cpu_before,
        log_path.stat().st_size - log_before,
        attempts,
        hello_ms,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bystanders", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedpca-reopen-") as tmp:
        workdir = Path(tmp)
        owners = [ATTACKER] + [f"owner-{i}" for i in range(args.bystanders)]
        tls = init_certificates(workdir / "certs", owner_ids=owners, analyst_ids=["alice"])
        port = free_loopback_port()
        address = f"127.0.0.1:{port}"
        config = write_proxy_config(workdir, tls[NodeIdentity(Role.PROXY, "proxy")], port, owners)
        proxy = start_proxy(workdir, config, [])
        bystanders: list[Bystander] = []
        try:
            proxy.wait_for(PROXY_READY_MARKER, timeout=60.0)
            pid = proxy.process.pid
            bystanders = [
                Bystander(address, TlsMaterial.load(tls[NodeIdentity(Role.OWNER, owner)]))
                for owner in owners[1:]
            ]
            attacker_channel = channels.secure_channel(
                address, TlsMaterial.load(tls[NodeIdentity(Role.OWNER, ATTACKER)])
            )
            attacker = owner_grpc.OwnerServiceStub(attacker_channel)
            time.sleep(2.0)  # every bystander's stream open and its first heartbeat read
            windows = [
                measure("quiet", pid, proxy.log_path, bystanders, args.seconds, None),
                measure("attack", pid, proxy.log_path, bystanders, args.seconds, attacker),
            ]
            attacker_channel.close()
        finally:
            for bystander in bystanders:
                bystander.close()
            proxy.stop(timeout=10.0)
    log(f"{args.bystanders} bystander owners with open task streams; one attacker")
    for window in windows:
        log(window.line())
    quiet, attack = windows
    log(
        f"attack_attempts_per_second={sum(attack.attempts.values()) / attack.seconds:.1f} "
        f"attack_opened={attack.attempts['opened']} "
        f"proxy_cpu_quiet={quiet.proxy_cpu / quiet.seconds:.3f} "
        f"proxy_cpu_attack={attack.proxy_cpu / attack.seconds:.3f} "
        f"log_kib_per_second_attack={attack.log_bytes / attack.seconds / 1024:.2f} "
        f"hello_ms_quiet={quiet.hello_median_ms:.1f} hello_ms_attack={attack.hello_median_ms:.1f}"
    )


if __name__ == "__main__":
    main()
