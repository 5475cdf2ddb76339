"""The analyst's side of the coordinator: cancelling a query, its status, its result
header and pages, and the analyst's budget."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime
from typing import Any, TypeVar

from fedpca.admission import NextQuery
from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
from fedpca.errors import ConfigError, OverloadError, QueryStateError
from fedpca.formatting import distinct
from fedpca.messages import (
    CANCELLED_REASON,
    BudgetStatus,
    CancelReceipt,
    Charge,
    OwnerDecline,
    QueryResult,
    QueryState,
    QueryStatus,
    ResultHeader,
)
from fedpca.proxy.coordinator_core import (
    CoordinatorCore,
    RecentlyUsed,
    task_id,
)
from fedpca.proxy.results import result_header, whole_result
from fedpca.proxy.store_records import QueryRecord, page_count
from fedpca.query import DEFAULT_QUERY_DELTA

__all__ = ["AnalystRequests", "next_query_for"]

logger = logging.getLogger("fedpca.proxy.coordinator")


class AnalystRequests(CoordinatorCore):
    """What an analyst may ask of its own queries (always keyed by :func:`task_id`)."""

    def cancel(self, analyst_id: str, query_id: str) -> CancelReceipt:
        """Stop the analyst's query while its contributions arrive: COLLECTING or
        AGGREGATING -> FAILED.

        The failure reason is :data:`CANCELLED_REASON`; the refund rule is that of
        every failure (the charge is refunded only if no owner began an upload, so a
        query cancelled while AGGREGATING stays charged: pages of it may be final), and
        owners that have not answered receive a TaskCancellation on their task stream.
        Cancelling an AGGREGATING query is what frees the analyst's place when a
        contributor stalls (its open queries are bounded). Cancelling a query that
        already failed changes nothing.

        Raises
        ------
        NotFoundError
            Unknown query (for this analyst).
        QueryStateError
            The query is NOISING or DONE: its result is complete or being completed.
        """
        key = task_id(analyst_id, query_id)
        record = self.store.query(key)
        if record.state in (QueryState.COLLECTING, QueryState.AGGREGATING):
            try:
                record = self.store.set_state(
                    key,
                    QueryState.FAILED,
                    expect=(QueryState.COLLECTING, QueryState.AGGREGATING),
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
                f"query {query_id!r} is {record.state.value}: every contribution has arrived "
                "and its result is being or has been released; it can no longer be cancelled"
            )
        status = self.status(analyst_id, query_id)
        return CancelReceipt(status, status.charge is Charge.REFUNDED)

    # ---------------------------------------------------------------- reading
    def status(self, analyst_id: str, query_id: str) -> QueryStatus:
        """The status of the analyst's query ``query_id``, with every public decline."""
        key = task_id(analyst_id, query_id)
        record = self.store.query(key)
        declines = []
        for owner, text in sorted(self.store.declines(key).items()):
            code, _, detail = text.partition(": ")
            declines.append(OwnerDecline(owner, code, detail))
        # From the stored summary, not the query: reading a large one took seconds.
        result_total = int(record.summary.get("result_ciphertexts", 0))
        total = int(record.summary.get("owner_ciphertexts", 0))
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
            # As it was when the query was asked (a list of old queries showed "0/3 of
            # 2" after the allow-list shrank: an operator's walkthrough).
            owners_registered=int(
                record.summary.get("owners_registered", len(self.registered_owners))
            ),
            pages_final=self.store.pages_final(key),
            pages_total=page_count(result_total, self.store.page_ciphertexts),
            charge=self._charge(key, record),
            result_deleted_at=_utc(self.store.result_purged_at(key)),
        )

    def _charge(self, key: str, record: QueryRecord) -> Charge:
        """Where the query's epsilon stands on its analyst's ledger. Read after
        ``record``: a query refunded in between (its failure and the refund are one
        transaction) reads as refunded, which it is."""
        if not self.store.has_release(key):
            return Charge.REFUNDED
        if record.state.terminal or record.uploads_begun:
            return Charge.CHARGED
        return Charge.RESERVED

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
        self._check_not_purged(key, query_id)
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
        return result_header(
            self._context(key),
            meta,
            self.store.page_ciphertexts,
            signature=record.signature,
            signer=record.signer,
        )

    def _check_not_purged(self, key: str, query_id: str) -> None:
        purged_at = _utc(self.store.result_purged_at(key))
        if purged_at is not None:
            when = purged_at.strftime("%Y-%m-%d")
            raise QueryStateError(
                f"the result of query {query_id!r} was deleted on {when}, when it was older "
                "than the proxy keeps results ([proxy] keep_results_days); its charge stands"
            )

    def result_pages(
        self, analyst_id: str, query_id: str, start: int, limit: int | None = None
    ) -> list[bytes]:
        """The analyst's final result pages from ``start`` on, at most ``limit`` of them
        (each is released once it is final and never changes).

        Raises
        ------
        NotFoundError, QueryStateError
            As :meth:`result_header`; a query that failed after some pages were
            released raises here (the pages released stay released).
        """
        key = task_id(analyst_id, query_id)
        pages = self.store.result_pages(key, start, limit)
        if not pages:
            self._check_not_purged(key, query_id)
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

    def budget(
        self,
        analyst_id: str,
        delta: float | None = None,
        query_delta: float | None = None,
        *,
        next_query: bool = True,
    ) -> BudgetStatus:
        """An analyst's cumulative privacy loss, and what its next query may ask for.

        ``epsilon_spent`` is composed at ``delta`` (default: the budget's delta);
        ``epsilon_remaining`` (kept for older analysts) is always measured at the
        budget's own delta, the one its epsilon limit refers to. ``next_query`` is the
        largest epsilon a query stating ``query_delta`` would be admitted with now, found
        with the rule :meth:`submit` applies (:mod:`fedpca.dp.next_query`); the default
        query delta is :data:`~fedpca.query.DEFAULT_QUERY_DELTA`, or the per-query delta
        cap if lower. ``next_query=False`` leaves it out (metrics need only the spent
        epsilon, and the search costs a few compositions of the ledger).

        Raises
        ------
        ConfigError
            ``query_delta`` is above the per-query delta cap: such a query is refused
            whatever its epsilon.
        OverloadError
            The analyst's previous request is still being computed (one at a time per
            analyst; with ``next_query`` only, as the analyst's own requests ask).
        """
        limit = self.config.budget.for_analyst(analyst_id)
        at = limit.delta if delta is None else delta
        privacy = self.config.privacy
        cap = privacy.delta_cap(limit)
        if query_delta is not None and query_delta > cap:
            shown, cap_text = distinct(query_delta, cap)
            raise ConfigError(
                f"a query delta of {shown} is above this proxy's per-query cap {cap_text} "
                "(privacy.max_delta_per_query): every such query is refused"
            )
        ledger = [PrivacyEvent.from_dict(r) for r in self.store.releases(analyst_id)]

        # Each composition not kept, not only the search: one at a delta never asked
        # before takes up to a second under pld-continuous, and an analyst asking at
        # fresh deltas from 16 threads held 16 workers (review, stop 42: another
        # analyst's status call took 1.5 s instead of 2 ms).
        searching = _SearchSlot(self, analyst_id) if next_query else None

        def spent_at(delta_: float) -> float:
            return composed(
                ledger, delta_, privacy.accountant, privacy.neighbouring, searching=searching
            )

        spent = spent_at(at)
        if math.isinf(limit.epsilon):
            remaining = math.inf
        else:
            used = spent if at == limit.delta else spent_at(limit.delta)
            remaining = max(0.0, limit.epsilon - used)
        admissible = None
        if next_query:
            admissible = next_query_for(
                ledger,
                limit,
                min(DEFAULT_QUERY_DELTA, cap) if query_delta is None else query_delta,
                privacy.accountant,
                privacy.neighbouring,
                searching=searching,
            )
        return BudgetStatus(
            analyst_id=analyst_id,
            delta=at,
            epsilon_spent=spent,
            epsilon_remaining=remaining,
            epsilon_limit=limit.epsilon,
            n_releases=len(ledger),
            limit_delta=limit.delta,
            next_query=admissible,
        )


class _SearchSlot:
    """One composition or search of an analyst's budget request at a time
    (:meth:`AnalystRequests.budget`); answers already kept need none."""

    def __init__(self, requests: AnalystRequests, analyst_id: str) -> None:
        self._requests = requests
        self._analyst = analyst_id

    def __enter__(self) -> None:
        with self._requests._lock:
            if self._analyst in self._requests._searching:
                # A search takes up to seconds of CPU under pld-continuous, one new one
                # per query delta asked about: an analyst asking for many at once would
                # hold as many worker threads. One runs; the others ask again.
                raise OverloadError(
                    "this analyst's previous budget request is still being computed; ask "
                    "again when it has answered"
                )
            self._requests._searching.add(self._analyst)

    def __exit__(self, *exc: object) -> None:
        with self._requests._lock:
            self._requests._searching.discard(self._analyst)


_V = TypeVar("_V")

NEXT_QUERY_CACHE_SIZE = 64
"""Next-query answers kept (by ledger, budget, query delta and accounting), and as many
compositions (by ledger, delta and accounting)."""

_NEXT_QUERIES: RecentlyUsed[tuple[Any, ...], NextQuery] = RecentlyUsed(NEXT_QUERY_CACHE_SIZE)
_COMPOSED: RecentlyUsed[tuple[Any, ...], float] = RecentlyUsed(NEXT_QUERY_CACHE_SIZE)


def composed(
    ledger: Sequence[PrivacyEvent],
    delta: float,
    accountant: Any,
    neighbouring: Any,
    *,
    searching: AbstractContextManager[Any] | None = None,
) -> float:
    """The ledger's epsilon at ``delta`` (:func:`~fedpca.dp.accounting.compose_epsilon`),
    composed once per ledger and delta: a dashboard polling an analyst's budget asks the
    same again until the next release changes the key. ``searching`` is entered around
    a composition, not around a value already kept (as for :func:`next_query_for`)."""
    from fedpca.dp.accounting import compose_epsilon  # slow import (dp_accounting)

    return _kept_or_found(
        _COMPOSED,
        (tuple(ledger), delta, accountant, neighbouring),
        lambda: compose_epsilon(list(ledger), delta, accountant, neighbouring=neighbouring),
        searching,
    )


def next_query_for(
    ledger: Sequence[PrivacyEvent],
    limit: PrivacyParams,
    query_delta: float,
    accountant: Any,
    neighbouring: Any,
    *,
    searching: AbstractContextManager[Any] | None = None,
) -> NextQuery:
    """The largest epsilon a query at ``query_delta`` is admitted with after ``ledger``
    (:func:`~fedpca.dp.next_query.largest_admissible_epsilon`), found once per ledger:
    the search composes the ledger a few times (up to seconds of CPU under
    pld-continuous), and an analyst (or a dashboard) asking again before its next
    release gets the same answer without it. A new release changes the key.

    ``searching`` is entered around a search, not around an answer already kept (the
    per-analyst slot of :meth:`AnalystRequests.budget`).
    """
    from fedpca.dp.next_query import largest_admissible_epsilon  # slow import

    return _kept_or_found(
        _NEXT_QUERIES,
        (tuple(ledger), limit, query_delta, accountant, neighbouring),
        lambda: largest_admissible_epsilon(
            list(ledger), limit, query_delta, accountant, neighbouring=neighbouring
        ),
        searching,
    )


def _kept_or_found(
    kept: RecentlyUsed[tuple[Any, ...], _V],
    key: tuple[Any, ...],
    find: Callable[[], _V],
    searching: AbstractContextManager[Any] | None,
) -> _V:
    """The value ``kept`` holds for ``key``, or ``find()``'s, found inside ``searching``
    (not entered for a value already kept) and kept."""
    value = kept.get(key)
    if value is not None:
        return value
    with searching if searching is not None else nullcontext():
        found = find()
    return kept.put(key, found)


def _utc(timestamp: float | None) -> datetime | None:
    return None if timestamp is None else datetime.fromtimestamp(timestamp, UTC)
