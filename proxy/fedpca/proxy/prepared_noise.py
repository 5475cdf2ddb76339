"""Stats-mode noise drawn and encrypted while the owners encrypt their shares.

A stats-mode query's noise depends on the public query only, so it is drawn and
encrypted under the analyst key on a background thread from submission on rather
than after the quorum (see docs/architecture.md for the measured gain). The
prepared noise

* lives in this process's memory only, as ciphertexts (the plaintext draws are
  dropped once encrypted), and is never persisted: a restarted proxy draws fresh
  noise, which is sound because the store keeps at most one result per query, so
  exactly one noise vector is ever added to a released result;
* belongs to one query id and leaves the table when the query takes it
  (:meth:`PreparedNoise.take`, used once) or fails (:meth:`PreparedNoise.discard`),
  so no vector is ever added to two results;
* is taken as it stands: not started yet, it is cancelled and the noise drawn
  then; being computed, it is waited for (less time than starting over); failed,
  its error is raised, as it would have been with the noise drawn at the end
  (drawing again after a draw beyond the slot headroom would truncate the noise
  distribution).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from phe.paillier import PaillierPublicKey

from fedpca.codec import CryptoPool, PackedCiphertexts
from fedpca.dp.noise import NoiseSampler
from fedpca.protocol import SHARES, ReleasePlan
from fedpca.query import ProtocolMode

__all__ = ["EncryptedNoise", "PreparedNoise", "draw_encrypted_noise"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncryptedNoise:
    """A stats-mode query's noise, encrypted under its analyst key (memory only)."""

    ciphertexts: PackedCiphertexts
    sample_seconds: float
    encrypt_seconds: float


def draw_encrypted_noise(
    plan: ReleasePlan,
    public_key: PaillierPublicKey,
    pool: CryptoPool,
    sampler: NoiseSampler | None,
) -> EncryptedNoise:
    """Draw a stats-mode query's discrete Gaussian noise and encrypt it, packed.

    Only the ciphertexts are kept; the plaintext draws go out of scope here.
    """
    started = time.perf_counter()
    values = plan.noise_values(sampler)
    sampled = time.perf_counter()
    ciphertexts = pool.encrypt_packed(
        public_key, values, plan.owner_block(SHARES).layout, plan.bounds.noise_headroom
    )
    del values
    return EncryptedNoise(ciphertexts, sampled - started, time.perf_counter() - sampled)


class PreparedNoise:
    """Query id -> its stats-mode noise, being (or already) drawn and encrypted.

    Parameters
    ----------
    pool : the crypto pool that encrypts the noise.
    sampler : integer Gaussian sampler (None: the production discrete Gaussian).
    enabled : prepare in the background at all; when False, :meth:`prepare` does
        nothing and every query draws its noise when it is finished.
    """

    def __init__(self, pool: CryptoPool, sampler: NoiseSampler | None, *, enabled: bool) -> None:
        self.pool = pool
        self.sampler = sampler
        self._lock = threading.Lock()
        self._closed = False
        self._futures: dict[str, Future[EncryptedNoise]] = {}
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedpca-noise-prep")
            if enabled
            else None
        )

    def prepare(self, key: str, plan: ReleasePlan, public_key: PaillierPublicKey) -> None:
        """Start drawing and encrypting a stats-mode query's noise in the background.

        ``key`` is the proxy's key of the query (its task id): two analysts' queries
        may share a query id, never a key.
        """
        spec = plan.spec
        if self._executor is None or spec.mode is not ProtocolMode.STATS or not plan.private:
            return
        with self._lock:
            if key in self._futures or self._closed:
                return
            try:
                future = self._executor.submit(
                    draw_encrypted_noise, plan, public_key, self.pool, self.sampler
                )
            except RuntimeError:  # shutting down: the noise is drawn at finish
                return
            self._futures[key] = future
        logger.info("query %s: preparing its noise while owners encrypt", key)

    def take(self, query_id: str) -> EncryptedNoise | None:
        """The prepared noise of a query, removed from the table; None: draw it now.

        Not prepared, or not started yet (then cancelled: drawing now is as fast):
        None. Being computed: waited for (faster than starting over). Failed: its
        error is raised, exactly as if the noise had been drawn now; drawing again
        after e.g. a draw beyond the headroom would truncate the distribution.
        """
        with self._lock:
            future = self._futures.pop(query_id, None)
        if future is None or future.cancel():
            return None
        noise = future.result()
        logger.info("query %s: using the noise prepared while owners encrypted", query_id)
        return noise

    def take_or_draw(
        self, key: str, plan: ReleasePlan, public_key: PaillierPublicKey
    ) -> tuple[EncryptedNoise, bool]:
        """The query's noise: prepared (True) if :meth:`take` has it, else drawn now (False)."""
        noise = self.take(key)
        if noise is not None:
            return noise, True
        return draw_encrypted_noise(plan, public_key, self.pool, self.sampler), False

    def discard(self, query_id: str) -> None:
        """Drop a query's prepared noise (it failed or is finished); never used again."""
        with self._lock:
            future = self._futures.pop(query_id, None)
        if future is not None:
            future.cancel()  # if it is already running, its result is simply dropped
            logger.info("query %s: prepared noise discarded", query_id)

    def pending(self, query_id: str) -> Future[EncryptedNoise] | None:
        """TEST AID: the pending preparation of a query's noise, if any (not removed)."""
        with self._lock:
            return self._futures.get(query_id)

    def shutdown(self, wait: bool = True) -> None:
        """Drop every prepared noise and stop the background thread."""
        with self._lock:
            self._closed = True
            futures, self._futures = self._futures, {}
        for future in futures.values():
            future.cancel()
        if self._executor is not None:
            self._executor.shutdown(wait=wait, cancel_futures=True)
