"""Proxy memory held by one hostile peer's concurrent oversized calls.

Claim measured: gRPC in Python reads a call's message whole, under one size limit for
every method, before any handler can refuse it; so what one certificate can make the
proxy hold at once is about ``max_calls_per_peer`` x the receive limit (and the copies
gRPC and protobuf make of it). A review held 1.95 GiB of a proxy with one owner's 64
concurrent calls of 8 MiB. The proxy now reads at most
``fedpca.transport.channels.PROXY_MAX_RECEIVE_BYTES`` (2 MiB) a message and takes at
most ``limits.max_calls_per_peer`` (16) calls of one peer at once.

One run starts, one after the other, a real proxy process (``fedpca proxy serve``, mutual
TLS on loopback, fresh certificates and database) per configuration:

* ``before``: the earlier settings, an 8 MiB receive limit and 64 calls per peer;
* ``after``: the shipped defaults.

For each, the allow-listed owner "attacker" opens ``--channels`` mutual-TLS channels and,
``--rounds`` times, sends at once ``max_calls_per_peer + 8`` ``Hello`` calls whose node id
is 1 KiB under the receive limit (the largest message the proxy reads; each is refused
by its checks with INVALID_ARGUMENT, those beyond the peer's slots with
RESOURCE_EXHAUSTED), then as many 1 KiB over it (refused by gRPC unread, RESOURCE_EXHAUSTED;
the outcomes are counted as ``under:CODE`` and ``over:CODE``). Reported: the
proxy main process's resident memory before the attack (VmRSS) and its peak after it
(VmHWM), from ``/proc/<pid>/status``, and the growth.

Usage::

    python benchmarks/hostile_calls_memory.py [--rounds 3] [--channels 8]

The last line reads
``before_growth_mib=<float> after_growth_mib=<float> before_over_after=<float>``.
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from proxy_memory import log, proc_status_kib, start_proxy, write_proxy_config

from fedpca.app.cluster import PROXY_READY_MARKER, ManagedProcess, free_loopback_port
from fedpca.messages import OwnerHello
from fedpca.transport import channels, serde
from fedpca.transport.certs import NodeIdentity, Role, TlsMaterial, init_certificates
from fedpca.v1 import owner_service_pb2 as owner_pb
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc

MIB = 1024 * 1024
ATTACKER = "attacker"

# Runs ``fedpca proxy serve`` with another receive limit (the "before" configuration).
RECEIVE_LIMIT_PROXY = """
import sys
from fedpca.transport import channels
limit = int(sys.argv[1])
base = channels.create_async_server
channels.create_async_server = lambda *args, **kwargs: base(limit, **kwargs)
channels.PROXY_MAX_RECEIVE_BYTES = limit
from fedpca.app.cli import main
main(args=sys.argv[2:], prog_name="fedpca")
"""


@dataclass(frozen=True)
class Setting:
    name: str
    receive_bytes: int
    max_calls_per_peer: int


@dataclass(frozen=True)
class Measurement:
    setting: Setting
    rss_before_mib: float
    hwm_after_mib: float
    outcomes: dict[str, int]

    @property
    def growth_mib(self) -> float:
        return self.hwm_after_mib - self.rss_before_mib


def run_proxy(workdir: Path, config: Path, setting: Setting) -> ManagedProcess:
    if setting.receive_bytes == channels.PROXY_MAX_RECEIVE_BYTES:
        return start_proxy(workdir, config, [])
    return start_proxy(workdir, config, [str(setting.receive_bytes)], patch=RECEIVE_LIMIT_PROXY)


def hello(stub: Any, size: int) -> str:
    request = owner_pb.OwnerHello(node_id="x" * size, software_version="1")
    try:
        stub.Hello(request, timeout=120.0)
    except grpc.RpcError as err:
        return err.code().name
    return "OK"


def attack(workdir: Path, setting: Setting, rounds: int, n_channels: int) -> Measurement:
    tls = init_certificates(workdir / "certs", owner_ids=[ATTACKER], analyst_ids=["alice"])
    port = free_loopback_port()
    config = write_proxy_config(
        workdir,
        tls[NodeIdentity(Role.PROXY, "proxy")],
        port,
        [ATTACKER],
        extra={"limits": {"max_calls_per_peer": setting.max_calls_per_peer}},
    )
    proxy = run_proxy(workdir, config, setting)
    try:
        proxy.wait_for(PROXY_READY_MARKER, timeout=60.0)
        pid = proxy.process.pid
        material = TlsMaterial.load(tls[NodeIdentity(Role.OWNER, ATTACKER)])
        opened = [
            channels.secure_channel(f"127.0.0.1:{port}", material, max_message_bytes=64 * MIB)
            for _ in range(n_channels)
        ]
        stubs = [owner_grpc.OwnerServiceStub(channel) for channel in opened]
        # Warm-up: every channel connected and one legitimate call answered.
        for stub in stubs:
            stub.Hello(serde.owner_hello_to_proto(OwnerHello(ATTACKER, "1")), timeout=30.0)
        rss_before = proc_status_kib(pid, "VmRSS") / 1024
        calls = setting.max_calls_per_peer + 8
        outcomes: Counter[str] = Counter()
        with ThreadPoolExecutor(max_workers=calls) as pool:
            for round_index in range(rounds):
                for label, size in (
                    ("under", setting.receive_bytes - 1024),
                    ("over", setting.receive_bytes + 1024),
                ):
                    futures = [
                        pool.submit(hello, stubs[i % n_channels], size) for i in range(calls)
                    ]
                    outcomes.update(f"{label}:{f.result()}" for f in futures)
                log(f"[{setting.name}] round {round_index + 1}: {dict(outcomes)}")
        hwm_after = proc_status_kib(pid, "VmHWM") / 1024
        for channel in opened:
            channel.close()
    finally:
        proxy.stop(timeout=10.0)
    return Measurement(setting, rss_before, hwm_after, dict(outcomes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--channels", type=int, default=8)
    args = parser.parse_args()
    settings = [
        Setting("before", 8 * MIB, 64),
        Setting("after", channels.PROXY_MAX_RECEIVE_BYTES, 16),
    ]
    results = []
    for setting in settings:
        with tempfile.TemporaryDirectory(prefix=f"fedpca-hostile-{setting.name}-") as workdir:
            results.append(attack(Path(workdir), setting, args.rounds, args.channels))
    log("")
    log(
        f"{'setting':8} {'receive MiB':>11} {'calls/peer':>10} {'VmRSS before':>13} "
        f"{'VmHWM after':>12} {'growth MiB':>11}  outcomes"
    )
    for m in results:
        log(
            f"{m.setting.name:8} {m.setting.receive_bytes / MIB:11.0f} "
            f"{m.setting.max_calls_per_peer:10d} {m.rss_before_mib:13.1f} "
            f"{m.hwm_after_mib:12.1f} {m.growth_mib:11.1f}  {m.outcomes}"
        )
    before, after = results
    log(
        f"before_growth_mib={before.growth_mib:.1f} after_growth_mib={after.growth_mib:.1f} "
        f"before_over_after={before.growth_mib / max(after.growth_mib, 0.1):.1f}"
    )


if __name__ == "__main__":
    main()
