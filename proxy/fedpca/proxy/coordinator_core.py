"""The coordinator's shared state: its change feed, the owner allow-list, the per-query
contexts and the failure step every part of the lifecycle uses.

:class:`fedpca.proxy.coordinator.Coordinator` is built from this core, the owners' task
feed (:mod:`fedpca.proxy.owner_tasks`) and the analyst's requests
(:mod:`fedpca.proxy.analyst_requests`); the lifecycle itself is in
:mod:`fedpca.proxy.coordinator`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from fedpca.codec import MIN_KEY_BITS, CryptoPool, SerialisedCiphertextGroup
from fedpca.dp.noise import NoiseSampler
from fedpca.errors import (
    AuthenticationError,
    QueryStateError,
)
from fedpca.messages import (
    QueryState,
)
from fedpca.protocol import ReleasePlan
from fedpca.proxy.config import ProxyConfig
from fedpca.proxy.prepared_noise import PreparedNoise
from fedpca.proxy.queries import QueryContext
from fedpca.proxy.store import ProxyStore
from fedpca.query_records import spec_from_dict

__all__ = [
    "CONTEXT_CACHE_SIZE",
    "ContextCache",
    "CoordinatorCore",
    "OpenUpload",
    "StalledStep",
    "task_id",
    "total_ciphertexts",
]

logger = logging.getLogger("fedpca.proxy.coordinator")


def total_ciphertexts(context: QueryContext) -> int:
    """Ciphertexts one owner uploads for the query."""
    return sum(block.layout.n_ciphertexts for block in context.plan.owner_blocks)


def task_id(analyst_id: str, query_id: str) -> str:
    """The proxy's key of analyst ``analyst_id``'s query ``query_id`` (what owners see).

    Neither part may contain "/" (node ids and query ids have safe alphabets).
    """
    return f"{analyst_id}/{query_id}"


_K = TypeVar("_K")
_V = TypeVar("_V")

CONTEXT_CACHE_SIZE = 256
"""Query contexts (spec, plan, key) kept in memory. Each is rebuilt from the store on a
miss, so the bound costs only time; without it every query ever served stayed in memory
(a flood of submitted and cancelled queries grew the proxy without end)."""


class RecentlyUsed(Generic[_K, _V]):
    """Key -> value, the ``size`` most recently used (thread-safe)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._kept: OrderedDict[_K, _V] = OrderedDict()

    def get(self, key: _K) -> _V | None:
        with self._lock:
            value = self._kept.get(key)
            if value is not None:
                self._kept.move_to_end(key)
            return value

    def put(self, key: _K, value: _V) -> _V:
        """Keep ``value`` unless one is kept already; return the kept one."""
        with self._lock:
            kept = self._kept.setdefault(key, value)
            self._kept.move_to_end(key)
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)
            return kept

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)


class ContextCache(RecentlyUsed[str, QueryContext]):
    """Query key -> its :class:`QueryContext`, the ``size`` most recently used."""

    def __init__(self, size: int = CONTEXT_CACHE_SIZE) -> None:
        super().__init__(size)


@dataclass
class OpenUpload:
    """The streams open for one upload id of one owner and query, and the turn its
    join and its take-out hold: a stream that broke must not take the contributor out
    between a new stream's join (which resumes from its mark) and its being counted
    (found by review: the new stream then failed at the mark and the owner's
    contribution was lost)."""

    streams: int = 0
    turn: threading.Lock = field(default_factory=threading.Lock)


STALL_BACKOFF_FIRST = 0.5
"""Seconds before a stalled step (:class:`StalledStep`) is first tried again."""
STALL_BACKOFF_MAX = 60.0
"""The longest wait between two tries of a stalled step (the wait doubles up to it)."""


@dataclass
class StalledStep:
    """A query's step that met a store that could not be written: how often it failed,
    and when (``time.monotonic``) it is next tried (infinity while it is being tried)."""

    failures: int = 0
    due: float = 0.0
    noise_step: bool = False
    """Masked mode's result (:meth:`Coordinator.finish`), not a page: a pass of
    :meth:`Coordinator.advance` that goes through does not clear it."""


class CoordinatorCore:
    """The state every part of the coordinator shares, and its constructor.

    Parameters
    ----------
    store : the proxy's SQLite store.
    config : the proxy configuration (budgets, test-key switch).
    pool : a started or lazily starting crypto pool (noise encryption, mask).
    noise_sampler : integer Gaussian sampler; default the production discrete
        Gaussian (:mod:`fedpca.dp.discrete_gaussian`). Tests inject a seeded one.
    clock : wall-clock seconds (injected by tests of deadlines).
    allow_insecure_test_keys : TEST ONLY: accept analyst keys below 2048 bits
        (also enabled by ``[crypto] allow_insecure_test_keys`` in the config).
    background : finish queries on a background thread (the server) or in the
        calling thread (tests, recovery tools).
    precompute_noise : draw and encrypt stats-mode noise on a background thread
        from submission on (:mod:`fedpca.proxy.prepared_noise`); default: ``background``.
    """

    def __init__(
        self,
        store: ProxyStore,
        config: ProxyConfig,
        pool: CryptoPool,
        noise_sampler: NoiseSampler | None = None,
        clock: Callable[[], float] = time.time,
        *,
        allow_insecure_test_keys: bool = False,
        background: bool = True,
        precompute_noise: bool | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.pool = pool
        self.noise_sampler = noise_sampler
        self.clock = clock
        self.allow_insecure_test_keys = (
            allow_insecure_test_keys or config.crypto.allow_insecure_test_keys
        )
        if self.allow_insecure_test_keys:
            logger.warning(
                "TEST ONLY: analyst keys shorter than %d bits are accepted", MIN_KEY_BITS
            )
        self._contexts = ContextCache()
        self._lock = threading.Lock()
        self._finishing: set[str] = set()
        self._searching: set[str] = set()  # analysts whose next-query search is running
        self._fold_cpu_seconds: dict[str, float] = {}
        self._last_chunk_at: dict[str, float] = {}
        self._open_streams: dict[tuple[str, str, str], OpenUpload] = {}
        # Queries whose last step (making pages final, a masked result) met a store that
        # could not be written then: the timer tries again (run_timers), backing off.
        self._stalled: dict[str, StalledStep] = {}
        self._finalizing: set[str] = set()
        self._dirty: set[str] = set()
        self._pages_final: dict[str, int] = {}
        self._changed = threading.Condition()
        self._version = 0
        self._listeners: list[Callable[[], None]] = []
        self._stopping = threading.Event()
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedpca-noise")
            if background
            else None
        )
        self._noise = PreparedNoise(
            noise_sampler,
            enabled=background if precompute_noise is None else precompute_noise,
            on_progress=self._noise_drawn,
        )
        self.observer: Any = None
        """Told each upload's fold seconds and each query's noise seconds
        (``chunk_folded`` / ``noise_added``; :class:`fedpca.proxy.metrics.ProxyMetrics`)."""

    # ---------------------------------------------------------- stalled steps
    def _stall(self, query_id: str, *, noise_step: bool = False) -> int:
        """Record that ``query_id``'s step failed on the store: it is tried again after
        a wait doubling from :data:`STALL_BACKOFF_FIRST` to :data:`STALL_BACKOFF_MAX`
        (a disk full for hours must not cost a recomputed masked result every half
        second: found by review). Returns how often it has failed in a row."""
        with self._lock:
            step = self._stalled.setdefault(query_id, StalledStep())
            step.noise_step = step.noise_step or noise_step
            step.failures += 1
            wait = min(STALL_BACKOFF_MAX, STALL_BACKOFF_FIRST * 2.0 ** (step.failures - 1))
            step.due = time.monotonic() + wait
            return step.failures

    def _unstall(self, query_id: str) -> None:
        with self._lock:
            self._stalled.pop(query_id, None)

    # ------------------------------------------------------------ change feed
    @property
    def version(self) -> int:
        """Increases on every query change; pair with :meth:`wait_for_change`."""
        with self._changed:
            return self._version

    def wait_for_change(self, seen: int, timeout: float) -> int:
        """Block until the version differs from ``seen``, ``timeout`` passes or shutdown."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._version != seen or self._stopping.is_set(), timeout
            )
            return self._version

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (from whichever thread) after every query change."""
        with self._changed:
            self._listeners.append(listener)

    def _notify(self) -> None:
        with self._changed:
            self._version += 1
            self._changed.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def shutdown(self, wait: bool = True) -> None:
        """Wake every waiting stream and stop the background finisher.

        A query whose noise step is cut short stays NOISING and is finished by
        :meth:`recover` on the next start.
        """
        self._stopping.set()
        self._notify()
        if self._executor is not None:
            self._executor.shutdown(wait=wait, cancel_futures=True)
        self._noise.shutdown(wait=wait)

    # ------------------------------------------------------------------ owners
    @property
    def registered_owners(self) -> frozenset[str]:
        """The owners this proxy accepts (its allow-list)."""
        return self.config.owners.allowed

    def require_owner(self, owner_id: str) -> None:
        """Refuse an owner that is not on the allow-list.

        Raises
        ------
        AuthenticationError
        """
        if owner_id not in self.config.owners.allowed:
            raise AuthenticationError(
                f"owner {owner_id!r} is not in this proxy's [owners] allowed list"
            )

    def require_analyst(self, analyst_id: str) -> None:
        """Refuse an analyst that is not on the allow-list, if there is one.

        Raises
        ------
        AuthenticationError
        """
        allowed = self.config.analysts.allowed
        if allowed is not None and analyst_id not in allowed:
            raise AuthenticationError(
                f"analyst {analyst_id!r} is not in this proxy's [analysts] allowed list"
            )

    def enroll(self, owner_id: str, info: Mapping[str, Any] | None = None) -> None:
        """Record that an allowed owner said hello (or is alive on its task stream)."""
        self.require_owner(owner_id)
        self.store.touch_owner(owner_id, info)

    def _context(self, query_id: str) -> QueryContext:
        context = self._contexts.get(query_id)
        if context is not None:
            return context
        spec = self.store.query_spec(query_id)  # NotFoundError for unknown ids
        return self._contexts.put(query_id, QueryContext.of(spec_from_dict(spec)))

    def plan(self, query_id: str) -> ReleasePlan:
        """The release plan of a stored query."""
        return self._context(query_id).plan

    def _fail(self, query_id: str, reason: str) -> None:
        try:
            self.store.set_state(
                query_id,
                QueryState.FAILED,
                expect=(QueryState.COLLECTING, QueryState.AGGREGATING, QueryState.NOISING),
                failure_reason=reason,
            )
        except QueryStateError:
            return
        logger.warning("query %s failed: %s", query_id, reason)
        self._noise.discard(query_id)
        self._notify()

    def _algebra(self, query_id: str) -> SerialisedCiphertextGroup:
        return SerialisedCiphertextGroup(self._context(query_id).public_key.n)

    def _noise_drawn(self, key: str) -> None:
        """Hook, called on the noise thread: more of query ``key``'s noise is drawn, so
        pages waiting for it may become final (:class:`~fedpca.proxy.coordinator.Coordinator`
        makes them so). Must not raise: an error here would fail the draw."""

    def _prepare_noise(self, key: str, context: QueryContext, *, bounded: bool = True) -> None:
        if not self._stopping.is_set():
            self._noise.prepare(key, context.plan, context.public_key.n, bounded=bounded)
