"""One private PCA over 2 to 1,000 owners against one proxy: time and proxy memory per owner.

For each owner count N (``--owners 2,10,100,1000``) one run lays out a fresh
loopback deployment with :class:`fedpca.app.cluster.LocalCluster` (a new CA, one
owner certificate per owner on the proxy's allow-list, a 2048-bit analyst Paillier
key and query-signing key, one data file and one ``owner.toml`` per owner) and
starts the real proxy process (``fedpca proxy serve``). The owners run in a few
*driver* processes (this script with ``--driver``; ``--owners-per-driver`` owners
each, as 1,000 owner processes do not fit on a 2-core machine), as one of two kinds
(``--clients``):

* ``async`` (the default, and the owners of every published table): one grpc.aio
  client per owner, over its own mutual-TLS channel with its own certificate, that
  says Hello, keeps its task stream, and answers the task with the owner's own
  functions: the public policy check, the exact fixed-point share, packed DJN
  encryption in the driver's shared crypto pool, hash-chained chunks. It keeps no
  budget ledger (no SQLite reservation per owner);
* ``node``: the owner daemon itself, :class:`fedpca.owner.node.OwnerNode`, as threads,
  each with its own SQLite budget ledger (completes at 100 owners here, not at 1,000:
  docs/performance.md says why).

The analyst is this process: a
:class:`fedpca.analyst.estimators.FederatedPCA` with quorum = N submits the signed
query, fetches the encrypted result page by page and decrypts it.

Data: a spiked-covariance sample (:mod:`synthetic`, seed N), ``--rows`` rows per
owner, public bounds [-4, 4], epsilon = 1, delta = 1e-5, 2 components. The query
declares max_owners = 1024 for every N, so the packed layout (and the work per
owner) is the same in every configuration.

Reported per N:

* end to end: ``fit`` from submission to components (the owners are connected
  before it starts; connecting them is reported separately as setup);
* time per owner: end to end / N;
* proxy memory: VmRSS of the proxy's main process once the N owners are connected
  (idle) and its VmHWM after the query, from ``/proc/<pid>/status`` (its crypto
  pool's workers are not counted); growth per extra owner = difference of VmHWM
  to the smallest configuration ÷ difference of owners, in KiB;
* the sequential PrivateLocalPCA baseline (:mod:`fedpca.analyst.baseline`, the
  protocol's own comparison) over the same N tables, timed in this process: its
  compute only (each owner's local PCA and merge, one after another), and that plus
  N − 1 hand-overs, each costed at one measured mutual-TLS hop of this run (a fresh
  channel to the proxy and one unary call, median of 5): a model of passing P from
  owner to owner, not a deployment of the baseline.

Every role shares this machine's cores, so times include the owners' own work.
The plot (runtime against owners, log-log) goes to ``docs/figures/scale_owners.png``
unless ``--plot`` says otherwise.

Usage::

    python benchmarks/scale_owners.py [--owners 2,10,100,1000] [--features 20]
                                      [--rows 16] [--owners-per-driver 250]
                                      [--clients async|node] [--connect-timeout 600]
                                      [--deadline 1800] [--plot PATH] [--keep DIR]

The last line reads ``owners=<largest N> end_to_end_seconds=<s>
seconds_per_owner=<s> proxy_growth_kib_per_owner=<KiB>`` (growth from the smallest
to the largest N).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from synthetic import BOUND, owner_tables

from fedpca.analyst.baseline import private_local_pca_baseline
from fedpca.analyst.client import AnalystClient
from fedpca.analyst.estimators import FederatedPCA
from fedpca.app.cluster import LocalCluster, ManagedProcess
from fedpca.preprocess import FeatureBounds, preprocess
from fedpca.transport.certs import TlsMaterial

KEY_BITS = 2048
MAX_OWNERS = 1024
DRIVER_READY = "driver ready:"
FIGURE = Path(__file__).resolve().parents[1] / "docs" / "figures" / "scale_owners.png"


def log(message: str) -> None:
    print(message, flush=True)


def proc_status_kib(pid: int, field: str) -> int:
    """A memory field (``VmRSS``, ``VmHWM``) of a live process, in KiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise SystemExit(f"no {field} for process {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process's threads (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    # utime and stime are fields 14 and 15 of stat(5); the split starts at field 3.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ driver
def run_driver(config_list: Path, clients: str, connect_timeout: float) -> None:
    """Run the owners whose configs ``config_list`` names until SIGTERM."""
    from fedpca.codec import CryptoPool

    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    paths = config_list.read_text().split()
    pool = CryptoPool(1)
    pool.start()
    try:
        if clients == "node":
            run_owner_nodes(paths, pool, connect_timeout)
        else:
            asyncio.run(run_async_owners(paths, pool, connect_timeout))
    finally:
        pool.close()


def run_owner_nodes(paths: list[str], pool: Any, connect_timeout: float) -> None:
    """``--clients node``: one :class:`OwnerNode` thread per owner (the real owner code)."""
    from fedpca.owner import node as owner_node
    from fedpca.owner import retry, task_processing
    from fedpca.owner.config import load_config
    from fedpca.owner.node import OwnerNode

    def details(err: Any) -> str:
        debug = getattr(err, "debug_error_string", None)
        return retry.status_details(err) + (f" [{debug()}]" if debug is not None else "")

    # DIAGNOSTIC: name gRPC's own reason in the driver logs (both modules that log it).
    owner_node.status_details = details
    task_processing.status_details = details
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    nodes = [OwnerNode(load_config(path), pool=pool) for path in paths]
    threads = [
        threading.Thread(target=node.run_forever, name=node.config.owner.id, daemon=True)
        for node in nodes
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + connect_timeout
    while not all(node.connected.is_set() for node in nodes):
        if time.monotonic() > deadline or stop.is_set():
            missing = [n.config.owner.id for n in nodes if not n.connected.is_set()]
            raise SystemExit(f"owners not connected after {connect_timeout:.0f} s: {missing[:5]}")
        time.sleep(0.1)
    log(f"{DRIVER_READY} {len(nodes)} owners connected")
    while not stop.wait(0.5):
        pass
    for node in nodes:
        node.stop()
    for thread in threads:
        thread.join(timeout=30.0)


def build_upload(task: Any, config: Any, table: Any, pool: Any) -> list[Any]:
    """An owner's upload messages for ``task``, made by the owner's own functions.

    The owner's public policy check (signature, pinned key, epsilon caps:
    :func:`fedpca.owner.policy.check_task`), its exact fixed-point share
    (:func:`fedpca.owner.compute.encode_share`), its packed DJN encryption
    (:func:`fedpca.owner.compute.encrypt_share_stream`) and its chained chunks
    (:class:`fedpca.messages.ChunkChain`, :func:`fedpca.messages.chunk_stream`, the
    serde messages), as :class:`fedpca.owner.upload.OutgoingUpload` builds them.
    Not done here: the budget ledger (no reservation is recorded).
    """
    from fedpca.codec.ciphertext import ciphertext_byte_length
    from fedpca.codec.paillier import Obfuscation
    from fedpca.messages import (
        UPLOAD_CHUNK_BYTES,
        ChunkChain,
        blocks_of,
        chunk_count,
        chunk_stream,
        ciphertexts_per_chunk,
        new_upload_id,
    )
    from fedpca.owner.compute import encode_share, encrypt_share_stream
    from fedpca.owner.policy import Refusal, check_task
    from fedpca.transport import serde

    decision = check_task(task, config, table)
    if isinstance(decision, Refusal):
        raise SystemExit(f"{config.owner.id} refused the task: {decision.detail}")
    spec, plan = task.query, decision.plan
    encoded = encode_share(
        spec,
        decision.table,
        plan,
        capacity=config.data.max_records,
        rng=np.random.default_rng(secrets.randbits(128)),
    )
    width = ciphertext_byte_length(spec.analyst_public_key_n.bit_length())
    per_chunk = ciphertexts_per_chunk(width, UPLOAD_CHUNK_BYTES)
    total = sum(block.layout.n_ciphertexts for block in plan.owner_blocks)
    header = serde.upload_header_message(
        task.key,
        spec.analyst_key_fingerprint,
        new_upload_id(),
        blocks_of(plan.owner_blocks),
        chunk_count(total, per_chunk),
    )
    batches = encrypt_share_stream(spec, encoded, plan, pool, obfuscation=Obfuscation.DJN)
    chain = ChunkChain()
    chunks = [
        serde.upload_chunk_message(chain.next(data))
        for data in chunk_stream(batches, width, per_chunk)
    ]
    return [header, *chunks]


async def async_owner(path: str, pool: Any, connected: list[int], stop: asyncio.Event) -> None:
    """``--clients async``: one owner as a grpc.aio client on this driver's event loop."""
    from fedpca.messages import ObfuscationVariant, OwnerHello, Task, UploadStatus
    from fedpca.owner.config import load_config
    from fedpca.owner.local_table import LocalTable
    from fedpca.transport import serde
    from fedpca.transport.channels import channel_credentials, client_options
    from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
    from fedpca.version import __version__

    config = load_config(path)
    table = LocalTable.load(config.data)
    tls = TlsMaterial.load(config.tls.files())
    owner_id = config.owner.id
    hello = OwnerHello(owner_id, __version__, (ObfuscationVariant.DJN, ObfuscationVariant.FULL))
    async with grpc.aio.secure_channel(
        config.owner.proxy, channel_credentials(tls), options=client_options()
    ) as channel:
        stub = owner_grpc.OwnerServiceStub(channel)
        for attempt in range(6):
            try:
                await stub.Hello(serde.owner_hello_to_proto(hello), timeout=60.0)
                break
            except grpc.aio.AioRpcError as err:
                if err.code() is not grpc.StatusCode.UNAVAILABLE or attempt == 5:
                    raise
                await asyncio.sleep(2.0**attempt)
        call = stub.StreamTasks(serde.task_stream_request_to_proto(owner_id))
        first = True
        async for message in call:
            if first:
                connected[0] += 1
                first = False
            event = serde.task_event_from_proto(message)
            if not isinstance(event, Task):
                continue
            messages = await asyncio.to_thread(build_upload, event, config, table, pool)
            reply = await stub.Upload(iter(messages), timeout=600.0)
            receipt = serde.upload_receipt_from_proto(reply)
            if receipt.status is not UploadStatus.ACCEPTED:
                raise SystemExit(f"{owner_id}: upload {receipt.status.value}")
            if stop.is_set():
                break


async def run_async_owners(paths: list[str], pool: Any, connect_timeout: float) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    connected = [0]
    tasks = [asyncio.create_task(async_owner(path, pool, connected, stop)) for path in paths]
    deadline = time.monotonic() + connect_timeout
    while connected[0] < len(paths):
        failed = [t for t in tasks if t.done()]
        if failed:
            failed[0].result()  # raises the owner's error
            raise SystemExit("an owner ended before the query")
        if time.monotonic() > deadline:
            raise SystemExit(f"{connected[0]}/{len(paths)} owners connected after the timeout")
        await asyncio.sleep(0.1)
    log(f"{DRIVER_READY} {len(paths)} owners connected")
    stopping = asyncio.create_task(stop.wait())
    pending = {*tasks, stopping}
    while not stop.is_set():
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not stopping and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def start_drivers(
    cluster: LocalCluster, per_driver: int, connect_timeout: float, clients: str
) -> list[ManagedProcess]:
    """Driver processes for all the cluster's owners; returns once every owner is connected."""
    drivers: list[ManagedProcess] = []
    logs = cluster.workdir / "logs"
    logs.mkdir(exist_ok=True)
    ids = cluster.owner_ids
    for index, start in enumerate(range(0, len(ids), per_driver)):
        listing = cluster.workdir / f"driver-{index}.txt"
        listing.write_text(
            "\n".join(str(cluster.owner_config(i)) for i in ids[start : start + per_driver])
        )
        log_path = logs / f"driver-{index}.log"
        log_file = open(log_path, "wb")  # noqa: SIM115 - closed by ManagedProcess.stop
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--driver",
            str(listing),
            "--connect-timeout",
            str(connect_timeout),
            "--clients",
            clients,
        ]
        process = subprocess.Popen(
            command,
            cwd=cluster.workdir,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # its own process group, killed as a whole on stop
        )
        drivers.append(ManagedProcess(f"driver-{index}", process, log_path, log_file))
    try:
        for driver in drivers:
            driver.wait_for(DRIVER_READY, timeout=connect_timeout + 60.0)
    except BaseException:
        for driver in drivers:
            driver.stop()
        raise
    return drivers


# ------------------------------------------------------------- measurement
@dataclass(frozen=True)
class Row:
    owners: int
    connect_seconds: float
    end_to_end: float
    connected_rss_kib: int
    peak_kib: int
    proxy_cpu: float
    owners_cpu: float
    baseline_compute: float
    hop_seconds: float
    explained: list[float]

    @property
    def per_owner(self) -> float:
        return self.end_to_end / self.owners

    @property
    def baseline_with_hops(self) -> float:
        return self.baseline_compute + (self.owners - 1) * self.hop_seconds


def mtls_hop_seconds(cluster: LocalCluster, repeats: int = 5) -> float:
    """Median time of a fresh mutual-TLS channel plus one unary call to the proxy."""
    tls = TlsMaterial.load(cluster.analyst_tls())
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        with AnalystClient(cluster.proxy_address, tls) as client:
            client.budget()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def baseline_seconds(tables: list[np.ndarray], n_features: int, repeats: int = 3) -> float:
    """Median time of the sequential PrivateLocalPCA baseline over ``tables`` (compute only)."""
    bounds = FeatureBounds((-BOUND,) * n_features, (BOUND,) * n_features)
    rows = [preprocess(table, bounds) for table in tables]
    times = []
    for repeat in range(repeats):
        started = time.perf_counter()
        private_local_pca_baseline(rows, 2, 1.0, np.random.default_rng(repeat))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(owners: int, args: argparse.Namespace, workdir: Path) -> Row:
    tables = owner_tables(owners, args.rows, args.features, seed=owners)
    cluster = LocalCluster(
        workdir=workdir, owner_tables=tables, key_bits=KEY_BITS, label_column=None
    )
    started = time.perf_counter()
    cluster.prepare()
    log(f"[{owners} owners] laid out in {time.perf_counter() - started:.1f} s; starting proxy")
    with cluster:
        cluster.start_proxy()
        assert cluster.proxy is not None
        pid = cluster.proxy.process.pid
        started = time.perf_counter()
        drivers = start_drivers(cluster, args.owners_per_driver, args.connect_timeout, args.clients)
        connect_seconds = time.perf_counter() - started
        try:
            connected_rss = proc_status_kib(pid, "VmRSS")
            log(
                f"[{owners} owners] {len(drivers)} driver process(es), every owner connected "
                f"in {connect_seconds:.1f} s; proxy VmRSS {connected_rss / 1024:.1f} MiB"
            )
            model = FederatedPCA(
                n_components=2,
                epsilon=1.0,
                delta=1e-5,
                bounds=(-BOUND, BOUND),
                quorum=owners,
                max_owners=MAX_OWNERS,
                max_records_per_owner=args.rows,
                deadline_seconds=args.deadline,
                **cluster.analyst_connection(),
            )
            driver_pids = [d.process.pid for d in drivers]
            proxy_cpu = cpu_seconds(pid)
            owners_cpu = sum(map(cpu_seconds, driver_pids))
            started = time.perf_counter()
            model.fit(n_features=args.features)
            end_to_end = time.perf_counter() - started
            proxy_cpu = cpu_seconds(pid) - proxy_cpu
            owners_cpu = sum(map(cpu_seconds, driver_pids)) - owners_cpu
            peak = proc_status_kib(pid, "VmHWM")
            if model.n_owners_ != owners:
                raise SystemExit(f"the result aggregates {model.n_owners_} owners, not {owners}")
            log(
                f"[{owners} owners] query done in {end_to_end:.2f} s; proxy VmHWM "
                f"{peak / 1024:.1f} MiB"
            )
            hop = mtls_hop_seconds(cluster)
        finally:
            for driver in drivers:
                driver.stop(timeout=30.0)
    return Row(
        owners=owners,
        connect_seconds=connect_seconds,
        end_to_end=end_to_end,
        connected_rss_kib=connected_rss,
        peak_kib=peak,
        proxy_cpu=proxy_cpu,
        owners_cpu=owners_cpu,
        baseline_compute=baseline_seconds(tables, args.features),
        hop_seconds=hop,
        explained=np.round(model.explained_variance_ratio_, 3).tolist(),
    )


def plot(rows: list[Row], path: Path, n_features: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    owners = [r.owners for r in rows]
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    axes.plot(owners, [r.end_to_end for r in rows], "o-", label="fedpca, end to end (measured)")
    axes.plot(
        owners,
        [r.baseline_with_hops for r in rows],
        "s--",
        label="PrivateLocalPCA, compute + N−1 mTLS hops (model)",
    )
    axes.plot(
        owners,
        [r.baseline_compute for r in rows],
        "^:",
        label="PrivateLocalPCA, compute only (measured)",
    )
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xticks(owners, [str(n) for n in owners])
    axes.minorticks_off()
    axes.set_xlabel("owners")
    axes.set_ylabel("seconds")
    axes.set_title(f"one private PCA, M = {n_features}, 2048-bit key, 2 cores")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--owners", default="2,10,100,1000", help="comma-separated owner counts")
    parser.add_argument("--features", type=int, default=20)
    parser.add_argument("--rows", type=int, default=16, help="rows per owner")
    parser.add_argument("--owners-per-driver", type=int, default=250)
    parser.add_argument(
        "--clients",
        choices=("async", "node"),
        default="async",
        help="owners as grpc.aio clients built from the owner's functions (async), or as "
        "OwnerNode threads (node; the real daemon, fine up to ~100 owners per machine)",
    )
    parser.add_argument("--connect-timeout", type=float, default=600.0)
    parser.add_argument("--deadline", type=float, default=1800.0, help="query deadline, s")
    parser.add_argument(
        "--plot", default=str(FIGURE), help="PNG to write the plot to ('' for none)"
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep the working folder here")
    parser.add_argument("--driver", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver is not None:
        run_driver(args.driver, args.clients, args.connect_timeout)
        return
    counts = sorted({int(n) for n in args.owners.split(",")})
    if not counts or counts[0] < 1 or counts[-1] > MAX_OWNERS:
        raise SystemExit(f"--owners must be counts in [1, {MAX_OWNERS}]")
    logging.getLogger("fedpca").setLevel(logging.WARNING)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="fedpca-scale-"))
    started = time.perf_counter()
    rows: list[Row] = []
    try:
        for owners in counts:
            folder = workdir / f"owners-{owners}"
            rows.append(measure(owners, args, folder))
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    first = rows[0]
    log("")
    clients = (
        "grpc.aio clients made of the owner's functions"
        if args.clients == "async"
        else "OwnerNode threads"
    )
    log(
        f"stats-mode PCA, M = {args.features}, {args.rows} rows per owner, epsilon = 1, "
        f"{KEY_BITS}-bit Paillier, gRPC with mutual TLS on loopback, {os.cpu_count()} cores; "
        f"owners: {clients}, {args.owners_per_driver} per driver process"
    )
    header = (
        f"{'owners':>6} {'e2e s':>7} {'s/owner':>8} {'proxy CPU':>9} {'owner CPU':>9} "
        f"{'proxy RSS':>9} {'proxy peak':>10} {'KiB/owner':>9} {'KiB/owner':>9} "
        f"{'baseline':>9} {'baseline+hops':>13} {'connect s':>9}"
    )
    units = (
        f"{'':>6} {'':>7} {'':>8} {'ms/owner':>9} {'ms/owner':>9} {'conn. MiB':>9} "
        f"{'MiB':>10} {'vs first':>9} {'vs prev':>9} {'compute s':>9} {'s (model)':>13} "
        f"{'(setup)':>9}"
    )
    log(header)
    log(units)
    previous = None
    for row in rows:
        vs_first = (
            (row.peak_kib - first.peak_kib) / (row.owners - first.owners)
            if row.owners > first.owners
            else math.nan
        )
        vs_previous = (
            (row.peak_kib - previous.peak_kib) / (row.owners - previous.owners)
            if previous is not None
            else math.nan
        )
        log(
            f"{row.owners:>6} {row.end_to_end:>7.2f} {row.per_owner:>8.4f} "
            f"{row.proxy_cpu / row.owners * 1e3:>9.1f} {row.owners_cpu / row.owners * 1e3:>9.1f} "
            f"{row.connected_rss_kib / 1024:>9.1f} {row.peak_kib / 1024:>10.1f} "
            f"{vs_first:>9.1f} {vs_previous:>9.1f} {row.baseline_compute:>9.4f} "
            f"{row.baseline_with_hops:>13.3f} {row.connect_seconds:>9.1f}"
        )
        previous = row
    log(
        "(proxy CPU: its main process during the query; owner CPU: the driver processes' "
        "main processes (crypto workers not counted); proxy RSS/peak: VmRSS with every owner "
        "connected before the query, VmHWM after it; hop = fresh mTLS channel + one call, "
        f"median {statistics.median(r.hop_seconds for r in rows) * 1e3:.1f} ms)"
    )
    for row in rows:
        log(f"  {row.owners} owners: explained variance ratio {row.explained}")
    if args.plot:
        plot(rows, Path(args.plot), args.features)
        log(f"plot written to {args.plot}")
    last = rows[-1]
    growth = (
        (last.peak_kib - first.peak_kib) / (last.owners - first.owners)
        if last.owners > first.owners
        else math.nan
    )
    log(f"total run time {time.perf_counter() - started:.1f} s")
    log(
        f"owners={last.owners} end_to_end_seconds={last.end_to_end:.2f} "
        f"seconds_per_owner={last.per_owner:.4f} proxy_growth_kib_per_owner={growth:.1f}"
    )


if __name__ == "__main__":
    main()
