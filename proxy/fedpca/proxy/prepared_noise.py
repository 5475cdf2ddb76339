"""Stats-mode noise, drawn while the owners encrypt and added to each result page.

A stats-mode query's noise depends on the public query only, so it is drawn on a
background thread from submission on (:meth:`PreparedNoise.prepare`) rather than after
the last upload. It is drawn in wire order, and each result page takes its slice when
every contributor has delivered the page *and* the slice is drawn
(:meth:`fedpca.proxy.store.ProxyStore.finalize_pages`): the first pages do not wait
for the whole vector (1.3 CPU-s at 500 features, about 10 µs a value).

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
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import gmpy2

from fedpca.codec import ciphertext_byte_length
from fedpca.codec.packing import pack_stream
from fedpca.dp.noise import DiscreteGaussianSampler, NoiseSampler
from fedpca.protocol import SHARES, IntArray, ReleasePlan
from fedpca.proxy.store_records import page_count
from fedpca.query import ProtocolMode

__all__ = [
    "MAX_PREPARED_BYTES_PER_ANALYST",
    "NOISE_THREADS",
    "URGENT_DRAWS",
    "PageNoise",
    "PreparedNoise",
    "draw_page_noise",
    "noise_threads",
]

logger = logging.getLogger(__name__)


URGENT_DRAWS = 2
"""Queries whose noise is drawn at once (needed now, never prepared or still queued)
at the same time, each on a thread of its own."""

NOISE_PIECE_VALUES = 1 << 12
"""Noise values drawn at a time, which bounds the memory a draw takes beside the packed
noise kept (measured at M = 2,000 with OpenDP's sampler, before fedpca's own: pieces of
65,536 values raised the peak by 46 MiB over the 15 MiB of packed noise kept, pieces of
4,096 by 24 MiB). fedpca's sampler costs about 1 µs a value in pieces of this size
(``benchmarks/noise_sampler.py`` draws in them: 0.81-1.20 µs across its scales)."""


class PageNoise:
    """A stats-mode query's noise, packed like the shares block (memory only), filled
    in wire order while it is drawn.

    Positions below :meth:`drawn` are final and never change, so a result page whose
    positions are all drawn can take its noise while later positions are still being
    drawn: the first pages become final without waiting for the whole vector.

    Attributes
    ----------
    n : the analyst's modulus.
    n_ciphertexts : packed noise plaintexts in all (one per result ciphertext).
    prepared : drawn in the background from submission on (not when the first page
        needed it).
    """

    def __init__(self, n: int, n_ciphertexts: int, *, prepared: bool = False) -> None:
        self.n = n
        self.n_ciphertexts = n_ciphertexts
        self.prepared = prepared
        # Each packed plaintext P mod n as ``width`` unsigned big-endian bytes (256 at
        # 2048 bits, where the same as Python ints would take about 300).
        self._packed = bytearray(n_ciphertexts * self.width)
        self._drawn = 0
        self._error: BaseException | None = None
        self._sample_cpu_seconds = 0.0
        self._lock = threading.Lock()

    @property
    def width(self) -> int:
        """Bytes per packed plaintext."""
        return (self.n.bit_length() + 7) // 8

    @property
    def nbytes(self) -> int:
        """Bytes the packed noise holds (allocated whole when it is made)."""
        return len(self._packed)

    @property
    def sample_cpu_seconds(self) -> float:
        """CPU time of the discrete Gaussian draws so far (the drawing thread's)."""
        with self._lock:
            return self._sample_cpu_seconds

    def drawn(self) -> int:
        """Positions whose noise is drawn and packed (``n_ciphertexts`` once complete).

        Raises
        ------
        Exception
            The draw's own error if it failed: the noise is never drawn again (a redraw
            would condition the released noise on the failure).
        """
        with self._lock:
            if self._error is not None:
                raise self._error
            return self._drawn

    def pages_drawn(self, page_ciphertexts: int) -> int:
        """Result pages of ``page_ciphertexts`` positions whose noise is all drawn."""
        drawn = self.drawn()
        if drawn >= self.n_ciphertexts:
            return page_count(self.n_ciphertexts, page_ciphertexts)
        return drawn // page_ciphertexts

    def plaintext(self, position: int) -> int:
        """The packed noise plaintext P mod n of result ciphertext ``position``."""
        if not 0 <= position < self.drawn():
            raise IndexError(f"noise position {position} is not drawn yet")
        width = self.width
        return int.from_bytes(self._packed[position * width : (position + 1) * width], "big")

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

    def _append(self, plaintexts: list[int], cpu_seconds: float) -> None:
        width = self.width
        at = self._drawn * width  # only the drawing thread moves _drawn
        for p in plaintexts:
            self._packed[at : at + width] = (p % self.n).to_bytes(width, "big")
            at += width
        with self._lock:
            self._drawn += len(plaintexts)
            self._sample_cpu_seconds += cpu_seconds

    def _failed(self, error: BaseException) -> None:
        with self._lock:
            self._error = error


def draw_page_noise(
    plan: ReleasePlan,
    n: int,
    sampler: NoiseSampler | None,
    *,
    into: PageNoise | None = None,
    on_progress: Callable[[], None] | None = None,
    threads: int = 1,
) -> PageNoise:
    """Draw a stats-mode query's discrete Gaussian noise and pack it (no encryption).

    The noise is drawn piece by piece (:meth:`ReleasePlan.noise_piece_draws`), on
    ``threads`` threads at once when more than one, and the pieces are packed in order
    as they come into ``into`` (a new :class:`PageNoise` by default), so only the
    packed plaintexts and a few pieces are kept; ``on_progress`` is called after each
    piece that completed some positions. A failed draw is recorded in the noise and
    raised.
    """
    block = plan.owner_block(SHARES)
    noise = PageNoise(n, block.layout.n_ciphertexts) if into is None else into
    draws = plan.noise_piece_draws(sampler, NOISE_PIECE_VALUES)
    drawing = 0.0

    def pieces() -> Iterator[IntArray]:
        nonlocal drawing
        for piece, cpu_seconds in _in_order(draws, threads):
            drawing += cpu_seconds
            yield piece

    try:
        for batch in pack_stream(pieces(), block.layout, plan.bounds.noise_headroom):
            noise._append(batch, drawing)
            drawing = 0.0
            if on_progress is not None and batch:
                on_progress()
    except BaseException as exc:
        noise._failed(exc)
        raise
    return noise


def _timed(draw: Callable[[], IntArray]) -> tuple[IntArray, float]:
    started = time.thread_time()
    piece = draw()
    return piece, time.thread_time() - started


def _in_order(
    draws: Iterable[Callable[[], IntArray]], threads: int
) -> Iterator[tuple[IntArray, float]]:
    """Each draw's piece and the CPU seconds it took, in the order of ``draws``; with
    more than one thread, up to two pieces per thread are drawn ahead."""
    if threads <= 1:
        for draw in draws:
            yield _timed(draw)
        return
    ahead: deque[Future[tuple[IntArray, float]]] = deque()
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fedpca-noise-draw") as pool:
        try:
            for draw in draws:
                ahead.append(pool.submit(_timed, draw))
                if len(ahead) >= 2 * threads:
                    yield ahead.popleft().result()
            while ahead:
                yield ahead.popleft().result()
        finally:
            for future in ahead:
                future.cancel()


NOISE_THREADS = 4
"""Threads drawing one query's noise when the sampler allows it (the production one
does). The draw costs about 10 µs of CPU a value (1.3 CPU-s at 500 features, 18 at
2,000) and result pages wait for their slice of it, so it is spread over threads; four
whatever the cores, because where the proxy shares its cores with other work (in
``benchmarks/end_to_end.py`` with twenty encryption workers) each thread gets its own
share of them: on two threads the last page waited 0.09-0.49 s for its noise after
the last chunk, on four 0.00-0.15 s."""


def noise_threads(sampler: NoiseSampler | None) -> int:
    """Threads to draw with: :data:`NOISE_THREADS` for a sampler that declares
    ``parallel_safe`` (None: the production sampler), else 1."""
    chosen = DiscreteGaussianSampler if sampler is None else sampler
    return NOISE_THREADS if getattr(chosen, "parallel_safe", False) else 1


MAX_PREPARED_BYTES_PER_ANALYST = 128 << 20
"""Most bytes of noise one analyst's open queries may hold drawn in advance. A query's
packed noise is about half the size of one owner's upload (one n-sized plaintext per
result ciphertext of n^2): 128 MiB covers one query at the largest upload
(``proxy.max_upload_mib``, 256). Found by review: an analyst's open queries each held
their whole noise from submission until they ended (up to their deadline while any
owner stayed offline), 4 of them up to 512 MiB. Beyond the bound a query's noise is
drawn once its contributors are fixed (``prepare(..., bounded=False)``), in the
background as before."""


def _analyst_of(key: str) -> str:
    return key.partition("/")[0]


class PreparedNoise:
    """Query key -> its stats-mode noise, being (or already) drawn.

    Parameters
    ----------
    sampler : integer Gaussian sampler (None: the production discrete Gaussian).
    enabled : draw in the background from submission on; when False, :meth:`prepare`
        does nothing and :meth:`get` draws on first use.
    on_progress : called with the query key after each piece of a background draw,
        so that pages whose noise just became complete can be made final. It is called
        on a thread of its own, once for any number of pieces drawn while it ran, so
        that making pages final (store writes) never holds up the draw.
    threads : threads drawing one query's noise (default :func:`noise_threads`).
    max_prepared_bytes_per_analyst : most bytes of noise drawn in advance for one
        analyst's queries (keys ``analyst/query``); beyond it :meth:`prepare` starts a
        query's draw only once told its contributors are fixed (``bounded=False``), or
        :meth:`get` when its pages are ready.
    """

    def __init__(
        self,
        sampler: NoiseSampler | None,
        *,
        enabled: bool,
        on_progress: Callable[[str], None] | None = None,
        threads: int | None = None,
        max_prepared_bytes_per_analyst: int = MAX_PREPARED_BYTES_PER_ANALYST,
    ) -> None:
        self.sampler = sampler
        self.max_prepared_bytes_per_analyst = max_prepared_bytes_per_analyst
        self.on_progress = on_progress
        self.threads = noise_threads(sampler) if threads is None else threads
        self._lock = threading.Lock()
        self._closed = False
        # Query key -> the draw's future (done when every value is drawn) and the noise
        # it fills, which is read while it is being drawn.
        self._draws: dict[str, tuple[Future[PageNoise], PageNoise]] = {}
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedpca-noise-prep")
            if enabled
            else None
        )
        # Noise a query needs now (its pages are ready) while the preparing thread is
        # busy with another's: drawn here, not on the caller's thread (an owner's upload
        # call, which would stall for the whole draw; found by review).
        self._urgent = (
            ThreadPoolExecutor(max_workers=URGENT_DRAWS, thread_name_prefix="fedpca-noise-now")
            if enabled
            else None
        )
        self._urgent_keys: set[str] = set()  # their draws are never cancelled and redone
        # Keys with a progress report queued and not yet started (see _report).
        self._reports_queued: set[str] = set()
        self._reporter = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedpca-noise-progress")
            if enabled and on_progress is not None
            else None
        )

    def prepare(self, key: str, plan: ReleasePlan, n: int, *, bounded: bool = True) -> None:
        """Start drawing a stats-mode query's noise in the background.

        ``key`` is the proxy's key of the query (its task id): two analysts' queries
        may share a query id, never a key. ``bounded``: within the analyst's bound on
        noise drawn in advance (:data:`MAX_PREPARED_BYTES_PER_ANALYST`), as from
        submission; a query whose contributors are fixed needs its noise now, and gets
        it drawn here in the background whatever the bound (otherwise an owner's upload
        call would draw it whole when the first page is ready).
        """
        if self._executor is None or not _needs_noise(plan):
            return
        n_ciphertexts = plan.owner_block(SHARES).layout.n_ciphertexts
        size = n_ciphertexts * ((n.bit_length() + 7) // 8)
        with self._lock:
            if key in self._draws or self._closed:
                return
            analyst = _analyst_of(key)
            held = sum(
                noise.nbytes
                for other, (_, noise) in self._draws.items()
                if noise.prepared and _analyst_of(other) == analyst
            )
            if bounded and held + size > self.max_prepared_bytes_per_analyst:
                logger.info(
                    "query %s: its noise (%.1f MiB) is drawn once its contributors are fixed: "
                    "%s's queries hold %.1f MiB of noise drawn in advance",
                    key,
                    size / 2**20,
                    analyst,
                    held / 2**20,
                )
                return
            noise = PageNoise(n, n_ciphertexts, prepared=True)
            try:
                future = self._executor.submit(self._draw, key, plan, noise)
            except RuntimeError:  # shutting down: drawn on first use
                return
            self._draws[key] = (future, noise)
        logger.info("query %s: drawing its noise while owners encrypt", key)

    def _draw(self, key: str, plan: ReleasePlan, noise: PageNoise) -> PageNoise:
        def progressed() -> None:
            with self._lock:
                wanted = key in self._draws and self._draws[key][1] is noise
            if not wanted:
                raise _Discarded  # the query is done or failed: stop drawing
            self._queue_report(key)

        started = time.monotonic()
        try:
            drawn = draw_page_noise(
                plan,
                noise.n,
                self.sampler,
                into=noise,
                on_progress=progressed,
                threads=self.threads,
            )
        except _Discarded:
            return noise
        except BaseException:
            # The noise keeps the error (PageNoise.drawn raises it): a report makes the
            # coordinator look, and fail the query, even when no fold is left to do so
            # (found by review: the query waited for its deadline, with a wrong reason).
            self._queue_report(key)
            raise
        logger.info("query %s: noise drawn in %.2f s", key, time.monotonic() - started)
        return drawn

    def _queue_report(self, key: str) -> None:
        # Making pages final after a piece waits for the store (measured in
        # benchmarks/end_to_end.py: up to 1.5 s for one call, 2.2 s of a 6.9 s draw
        # when it ran on the drawing thread, which then drew nothing). Queued on the
        # reporter instead: one report covers every piece drawn before it starts.
        if self._reporter is None:
            return
        with self._lock:
            if key in self._reports_queued:
                return
            self._reports_queued.add(key)
        try:
            self._reporter.submit(self._report, key)
        except RuntimeError:  # shutting down
            with self._lock:
                self._reports_queued.discard(key)

    def _report(self, key: str) -> None:
        with self._lock:
            self._reports_queued.discard(key)  # pieces drawn from now on report again
            wanted = key in self._draws  # not when the query is done or failed meanwhile
        if wanted and self.on_progress is not None:
            self.on_progress(key)

    def get(self, key: str, plan: ReleasePlan, n: int) -> PageNoise:
        """The query's noise: as far as drawn if it is being drawn in the background
        (:meth:`PageNoise.drawn` says how far). If it was never prepared, or its
        preparation has not started yet (it is then cancelled: waiting for the queue
        would be slower), it is drawn now: on a background thread of its own when
        preparation is enabled (the caller gets it as far as drawn, and progress is
        reported as for a prepared draw), in this thread otherwise.

        Kept until :meth:`discard`, so every page of the result takes its slice of one
        draw. A failed draw raises its error from :meth:`PageNoise.drawn` (every time:
        it is never drawn again).
        """
        with self._lock:
            draw = self._draws.get(key)
            # A queued preparation is cancelled and drawn now; an urgent draw, queued or
            # not, is the one (cancelled at every fold it would be queued again and
            # again, each time with a new vector in memory: found by review).
            redraw = draw is None or (key not in self._urgent_keys and draw[0].cancel())
            if redraw and self._urgent is not None and not self._closed:
                noise = PageNoise(n, plan.owner_block(SHARES).layout.n_ciphertexts)
                try:
                    # Inside the lock: the draw's progress checks find it registered.
                    urgent = self._urgent.submit(self._draw, key, plan, noise)
                except RuntimeError:  # shutting down: drawn here below
                    pass
                else:
                    self._draws[key] = (urgent, noise)
                    self._urgent_keys.add(key)
                    return noise
            draw_here = redraw
            if draw_here:
                future: Future[PageNoise] = Future()
                future.set_running_or_notify_cancel()  # others read it, never cancel it
                noise = PageNoise(n, plan.owner_block(SHARES).layout.n_ciphertexts)
                self._draws[key] = (future, noise)
            else:
                assert draw is not None
                future, noise = draw
        if draw_here:
            try:
                future.set_result(
                    draw_page_noise(plan, n, self.sampler, into=noise, threads=self.threads)
                )
            except BaseException as exc:
                future.set_exception(exc)  # and kept in the noise: drawn() raises it
        return noise

    def discard(self, key: str) -> None:
        """Drop a query's noise (it is done or failed); never used again."""
        with self._lock:
            draw = self._draws.pop(key, None)
            self._urgent_keys.discard(key)
        if draw is not None:
            draw[0].cancel()  # if it is being drawn, its result is simply dropped
            logger.debug("query %s: prepared noise dropped", key)

    def pending(self, key: str) -> Future[PageNoise] | None:
        """TEST AID: the query's noise being (or already) drawn, if any (not removed)."""
        with self._lock:
            draw = self._draws.get(key)
        return None if draw is None else draw[0]

    def shutdown(self, wait: bool = True) -> None:
        """Drop every prepared noise and stop the background thread."""
        with self._lock:
            self._closed = True
            draws, self._draws = self._draws, {}
            self._urgent_keys.clear()
        for future, _ in draws.values():
            future.cancel()
        for executor in (self._executor, self._urgent):
            if executor is not None:
                executor.shutdown(wait=wait, cancel_futures=True)
        if self._reporter is not None:
            self._reporter.shutdown(wait=wait, cancel_futures=True)


class _Discarded(Exception):
    """A background draw whose query no longer needs it."""


def _needs_noise(plan: ReleasePlan) -> bool:
    return plan.spec.mode is ProtocolMode.STATS and plan.private
