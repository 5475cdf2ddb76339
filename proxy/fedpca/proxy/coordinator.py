"""The proxy's query lifecycle: submission, uploads, quorum, deadlines and the result.

Pure domain code: no gRPC here (:mod:`fedpca.proxy.servicer` translates), and
every durable change goes through :class:`~fedpca.proxy.store.ProxyStore`.

Lifecycle of one query::

    submit ─▶ COLLECTING ─(quorum owners began)─▶ AGGREGATING ─(stats: last page final)─▶ DONE
                  │                                   └─(masked: all folded)─▶ NOISING ─▶ DONE
                  └─(deadline, or declines leave the quorum out of reach; from
                     AGGREGATING: a contributor did not finish by the deadline)─▶ FAILED

The first ``quorum`` owners to begin an upload are the query's contributors; while the
set is open, an upload whose stream breaks is taken out and its place freed. Once it
is fixed, each result page is final (noise added under encryption) as soon as every
contributor's chunks covering it are folded, and the analyst fetches and decrypts it
while the owners still encrypt the later ones; an interrupted upload resumes where its
durable mark stands.

Queries are keyed by analyst: the proxy stores analyst ``a``'s query ``q`` under the
*task id* ``a/q``, which is also what owners see and answer with, so one analyst's
query ids say nothing about another's. Only owners on the allow-list
(``[owners] allowed``) are offered tasks or may upload and decline.

The noise of a stats-mode query is drawn while owners encrypt
(:mod:`fedpca.proxy.prepared_noise`) and added page by page; a masked-mode result is
computed at the end by :mod:`fedpca.proxy.masking`. Why each step is safe against concurrent
submissions, broken streams and crashes, and what the noise step costs, is in
docs/architecture.md ("The proxy's query lifecycle").
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fedpca.codec import MIN_KEY_BITS, CryptoPool, SerialisedCiphertextGroup
from fedpca.dp.mechanisms import PrivacyEvent
from fedpca.dp.noise import NoiseSampler
from fedpca.errors import (
    AuthenticationError,
    ConfigError,
    FedpcaError,
    NotFoundError,
    QueryStateError,
)
from fedpca.messages import (
    MAX_DECLINE_DETAIL,
    BudgetStatus,
    CancelReceipt,
    OwnerDecline,
    QueryResult,
    QueryState,
    QueryStatus,
    ResultHeader,
    SignedQuery,
    Task,
    TaskCancellation,
    UploadHeader,
)
from fedpca.protocol import ReleasePlan
from fedpca.proxy.config import ProxyConfig
from fedpca.proxy.masking import masked_result
from fedpca.proxy.prepared_noise import PageNoise, PreparedNoise
from fedpca.proxy.queries import (
    QueryContext,
    result_blocks,
    spec_from_dict,
    spec_to_dict,
    validate_query,
)
from fedpca.proxy.results import aggregate_blocks, result_header, result_meta, whole_result
from fedpca.proxy.store import ProxyStore
from fedpca.proxy.store_records import Contributor, QueryRecord, page_count
from fedpca.proxy.uploads import UploadStream, check_upload_header
from fedpca.query import ProtocolMode, QuerySpec
from fedpca.signing import verify_query

__all__ = ["CANCELLED_REASON", "Coordinator", "task_id"]

logger = logging.getLogger(__name__)

CANCELLED_REASON = "cancelled by the analyst"
"""The failure reason of a query its analyst cancelled."""

DEFAULT_TIMER_INTERVAL = 0.5
"""Seconds between deadline checks of :meth:`Coordinator.run_timers`."""

_BUDGET_CHECK_ATTEMPTS = 5
"""Times a submission recomposes its analyst's ledger if another one changed it meanwhile."""


def _total_ciphertexts(context: QueryContext) -> int:
    return sum(block.layout.n_ciphertexts for block in context.plan.owner_blocks)


def task_id(analyst_id: str, query_id: str) -> str:
    """The proxy's key of analyst ``analyst_id``'s query ``query_id`` (what owners see).

    Neither part may contain "/" (node ids and query ids have safe alphabets).
    """
    return f"{analyst_id}/{query_id}"


@dataclass(frozen=True)
class _OpenQuery:
    task: Task
    deadline_at: float
    answered: frozenset[str]
    """Owners that uploaded to or declined the query."""


class _LedgerChanged(Exception):
    """Another submission changed the analyst's ledger during a budget check."""


def _one_line(text: str) -> str:
    """A peer-supplied text as one bounded log/status line (no forged line breaks)."""
    cleaned = " ".join(text.split())
    if len(cleaned) > MAX_DECLINE_DETAIL:
        cleaned = cleaned[: MAX_DECLINE_DETAIL - 3] + "..."
    return cleaned


class Coordinator:
    """Runs every query's lifecycle on top of the durable store.

    Parameters
    ----------
    store : the proxy's SQLite store.
    config : the proxy configuration (budgets, test-key switch).
    pool : a started or lazily starting crypto pool (noise encryption, mask).
    noise_sampler : integer Gaussian sampler; default the production discrete
        Gaussian (OpenDP). Tests inject a seeded one.
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
        self._contexts: dict[str, QueryContext] = {}
        self._lock = threading.Lock()
        self._finishing: set[str] = set()
        self._fold_cpu_seconds: dict[str, float] = {}
        self._last_chunk_at: dict[str, float] = {}
        self._open_streams: Counter[tuple[str, str]] = Counter()
        self._finalizing: set[str] = set()
        self._dirty: set[str] = set()
        self._pages_final: dict[str, int] = {}
        self._changed = threading.Condition()
        self._version = 0
        self._listeners: list[Callable[[], None]] = []
        self._snapshot: tuple[int, list[_OpenQuery]] | None = None
        self._stopping = threading.Event()
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedpca-noise")
            if background
            else None
        )
        self._noise = PreparedNoise(
            noise_sampler,
            enabled=background if precompute_noise is None else precompute_noise,
        )
        self.observer: Any = None
        """Told each upload's fold seconds and each query's noise seconds
        (``chunk_folded`` / ``noise_added``; :class:`fedpca.proxy.metrics.ProxyMetrics`)."""

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

    def enroll(self, owner_id: str, info: Mapping[str, Any] | None = None) -> None:
        """Record that an allowed owner said hello (or is alive on its task stream)."""
        self.require_owner(owner_id)
        self.store.touch_owner(owner_id, info)

    # ------------------------------------------------------------------ submit
    def submit(self, analyst_id: str, signed: SignedQuery) -> QueryRecord:
        """Validate a signed query, charge the analyst's budget and publish it to owners.

        Resubmitting the same query id with the same spec returns the existing
        record without charging again. The query is stored under
        :func:`task_id` ``(analyst_id, query_id)``.

        Raises
        ------
        ConfigError
            Short or malformed analyst key, fingerprint mismatch, invalid deadline,
            a relation other than the deployment's, a delta above the per-query cap,
            a quorum larger than the allow-list, a missing or invalid signature, or a
            query the release plan cannot serve (also LayoutError /
            EncodingOverflowError / CalibrationError from the plan).
        BudgetExceededError
            The release would exceed the analyst's total budget.
        ProtocolError
            The query id exists with a different spec.
        """
        spec = signed.spec
        self._check_public_facts(signed, analyst_id)
        context = validate_query(
            spec,
            allow_insecure_test_keys=self.allow_insecure_test_keys,
            max_upload_mib=self.config.proxy.max_upload_mib,
        )
        key = task_id(analyst_id, spec.query_id)
        plan = context.plan
        budget = self.config.budget.for_analyst(analyst_id)
        event = plan.privacy_event(analyst_id)
        event = PrivacyEvent.from_dict({**event.to_dict(), "query_id": key})
        event_record = json.loads(event.to_json())
        deadline_at = self.clock() + spec.deadline_seconds
        self.store.set_analyst_budget(analyst_id, budget.epsilon, budget.delta)
        record: QueryRecord | None = None
        for _ in range(_BUDGET_CHECK_ATTEMPTS):
            # Composing a ledger takes a while: do it outside the store's transaction
            # (which every other call waits for), then insert only if the ledger did
            # not change meanwhile, else compose again.
            rows = self.store.releases(analyst_id)
            decision = self._check_budget(rows, event, budget)

            def charge(conn: Any, rows: list[dict[str, Any]] = rows, fits: Any = decision) -> None:
                if self.store.release_ids(conn, analyst_id) != [r["query_id"] for r in rows]:
                    raise _LedgerChanged
                fits.raise_if_exceeded()
                self.store.record_release(conn, analyst_id, key, event_record)

            try:
                record = self.store.create_query(
                    key,
                    analyst_id,
                    spec_to_dict(spec),
                    plan.describe(),
                    deadline_at,
                    signature=signed.signature,
                    signer=signed.signer,
                    before_insert=charge,
                )
                break
            except _LedgerChanged:
                continue
        if record is None:
            raise QueryStateError(
                "the analyst's ledger kept changing during the budget check; submit again"
            )
        with self._lock:
            self._contexts.setdefault(key, context)
        if record.state is QueryState.COLLECTING:
            self._prepare_noise(key, context)
        if not spec.private:
            logger.warning("query %s: epsilon = inf, the result will be NOT PRIVATE", key)
        logger.info(
            "query %s: %s %s, M=%d, quorum %d of %d owners, deadline in %.0f s",
            key,
            spec.kind.value,
            spec.mode.value,
            spec.n_features,
            spec.quorum,
            len(self.registered_owners),
            spec.deadline_seconds,
        )
        self._notify()
        return record

    def _check_public_facts(self, signed: SignedQuery, analyst_id: str) -> None:
        """Refuse, before anything is charged, what the deployment can never serve."""
        spec = signed.spec
        privacy = self.config.privacy
        if spec.neighbouring is not privacy.neighbouring:
            raise ConfigError(
                f"the query is stated for {spec.neighbouring.value} adjacency; this deployment "
                f"accounts under {privacy.neighbouring.value}"
            )
        cap = privacy.delta_cap(self.config.budget.for_analyst(analyst_id))
        if spec.private and spec.delta > cap:
            raise ConfigError(
                f"delta = {spec.delta:g} is above this proxy's per-query cap {cap:g} "
                "(privacy.max_delta_per_query)"
            )
        registered = len(self.registered_owners)
        if spec.quorum > registered:
            raise ConfigError(
                f"quorum {spec.quorum} is more than the {registered} owners this proxy accepts"
            )
        if not signed.signer:
            raise ConfigError(
                "the query is not signed; owners answer only queries signed by an analyst "
                "key they pin (fedpca analyst keygen creates one)"
            )
        try:
            verify_query(spec, signed.signature, signed.signer)
        except FedpcaError as exc:
            raise ConfigError(f"invalid query signature: {exc}") from None

    def _check_budget(self, rows: list[dict[str, Any]], event: PrivacyEvent, budget: Any) -> Any:
        from fedpca.dp.accounting import check_budget  # slow import (dp_accounting)

        return check_budget(
            [PrivacyEvent.from_dict(r) for r in rows],
            event,
            budget,
            self.config.privacy.accountant,
            neighbouring=self.config.privacy.neighbouring,
        )

    def _context(self, query_id: str) -> QueryContext:
        with self._lock:
            context = self._contexts.get(query_id)
        if context is not None:
            return context
        record = self.store.query(query_id)  # NotFoundError for unknown ids
        context = QueryContext.of(spec_from_dict(record.spec))
        with self._lock:
            return self._contexts.setdefault(query_id, context)

    def plan(self, query_id: str) -> ReleasePlan:
        """The release plan of a stored query."""
        return self._context(query_id).plan

    # ------------------------------------------------------------------- tasks
    def tasks_for(self, owner_id: str) -> list[QuerySpec]:
        """COLLECTING queries this owner has neither uploaded to nor declined."""
        return [task.query for task in self.pending_tasks(owner_id)]

    def _open_queries(self) -> list[_OpenQuery]:
        """The COLLECTING queries with who answered them, read once per change.

        Every owner's task stream asks after every change; one read of the store per
        change serves them all (a thousand streams would otherwise read it a thousand
        times).
        """
        version = self.version
        with self._lock:
            if self._snapshot is not None and self._snapshot[0] == version:
                return self._snapshot[1]
        snapshot = []
        for record in self.store.queries(QueryState.COLLECTING):
            answered = set(self.store.declines(record.query_id))
            answered.update(u.owner_id for u in self.store.uploads(record.query_id))
            task = Task(
                query=self._context(record.query_id).spec,
                upload_deadline=datetime.fromtimestamp(record.deadline_at, UTC),
                query_signature=record.signature,
                query_signer=record.signer,
                task_id=record.query_id,
            )
            snapshot.append(_OpenQuery(task, record.deadline_at, frozenset(answered)))
        with self._lock:
            self._snapshot = (version, snapshot)
        return snapshot

    def pending_tasks(self, owner_id: str) -> list[Task]:
        """:meth:`tasks_for` with each query's upload deadline, ready for the task stream.

        Each task carries its task id and the analyst's signature, forwarded unchanged.
        """
        if owner_id not in self.registered_owners:
            return []
        now = self.clock()
        return [
            open_query.task
            for open_query in self._open_queries()
            if open_query.deadline_at > now and owner_id not in open_query.answered
        ]

    def withdrawn_tasks(self, owner_id: str, query_ids: Sequence[str]) -> list[TaskCancellation]:
        """Cancellations for delivered tasks the owner should no longer answer.

        A task is withdrawn when its query stopped collecting (quorum reached,
        failed, done) or its deadline passed before this owner answered. Tasks
        the owner contributes to (its upload complete or not) or declined are never
        withdrawn.
        """
        now = self.clock()
        cancellations = []
        for query_id in query_ids:
            try:
                record = self.store.query(query_id)
            except NotFoundError:
                continue
            # A contributor keeps its task whatever the state: its upload may still be
            # streaming in (or resume after a restart of either side).
            if owner_id in self.store.declines(query_id) or any(
                c.owner_id == owner_id for c in self.store.contributors(query_id)
            ):
                continue
            if record.state is QueryState.FAILED:
                reason = f"query failed: {record.failure_reason}"
            elif record.state is not QueryState.COLLECTING:
                reason = "uploads are closed (the quorum was reached)"
            elif record.deadline_at <= now:
                reason = "the upload deadline has passed"
            else:
                continue
            cancellations.append(TaskCancellation(query_id=query_id, reason=reason))
        return cancellations

    def decline(self, owner_id: str, query_id: str, reason: str, detail: str = "") -> None:
        """Record an owner's refusal of a task (it is not offered again).

        Accepted only from an allowed owner while the query collects and before that
        owner uploaded; the detail is cut to one line of at most
        :data:`~fedpca.messages.MAX_DECLINE_DETAIL` characters. When the declines
        leave fewer owners than the quorum, the query fails at once (the declines are
        public, so failing early releases nothing new) instead of at its deadline.

        Raises
        ------
        AuthenticationError, NotFoundError, QueryStateError
        """
        self.require_owner(owner_id)
        line = _one_line(detail)
        self.store.record_decline(query_id, owner_id, f"{reason}: {line}" if line else reason)
        logger.info("query %s: owner %s declined (%s)", query_id, owner_id, reason)
        self._fail_if_quorum_unreachable(query_id)
        self._notify()

    def _fail_if_quorum_unreachable(self, query_id: str) -> None:
        record = self.store.query(query_id)
        if record.state is not QueryState.COLLECTING:
            return
        quorum = int(record.spec.get("quorum", 1))
        declines = self.store.declines(query_id)
        available = len(self.registered_owners - set(declines))
        if available >= quorum:
            return
        listed = "; ".join(f"{owner}: {why}" for owner, why in sorted(declines.items()))
        reason = (
            f"the quorum of {quorum} can no longer be reached: {len(declines)} of "
            f"{len(self.registered_owners)} owners declined ({listed})"
        )
        self._fail(query_id, reason)

    # ----------------------------------------------------------------- uploads
    def check_upload_header(self, owner_id: str, header: UploadHeader) -> None:
        """:func:`fedpca.proxy.uploads.check_upload_header` against the stored query."""
        self.require_owner(owner_id)
        check_upload_header(self._context(header.query_id), header)

    def begin_upload(self, owner_id: str, header: UploadHeader) -> UploadStream:
        """Check an upload's header, let the owner join the query's contributors (or
        resume its upload), and open the stream its chunks are folded through.

        From here on the owner may have spent budget on the query, so it is marked as
        never to be refunded.

        Raises the errors of :meth:`check_upload_header` and of
        :meth:`fedpca.proxy.store.ProxyStore.join` (NotContributingError for an owner
        that is not, and can no longer become, a contributor).
        """
        self.check_upload_header(owner_id, header)
        key = header.query_id
        context = self._context(key)
        total = _total_ciphertexts(context)

        def meta_when_fixed(contributors: Sequence[Contributor]) -> dict[str, Any]:
            return result_meta(
                context.plan, len(contributors), [c.public_count for c in contributors]
            )

        joined = self.store.join(
            key,
            owner_id,
            header.upload_id,
            total_ciphertexts=total,
            algebra=self._algebra(key),
            public_count=header.public_record_count,
            on_fixed=meta_when_fixed,
        )
        if joined.fixed:
            logger.info(
                "query %s: its %d contributors are fixed; pages become final as they complete",
                key,
                context.spec.quorum,
            )
            self._notify()
        elif joined.covered and not joined.duplicate:
            logger.info(
                "query %s: %s resumes upload %s after %d folded ciphertexts",
                key,
                owner_id,
                header.upload_id,
                joined.covered,
            )
        stream_key = (key, owner_id)
        with self._lock:
            self._open_streams[stream_key] += 1

        def ended() -> None:
            with self._lock:
                self._open_streams[stream_key] -= 1
                if self._open_streams[stream_key] <= 0:
                    del self._open_streams[stream_key]

        def streams_open() -> int:
            with self._lock:
                return self._open_streams[stream_key]

        return UploadStream(
            self.store,
            owner_id,
            header,
            context,
            joined,
            on_folded=self._folded,
            on_completed=self._completed,
            on_ended=ended,
            streams_open=streams_open,
        )

    def share_released(self, query_id: str, owner_id: str) -> bool:
        """Whether a result of the query can hold anything of this owner's share.

        False for an owner that is not one of the query's contributors (nothing of it
        was ever folded into what is released), and for every owner of a query that
        failed before any page of its result was released.
        """
        try:
            record = self.store.query(query_id)
        except NotFoundError:
            return False
        if owner_id not in {c.owner_id for c in self.store.contributors(query_id)}:
            return False
        return not (record.state is QueryState.FAILED and self.store.pages_final(query_id) == 0)

    def _folded(self, query_id: str, fold_cpu_seconds: float) -> None:
        with self._lock:
            self._last_chunk_at[query_id] = time.time()
            self._fold_cpu_seconds[query_id] = (
                self._fold_cpu_seconds.get(query_id, 0.0) + fold_cpu_seconds
            )
        if self.observer is not None:
            self.observer.chunk_folded(fold_cpu_seconds)
        self.advance(query_id)
        self._notify()

    def _completed(self, query_id: str) -> None:
        self._notify()

    def advance(self, query_id: str) -> None:
        """Make final whatever the folded chunks allow: result pages of a stats-mode
        query, or (masked mode) the whole result once every contribution is in.

        Called after every fold, and at start-up; concurrent calls for one query
        collapse into one pass that repeats while more folds arrived meanwhile.
        """
        with self._lock:
            self._dirty.add(query_id)
            if query_id in self._finalizing:
                return
            self._finalizing.add(query_id)
        try:
            while True:
                with self._lock:
                    if query_id not in self._dirty:
                        self._finalizing.discard(query_id)
                        return
                    self._dirty.discard(query_id)
                self._advance_once(query_id)
        except BaseException:
            with self._lock:
                self._finalizing.discard(query_id)
            raise

    def _advance_once(self, query_id: str) -> None:
        context = self._context(query_id)
        total = _total_ciphertexts(context)
        through = self.store.aggregated_through(query_id)
        if context.spec.mode is ProtocolMode.MASKED:
            if through >= total:
                self.close(query_id)
            return
        size = self.store.page_ciphertexts
        ready = page_count(total, size) if through >= total else through // size
        with self._lock:
            if ready <= self._pages_final.get(query_id, 0):
                return
        noise: PageNoise | None = None
        try:
            if context.plan.private:
                noise = self._noise.get(query_id, context.plan, context.public_key.n)
            finalized = self.store.finalize_pages(
                query_id,
                total,
                self._algebra(query_id),
                None if noise is None else lambda _page, start, count: noise.encoded(start, count),
            )
        except FedpcaError as exc:
            self._fail(query_id, f"adding noise failed ({type(exc).__name__}); see the proxy log")
            logger.error("query %s: noise step failed: %s", query_id, type(exc).__name__)
            return
        with self._lock:
            self._pages_final[query_id] = finalized.pages_final
        if finalized.new_pages:
            logger.debug(
                "query %s: %d of %d result pages final",
                query_id,
                finalized.pages_final,
                page_count(total, size),
            )
            self._notify()
        if finalized.done and finalized.new_pages:
            # This pass made the last pages final (a later pass finds the query DONE
            # with nothing new, and must not report it done again).
            self._done(query_id, noise)

    def _done(self, query_id: str, noise: PageNoise | None) -> None:
        with self._lock:
            last_chunk = self._last_chunk_at.pop(query_id, None)
            fold_cpu_seconds = self._fold_cpu_seconds.pop(query_id, None)
            self._pages_final.pop(query_id, None)
        timings: dict[str, float] = {}
        if noise is not None:
            timings["sample_cpu_seconds"] = noise.sample_cpu_seconds
            if noise.prepared:
                timings["noise_precomputed"] = 1.0
        if fold_cpu_seconds is not None:
            timings["fold_cpu_seconds"] = fold_cpu_seconds
        if last_chunk is not None:
            timings["final_after_last_chunk_seconds"] = max(0.0, time.time() - last_chunk)
        self.store.update_result_meta(query_id, {"timings": timings})
        if self.observer is not None and "sample_cpu_seconds" in timings:
            self.observer.noise_added(timings["sample_cpu_seconds"])
        self._noise.discard(query_id)
        record = self.store.query(query_id)
        logger.info(
            "query %s done: %d contributors, every page final, %.3f CPU-s checking and "
            "folding chunks, %.3f CPU-s drawing noise%s",
            query_id,
            record.quorum,
            timings.get("fold_cpu_seconds", 0.0),
            timings.get("sample_cpu_seconds", 0.0),
            f", {timings['final_after_last_chunk_seconds']:.3f} s after the last chunk arrived"
            if "final_after_last_chunk_seconds" in timings
            else "",
        )
        self._notify()

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

    # --------------------------------------------------------- masked results
    def close(self, query_id: str) -> None:
        """Every contribution of a masked-mode query is in: AGGREGATING → NOISING, then
        compute its result (on the background thread, or here without one). A no-op
        if another thread closed it first."""
        try:
            self.store.set_state(query_id, QueryState.NOISING, expect=(QueryState.AGGREGATING,))
        except QueryStateError:
            return
        logger.info("query %s: every contribution folded, masking and adding noise", query_id)
        self._notify()
        self._schedule(query_id)

    def _schedule(self, query_id: str) -> None:
        if self._executor is None:
            self.finish(query_id)
            return
        try:
            self._executor.submit(self.finish, query_id)
        except RuntimeError:
            # Shutting down: the query stays NOISING and recover() finishes it.
            logger.info("query %s: shutting down, noise step deferred to restart", query_id)

    def finish(self, query_id: str) -> QueryRecord:
        """Compute and store a NOISING (masked-mode) query's result; idempotent.

        A DONE or FAILED query is returned as is. Errors while adding noise fail the
        query (the reason names the error class only: messages may carry noise
        values). A crash (process death) leaves it NOISING for :meth:`recover`.
        """
        with self._lock:
            if query_id in self._finishing:
                return self.store.query(query_id)
            self._finishing.add(query_id)
        try:
            record = self.store.query(query_id)
            if record.state is not QueryState.NOISING:
                return record
            try:
                data, meta = self._masked_result(record)
                record = self.store.store_result(query_id, data, meta)
            except Exception as exc:
                if self._stopping.is_set():
                    # Interrupted by shutdown (e.g. the pool was closed under us):
                    # leave NOISING, the next start finishes it from the intact aggregate.
                    logger.warning(
                        "query %s: noise step interrupted by shutdown (%s); it will be "
                        "finished on restart",
                        query_id,
                        type(exc).__name__,
                    )
                    return self.store.query(query_id)
                if isinstance(exc, FedpcaError):
                    logger.error("query %s: noise step failed: %s", query_id, type(exc).__name__)
                else:
                    logger.exception("query %s: noise step failed", query_id)
                self._fail(
                    query_id, f"adding noise failed ({type(exc).__name__}); see the proxy log"
                )
                return self.store.query(query_id)
            logger.info(
                "query %s done: %d owners, noise step %.2f s",
                query_id,
                record.quorum,
                meta["timings"]["noise_seconds"],
            )
            if self.observer is not None:
                self.observer.noise_added(meta["timings"]["noise_seconds"])
            self._notify()
            return record
        finally:
            with self._lock:
                self._finishing.discard(query_id)

    def _algebra(self, query_id: str) -> SerialisedCiphertextGroup:
        return SerialisedCiphertextGroup(self._context(query_id).public_key.n)

    def _masked_result(self, record: QueryRecord) -> tuple[bytes, dict[str, Any]]:
        context = self._context(record.query_id)
        meta = self.store.result_meta(record.query_id) or {}
        aggregate = aggregate_blocks(context, self.store.aggregate(record.query_id))
        started = time.perf_counter()
        blocks, _sections, timings = masked_result(
            context.plan,
            context.public_key,
            aggregate,
            int(meta.get("public_n", 0)),
            self.pool,
            self.noise_sampler,
        )
        timings["noise_seconds"] = time.perf_counter() - started
        data = b"".join(blocks[block.name] for block in context.plan.result_blocks)
        return data, {"timings": timings}

    def _prepare_noise(self, key: str, context: QueryContext) -> None:
        if not self._stopping.is_set():
            self._noise.prepare(key, context.plan, context.public_key.n)

    def prepared_noise(self, query_id: str) -> Future[PageNoise] | None:
        """TEST AID: the query's noise being (or already) drawn, if any (not removed)."""
        return self._noise.pending(query_id)

    # -------------------------------------------------------------- deadlines
    def check_deadlines(self) -> list[str]:
        """Fail the queries whose deadline passed before they could finish; returns
        their ids.

        A COLLECTING query fails when fewer than ``quorum`` owners began an upload in
        time; an AGGREGATING one when a contributor did not deliver all its chunks.
        Result pages already released stay released (and charged, like every query
        some owner began an upload for).
        """
        now = self.clock()
        due = []
        for record in self.store.queries(QueryState.COLLECTING, QueryState.AGGREGATING):
            if record.deadline_at > now:
                continue
            due.append(record.query_id)
            if record.state is QueryState.COLLECTING:
                joined = len(self.store.contributors(record.query_id))
                reason = (
                    f"deadline passed with {joined} of {record.quorum} required owners uploading"
                )
            else:
                late = sorted(self.store.partial_uploads(record.query_id))
                reason = (
                    f"deadline passed before contributors {', '.join(late) or '?'} delivered "
                    "all their chunks"
                )
            self._fail(record.query_id, reason)
        return due

    def run_timers(
        self, stop_event: threading.Event, interval: float = DEFAULT_TIMER_INTERVAL
    ) -> None:
        """Check deadlines every ``interval`` seconds until ``stop_event`` is set."""
        while not stop_event.wait(interval):
            try:
                self.check_deadlines()
            except Exception:
                logger.exception("deadline check failed; retrying")

    def recover(self) -> list[str]:
        """After a (re)start: finish every NOISING query, take out the uploads the old
        process was receiving for COLLECTING queries (their owners resend), finalise
        whatever pages of AGGREGATING queries are ready, then handle due ones.

        Returns
        -------
        The ids of the queries that were finished, failed or scheduled.
        """
        handled = []
        for record in self.store.queries(QueryState.NOISING):
            logger.warning(
                "query %s was interrupted while adding noise; finishing", record.query_id
            )
            handled.append(record.query_id)
            self._schedule(record.query_id)
        for record in self.store.queries(QueryState.COLLECTING, QueryState.AGGREGATING):
            context = self._context(record.query_id)
            removed = self.store.discard_partial_uploads(
                record.query_id,
                total_ciphertexts=_total_ciphertexts(context),
                algebra=self._algebra(record.query_id),
            )
            if removed:
                logger.warning(
                    "query %s: %d chunks of uploads interrupted by the restart taken out",
                    record.query_id,
                    removed,
                )
            # Noise drawn before the restart is gone: pages not yet final get a fresh draw.
            self._prepare_noise(record.query_id, context)
            if record.state is QueryState.AGGREGATING:
                self.advance(record.query_id)
        return handled + self.check_deadlines()

    # ----------------------------------------------------------------- cancel
    def cancel(self, analyst_id: str, query_id: str) -> CancelReceipt:
        """Stop the analyst's query while it collects: COLLECTING -> FAILED.

        The failure reason is :data:`CANCELLED_REASON`; the refund rule is that of
        every failure (the charge is refunded only if no owner began an upload), and
        owners that have not answered receive a TaskCancellation on their task stream.
        Cancelling a query that already failed changes nothing.

        Raises
        ------
        NotFoundError
            Unknown query (for this analyst).
        QueryStateError
            Collection has closed (contributors fixed, NOISING or DONE): result pages
            are, or may be, released and can no longer be withheld.
        """
        key = task_id(analyst_id, query_id)
        record = self.store.query(key)
        if record.state is QueryState.COLLECTING:
            try:
                record = self.store.set_state(
                    key,
                    QueryState.FAILED,
                    expect=(QueryState.COLLECTING,),
                    failure_reason=CANCELLED_REASON,
                )
            except QueryStateError:
                record = self.store.query(key)  # closed or failed meanwhile
            else:
                logger.warning("query %s failed: %s", key, CANCELLED_REASON)
                self._noise.discard(key)
                self._notify()
        if record.state is not QueryState.FAILED:
            raise QueryStateError(
                f"query {query_id!r} is {record.state.value}: collection has closed and its "
                "result is being or has been released; it can no longer be cancelled"
            )
        return CancelReceipt(self.status(analyst_id, query_id), not self.store.has_release(key))

    # ---------------------------------------------------------------- reading
    def status(self, analyst_id: str, query_id: str) -> QueryStatus:
        """The status of the analyst's query ``query_id``, with every public decline."""
        key = task_id(analyst_id, query_id)
        record = self.store.query(key)
        declines = []
        for owner, text in sorted(self.store.declines(key).items()):
            code, _, detail = text.partition(": ")
            declines.append(OwnerDecline(owner, code, detail))
        context = self._context(key)
        result_total = sum(block.n_ciphertexts for block in result_blocks(context.plan))
        total = _total_ciphertexts(context)
        contributors = self.store.contributors(key)
        # A contribution counts once all its chunks are folded (its stream's own end
        # may be acknowledged a moment later); the others are still uploading.
        delivered = sum(1 for c in contributors if c.covered >= total)
        return QueryStatus(
            query_id=query_id,
            state=record.state,
            owners_contributed=max(delivered, record.n_contributed),
            quorum=record.quorum,
            owners_declined=len(declines),
            deadline=datetime.fromtimestamp(record.deadline_at, UTC),
            failure_reason=record.failure_reason,
            owners_uploading=len(contributors) - delivered,
            declines=tuple(declines),
            owners_registered=len(self.registered_owners),
            pages_final=self.store.pages_final(key),
            pages_total=page_count(result_total, self.store.page_ciphertexts),
        )

    def result_header(self, analyst_id: str, query_id: str) -> ResultHeader:
        """The header of the analyst's result, known once its contributors are fixed.

        Raises
        ------
        NotFoundError
            Unknown query (for this analyst).
        QueryStateError
            The query failed (the message carries its reason), or it is still
            collecting: the owner count, and so the header, is not known yet (the
            analyst watches the query until its contributors are fixed, then fetches).
        """
        key = task_id(analyst_id, query_id)
        record = self.store.query(key)
        if record.state is QueryState.FAILED:
            raise QueryStateError(
                f"query {query_id!r} failed: {record.failure_reason or 'no reason'}"
            )
        meta = self.store.result_meta(key)
        if record.state is QueryState.COLLECTING or meta is None:
            raise QueryStateError(
                f"query {query_id!r} is still collecting: its result can be fetched once "
                "its contributors are fixed (watch the query until then)"
            )
        return result_header(self._context(key), meta, self.store.page_ciphertexts)

    def result_pages(self, analyst_id: str, query_id: str, start: int) -> list[bytes]:
        """The analyst's final result pages from ``start`` on (each is released once it
        is final and never changes).

        Raises
        ------
        NotFoundError, QueryStateError
            As :meth:`result_header`; a query that failed after some pages were
            released raises here (the pages released stay released).
        """
        key = task_id(analyst_id, query_id)
        pages = self.store.result_pages(key, start)
        if not pages:
            record = self.store.query(key)
            if record.state is QueryState.FAILED:
                raise QueryStateError(
                    f"query {query_id!r} failed: {record.failure_reason or 'no reason'}"
                )
        return pages

    def result(self, analyst_id: str, query_id: str) -> QueryResult:
        """The analyst's whole result, once DONE (tools and tests; the servicer streams
        pages as they become final instead).

        Raises
        ------
        NotFoundError
            Unknown query (for this analyst).
        QueryStateError
            Not DONE yet (or FAILED).
        """
        key = task_id(analyst_id, query_id)
        record = self.store.query(key)
        header = self.result_header(analyst_id, query_id)
        if record.state is not QueryState.DONE:
            raise QueryStateError(f"query {query_id!r} is {record.state.value}: no result yet")
        return whole_result(header, self.store.result_pages(key))

    def result_meta(self, analyst_id: str, query_id: str) -> dict[str, Any]:
        """The JSON metadata stored with a result (sigmas, public N, timings); empty
        before the query's contributors are fixed.

        Raises
        ------
        NotFoundError
            Unknown query (for this analyst).
        """
        key = task_id(analyst_id, query_id)
        self.store.query(key)
        return self.store.result_meta(key) or {}

    def budget(self, analyst_id: str, delta: float | None = None) -> BudgetStatus:
        """An analyst's cumulative privacy loss.

        ``epsilon_spent`` is composed at ``delta`` (default: the budget's delta);
        ``epsilon_remaining`` is always measured at the budget's own delta, the one
        its epsilon limit refers to.
        """
        from fedpca.dp.accounting import compose_epsilon  # slow import (dp_accounting)

        limit = self.config.budget.for_analyst(analyst_id)
        at = limit.delta if delta is None else delta
        ledger = [PrivacyEvent.from_dict(r) for r in self.store.releases(analyst_id)]
        privacy = self.config.privacy

        def spent_at(delta_: float) -> float:
            return compose_epsilon(
                ledger, delta_, privacy.accountant, neighbouring=privacy.neighbouring
            )

        spent = spent_at(at)
        if math.isinf(limit.epsilon):
            remaining = math.inf
        else:
            used = spent if at == limit.delta else spent_at(limit.delta)
            remaining = max(0.0, limit.epsilon - used)
        return BudgetStatus(
            analyst_id=analyst_id,
            delta=at,
            epsilon_spent=spent,
            epsilon_remaining=remaining,
            epsilon_limit=limit.epsilon,
            n_releases=len(ledger),
            limit_delta=limit.delta,
        )
