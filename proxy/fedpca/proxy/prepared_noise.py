"""Stats-mode noise, drawn while the owners encrypt and added to each result page.

A stats-mode query's noise depends on the public query only, so it is drawn on a
background thread from submission on (:meth:`PreparedNoise.prepare`) rather than after
the last upload, and each result page takes its slice when it becomes final
(:meth:`fedpca.proxy.store.ProxyStore.finalize_pages`).

The noise is added to the encrypted aggregate as the ciphertext ``(1 + P n) mod n^2``
of its packed value P, *without* a random obfuscator: the aggregate it multiplies is
already randomised by every owner's obfuscators, so the product is an encryption of
sum + noise with the owners' randomness, exactly as distributed as before for anyone
without the aggregate itself; and the analyst, the only party that decrypts, never
sees the aggregate without the noise. This saves one full encryption per result
ciphertext (the proxy's largest cost before).

The prepared noise

* lives in this process's memory only and is never persisted: a restarted proxy
  draws a fresh vector for the pages not yet final. That is sound because every
  coordinate of the noise is an independent draw and every result page is released
  once and never recomputed, so each released coordinate carries exactly one draw;
* belongs to one query key and is dropped when the query is done or failed
  (:meth:`PreparedNoise.discard`);
* is used as it stands: if its draw failed (a value beyond the slot headroom), the
  error is raised and the query fails; drawing again would truncate the distribution.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import gmpy2

from fedpca.codec import ciphertext_byte_length
from fedpca.codec.packing import pack_stream
from fedpca.dp.noise import NoiseSampler
from fedpca.protocol import SHARES, IntArray, ReleasePlan
from fedpca.query import ProtocolMode

__all__ = ["PageNoise", "PreparedNoise", "draw_page_noise"]

logger = logging.getLogger(__name__)


NOISE_PIECE_VALUES = 1 << 12
"""Noise values drawn at a time. The sampler takes and returns Python lists (about
100 bytes a value with its buffers): drawing the 2 million values of M = 2,000 at once
took some 200 MiB. Measured at M = 2,000 with OpenDP loaded: pieces of 65,536 values
raised the peak by 46 MiB over the 15 MiB of packed noise kept, pieces of 4,096 by
24 MiB, in the same time (the per-call cost of the sampler is negligible)."""


@dataclass(frozen=True)
class PageNoise:
    """A stats-mode query's noise, packed like the shares block (memory only).

    Attributes
    ----------
    packed : the packed noise plaintexts P mod n, one per result ciphertext, each as
        ``width`` unsigned big-endian bytes (read-only; 256 bytes at 2048 bits, where
        the same as Python ints would take about 300).
    n : the analyst's modulus.
    sample_cpu_seconds : CPU time of the discrete Gaussian draws (this thread's).
    prepared : drawn in the background from submission on.
    """

    packed: memoryview
    n: int
    sample_cpu_seconds: float
    prepared: bool = False
    """Drawn in the background from submission on (not when the first page needed it)."""

    @property
    def width(self) -> int:
        """Bytes per packed plaintext."""
        return (self.n.bit_length() + 7) // 8

    def plaintext(self, position: int) -> int:
        """The packed noise plaintext P mod n of result ciphertext ``position``."""
        width = self.width
        return int.from_bytes(self.packed[position * width : (position + 1) * width], "big")

    def encoded(self, start: int, count: int) -> bytes:
        """Ciphertexts ``(1 + P n) mod n^2`` of positions ``start .. start + count - 1``,
        fixed width, ready to multiply into an aggregate page."""
        n = gmpy2.mpz(self.n)
        n_square = n * n
        width = ciphertext_byte_length(self.n.bit_length())
        return b"".join(
            int((1 + self.plaintext(position) * n) % n_square).to_bytes(width, "big")
            for position in range(start, start + count)
        )


def draw_page_noise(
    plan: ReleasePlan, n: int, sampler: NoiseSampler | None, *, prepared: bool = False
) -> PageNoise:
    """Draw a stats-mode query's discrete Gaussian noise and pack it (no encryption).

    The noise is drawn piece by piece (:meth:`ReleasePlan.noise_pieces`) and each
    piece packed at once, so only the packed plaintexts are kept.
    """
    block = plan.owner_block(SHARES)
    width = (n.bit_length() + 7) // 8
    packed = bytearray(block.layout.n_ciphertexts * width)
    pieces = plan.noise_pieces(sampler, NOISE_PIECE_VALUES)
    drawing = 0.0

    def drawn() -> Iterator[IntArray]:
        nonlocal drawing
        while True:
            started = time.thread_time()
            piece = next(pieces, None)
            drawing += time.thread_time() - started
            if piece is None:
                return
            yield piece

    position = 0
    for batch in pack_stream(drawn(), block.layout, plan.bounds.noise_headroom):
        for p in batch:
            packed[position : position + width] = (p % n).to_bytes(width, "big")
            position += width
    return PageNoise(memoryview(packed).toreadonly(), n, drawing, prepared)


class PreparedNoise:
    """Query key -> its stats-mode noise, being (or already) drawn.

    Parameters
    ----------
    sampler : integer Gaussian sampler (None: the production discrete Gaussian).
    enabled : draw in the background from submission on; when False, :meth:`prepare`
        does nothing and :meth:`get` draws on first use.
    """

    def __init__(self, sampler: NoiseSampler | None, *, enabled: bool) -> None:
        self.sampler = sampler
        self._lock = threading.Lock()
        self._closed = False
        self._futures: dict[str, Future[PageNoise]] = {}
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedpca-noise-prep")
            if enabled
            else None
        )

    def prepare(self, key: str, plan: ReleasePlan, n: int) -> None:
        """Start drawing a stats-mode query's noise in the background.

        ``key`` is the proxy's key of the query (its task id): two analysts' queries
        may share a query id, never a key.
        """
        if self._executor is None or not _needs_noise(plan):
            return
        with self._lock:
            if key in self._futures or self._closed:
                return
            try:
                future = self._executor.submit(
                    draw_page_noise, plan, n, self.sampler, prepared=True
                )
            except RuntimeError:  # shutting down: drawn on first use
                return
            self._futures[key] = future
        logger.info("query %s: drawing its noise while owners encrypt", key)

    def get(self, key: str, plan: ReleasePlan, n: int) -> PageNoise:
        """The query's noise: waited for if being drawn, drawn now (in this thread) if
        never prepared or its preparation has not started yet (it is then cancelled:
        drawing now is as fast as waiting for the queue).

        Kept until :meth:`discard`, so every page of the result takes its slice of one
        draw. A failed draw raises its error (every time: it is never drawn again).
        """
        with self._lock:
            future = self._futures.get(key)
            draw_here = future is None or future.cancel()
            if draw_here:
                future = Future()
                future.set_running_or_notify_cancel()  # others wait for it, never cancel it
                self._futures[key] = future
        assert future is not None
        if draw_here:
            try:
                future.set_result(draw_page_noise(plan, n, self.sampler))
            except BaseException as exc:
                future.set_exception(exc)
        return future.result()

    def discard(self, key: str) -> None:
        """Drop a query's noise (it is done or failed); never used again."""
        with self._lock:
            future = self._futures.pop(key, None)
        if future is not None:
            future.cancel()  # if it is being drawn, its result is simply dropped
            logger.debug("query %s: prepared noise dropped", key)

    def pending(self, key: str) -> Future[PageNoise] | None:
        """TEST AID: the query's noise being (or already) drawn, if any (not removed)."""
        with self._lock:
            return self._futures.get(key)

    def shutdown(self, wait: bool = True) -> None:
        """Drop every prepared noise and stop the background thread."""
        with self._lock:
            self._closed = True
            futures, self._futures = self._futures, {}
        for future in futures.values():
            future.cancel()
        if self._executor is not None:
            self._executor.shutdown(wait=wait, cancel_futures=True)


def _needs_noise(plan: ReleasePlan) -> bool:
    return plan.spec.mode is ProtocolMode.STATS and plan.private
