"""Paillier encryption and decryption of packed plaintexts on a process pool.

Two obfuscator variants, both with g = n + 1 so the nude ciphertext is
``(1 + m n) mod n^2`` and all the cost is in the obfuscator:

* ``Obfuscation.STANDARD``: phe's ``raw_encrypt`` with ``r^n mod n^2``, r uniform in
  [1, n).  Semantically secure under the decisional composite residuosity (DCR)
  assumption alone.
* ``Obfuscation.DJN`` (Damgård-Jurik-Nielsen): once per key draw x in Z*_n, set
  ``h = -x^2 mod n`` and ``h_s = h^n mod n^2``; each obfuscator is ``h_s^a mod n^2``
  with ``a`` uniform among ``4 * lambda``-bit integers, lambda being the NIST
  SP 800-57 security level of the modulus (448 bits for 2048-bit n).

DJN security assumption: besides DCR, DJN needs that ``h_s^a`` for a short
uniform exponent ``a`` is computationally indistinguishable from ``h_s^r`` for
r uniform over the whole group (short-exponent indistinguishability, as for
short-exponent Diffie-Hellman).  The best known attacks on a t-bit exponent cost
about 2^(t/2) (Pollard lambda / baby-step giant-step), so t = 2 lambda would
already match the key's security level; we use t = 4 lambda for margin.  Anyone
who does not want the extra assumption selects ``Obfuscation.STANDARD``.

The default is DJN because it is measured much faster: ``benchmarks/primitives.py``
prints the cost of one full ``r^n`` encryption, one short-exponent powmod and one
encryption with the fixed-base window table used here (about 36x cheaper than the
full obfuscator at 2048 bits), and ``benchmarks/owner_encrypt.py --obfuscation
standard`` compares whole scatter shares.

Neither variant is constant-time (gmpy2's powmod and the table lookups depend on
secret exponents); owners encrypt on their own hardware, where such side channels
are out of scope of the trust model.

Work is spread over a ``ProcessPoolExecutor`` started with "forkserver" (or
"spawn"), never "fork": these pools live inside multi-threaded gRPC servers, and
forking a threaded process can deadlock the child on locks held by other threads.
"""

from __future__ import annotations

import enum
import logging
import math
import multiprocessing
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from types import TracebackType
from typing import Any

import gmpy2
import numpy as np
from numpy.typing import NDArray

from ..errors import CiphertextError, ConfigError, EncodingOverflowError, LayoutError
from . import _worker
from ._processes import worker_context
from .ciphertext import PackedCiphertexts, validate_ciphertexts
from .packing import SlotLayout, pack_slots, unpack_slots

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[int], None]

IN_FLIGHT_TASKS_PER_WORKER = 8
"""Tasks per worker a stream keeps submitted ahead of its consumer: enough that no
worker waits for the next batch, few enough that the source is not read far ahead
(at 2048 bits, 8 tasks of 256 encryptions are about 0.5 s of one worker's time)."""

MIN_STREAM_TASK_CIPHERTEXTS = 64
"""Fewest ciphertexts per task of a streamed encryption: about 16 ms of work at 2048
bits, so the first chunk of an upload is ready after a few tasks."""

MAX_STREAM_TASK_CIPHERTEXTS = 256
"""Most ciphertexts per task of a streamed encryption. Each task costs about 0.2-0.3 ms
of pickling, queueing and waking across the processes, whatever its size: in
benchmarks/end_to_end.py (10 owners of 3,811 ciphertexts on 2 cores) tasks of 256
instead of 64 cut the owners' CPU outside encryption from ~0.9 to ~0.7 CPU-s."""


def stream_task_ciphertexts(total: int, processes: int) -> int:
    """Ciphertexts per task for a streamed encryption of ``total`` ciphertexts on
    ``processes`` workers: about four tasks per worker (so the last tasks leave little
    imbalance), within [MIN_STREAM_TASK_CIPHERTEXTS, MAX_STREAM_TASK_CIPHERTEXTS]."""
    share = math.ceil(total / (4 * max(1, processes)))
    return max(MIN_STREAM_TASK_CIPHERTEXTS, min(MAX_STREAM_TASK_CIPHERTEXTS, share))


class Obfuscation(enum.Enum):
    """Which random obfuscator multiplies the nude ciphertext."""

    STANDARD = "standard"
    """Full ``r^n mod n^2`` (phe's ``raw_encrypt``); DCR assumption only."""
    DJN = "djn"
    """Short-exponent ``h_s^a mod n^2``; DCR plus short-exponent indistinguishability."""


DEFAULT_OBFUSCATION = Obfuscation.DJN

# NIST SP 800-57 Part 1 Rev. 5, Table 2: security strength (bits) of
# integer-factorisation (IFC) moduli of at least the given length.
_NIST_IFC_STRENGTH = ((15360, 256), (7680, 192), (3072, 128), (2048, 112), (1024, 80))


def security_level(key_bits: int) -> int:
    """Security strength in bits of a ``key_bits`` modulus per NIST SP 800-57.

    Moduli shorter than 1024 bits (test-only keys) get the lowest tabulated level, 80.
    """
    for modulus_bits, strength in _NIST_IFC_STRENGTH:
        if key_bits >= modulus_bits:
            return strength
    return _NIST_IFC_STRENGTH[-1][1]


def djn_exponent_bits(key_bits: int) -> int:
    """Length of the DJN short exponent: 4 x security level (448 for 2048-bit n)."""
    return 4 * security_level(key_bits)


def _check_plaintexts(plaintexts: Sequence[int], n: int) -> None:
    for index, m in enumerate(plaintexts):
        if not isinstance(m, int) or isinstance(m, bool):
            raise TypeError(f"plaintext {index} is {type(m).__name__}, not an int")
        if not 0 <= m < n:
            raise EncodingOverflowError(f"plaintext {index} is not in [0, n)")


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _default_start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


class CryptoPool:
    """Reusable process pool for batch Paillier encryption and CRT decryption.

    Constructing the pool only stores parameters; worker processes start on first
    use and are reused across calls until :meth:`close` (or the end of a ``with``
    block).  Safe to share between threads.

    Parameters
    ----------
    processes : int, optional
        Number of worker processes (default: the CPUs this process may run on).
    start_method : {"forkserver", "spawn"}, optional
        Multiprocessing start method (default "forkserver" where available).
        "fork" is refused: see the module docstring.
    chunk_size : int, optional
        Items per task; by default about eight tasks per worker, which balances
        load while keeping per-task pickling negligible.
    """

    def __init__(
        self,
        processes: int | None = None,
        *,
        start_method: str | None = None,
        chunk_size: int | None = None,
    ) -> None:
        method = start_method if start_method is not None else _default_start_method()
        if method not in ("forkserver", "spawn"):
            raise ConfigError(
                f"start_method must be 'forkserver' or 'spawn', got {method!r}; 'fork' is "
                "unsafe inside multi-threaded servers"
            )
        if processes is not None and processes < 1:
            raise ConfigError(f"processes must be >= 1, got {processes}")
        if chunk_size is not None and chunk_size < 1:
            raise ConfigError(f"chunk_size must be >= 1, got {chunk_size}")
        self.processes = processes if processes is not None else _available_cpus()
        self.start_method = method
        self.chunk_size = chunk_size
        self._executor: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._djn_bases: dict[int, int] = {}
        self._work: dict[str, list[float]] = {}

    def __enter__(self) -> CryptoPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker processes; a later call starts new ones."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def start(self) -> None:
        """Start all worker processes now instead of on first use."""
        executor = self._get_executor()
        for future in [executor.submit(_worker.warm_up) for _ in range(self.processes)]:
            future.result()

    def _get_executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._executor is None:
                logger.debug("starting %d crypto workers (%s)", self.processes, self.start_method)
                # Workers watch this process and exit when it is gone, so that a
                # kill -9 of the owner daemon or the proxy leaves no orphaned workers.
                self._executor = ProcessPoolExecutor(
                    max_workers=self.processes,
                    # Workers never import the caller's __main__ (see _processes): a
                    # script without a main guard must not run again in them.
                    mp_context=worker_context(self.start_method),
                    initializer=_worker.watch_creator,
                    initargs=(os.getpid(),),
                )
            return self._executor

    def _chunk_length(self, count: int) -> int:
        if self.chunk_size is not None:
            return self.chunk_size
        return max(1, math.ceil(count / (8 * self.processes)))

    def work_done(self) -> dict[str, tuple[int, float]]:
        """Task kind (the worker function's name) -> (items processed, worker CPU seconds).

        Measured by the workers themselves (``time.process_time`` around each task),
        so the figures are the cost of the operations in this run, whatever else the
        machine was doing; benchmarks read them to compute the crypto floor.
        """
        with self._lock:
            return {name: (int(items), cpu) for name, (items, cpu) in self._work.items()}

    def _submit(
        self,
        executor: ProcessPoolExecutor,
        function: Callable[..., list[Any]],
        fixed_args: tuple[Any, ...],
        chunk: list[Any],
    ) -> Future[tuple[list[Any], float]]:
        return executor.submit(_worker.timed, function, *fixed_args, chunk)

    def _result(
        self, function: Callable[..., list[Any]], future: Future[tuple[list[Any], float]], size: int
    ) -> list[Any]:
        chunk_result, cpu = future.result()
        if len(chunk_result) != size:
            raise ValueError(
                f"{getattr(function, '__name__', function)!s} returned "
                f"{len(chunk_result)} results for a chunk of {size} items"
            )
        name = getattr(function, "__name__", "task")
        with self._lock:
            totals = self._work.setdefault(name, [0.0, 0.0])
            totals[0] += size
            totals[1] += cpu
        return chunk_result

    def _broken(self, executor: ProcessPoolExecutor) -> None:
        # A worker died (e.g. killed by the OOM killer); drop the executor so the
        # next call starts fresh workers instead of failing forever.
        with self._lock:
            if self._executor is executor:
                self._executor = None
        executor.shutdown(wait=False, cancel_futures=True)

    def _ordered(
        self,
        function: Callable[..., list[Any]],
        fixed_args: tuple[Any, ...],
        batches: Iterable[Sequence[Any]],
        task_length: Callable[[int], int],
        check: Callable[[Sequence[Any]], None] | None = None,
    ) -> Iterator[list[Any]]:
        """Results of ``function`` over batches arriving one after another, in order.

        Each batch is cut into tasks and submitted as soon as it arrives; the result
        of a batch is yielded once all its tasks (and all earlier batches) are done,
        and the next batch is read meanwhile, so the workers compute while the
        caller's source (an encryption in progress, a network stream) produces more.
        At most :data:`IN_FLIGHT_TASKS_PER_WORKER` tasks per worker wait: beyond that
        the oldest batch is waited for before the source is read again, so a lazy
        source (packing as it goes, pages from the network) is consumed at the pace
        of the workers instead of being held whole in the queue.
        """
        executor = self._get_executor()
        pending: deque[list[tuple[Future[tuple[list[Any], float]], int]]] = deque()
        limit = IN_FLIGHT_TASKS_PER_WORKER * self.processes

        def ready() -> bool:
            return bool(pending) and all(future.done() for future, _ in pending[0])

        def full() -> bool:
            return sum(len(tasks) for tasks in pending) >= limit

        def take() -> list[Any]:
            out: list[Any] = []
            for future, size in pending.popleft():
                out.extend(self._result(function, future, size))
            return out

        try:
            for batch in batches:
                if check is not None:
                    check(batch)
                items = list(batch)
                length = max(1, task_length(len(items)))
                pending.append(
                    [
                        (
                            self._submit(executor, function, fixed_args, items[i : i + length]),
                            len(items[i : i + length]),
                        )
                        for i in range(0, len(items), length)
                    ]
                )
                while ready() or full():
                    yield take()
            while pending:
                yield take()
        except BrokenProcessPool:
            self._broken(executor)
            raise
        finally:
            for tasks in pending:
                for future, _ in tasks:
                    future.cancel()

    def map(
        self,
        function: Callable[..., list[Any]],
        fixed_args: tuple[Any, ...],
        items: Sequence[Any],
        progress: ProgressCallback | None = None,
    ) -> list[Any]:
        """Apply ``function(*fixed_args, chunk)`` to chunks of ``items`` on the workers.

        Parameters
        ----------
        function : callable
            A module-level (picklable) function taking the fixed arguments and then
            a list of items, and returning one result per item, in the same order.
        fixed_args : tuple
            Picklable arguments passed before every chunk.
        items : sequence
            Picklable items; cut into chunks of ``chunk_size`` (default: about
            eight chunks per worker).
        progress : callable, optional
            Called as ``progress(items_done)`` in the calling thread after each chunk.

        Returns
        -------
        list
            The results of all items, in input order.

        Raises
        ------
        ValueError
            If ``function`` returned a different number of results than it got items.
        concurrent.futures.process.BrokenProcessPool
            If a worker died; the next call starts fresh workers.
        """
        if not items:
            return []
        executor = self._get_executor()
        length = self._chunk_length(len(items))
        results: list[Any] = [None] * len(items)
        futures: dict[Future[tuple[list[Any], float]], tuple[int, int]] = {}
        try:
            for start in range(0, len(items), length):
                chunk = list(items[start : start + length])
                futures[self._submit(executor, function, fixed_args, chunk)] = (start, len(chunk))
            done = 0
            for future in as_completed(futures):
                start, size = futures[future]
                results[start : start + size] = self._result(function, future, size)
                done += size
                if progress is not None:
                    progress(done)
        except BrokenProcessPool:
            self._broken(executor)
            raise
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return results

    def _djn_base(self, n: int) -> int:
        with self._lock:
            cached = self._djn_bases.get(n)
        if cached is not None:
            return cached
        while True:
            x = secrets.randbelow(n - 1) + 1
            if gmpy2.gcd(x, n) == 1:
                break
        h = (-x * x) % n
        h_s = int(gmpy2.powmod(h, n, gmpy2.mpz(n) * n))
        with self._lock:
            return self._djn_bases.setdefault(n, h_s)

    def encrypt(
        self,
        public_key: Any,
        plaintexts: Sequence[int],
        *,
        obfuscation: Obfuscation = DEFAULT_OBFUSCATION,
        progress: ProgressCallback | None = None,
    ) -> list[int]:
        """Encrypt raw plaintexts in [0, n) on the pool.

        Parameters
        ----------
        public_key : phe.paillier.PaillierPublicKey
        plaintexts : sequence of int, shape (count,)
            Raw plaintexts in [0, n) (a packed plaintext P is passed as ``P mod n``).
        obfuscation : Obfuscation
            Obfuscator variant (default :data:`DEFAULT_OBFUSCATION`).
        progress : callable, optional
            Called as ``progress(count_done)`` in the calling thread after each chunk.

        Returns
        -------
        list of int, shape (count,)
            Ciphertexts in Z*_{n^2}, in input order.
        """
        _check_plaintexts(plaintexts, public_key.n)
        start = time.perf_counter()
        function, fixed = self._encryptor(public_key.n, obfuscation)
        ciphertexts = self.map(function, fixed, plaintexts, progress)
        logger.debug(
            "encrypted %d plaintexts (%s) in %.3f s",
            len(ciphertexts),
            obfuscation.value,
            time.perf_counter() - start,
        )
        return ciphertexts

    def _encryptor(
        self, n: int, obfuscation: Obfuscation
    ) -> tuple[Callable[..., list[Any]], tuple[Any, ...]]:
        if obfuscation is Obfuscation.DJN:
            return _worker.encrypt_chunk_djn, (
                n,
                self._djn_base(n),
                djn_exponent_bits(n.bit_length()),
            )
        if obfuscation is Obfuscation.STANDARD:
            return _worker.encrypt_chunk_standard, (n,)
        raise ValueError(f"unknown obfuscation {obfuscation!r}")

    def encrypt_batches(
        self,
        public_key: Any,
        batches: Iterable[Sequence[int]],
        *,
        obfuscation: Obfuscation = DEFAULT_OBFUSCATION,
    ) -> Iterator[list[int]]:
        """Encrypt raw plaintexts in [0, n) arriving batch by batch; yield each batch's
        ciphertexts, in order, as they are ready.

        Each batch is one task. ``batches`` is read only as fast as the workers
        encrypt (a bounded number of tasks wait), so a generator that packs the
        plaintexts as it goes never has more than a few batches of them in memory.

        Raises
        ------
        TypeError, EncodingOverflowError
            A plaintext that is not an int in [0, n) (checked before its batch is
            submitted).
        """
        n = public_key.n
        function, fixed = self._encryptor(n, obfuscation)
        return self._ordered(
            function,
            fixed,
            batches,
            lambda count: count,
            check=lambda batch: _check_plaintexts(batch, n),
        )

    def decrypt_stream(
        self, private_key: Any, batches: Iterable[Sequence[int]]
    ) -> Iterator[list[int]]:
        """Decrypt batches of ciphertexts as they arrive; yield each batch's plaintexts in order.

        A batch (e.g. one result page from the network) is validated and handed to the
        workers the moment it arrives, and the next one is read while they decrypt,
        so decryption overlaps the transfer and the proxy's work on later pages.

        Raises
        ------
        CiphertextError
            A ciphertext of some batch is not in Z*_{n^2} (nothing of that batch is
            decrypted).
        """
        public_key = private_key.public_key
        fixed = (public_key.n, private_key.p, private_key.q)
        per_task = max(1, 4 * self.processes)
        return self._ordered(
            _worker.decrypt_chunk,
            fixed,
            batches,
            lambda count: -(-count // per_task),
            check=lambda batch: validate_ciphertexts(batch, public_key),
        )

    def decrypt(
        self,
        private_key: Any,
        ciphertexts: Sequence[int],
        *,
        progress: ProgressCallback | None = None,
    ) -> list[int]:
        """Validate and decrypt ciphertexts with phe's CRT ``raw_decrypt`` on the pool.

        Parameters
        ----------
        private_key : phe.paillier.PaillierPrivateKey
        ciphertexts : sequence of int, shape (count,)
        progress : callable, optional
            Called as ``progress(count_done)`` after each chunk.

        Returns
        -------
        list of int, shape (count,)
            Plaintexts in [0, n).

        Raises
        ------
        CiphertextError
            If any ciphertext is not in Z*_{n^2}.
        """
        public_key = private_key.public_key
        validate_ciphertexts(ciphertexts, public_key)
        fixed = (public_key.n, private_key.p, private_key.q)
        return self.map(_worker.decrypt_chunk, fixed, ciphertexts, progress)

    def encrypt_packed(
        self,
        public_key: Any,
        values: NDArray[np.integer] | Sequence[int],
        layout: SlotLayout,
        bound: int,
        *,
        obfuscation: Obfuscation = DEFAULT_OBFUSCATION,
        progress: ProgressCallback | None = None,
    ) -> PackedCiphertexts:
        """Pack signed fixed-point values and encrypt them.

        Every value is checked against ``bound`` before anything is encrypted.

        Parameters
        ----------
        public_key : phe.paillier.PaillierPublicKey
        values : numpy.ndarray of int64 or sequence of int, shape (layout.value_count,)
        layout : SlotLayout
        bound : int
            Declared bound on |value| (``owner_value_bound(bounds)`` for a scatter
            share, ``bounds.noise_headroom`` for noise).
        obfuscation : Obfuscation
        progress : callable, optional
            Called as ``progress(ciphertexts_done)``.

        Returns
        -------
        PackedCiphertexts
            With ``slot_bound == bound``.

        Raises
        ------
        EncodingOverflowError
            If some |value| > bound or the bound exceeds the slot capacity.
        LayoutError
            If the layout does not match the key size or the value count.
        """
        n = public_key.n
        if layout.key_bits != n.bit_length():
            raise LayoutError(
                f"layout is for a {layout.key_bits}-bit key, the public key has "
                f"{n.bit_length()} bits"
            )
        packed = pack_slots(values, layout, bound)
        ciphertexts = self.encrypt(
            public_key, [p % n for p in packed], obfuscation=obfuscation, progress=progress
        )
        return PackedCiphertexts(public_key, layout, tuple(ciphertexts), bound)

    def decrypt_packed(
        self,
        private_key: Any,
        packed: PackedCiphertexts,
        *,
        progress: ProgressCallback | None = None,
    ) -> list[int]:
        """Decrypt packed ciphertexts and unpack their slots.

        Parameters
        ----------
        private_key : phe.paillier.PaillierPrivateKey
        packed : PackedCiphertexts
        progress : callable, optional

        Returns
        -------
        list of int, shape (packed.layout.value_count,)
            Signed slot values (fixed-point units; decode with ``decode_fixed_point``).

        Raises
        ------
        CiphertextError
            If the private key does not belong to the ciphertexts' public key.
        EncodingOverflowError
            If a slot decodes outside ``packed.slot_bound``.
        """
        if private_key.public_key != packed.public_key:
            raise CiphertextError("the private key does not match the ciphertexts' public key")
        plaintexts = self.decrypt(private_key, packed.ciphertexts, progress=progress)
        return unpack_slots(plaintexts, packed.layout, packed.public_key.n, packed.slot_bound)
