"""Proxy ingest throughput, group commit on vs off, measured in one run.

In-process benchmark of the proxy's durable ingest path, without gRPC: the real
:class:`fedpca.proxy.coordinator.Coordinator` over a real
:class:`fedpca.proxy.store.ProxyStore` (SQLite in WAL mode with ``synchronous=FULL``
on this machine's disk, in a fresh temporary folder per trial), a signed stats-mode
PCA query under a 2048-bit analyst key, and ``--uploaders`` concurrent uploads, one
thread each (as the proxy's worker threads fold the chunks of concurrent upload
streams). Every upload goes through exactly what the proxy's servicer calls for it:
``begin_upload`` (header checks, the owner joins the contributors), ``add`` for each
chunk (ciphertext range and coprimality checks, the homomorphic fold into the
aggregate page, acknowledged only once committed; the pages it completes become
final), ``complete``. The chunks are those an owner sends (``serde.encode_upload``:
512 ciphertexts, 256 KiB each, hash-chained), decoded and chain-checked before the
clock starts (the servicer does that on its event loop, outside the store).

The ciphertexts are uniformly random elements of [2, n^2) (in Z*_{n^2} with
overwhelming probability): the proxy cannot tell them from encryptions and does the
same work; nobody decrypts. epsilon = inf (NOT PRIVATE verification mode), so no
noise is drawn: noise is not ingest.

Trials alternate between ``ProxyStore(group_commit=True)`` and ``group_commit=False``
(one transaction and one fsync per operation), ``--trials`` of each; the median of
each mode is reported, and their ratio.

Usage::

    python benchmarks/proxy_ingest.py [--uploaders 10] [--features 1000] [--trials 2]

The last line reads ``group_commit_chunks_per_s=<x> no_group_commit_chunks_per_s=<x>
speedup=<x>``.
"""

from __future__ import annotations

import argparse
import logging
import math
import secrets
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedpca.codec import CryptoPool, generate_keypair, key_fingerprint
from fedpca.dp.mechanisms import PrivacyParams
from fedpca.messages import (
    UPLOAD_CHUNK_BYTES,
    CiphertextPayload,
    DecodedChunk,
    QueryState,
    SignedQuery,
)
from fedpca.protocol import ReleasePlan
from fedpca.proxy.config import BudgetConfig, OwnersConfig, ProxyConfig
from fedpca.proxy.coordinator import Coordinator, task_id
from fedpca.proxy.queries import wire_blocks
from fedpca.proxy.store import ProxyStore
from fedpca.query import QueryKind, QuerySpec, stamped
from fedpca.signing import generate_signing_key, sign_query, signer_id
from fedpca.transport import serde

KEY_BITS = 2048
ANALYST = "alice"
MIB = 1024 * 1024


@dataclass(frozen=True)
class Upload:
    """One owner's upload, decoded as the servicer hands it to the coordinator."""

    owner_id: str
    header: Any
    chunks: list[DecodedChunk]
    content_sha256: bytes
    n_bytes: int


@dataclass(frozen=True)
class Trial:
    group_commit: bool
    seconds: float
    chunks: int
    n_bytes: int
    operations: int
    commits: int

    @property
    def chunks_per_second(self) -> float:
        return self.chunks / self.seconds

    @property
    def mib_per_second(self) -> float:
        return self.n_bytes / MIB / self.seconds


def make_spec(public_key: Any, n_features: int, owners: int, query_id: str) -> QuerySpec:
    return QuerySpec(
        query_id=query_id,
        kind=QueryKind.PCA,
        n_features=n_features,
        epsilon=math.inf,  # NOT PRIVATE verification mode: no noise to draw
        delta=1e-5,
        n_components=2,
        analyst_public_key_n=public_key.n,
        analyst_key_fingerprint=key_fingerprint(public_key),
        quorum=owners,
        deadline_seconds=3600.0,
    )


def make_upload(spec: QuerySpec, n: int, owner_id: str) -> Upload:
    """Random ciphertexts in the plan's layout, encoded and decoded as on the wire."""
    blocks = wire_blocks(ReleasePlan.for_query(spec, KEY_BITS))
    n_square = n * n
    payload = CiphertextPayload(
        blocks,
        {
            block.name: [secrets.randbelow(n_square - 2) + 2 for _ in range(block.n_ciphertexts)]
            for block in blocks
        },
    )
    messages = serde.encode_upload(
        task_id(ANALYST, spec.query_id),
        spec.analyst_key_fingerprint,
        f"{owner_id}-{secrets.token_hex(8)}",
        payload,
        UPLOAD_CHUNK_BYTES,
    )
    header = serde.upload_header_from_message(messages[0])
    assembler = header.assembler()
    chunks = [assembler.add(serde.upload_chunk_from_message(m)) for m in messages[1:]]
    assembler.finish()
    return Upload(
        owner_id, header, chunks, assembler.content_sha256, sum(len(c.data) for c in chunks)
    )


def run_trial(
    folder: Path,
    group_commit: bool,
    public_key: Any,
    signing_key: Any,
    pool: CryptoPool,
    args: argparse.Namespace,
    index: int,
) -> Trial:
    owner_ids = [f"owner-{i + 1}" for i in range(args.uploaders)]
    config = ProxyConfig(
        budget=BudgetConfig(
            PrivacyParams(math.inf, 1e-3), {ANALYST: PrivacyParams(math.inf, 1e-3)}
        ),
        owners=OwnersConfig(frozenset(owner_ids)),
    )
    store = ProxyStore(folder / "proxy.sqlite3", group_commit=group_commit)
    coordinator = Coordinator(store, config, pool, precompute_noise=False)
    try:
        for owner_id in owner_ids:
            coordinator.enroll(owner_id)
        # Stamped with its signing time, as the analyst's client does (the proxy refuses
        # a query no owner would answer).
        spec = stamped(make_spec(public_key, args.features, args.uploaders, f"ingest-{index}"))
        signed = SignedQuery(spec, sign_query(spec, signing_key), signer_id(signing_key))
        coordinator.submit(ANALYST, signed)
        uploads = [make_upload(spec, public_key.n, owner_id) for owner_id in owner_ids]
        operations_before, commits_before = store.commit_stats
        start = threading.Barrier(len(uploads) + 1)
        errors: list[BaseException] = []

        def upload(item: Upload) -> None:
            try:
                start.wait()
                stream = coordinator.begin_upload(item.owner_id, item.header)
                try:
                    for chunk in item.chunks:
                        stream.add(chunk)
                    stream.complete(item.content_sha256)
                except BaseException:
                    stream.abandon()
                    raise
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=upload, args=(u,)) for u in uploads]
        for thread in threads:
            thread.start()
        start.wait()
        started = time.perf_counter()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started
        if errors:
            raise SystemExit(f"an upload failed: {errors[0]!r}")
        key = task_id(ANALYST, spec.query_id)
        deadline = time.monotonic() + 60.0
        while store.query(key).state is not QueryState.DONE:
            if time.monotonic() > deadline:
                raise SystemExit(f"query {key} is {store.query(key).state.value}, not done")
            time.sleep(0.05)
        operations, commits = store.commit_stats
    finally:
        coordinator.shutdown()
        store.close()
    return Trial(
        group_commit,
        seconds,
        sum(len(u.chunks) for u in uploads),
        sum(u.n_bytes for u in uploads),
        operations - operations_before,
        commits - commits_before,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uploaders", type=int, default=10, help="concurrent uploads")
    parser.add_argument("--features", type=int, default=1000, help="M (upload size ~ M^2/2)")
    parser.add_argument("--trials", type=int, default=2, help="trials of each mode")
    parser.add_argument("--keep", type=Path, default=None, help="keep the working folder here")
    args = parser.parse_args()
    # Every plan and the coordinator would warn that epsilon = inf is NOT PRIVATE.
    logging.getLogger("fedpca").setLevel(logging.ERROR)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="fedpca-ingest-"))
    public_key, _ = generate_keypair(KEY_BITS)
    signing_key = generate_signing_key()
    trials: list[Trial] = []
    try:
        with CryptoPool(1) as pool:
            for index in range(2 * args.trials):
                group_commit = index % 2 == 0
                folder = workdir / f"trial-{index}"
                folder.mkdir(parents=True)
                trial = run_trial(folder, group_commit, public_key, signing_key, pool, args, index)
                trials.append(trial)
                print(
                    f"trial {index + 1}: group commit {'on ' if group_commit else 'off'} "
                    f"{trial.chunks} chunks ({trial.n_bytes / MIB:.1f} MiB) in "
                    f"{trial.seconds:.2f} s: {trial.chunks_per_second:.1f} chunks/s, "
                    f"{trial.mib_per_second:.1f} MiB/s; {trial.operations} writes in "
                    f"{trial.commits} commits",
                    flush=True,
                )
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)

    def median(mode: bool, attribute: str) -> float:
        return statistics.median(getattr(t, attribute) for t in trials if t.group_commit is mode)

    on_chunks, off_chunks = median(True, "chunks_per_second"), median(False, "chunks_per_second")
    on_mib, off_mib = median(True, "mib_per_second"), median(False, "mib_per_second")
    writes_per_commit = sum(t.operations for t in trials if t.group_commit) / sum(
        t.commits for t in trials if t.group_commit
    )
    print("")
    print(
        f"in-process ingest: {args.uploaders} concurrent uploads, M = {args.features} "
        f"({trials[0].chunks // args.uploaders} chunks of 512 ciphertexts each), "
        f"{KEY_BITS}-bit key, SQLite WAL synchronous=FULL; median of {args.trials} trial(s)"
    )
    print(f"{'group commit':<14}{'chunks/s':>10}{'MiB/s':>8}")
    print(f"{'on':<14}{on_chunks:>10.1f}{on_mib:>8.1f}")
    print(f"{'off':<14}{off_chunks:>10.1f}{off_mib:>8.1f}")
    print(f"on: {writes_per_commit:.1f} writes per commit (fsync) on average")
    print(
        f"group_commit_chunks_per_s={on_chunks:.1f} no_group_commit_chunks_per_s="
        f"{off_chunks:.1f} speedup={on_chunks / off_chunks:.2f}"
    )


if __name__ == "__main__":
    main()
