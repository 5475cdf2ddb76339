"""Durable proxy state in SQLite.

Everything the proxy must not lose lives here: enrolled owners, queries and their
lifecycle, each query's contributors and how far their chunks are folded, accepted
uploads, the running encrypted aggregates, the result pages released so far, and each
analyst's privacy-budget ledger. The tables and migrations are in
:mod:`fedpca.proxy.store_schema`.

Crash safety rests on three rules:

* every state change that must be atomic is one ``BEGIN IMMEDIATE`` transaction
  (WAL journal, ``synchronous=FULL``), so a ``kill -9`` leaves either the state
  before or the state after it; concurrent chunk folds share one transaction and one
  fsync (:mod:`fedpca.proxy.group_commit`), and a chunk counts only once committed;
* a chunk is folded exactly once. Each contributor's row records how many of its
  ciphertexts (from the start, in wire order) are folded; a chunk below that mark
  (a retry, or an upload resumed after a restart of either side) is skipped, one at
  the mark is folded and the mark moves in the same transaction, and one beyond it
  is refused;
* while the contributors are not yet fixed (state COLLECTING) a copy of each folded
  chunk is staged, so an upload whose stream breaks is taken out exactly (by
  multiplying the staged chunks' inverses into the aggregate) and its place goes to
  the next owner. From the moment the contributors are fixed (AGGREGATING) result
  pages may be released, so nothing is ever taken out again: the staged copies are
  dropped and a broken upload resumes where its mark stands.

The aggregate lives in pages of :data:`PAGE_CIPHERTEXTS` ciphertexts, so folding a
chunk reads and rewrites only the pages it touches, and a page of the result is
final (noise added, :meth:`ProxyStore.finalize_pages`) as soon as every contributor's
mark has passed it; it is then never changed.

Ciphertexts are stored as opaque fixed-width byte strings; the group operation is
a :class:`CiphertextAlgebra` supplied by the caller (homomorphic addition lives in
the codec).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from fedpca.errors import NotFoundError, ProtocolError, QueryStateError
from fedpca.messages import DECLINES_CLOSED, QueryState
from fedpca.proxy.store_contributions import ContributionStore
from fedpca.proxy.store_records import (
    QUERY_HEAD,
    QueryRecord,
    query_record_of,
    query_summary,
    stored_size,
)
from fedpca.proxy.store_schema import SCHEMA_VERSION

__all__ = ["RECENT_FAILURES_KEPT", "SCHEMA_VERSION", "ProxyStore", "QueryProgress"]

logger = logging.getLogger(__name__)

RECENT_FAILURES_KEPT = 1024
"""Failed queries whose reasons :meth:`ProxyStore.recent_failure` keeps in memory."""


class QueryProgress(NamedTuple):
    """How far a query got: its state and whether any owner began an upload."""

    state: QueryState
    uploads_begun: bool


class ProxyStore(ContributionStore):
    """Thread-safe access to the proxy's SQLite database: owners, queries and their
    lifecycle, declines and the analysts' budget ledgers here; contributions, uploads
    and result pages in :class:`~fedpca.proxy.store_contributions.ContributionStore`;
    the connection in :class:`~fedpca.proxy.store_database.StoreDatabase` (whose
    parameters it takes)."""

    def touch_owner(self, owner_id: str, info: Mapping[str, Any] | None = None) -> None:
        """Record that an owner enrolled or was seen (enrolment is idempotent)."""
        now = self._clock()
        with self.transaction() as conn:
            conn.execute(
                "INSERT INTO owners(owner_id, first_seen, last_seen, info) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(owner_id) DO UPDATE SET last_seen=excluded.last_seen, "
                "info=CASE WHEN ? THEN excluded.info ELSE owners.info END",
                (owner_id, now, now, json.dumps(dict(info or {})), info is not None),
            )

    def owners(self) -> list[str]:
        with self._lock:
            rows = self._conn.execute("SELECT owner_id FROM owners ORDER BY owner_id").fetchall()
        return [str(r["owner_id"]) for r in rows]

    def create_query(
        self,
        query_id: str,
        analyst_id: str,
        spec: Mapping[str, Any],
        plan: Mapping[str, Any],
        deadline_at: float,
        *,
        signature: bytes = b"",
        signer: str = "",
        before_insert: Callable[[sqlite3.Connection], None] | None = None,
        owners_registered: int | None = None,
    ) -> QueryRecord:
        """Create a query in state COLLECTING.

        ``owners_registered`` (the allow-list's size now) is kept in its summary: its
        status says "k of n registered" with the n it was asked under, not today's.

        ``before_insert`` runs inside the same transaction (the budget check uses
        it so that two concurrent submissions cannot both pass). Submitting the
        same query id again with the same spec returns the existing record;
        with a different spec it is a protocol error. Query ids are the proxy's
        keys, scoped by analyst (:meth:`fedpca.proxy.coordinator.Coordinator.submit`).
        """
        now = self._clock()
        spec_json = json.dumps(dict(spec), sort_keys=True)
        plan_json = json.dumps(dict(plan), sort_keys=True)
        summary_record = query_summary(spec, plan)
        if owners_registered is not None:
            summary_record["owners_registered"] = owners_registered
        summary = json.dumps(summary_record, sort_keys=True)
        with self.transaction() as conn:
            row = conn.execute(
                "SELECT spec, analyst_id FROM queries WHERE query_id=?", (query_id,)
            ).fetchone()
            if row is not None:
                if row["spec"] != spec_json or row["analyst_id"] != analyst_id:
                    raise ProtocolError(
                        f"query id {query_id!r} already exists with a different spec"
                    )
            else:
                if before_insert is not None:
                    before_insert(conn)
                conn.execute(
                    "INSERT INTO queries(query_id, analyst_id, spec, plan, state, created_at, "
                    "deadline_at, updated_at, signature, signer, summary, stored_bytes) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        query_id,
                        analyst_id,
                        spec_json,
                        plan_json,
                        QueryState.COLLECTING.value,
                        now,
                        deadline_at,
                        now,
                        signature,
                        signer,
                        summary,
                        stored_size(spec_json, plan_json, signature),
                    ),
                )
        return self.query(query_id)

    def queries(self, *states: QueryState) -> list[QueryRecord]:
        with self._lock:
            if states:
                marks = ",".join("?" for _ in states)
                rows = self._conn.execute(
                    f"SELECT {QUERY_HEAD} FROM queries WHERE state IN ({marks}) "
                    "ORDER BY created_at",
                    [s.value for s in states],
                ).fetchall()
            else:
                rows = self._conn.execute(
                    f"SELECT {QUERY_HEAD} FROM queries ORDER BY created_at"
                ).fetchall()
        return [query_record_of(r) for r in rows]

    def contributed_releases(self, owner_id: str) -> list[tuple[QueryRecord, float]]:
        """The queries with a release on their analyst's ledger that ``owner_id``'s upload
        joined, each with the time it joined, in that order (``proxy export-releases``)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT q.*, c.joined_at AS joined_at FROM queries q "
                "JOIN contributors c ON c.query_id = q.query_id "
                "JOIN releases r ON r.query_id = q.query_id "
                "WHERE c.owner_id=? ORDER BY c.joined_at, q.query_id",
                (owner_id,),
            ).fetchall()
        return [(query_record_of(r), float(r["joined_at"])) for r in rows]

    def analyst_queries(self, analyst_id: str, limit: int) -> list[QueryRecord]:
        """The analyst's ``limit`` newest queries, newest first."""
        # Without the queries themselves (up to 2 MiB each): sorting whole rows copied
        # every one through SQLite's sorter, most of a listing's time.
        with self._lock:
            rows = self._conn.execute(
                f"SELECT {QUERY_HEAD} FROM queries WHERE analyst_id=? "
                "ORDER BY created_at DESC, query_id LIMIT ?",
                (analyst_id, limit),
            ).fetchall()
        return [query_record_of(r) for r in rows]

    def state_counts(self) -> dict[QueryState, int]:
        """How many queries are in each state (for monitoring)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT state, COUNT(*) AS n FROM queries GROUP BY state"
            ).fetchall()
        return {QueryState(r["state"]): int(r["n"]) for r in rows}

    def oldest_open_query_created(self) -> float | None:
        """When the oldest query not yet done or failed was created (None: no such query)."""
        open_states = [state.value for state in QueryState if not state.terminal]
        marks = ",".join("?" for _ in open_states)
        with self._lock:
            row = self._conn.execute(
                f"SELECT MIN(created_at) AS oldest FROM queries WHERE state IN ({marks})",
                open_states,
            ).fetchone()
        return None if row["oldest"] is None else float(row["oldest"])

    def analyst_ids(self) -> list[str]:
        """Analysts with a recorded budget (every analyst that ever submitted)."""
        with self._lock:
            rows = self._conn.execute("SELECT analyst_id FROM analysts ORDER BY analyst_id")
            return [str(r["analyst_id"]) for r in rows.fetchall()]

    def has_release(self, query_id: str) -> bool:
        """Whether the query's charge is on its analyst's ledger (False once refunded)."""
        with self._lock:
            return self.release_recorded(self._conn, query_id)

    def set_state(
        self,
        query_id: str,
        state: QueryState,
        *,
        expect: tuple[QueryState, ...] = (),
        failure_reason: str | None = None,
    ) -> QueryRecord:
        """Move a query to ``state``; refuse if it is not currently in one of ``expect``.

        A query that fails drops its staged chunks (its aggregate is never used). It is
        refunded only if no owner ever began an upload (docs/privacy.md, "Refunds").
        """
        with self.transaction() as conn:
            row = conn.execute("SELECT state FROM queries WHERE query_id=?", (query_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"unknown query {query_id!r}")
            current = QueryState(row["state"])
            if expect and current not in expect:
                raise QueryStateError(
                    f"query {query_id!r} is {current.value}, expected "
                    + " or ".join(s.value for s in expect)
                )
            if state is QueryState.FAILED:
                # Its staged chunks and its aggregate (without noise) are never used.
                conn.execute("DELETE FROM staged_chunks WHERE query_id=?", (query_id,))
                conn.execute("DELETE FROM aggregate_pages WHERE query_id=?", (query_id,))
                # Refunded only if no owner ever began an upload: then no owner spent
                # budget on it and the analyst received nothing but a failure that
                # depends on public facts. Once an upload began (and so before any
                # result page can have been released), the analyst pays in full.
                begun = conn.execute(
                    "SELECT uploads_begun FROM queries WHERE query_id=?", (query_id,)
                ).fetchone()
                if not begun["uploads_begun"]:
                    refunded = conn.execute(
                        "DELETE FROM releases WHERE query_id=?", (query_id,)
                    ).rowcount
                    if refunded:
                        logger.info(
                            "query %s failed before any upload: its charge is refunded", query_id
                        )
            conn.execute(
                "UPDATE queries SET state=?, failure_reason=?, updated_at=? WHERE query_id=?",
                (state.value, failure_reason, self._clock(), query_id),
            )
        if state is QueryState.FAILED:  # committed
            with self._recent_failures_lock:
                self._recent_failures[query_id] = failure_reason or "no reason"
                while len(self._recent_failures) > RECENT_FAILURES_KEPT:
                    self._recent_failures.popitem(last=False)
        return self.query(query_id)

    def recent_failure(self, query_id: str) -> str | None:
        """The reason ``query_id`` failed, if it is among the latest
        :data:`RECENT_FAILURES_KEPT` queries this process failed (memory only, no read,
        no wait for the database: the event loop calls it)."""
        with self._recent_failures_lock:
            return self._recent_failures.get(query_id)

    def record_decline(self, query_id: str, owner_id: str, reason: str) -> bool:
        """Record an owner's decline while the query collects uploads; False if the owner
        had declined it already (the first decline and its reason stay, nothing is
        written: repeated, each was a transaction, a log line and a wake-up of every
        stream, at a rate the owner chose; review, stop 42).

        Raises
        ------
        NotFoundError
            Unknown query.
        QueryStateError
            The query no longer collects, or this owner uploaded to it or is uploading.
        """
        with self.transaction() as conn:
            row = conn.execute("SELECT state FROM queries WHERE query_id=?", (query_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"unknown query {query_id!r}")
            if QueryState(row["state"]) is not QueryState.COLLECTING:
                raise QueryStateError(f"query {query_id!r} is {row['state']}: {DECLINES_CLOSED}")
            if self._has_owner_row(conn, "uploads", query_id, owner_id):
                raise QueryStateError(
                    f"query {query_id!r}: owner {owner_id!r} already uploaded; it cannot decline"
                )
            if self._has_owner_row(conn, "contributors", query_id, owner_id):
                # Counted as declined and as a contributor, it left the quorum fixed with
                # an owner that would never finish (found by review). Its upload is taken
                # out when its stream ends; it may decline then.
                raise QueryStateError(
                    f"query {query_id!r}: owner {owner_id!r} is uploading to it; it cannot "
                    "decline while that upload runs"
                )
            inserted = conn.execute(
                "INSERT INTO declines(query_id, owner_id, reason, declined_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(query_id, owner_id) DO NOTHING",
                (query_id, owner_id, reason, self._clock()),
            )
            return inserted.rowcount > 0

    def has_declined(self, query_id: str, owner_id: str) -> bool:
        """Whether this owner declined the query (one indexed row)."""
        with self._lock:
            return self._has_owner_row(self._conn, "declines", query_id, owner_id)

    def answered_owners(self, query_id: str) -> set[str]:
        """The owners that declined the query or whose upload to it was accepted (ids
        only: read for every change while a thousand owners answer)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT owner_id FROM declines WHERE query_id=? "
                "UNION SELECT owner_id FROM uploads WHERE query_id=?",
                (query_id, query_id),
            ).fetchall()
        return {str(r["owner_id"]) for r in rows}

    def declines(self, query_id: str) -> dict[str, str]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT owner_id, reason FROM declines WHERE query_id=?", (query_id,)
            ).fetchall()
        return {str(r["owner_id"]): str(r["reason"]) for r in rows}

    def set_analyst_budget(self, analyst_id: str, epsilon: float, delta: float) -> None:
        with self.transaction() as conn:
            conn.execute(
                "INSERT INTO analysts(analyst_id, epsilon_budget, delta_budget) VALUES (?, ?, ?) "
                "ON CONFLICT(analyst_id) DO UPDATE SET epsilon_budget=excluded.epsilon_budget, "
                "delta_budget=excluded.delta_budget",
                (analyst_id, epsilon, delta),
            )

    def analyst_query_counts(
        self, analyst_id: str, since: float, conn: sqlite3.Connection | None = None
    ) -> tuple[int, int, int]:
        """(queries of the analyst not yet done or failed, queries it submitted at or
        after ``since``, the bytes they take in the database): what its per-analyst
        bounds count (pass ``conn`` inside a transaction)."""
        sql = (
            "SELECT COALESCE(SUM(state NOT IN (?, ?)), 0) AS open, "
            "COALESCE(SUM(created_at >= ?), 0) AS recent, "
            "COALESCE(SUM(CASE WHEN created_at >= ? THEN stored_bytes END), 0) AS bytes "
            "FROM queries WHERE analyst_id=?"
        )
        parameters = (QueryState.DONE.value, QueryState.FAILED.value, since, since, analyst_id)
        if conn is None:
            with self._lock:
                row = self._conn.execute(sql, parameters).fetchone()
        else:
            row = conn.execute(sql, parameters).fetchone()
        return int(row["open"]), int(row["recent"]), int(row["bytes"])

    def bind_signer(self, conn: sqlite3.Connection, signer: str, analyst_id: str) -> str:
        """The analyst ``signer`` belongs to: bound to ``analyst_id`` the first time it
        signs a submission (inside the submission's transaction), never changed."""
        row = conn.execute("SELECT analyst_id FROM signers WHERE signer=?", (signer,)).fetchone()
        if row is not None:
            return str(row["analyst_id"])
        conn.execute(
            "INSERT INTO signers(signer, analyst_id, first_seen) VALUES (?, ?, ?)",
            (signer, analyst_id, self._clock()),
        )
        return analyst_id

    def purge_results(self, finished_before: float) -> list[str]:
        """Delete the result pages of every query that finished (done or failed) before
        ``finished_before``, recording when; returns their keys. The query, its charge
        and its metadata stay."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT query_id FROM queries WHERE state IN (?, ?) AND updated_at < ? "
                "AND EXISTS (SELECT 1 FROM result_pages WHERE "
                "result_pages.query_id = queries.query_id)",
                (QueryState.DONE.value, QueryState.FAILED.value, finished_before),
            ).fetchall()
        keys = [str(row["query_id"]) for row in rows]
        # One query per transaction: the store's other work (folds, joins) waits for one
        # query's pages at a time, not for every result due (the first run after an
        # upgrade may find months of them).
        for key in keys:
            with self.transaction() as conn:
                conn.execute("DELETE FROM result_pages WHERE query_id=?", (key,))
                conn.execute(
                    "INSERT INTO purged_results(query_id, purged_at) VALUES (?, ?)",
                    (key, self._clock()),
                )
        return keys

    def drop_refunded_statements(self, failed_before: float) -> list[str]:
        """Drop the statement and plan of every query that failed before
        ``failed_before`` with its charge refunded (no release recorded: no owner began
        an upload); returns their keys.

        Such a query is on no ledger, yet each kept up to 2 MiB for good (a review filled
        1.1 GiB a day with cancelled histogram queries). Its row stays, small: its
        status and listing (from the summary), its id (a resubmission of it is refused
        as another query under a taken id, not charged anew) and that it was refunded
        (``proxy import-releases`` does not charge it from an owner's export). A charged
        one keeps its statement: owners may import it (``proxy export-releases``)."""
        with self.transaction() as conn:
            rows = conn.execute(
                "SELECT query_id FROM queries q WHERE state=? AND updated_at < ? AND spec != '{}' "
                "AND NOT EXISTS (SELECT 1 FROM releases r WHERE r.query_id = q.query_id)",
                (QueryState.FAILED.value, failed_before),
            ).fetchall()
            keys = [str(row["query_id"]) for row in rows]
            for key in keys:
                conn.execute(
                    "UPDATE queries SET spec='{}', plan='{}', stored_bytes=length(signature) + 4 "
                    "WHERE query_id=?",
                    (key,),
                )
        return keys

    def result_purged_at(self, query_id: str) -> float | None:
        """When the query's result pages were deleted (None: they were not)."""
        with self._lock:
            row = self._conn.execute(
                "SELECT purged_at FROM purged_results WHERE query_id=?", (query_id,)
            ).fetchone()
        return None if row is None else float(row["purged_at"])

    def has_query(self, query_id: str) -> bool:
        with self._lock:
            row = self._conn.execute(
                "SELECT 1 FROM queries WHERE query_id=?", (query_id,)
            ).fetchone()
        return row is not None

    @staticmethod
    def release_recorded(conn: sqlite3.Connection, query_id: str) -> bool:
        """Whether the query's release is on its analyst's ledger (inside a transaction)."""
        row = conn.execute("SELECT 1 FROM releases WHERE query_id=?", (query_id,)).fetchone()
        return row is not None

    @staticmethod
    def query_progress(conn: sqlite3.Connection, query_id: str) -> QueryProgress | None:
        """The query's state and whether an upload began (None: unknown), in a transaction."""
        row = conn.execute(
            "SELECT state, uploads_begun FROM queries WHERE query_id=?", (query_id,)
        ).fetchone()
        if row is None:
            return None
        return QueryProgress(QueryState(row["state"]), bool(row["uploads_begun"]))

    @staticmethod
    def mark_uploads_begun(conn: sqlite3.Connection, query_id: str) -> None:
        """Record that an upload of the query began: its charge is never refunded."""
        conn.execute("UPDATE queries SET uploads_begun=1 WHERE query_id=?", (query_id,))

    def release_ids(self, conn: sqlite3.Connection, analyst_id: str) -> list[str]:
        """Ids of the analyst's recorded releases, in order (inside a transaction)."""
        rows = conn.execute(
            "SELECT query_id FROM releases WHERE analyst_id=? ORDER BY recorded_at, query_id",
            (analyst_id,),
        ).fetchall()
        return [str(r["query_id"]) for r in rows]

    def releases(
        self, analyst_id: str, conn: sqlite3.Connection | None = None
    ) -> list[dict[str, Any]]:
        """The analyst's recorded releases (pass ``conn`` inside a transaction)."""
        if conn is None:
            with self._lock:
                rows = self._conn.execute(
                    "SELECT event FROM releases WHERE analyst_id=? ORDER BY recorded_at, query_id",
                    (analyst_id,),
                ).fetchall()
        else:
            rows = conn.execute(
                "SELECT event FROM releases WHERE analyst_id=? ORDER BY recorded_at, query_id",
                (analyst_id,),
            ).fetchall()
        return [json.loads(r["event"]) for r in rows]

    def record_release(
        self, conn: sqlite3.Connection, analyst_id: str, query_id: str, event: Mapping[str, Any]
    ) -> None:
        """Insert a release inside the caller's transaction (see ``create_query``)."""
        conn.execute(
            "INSERT INTO releases(query_id, analyst_id, event, recorded_at) VALUES (?, ?, ?, ?)",
            (query_id, analyst_id, json.dumps(dict(event), sort_keys=True), self._clock()),
        )
