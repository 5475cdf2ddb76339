"""TEST ONLY: run the proxy with a seeded, *insecure* noise sampler.

``python tests/integration/seeded_proxy.py --seed 7 --config proxy.toml`` behaves
like ``fedpca proxy serve --config proxy.toml`` (prints ``proxy listening on
HOST:PORT`` once it serves, stops gracefully on SIGTERM/SIGINT, dies on SIGKILL
like the real thing) but builds :class:`fedpca.proxy.server.ProxyServer` with
:class:`fedpca.dp.noise.TestOnlySeededSampler` noise, so that two runs of the same
query draw the same noise and their results can be compared.

Every draw is seeded afresh from ``(seed, sigma_int, size)``
(:class:`PerDrawSeededSampler`): a query's noise must not depend on which process
draws it (the first one, or the one restarted after a ``kill -9`` in the middle of
the noise step) nor on the queries that process noised before.

``--crash TASK_ID:POINT:K`` (TEST ONLY fault injection) makes the process SIGKILL
itself at an exact point of that query, for windows of a few milliseconds that a
kill from outside rarely hits. ``TASK_ID`` is the proxy's key of the query,
``analyst/query_id`` (:func:`fedpca.proxy.coordinator.task_id`):

* ``prep:K``: at the K-th noise draw of that query's noise preparation, which the
  proxy starts on a background thread when it accepts the query;
* ``fold:K``: inside the SQLite transaction that folds a chunk of the K-th owner's
  upload into the aggregate, before it commits;
* ``staged:K``: right after such a chunk fold committed, before the upload
  completes (the restarted proxy must take the chunk out, and the owner's resent
  upload fold it again exactly once);
* ``folded:K``: right after the transaction accepting the K-th upload committed,
  before the owner's acknowledgement leaves (the owner must retry and be answered
  DUPLICATE);
* ``page:K``: with the noise of the query's K-th result page computed, inside the
  transaction that stores the page, before its COMMIT (the page is not final; the
  restarted proxy makes it final with fresh noise).

This file lives under ``tests/`` on purpose: production code has no way to seed
its noise (no CLI flag, no environment variable); only a test can construct the
server with another sampler. :class:`fedpca.app.cluster.LocalCluster` runs it as a
separate OS process through its ``proxy_command`` field.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import numpy.typing as npt

from fedpca.app.cluster import PROXY_READY_MARKER
from fedpca.dp.noise import TestOnlySeededSampler
from fedpca.logs import TEXT_FORMAT as LOG_FORMAT
from fedpca.messages import SignedQuery
from fedpca.proxy.config import load_config
from fedpca.proxy.coordinator import Coordinator, task_id
from fedpca.proxy.server import ProxyServer
from fedpca.proxy.store import ProxyStore
from fedpca.proxy.store_records import QueryRecord, UploadCompletion

logger = logging.getLogger("fedpca.tests.seeded_proxy")


class PerDrawSeededSampler:
    """TEST ONLY: :class:`TestOnlySeededSampler` seeded by ``(seed, sigma_int, size)``.

    The same request always returns the same values, in any process and after any
    history; insecure by construction (see :class:`TestOnlySeededSampler`).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.crash_in: int | None = None
        """TEST ONLY: SIGKILL this process at the ``crash_in``-th draw from now."""

    def sample(self, sigma_int: float, size: int) -> npt.NDArray[np.int64]:
        if self.crash_in is not None:
            self.crash_in -= 1
            if self.crash_in == 0:
                _crash("while drawing a query's noise")
        key = f"{self.seed}:{float(sigma_int).hex()}:{size}".encode()
        draw_seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "big")
        return TestOnlySeededSampler(draw_seed).sample(sigma_int, size)


def _crash(reason: str) -> None:
    logger.warning("TEST ONLY: crashing (SIGKILL) %s", reason)
    os.kill(os.getpid(), signal.SIGKILL)


def inject_crash(query_id: str, point: str, k: int, sampler: PerDrawSeededSampler) -> None:
    """TEST ONLY: make this process kill itself at ``point`` of the query whose task id
    is ``query_id`` (``--crash``)."""
    if point not in ("prep", "fold", "staged", "folded", "page") or k < 1:
        raise SystemExit(f"--crash: unknown point {point}:{k}")
    if point == "prep":
        submit = Coordinator.submit

        def arming_submit(self: Coordinator, analyst_id: str, signed: SignedQuery) -> QueryRecord:
            if task_id(analyst_id, signed.spec.query_id) == query_id:
                # Its noise preparation starts inside submit: the next draws are its own.
                sampler.crash_in = k
            return submit(self, analyst_id, signed)

        Coordinator.submit = arming_submit  # type: ignore[method-assign]
        return
    if point == "page":
        finalize_pages = ProxyStore.finalize_pages

        def crashing_finalize_pages(
            self: ProxyStore,
            finalized: str,
            total_ciphertexts: int,
            algebra: Any,
            page_noise: Callable[[int, int, int], bytes] | None,
            *,
            limit: int | None = None,
        ) -> Any:
            if finalized != query_id or page_noise is None:
                return finalize_pages(
                    self, finalized, total_ciphertexts, algebra, page_noise, limit=limit
                )
            noise = page_noise

            def noise_then_crash(page: int, start: int, count: int) -> bytes:
                encoded = noise(page, start, count)
                if page + 1 == k:
                    _crash(
                        f"with the noise of page {page} of query {query_id} computed, inside "
                        "the transaction that stores the page, before COMMIT"
                    )
                return encoded

            return finalize_pages(
                self, finalized, total_ciphertexts, algebra, noise_then_crash, limit=limit
            )

        ProxyStore.finalize_pages = crashing_finalize_pages  # type: ignore[method-assign]
        return
    if point == "folded":
        complete_upload = ProxyStore.complete_upload
        complete_signature = inspect.signature(complete_upload)

        def crashing_complete(self: ProxyStore, *args: Any, **kwargs: Any) -> UploadCompletion:
            receipt = complete_upload(self, *args, **kwargs)
            stored = complete_signature.bind(self, *args, **kwargs)
            if (
                stored.arguments["query_id"] == query_id
                and not receipt.duplicate
                and receipt.n_contributed == k
            ):
                _crash(
                    f"after upload {k} of query {query_id} committed, before its acknowledgement"
                )
            return receipt

        ProxyStore.complete_upload = crashing_complete  # type: ignore[method-assign]
        return
    # fold / staged: the K-th owner whose chunk is folded into this query's aggregate.
    fold_chunk = ProxyStore.fold_chunk
    signature = inspect.signature(fold_chunk)
    folding_owners: list[str] = []

    def crashing_fold(self: ProxyStore, *args: Any, **kwargs: Any) -> bool:
        call = signature.bind(self, *args, **kwargs)
        owner = call.arguments["owner_id"]
        if call.arguments["query_id"] != query_id:
            return fold_chunk(*call.args, **call.kwargs)
        if owner not in folding_owners:
            folding_owners.append(owner)
        if folding_owners.index(owner) + 1 != k:
            return fold_chunk(*call.args, **call.kwargs)
        if point == "fold":
            algebra = call.arguments["algebra"]

            class CrashingAlgebra:
                width = algebra.width
                subtract = algebra.subtract

                def add(self, current: bytes, data: bytes) -> bytes:
                    algebra.add(current, data)
                    _crash(f"inside the fold of upload {k} of query {query_id}, before COMMIT")
                    raise AssertionError("unreachable")

            call.arguments["algebra"] = CrashingAlgebra()
            return fold_chunk(*call.args, **call.kwargs)
        folded = fold_chunk(*call.args, **call.kwargs)
        _crash(
            f"after a chunk of upload {k} of query {query_id} was folded, before the upload "
            "completed"
        )
        return folded

    ProxyStore.fold_chunk = crashing_fold  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, required=True, help="noise seed (TEST ONLY)")
    parser.add_argument("--config", type=Path, required=True, help="the proxy's TOML config")
    parser.add_argument(
        "--crash",
        help="TASK_ID:POINT:K, POINT prep, fold, staged, folded or page (TEST ONLY)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG, format=LOG_FORMAT)
    logger.warning(
        "TEST ONLY proxy: noise comes from a seeded floating-point sampler (seed %d); "
        "its releases are NOT PRIVATE",
        args.seed,
    )
    sampler = PerDrawSeededSampler(args.seed)
    if args.crash:
        query_id, point, k = args.crash.rsplit(":", 2)
        inject_crash(query_id, point, int(k), sampler)
        logger.warning("TEST ONLY: will crash at %s", args.crash)
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        logger.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, request_stop)
    server = ProxyServer(load_config(args.config), noise_sampler=sampler)
    try:
        address = server.start()
        print(f"{PROXY_READY_MARKER} {address}", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
