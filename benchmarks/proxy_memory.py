"""Proxy peak memory with a few vs many owners uploading at once.

Claim measured: the proxy folds each upload chunk into the encrypted aggregate as it
arrives, so its memory grows with the number of ciphertexts of one upload, not with
owners × ciphertexts.

One run starts two real proxy processes (``python -m fedpca.app.cli proxy serve``), one
after the other, each with fresh certificates and database: one for
``--owners-small`` owners and one for ``--owners-large`` owners. For each, the
analyst "alice" (unlimited budget in the proxy config, 2048-bit Paillier key)
submits one stats-mode PCA query over ``--features`` features with epsilon = inf
(NOT PRIVATE verification mode: no noise, so the proxy's noise step is trivial) and
quorum = owners, over gRPC with mutual TLS on loopback. The owners are threads of
this process, each with its own mTLS channel and owner certificate: Hello, read the
task from StreamTasks, build the upload, then all are released at once by a barrier
so that their uploads stream in concurrently.

The owners do not encrypt: each ciphertext is a uniformly random element of
[2, n^2), which is in Z*_{n^2} with overwhelming probability. The proxy only
validates ciphertexts (range, coprime to n) and multiplies them mod n^2; it cannot
tell them from real encryptions, so its memory and work are those of a real query
(the result is meaningless, and nobody decrypts it).

Reported per proxy: owners, ciphertexts and MiB per upload, MiB uploaded in total,
the proxy's resident memory just before the uploads start (VmRSS, the baseline) and
its peak resident memory once the query is DONE (VmHWM), both from
``/proc/<pid>/status`` of the proxy's main process (which folds the chunks; its
crypto pool's worker processes are not counted). Then the growth of
peak − baseline from the small to the large configuration, against the bytes the
extra owners uploaded concurrently. A proxy that buffered whole uploads would show a
ratio of at least 1; a proxy that folds chunk by chunk shows a ratio well below 1.

What it found: with gRPC's default bandwidth-delay probing, the proxy's memory did
grow with owners x upload size at this size (2 vs 10 owners, M = 1500, eight runs:
ratio 0.43 to 1.45). The proxy's own code folded chunk by chunk, but gRPC widened each
upload stream's HTTP/2 window until whole uploads waited in its receive buffers while
the proxy was still folding earlier chunks. The proxy now runs with a fixed 1 MiB
window per stream (``fedpca.transport.channels.STREAM_WINDOW_BYTES``);
``--grpc-server-option`` appends other options for experiments. The figures quoted in
README.md come from runs of this script.

Usage::

    python benchmarks/proxy_memory.py [--features 1500] [--owners-small 2]
                                      [--owners-large 10] [--keep DIR]
                                      [--grpc-server-option NAME=INT ...]

The last line reads
``proxy_peak_growth_mib=<float> extra_upload_mib=<float> growth_over_uploaded=<float>``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from fedpca.app.cluster import PROXY_READY_MARKER, ManagedProcess, free_loopback_port, write_toml
from fedpca.codec import generate_keypair, key_fingerprint
from fedpca.messages import (
    UPLOAD_CHUNK_BYTES,
    CiphertextPayload,
    OwnerHello,
    QueryState,
    SignedQuery,
    Task,
    UploadReceipt,
    UploadStatus,
)
from fedpca.protocol import ReleasePlan
from fedpca.proxy.queries import wire_blocks
from fedpca.query import QueryKind, QuerySpec, stamped
from fedpca.signing import generate_signing_key, sign_query, signer_id
from fedpca.transport import channels, serde
from fedpca.transport.certs import NodeIdentity, Role, TlsFiles, TlsMaterial, init_certificates
from fedpca.v1 import analyst_service_pb2_grpc as analyst_grpc
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc

KEY_BITS = 2048
MIB = 1024 * 1024
RPC_TIMEOUT = 600.0
QUERY_TIMEOUT = 900.0


def log(message: str) -> None:
    print(message, flush=True)


def proc_status_kib(pid: int, field: str) -> int:
    """A memory field (``VmRSS``, ``VmHWM``) of a live process, in KiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise SystemExit(f"no {field} for process {pid}")


def make_spec(public_key: Any, query_id: str, n_features: int, owners: int) -> QuerySpec:
    return QuerySpec(
        query_id=query_id,
        kind=QueryKind.PCA,
        n_features=n_features,
        epsilon=math.inf,  # NOT PRIVATE verification mode: no noise
        delta=1e-5,
        n_components=2,
        analyst_public_key_n=public_key.n,
        analyst_key_fingerprint=key_fingerprint(public_key),
        quorum=owners,
        deadline_seconds=QUERY_TIMEOUT,
    )


SIGNING_KEY = generate_signing_key()
"""The analyst's query-signing key of this run (the owners here are not real nodes and
check nothing; the proxy refuses unsigned queries)."""


def signed_query(spec: QuerySpec) -> SignedQuery:
    """``spec`` (stamped with its signing time, as the analyst's client stamps it: the
    proxy refuses a query no owner would answer) signed."""
    return SignedQuery(spec, sign_query(spec, SIGNING_KEY), signer_id(SIGNING_KEY))


def first_task(stub: owner_grpc.OwnerServiceStub) -> Task:
    """Open a task stream and read events until a task arrives."""
    call = stub.StreamTasks(serde.task_stream_request_to_proto("ignored"), timeout=60.0)
    try:
        for message in call:
            event = serde.task_event_from_proto(message)
            if isinstance(event, Task):
                return event
    finally:
        call.cancel()
    raise RuntimeError("task stream ended without a task")


def random_upload(task: Task, n: int, upload_id: str) -> tuple[list[Any], int]:
    """Upload messages of random elements of Z*_{n^2} in the plan's layout; and their count."""
    spec = task.query
    blocks = wire_blocks(ReleasePlan.for_query(spec, KEY_BITS))
    n_square = n * n
    ciphertexts = {
        block.name: [secrets.randbelow(n_square - 2) + 2 for _ in range(block.n_ciphertexts)]
        for block in blocks
    }
    payload = CiphertextPayload(blocks, ciphertexts)
    messages = serde.encode_upload(
        task.key,  # the proxy's id of the task: analyst/query
        spec.analyst_key_fingerprint,
        upload_id,
        payload,
        UPLOAD_CHUNK_BYTES,
    )
    return messages, payload.total_ciphertexts


@dataclass
class Measurement:
    owners: int
    ciphertexts_per_upload: int
    upload_mib: float
    chunks_per_upload: int
    started_rss_mib: float
    baseline_rss_mib: float
    peak_mib: float
    upload_seconds: float
    max_uploading: int

    @property
    def total_mib(self) -> float:
        return self.owners * self.upload_mib

    @property
    def growth_mib(self) -> float:
        return self.peak_mib - self.baseline_rss_mib


@dataclass
class OwnerThread:
    """One fake owner: its own mTLS channel, task, pre-built upload, receipt."""

    owner_id: str
    files: TlsFiles
    address: str
    spec_query_id: str
    public_n: int
    ready: threading.Barrier
    go: threading.Barrier
    messages: list[Any] | None = None
    n_ciphertexts: int = 0
    receipt: UploadReceipt | None = None
    finished_at: float = 0.0
    error: BaseException | None = None

    def run(self) -> None:
        try:
            with channels.secure_channel(self.address, TlsMaterial.load(self.files)) as channel:
                stub = owner_grpc.OwnerServiceStub(channel)
                stub.Hello(
                    serde.owner_hello_to_proto(OwnerHello(self.owner_id, "proxy_memory")),
                    timeout=60.0,
                )
                task = first_task(stub)
                if task.query.query_id != self.spec_query_id:
                    raise RuntimeError(f"{self.owner_id} got task {task.query.query_id!r}")
                self.messages, self.n_ciphertexts = random_upload(
                    task, self.public_n, f"{self.owner_id}-upload"
                )
                self.ready.wait()
                self.go.wait()
                reply = stub.Upload(iter(self.messages), timeout=RPC_TIMEOUT)
                self.finished_at = time.perf_counter()
                self.receipt = serde.upload_receipt_from_proto(reply)
        except BaseException as exc:  # reported by the main thread
            self.error = exc
            self.ready.abort()
            self.go.abort()


def write_proxy_config(
    workdir: Path,
    files: TlsFiles,
    port: int,
    owner_ids: list[str],
    extra: dict[str, dict[str, Any]] | None = None,
) -> Path:
    """A benchmark proxy's configuration: loopback, these owners allowed, a 1e-5 budget,
    one crypto worker; ``extra``'s tables added (a table already there is updated)."""
    document: dict[str, dict[str, Any]] = {
        "proxy": {
            "id": "proxy",
            "listen": f"127.0.0.1:{port}",
            "database": workdir / "state" / "proxy.sqlite3",
        },
        "owners": {"allowed": owner_ids},
        "tls": {
            "ca": files.ca_certificate,
            "cert": files.certificate,
            "key": files.private_key,
        },
        "budget": {"epsilon": 1.0, "delta": 1e-5},
        "crypto": {"processes": 1},
    }
    for table, entries in (extra or {}).items():
        document.setdefault(table, {}).update(entries)
    path = workdir / "proxy.toml"
    write_toml(path, document)
    (workdir / "state").mkdir(exist_ok=True)
    return path


# Runs ``fedpca proxy serve`` with extra gRPC server options appended to
# fedpca.transport.channels.server_options (diagnostic runs only, see --grpc-server-option).
PATCHED_PROXY = """
import sys
from fedpca.transport import channels
pairs = [option.partition("=") for option in sys.argv[1].split(",")]
extra = [(name, int(value)) for name, _, value in pairs]
base = channels.server_options
channels.server_options = lambda *args, **kwargs: base(*args, **kwargs) + extra
from fedpca.app.cli import main
main(args=sys.argv[2:], prog_name="fedpca")
"""


def start_proxy(
    workdir: Path, config: Path, server_options: list[str], patch: str = PATCHED_PROXY
) -> ManagedProcess:
    """``fedpca proxy serve``; with ``server_options``, through ``patch`` given them."""
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    log_path = logs / "proxy.log"
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed by ManagedProcess.stop
    serve = ["proxy", "serve", "--config", str(config), "--new-database"]
    if server_options:
        command = [sys.executable, "-c", patch, ",".join(server_options), *serve]
    else:
        command = [sys.executable, "-m", "fedpca.app.cli", *serve]
    process = subprocess.Popen(
        command,
        cwd=workdir,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # its own process group, killed as a whole on exit
    )
    return ManagedProcess("proxy", process, log_path, log_file)


@contextlib.contextmanager
def running_proxy(
    workdir: Path, config: Path, server_options: list[str]
) -> Iterator[ManagedProcess]:
    proxy = start_proxy(workdir, config, server_options)
    try:
        proxy.wait_for(PROXY_READY_MARKER, timeout=60.0)
        yield proxy
    finally:
        proxy.stop(timeout=10.0)  # SIGTERM, then SIGKILL of the whole process group


def measure(
    workdir: Path, owners: int, n_features: int, public_key: Any, server_options: list[str]
) -> Measurement:
    """Run one proxy, one query with ``owners`` concurrent uploads; measure its memory."""
    owner_ids = [f"owner-{i + 1}" for i in range(owners)]
    tls = init_certificates(workdir / "certs", owner_ids=owner_ids, analyst_ids=["alice"])
    port = free_loopback_port()
    address = f"127.0.0.1:{port}"
    config = write_proxy_config(
        workdir,
        tls[NodeIdentity(Role.PROXY, "proxy")],
        port,
        owner_ids,
        extra={
            "proxy": {"heartbeat_seconds": 2.0},
            # epsilon = inf queries (no noise) only pass an unlimited budget.
            "budget.analysts.alice": {"epsilon": math.inf, "delta": 1.0e-3},
        },
    )
    log(f"[{owners} owners] starting proxy process")
    with running_proxy(workdir, config, server_options) as proxy:
        pid = proxy.process.pid
        started_rss = proc_status_kib(pid, "VmRSS") / 1024
        log(f"[{owners} owners] proxy pid {pid} ready, VmRSS {started_rss:.1f} MiB")
        analyst_tls = TlsMaterial.load(tls[NodeIdentity(Role.ANALYST, "alice")])
        with channels.secure_channel(address, analyst_tls) as analyst_channel:
            analyst = analyst_grpc.AnalystServiceStub(analyst_channel)
            spec = stamped(make_spec(public_key, f"memory-{owners}", n_features, owners))
            status = serde.query_status_from_proto(
                analyst.SubmitQuery(
                    serde.submit_query_request_to_proto(signed_query(spec)), timeout=60.0
                )
            )
            log(f"[{owners} owners] query {spec.query_id} submitted: {status.state.value}")

            ready = threading.Barrier(owners + 1, timeout=RPC_TIMEOUT)
            go = threading.Barrier(owners + 1, timeout=RPC_TIMEOUT)
            workers = [
                OwnerThread(
                    owner_id,
                    tls[NodeIdentity(Role.OWNER, owner_id)],
                    address,
                    spec.query_id,
                    public_key.n,
                    ready,
                    go,
                )
                for owner_id in owner_ids
            ]
            threads = [
                threading.Thread(target=w.run, name=w.owner_id, daemon=True) for w in workers
            ]
            log(f"[{owners} owners] owners: Hello, task, building random uploads")
            for thread in threads:
                thread.start()
            try:
                ready.wait()
            except threading.BrokenBarrierError:
                raise_owner_errors(workers, threads)
                raise
            chunks = len(workers[0].messages or []) - 1
            per_upload = workers[0].n_ciphertexts
            upload_mib = per_upload * (KEY_BITS // 4) / MIB
            baseline_rss = proc_status_kib(pid, "VmRSS") / 1024
            log(
                f"[{owners} owners] all uploads built ({per_upload} ciphertexts, "
                f"{upload_mib:.1f} MiB, {chunks} chunks each); proxy VmRSS "
                f"{baseline_rss:.1f} MiB; releasing all owners at once"
            )
            go.wait()
            released = time.perf_counter()
            max_uploading = 0
            deadline = time.monotonic() + QUERY_TIMEOUT
            while True:
                status = serde.query_status_from_proto(
                    analyst.GetQueryStatus(serde.query_ref_to_proto(spec.query_id), timeout=60.0)
                )
                max_uploading = max(max_uploading, status.owners_uploading)
                if status.terminal:
                    break
                if any(w.error for w in workers):
                    raise_owner_errors(workers, threads)
                if time.monotonic() > deadline:
                    raise SystemExit(f"query {spec.query_id} not done: {status}")
                time.sleep(0.1)
            peak = proc_status_kib(pid, "VmHWM") / 1024
            for thread in threads:
                thread.join(timeout=60.0)
            raise_owner_errors(workers, threads)
            if status.state is not QueryState.DONE or status.owners_contributed != owners:
                raise SystemExit(
                    f"query {spec.query_id} ended {status.state.value} with "
                    f"{status.owners_contributed}/{owners} owners: {status.failure_reason}"
                )
            for worker in workers:
                receipt = worker.receipt
                if (
                    receipt is None
                    or receipt.status is not UploadStatus.ACCEPTED
                    or receipt.ciphertexts_received != per_upload
                ):
                    raise SystemExit(f"{worker.owner_id}: upload not accepted: {receipt}")
            upload_seconds = max(w.finished_at for w in workers) - released
            log(
                f"[{owners} owners] query DONE with {status.owners_contributed} owners, "
                f"uploads took {upload_seconds:.1f} s; fetching the result"
            )
            result = serde.decode_result(
                analyst.FetchResult(serde.query_ref_to_proto(spec.query_id), timeout=RPC_TIMEOUT)
            )
            if result.n_owners != owners or result.query != spec:
                raise SystemExit(f"result aggregates {result.n_owners} owners, not {owners}")
            if result.payload.total_ciphertexts != per_upload:
                raise SystemExit(
                    f"result has {result.payload.total_ciphertexts} ciphertexts, not {per_upload}"
                )
    return Measurement(
        owners=owners,
        ciphertexts_per_upload=per_upload,
        upload_mib=upload_mib,
        chunks_per_upload=chunks,
        started_rss_mib=started_rss,
        baseline_rss_mib=baseline_rss,
        peak_mib=peak,
        upload_seconds=upload_seconds,
        max_uploading=max_uploading,
    )


def raise_owner_errors(workers: list[OwnerThread], threads: list[threading.Thread]) -> None:
    alive = [t.name for t in threads if t.is_alive()]
    for worker in workers:
        if worker.error is not None and not isinstance(worker.error, threading.BrokenBarrierError):
            error: Any = worker.error
            detail = f"{error.code()}: {error.details()}" if isinstance(error, grpc.Call) else error
            raise SystemExit(f"{worker.owner_id} failed: {detail}")
    if alive:
        raise SystemExit(f"owner threads still running: {alive}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=1500, help="M (upload size ~ M^2/2)")
    parser.add_argument("--owners-small", type=int, default=2)
    parser.add_argument("--owners-large", type=int, default=10)
    parser.add_argument("--keep", type=Path, default=None, help="keep the working folder here")
    parser.add_argument(
        "--grpc-server-option",
        action="append",
        default=[],
        metavar="NAME=INT",
        help="DIAGNOSTIC: append this gRPC server option to the proxy's (e.g. "
        "grpc.http2.bdp_probe=0); the proxy then runs through a small launcher that "
        "patches fedpca.transport.channels.server_options, not the plain command",
    )
    args = parser.parse_args()
    if not 1 <= args.owners_small < args.owners_large:
        raise SystemExit("need 1 <= --owners-small < --owners-large")
    server_options: list[str] = args.grpc_server_option
    for option in server_options:
        name, equals, value = option.partition("=")
        if not (name and equals and value.lstrip("-").isdigit()) or "," in option:
            raise SystemExit(f"--grpc-server-option {option!r}: expected NAME=INT")
    if server_options:
        log(f"DIAGNOSTIC run: proxy gRPC server options + {server_options}")
    # Every owner's plan would warn that epsilon = inf is NOT PRIVATE; say it once.
    logging.getLogger("fedpca.dp.calibration").setLevel(logging.ERROR)
    log("epsilon = inf: verification mode, no noise, NOT PRIVATE (random ciphertexts anyway)")
    started = time.perf_counter()
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="fedpca-proxy-memory-"))
    try:
        public_key, _ = generate_keypair(KEY_BITS)
        if public_key.n.bit_length() != KEY_BITS:
            raise SystemExit(f"analyst key has {public_key.n.bit_length()} bits")
        results = []
        for owners in (args.owners_small, args.owners_large):
            folder = workdir / f"owners-{owners}"
            folder.mkdir(parents=True, exist_ok=True)
            results.append(
                measure(folder.resolve(), owners, args.features, public_key, server_options)
            )
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    small, large = results
    log("")
    log(
        f"stats-mode PCA, M = {args.features}, epsilon = inf (no noise), {KEY_BITS}-bit "
        "Paillier key, gRPC with mutual TLS on loopback, one proxy process per row"
    )
    log(
        f"{'owners':>6} {'ciphertexts/upload':>18} {'MiB/upload':>10} {'chunks':>6} "
        f"{'MiB total':>9} {'RSS start':>9} {'baseline':>8} {'peak':>7} {'peak-base':>9} "
        f"{'upload s':>8} {'max concurrent':>14}"
    )
    for m in results:
        log(
            f"{m.owners:>6} {m.ciphertexts_per_upload:>18} {m.upload_mib:>10.1f} "
            f"{m.chunks_per_upload:>6} {m.total_mib:>9.1f} {m.started_rss_mib:>9.1f} "
            f"{m.baseline_rss_mib:>8.1f} {m.peak_mib:>7.1f} {m.growth_mib:>9.1f} "
            f"{m.upload_seconds:>8.1f} {m.max_uploading:>14}"
        )
    log(
        "(MiB of resident memory of the proxy's main process: 'baseline' is VmRSS just "
        "before the uploads, 'peak' is VmHWM once the query is DONE; 'max concurrent' is "
        "the most owners the proxy reported as uploading at once, polled every 0.1 s)"
    )
    growth = large.growth_mib - small.growth_mib
    extra = (large.owners - small.owners) * large.upload_mib
    ratio = growth / extra
    log(
        f"{large.owners - small.owners} extra owners uploaded {extra:.1f} MiB more, "
        f"concurrently; the proxy's peak above baseline grew by {growth:.1f} MiB "
        f"({ratio:.3f} of the extra bytes; buffering whole uploads would give >= 1)"
    )
    log(
        f"per extra owner: {growth / (large.owners - small.owners):.1f} MiB of proxy memory "
        f"for an upload of {large.upload_mib:.1f} MiB"
    )
    log(f"total run time {time.perf_counter() - started:.1f} s")
    log(
        f"proxy_peak_growth_mib={growth:.2f} extra_upload_mib={extra:.2f} "
        f"growth_over_uploaded={ratio:.3f}"
    )


if __name__ == "__main__":
    main()
