"""The proxy's query lifecycle: submission, uploads, quorum, deadlines and the result.

Pure domain code: no gRPC here (:mod:`fedpca.proxy.servicer` translates), and
every durable change goes through :class:`~fedpca.proxy.store.ProxyStore`.

Lifecycle of one query::

    submit ──▶ COLLECTING ──(quorum reached, or deadline with >= quorum)──▶ NOISING ──▶ DONE
                   └──(deadline with fewer than quorum, or so many public
                       declines that the quorum can no longer be reached)──────▶ FAILED

Queries are keyed by analyst: the proxy stores analyst ``a``'s query ``q`` under the
*task id* ``a/q``, which is also what owners see and answer with, so one analyst's
query ids say nothing about another's. Only owners on the allow-list
(``[owners] allowed``) are offered tasks or may upload and decline.

The noise of a stats-mode query is prepared while owners encrypt
(:mod:`fedpca.proxy.prepared_noise`); a masked-mode result is computed by
:mod:`fedpca.proxy.masking`. Why each step is safe against concurrent
submissions, broken streams and crashes, and what the noise step costs, is in
docs/architecture.md ("The proxy's query lifecycle").
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import threading
import time
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
    SignedQuery,
    Task,
    TaskCancellation,
    UploadHeader,
)
from fedpca.protocol import ReleasePlan
from fedpca.proxy.config import ProxyConfig
from fedpca.proxy.masking import masked_result
from fedpca.proxy.prepared_noise import EncryptedNoise, PreparedNoise
from fedpca.proxy.queries import QueryContext, spec_from_dict, spec_to_dict, validate_query
from fedpca.proxy.results import aggregate_blocks, stats_result, stored_result
from fedpca.proxy.store import ProxyStore, QueryRecord, UploadCompletion
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
        self._fold_seconds: dict[str, float] = {}
        self._stream_numbers = itertools.count(1)
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
            pool,
            noise_sampler,
            enabled=background if precompute_noise is None else precompute_noise,
        )
        self.observer: Any = None
        """Told each upload's fold seconds and each query's noise seconds
        (``upload_folded`` / ``noise_added``; :class:`fedpca.proxy.metrics.ProxyMetrics`)."""

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
        the owner uploaded to or declined need no cancellation.
        """
        now = self.clock()
        cancellations = []
        for query_id in query_ids:
            try:
                record = self.store.query(query_id)
            except NotFoundError:
                continue
            if owner_id in self.store.declines(query_id) or any(
                u.owner_id == owner_id for u in self.store.uploads(query_id)
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
        try:
            self.store.set_state(
                query_id,
                QueryState.FAILED,
                expect=(QueryState.COLLECTING,),
                failure_reason=reason,
                algebra=self._algebra(query_id),
            )
        except QueryStateError:
            return
        logger.warning("query %s failed: %s", query_id, reason)
        self._noise.discard(query_id)

    # ----------------------------------------------------------------- uploads
    def check_upload_header(self, owner_id: str, header: UploadHeader) -> bool:
        """:func:`fedpca.proxy.uploads.check_upload_header` against the stored query.

        Returns True when the header is a retry of an upload already accepted.
        """
        return check_upload_header(
            self._context(header.query_id), self.store, owner_id, header, self.clock
        )

    def begin_upload(self, owner_id: str, header: UploadHeader) -> UploadStream:
        """Check an upload's header and open the stream its chunks are folded through.

        From here on the owner may have spent budget on the query, so it is marked as
        never to be refunded.

        Raises the errors of :meth:`check_upload_header`, and AuthenticationError for
        an owner that is not on the allow-list.
        """
        self.require_owner(owner_id)
        duplicate = self.check_upload_header(owner_id, header)
        if not duplicate:
            self.store.mark_upload_begun(header.query_id)
        context = self._context(header.query_id)
        with self._lock:
            stream = next(self._stream_numbers)
        return UploadStream(
            self.store,
            owner_id,
            header,
            context,
            stream,
            duplicate=duplicate,
            on_change=self._notify,
            on_accepted=self._uploaded,
        )

    def _uploaded(self, query_id: str, receipt: UploadCompletion, fold_seconds: float) -> None:
        with self._lock:
            self._fold_seconds[query_id] = self._fold_seconds.get(query_id, 0.0) + fold_seconds
        if self.observer is not None:
            self.observer.upload_folded(fold_seconds)
        self._notify()
        if receipt.n_contributed >= self._context(query_id).spec.quorum:
            self.close(query_id)

    # --------------------------------------------------------- quorum/deadline
    def close(self, query_id: str) -> None:
        """Stop collecting (COLLECTING → NOISING) and finish the query.

        A no-op if another thread closed it first. The result is computed on the
        background thread (or here, without one).
        """
        try:
            self.store.set_state(
                query_id,
                QueryState.NOISING,
                expect=(QueryState.COLLECTING,),
                algebra=self._algebra(query_id),
            )
        except QueryStateError:
            return
        logger.info("query %s: collection closed, adding noise", query_id)
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

    def check_deadlines(self) -> list[str]:
        """Finish or fail COLLECTING queries that are due; returns their ids.

        Due means: the quorum is already reached (e.g. after a crash between the
        last fold and closing), or the deadline has passed. At the deadline a
        query with at least ``quorum`` owners is finished, otherwise it fails.
        """
        now = self.clock()
        due = []
        for record in self.store.queries(QueryState.COLLECTING):
            quorum = int(record.spec.get("quorum", 1))
            if record.n_contributed >= quorum:
                due.append(record.query_id)
                self.close(record.query_id)
            elif record.deadline_at <= now:
                due.append(record.query_id)
                reason = f"deadline passed with {record.n_contributed} of {quorum} required owners"
                try:
                    self.store.set_state(
                        record.query_id,
                        QueryState.FAILED,
                        expect=(QueryState.COLLECTING,),
                        failure_reason=reason,
                    )
                except QueryStateError:
                    continue  # an upload closed it in the meantime
                logger.warning("query %s failed: %s", record.query_id, reason)
                self._noise.discard(record.query_id)
                self._notify()
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
        """After a (re)start: finish every NOISING query, then handle due ones.

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
        for record in self.store.queries(QueryState.COLLECTING):
            # Upload streams died with the old process: take their chunks out (the
            # owners resend), and noise prepared before the restart: draw it anew.
            removed = self.store.discard_partial_uploads(
                record.query_id, self._algebra(record.query_id)
            )
            if removed:
                logger.warning(
                    "query %s: %d chunks of uploads interrupted by the restart taken out",
                    record.query_id,
                    removed,
                )
            self._prepare_noise(record.query_id, self._context(record.query_id))
        return handled + self.check_deadlines()

    # ------------------------------------------------------------------ finish
    def finish(self, query_id: str) -> QueryRecord:
        """Add noise (and the mask) and store the result; idempotent.

        COLLECTING is first moved to NOISING; a DONE or FAILED query is returned
        as is. Errors while adding noise fail the query (the reason names the error
        class only: messages may carry noise values). A crash (process death)
        leaves it NOISING for :meth:`recover`.
        """
        with self._lock:
            if query_id in self._finishing:
                return self.store.query(query_id)
            self._finishing.add(query_id)
        try:
            record = self.store.query(query_id)
            if record.state is QueryState.COLLECTING:
                try:
                    record = self.store.set_state(
                        query_id,
                        QueryState.NOISING,
                        expect=(QueryState.COLLECTING,),
                        algebra=self._algebra(query_id),
                    )
                except QueryStateError:
                    record = self.store.query(query_id)
                self._notify()
            if record.state is not QueryState.NOISING:
                return record
            try:
                blocks, meta = self._compute_result(record)
                record = self.store.store_result(query_id, blocks, meta)
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
                reason = f"adding noise failed ({type(exc).__name__}); see the proxy log"
                try:
                    record = self.store.set_state(
                        query_id,
                        QueryState.FAILED,
                        expect=(QueryState.NOISING,),
                        failure_reason=reason,
                    )
                except QueryStateError:
                    record = self.store.query(query_id)
            else:
                logger.info(
                    "query %s done: %d owners, noise step %.2f s",
                    query_id,
                    record.n_contributed,
                    meta["timings"]["noise_seconds"],
                )
                if self.observer is not None:
                    self.observer.noise_added(meta["timings"]["noise_seconds"])
            self._notify()
            return record
        finally:
            with self._lock:
                self._finishing.discard(query_id)
            # Done (its noise was taken), failed or already terminal: prepared noise
            # of this query, if any is left, must never be used.
            self._noise.discard(query_id)

    def _algebra(self, query_id: str) -> SerialisedCiphertextGroup:
        return SerialisedCiphertextGroup(self._context(query_id).public_key.n)

    def _compute_result(self, record: QueryRecord) -> tuple[dict[str, bytes], dict[str, Any]]:
        context = self._context(record.query_id)
        n_owners = record.n_contributed
        if n_owners < 1:
            raise QueryStateError(f"query {record.query_id!r} has no uploads to release")
        aggregate = aggregate_blocks(context, self.store.aggregate(record.query_id))
        started = time.perf_counter()
        if context.spec.mode is ProtocolMode.MASKED:
            public_n = sum(u.public_count or 0 for u in self.store.uploads(record.query_id))
            blocks, sections, timings = masked_result(
                context.plan,
                context.public_key,
                aggregate,
                public_n,
                self.pool,
                self.noise_sampler,
            )
        else:
            public_n = None
            blocks, sections, timings = stats_result(
                record.query_id, context, aggregate, n_owners, self._noise
            )
        timings["noise_seconds"] = time.perf_counter() - started
        with self._lock:
            fold_seconds = self._fold_seconds.get(record.query_id)
        if fold_seconds is not None:
            # Only folds done by this process; absent after a restart.
            timings["fold_seconds"] = fold_seconds
        meta: dict[str, Any] = {
            "n_owners": n_owners,
            "mode": context.spec.mode.value,
            "not_private": not context.spec.private,
            "sections": sections,
            "plan": context.plan.describe(),
            "timings": timings,
        }
        if public_n is not None:
            meta["public_n"] = public_n
        return blocks, meta

    def _prepare_noise(self, key: str, context: QueryContext) -> None:
        if not self._stopping.is_set():
            self._noise.prepare(key, context.plan, context.public_key)

    def prepared_noise(self, query_id: str) -> Future[EncryptedNoise] | None:
        """TEST AID: the pending preparation of a query's noise, if any (not removed)."""
        return self._noise.pending(query_id)

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
            Collection has closed (NOISING or DONE): the result is, or is being,
            released and can no longer be withheld.
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
                    algebra=self._algebra(key),
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
        return QueryStatus(
            query_id=query_id,
            state=record.state,
            owners_contributed=record.n_contributed,
            quorum=int(record.spec.get("quorum", 1)),
            owners_declined=len(declines),
            deadline=datetime.fromtimestamp(record.deadline_at, UTC),
            failure_reason=record.failure_reason,
            owners_uploading=len(self.store.partial_uploads(key)),
            declines=tuple(declines),
            owners_registered=len(self.registered_owners),
        )

    def result(self, analyst_id: str, query_id: str) -> QueryResult:
        """The analyst's stored, noise-added result, ready for
        :func:`fedpca.transport.serde.encode_result`.

        Raises
        ------
        NotFoundError
            Unknown query (for this analyst).
        QueryStateError
            Not DONE yet (or FAILED).
        """
        key = task_id(analyst_id, query_id)
        record = self.store.query(key)
        data, meta = self.store.result(key)
        return stored_result(self._context(key), record.n_contributed, data, meta)

    def result_meta(self, analyst_id: str, query_id: str) -> dict[str, Any]:
        """The JSON metadata stored with a result (sigmas, public N, timings)."""
        return self.store.result(task_id(analyst_id, query_id))[1]

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
