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
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fedpca.errors import (
    LayoutError,
    NotFoundError,
    ProtocolError,
    QueryStateError,
)
from fedpca.messages import QueryState
from fedpca.proxy.group_commit import GroupCommit
from fedpca.proxy.store_schema import SCHEMA, SCHEMA_VERSION, migrate
from fedpca.query import Neighbouring

__all__ = [
    "PAGE_CIPHERTEXTS",
    "SCHEMA_VERSION",
    "CiphertextAlgebra",
    "Contributor",
    "Finalized",
    "Folded",
    "Joined",
    "NotContributingError",
    "ProxyStore",
    "QueryRecord",
    "UploadCompletion",
    "UploadRecord",
    "stored_block",
]

logger = logging.getLogger(__name__)

PAGE_CIPHERTEXTS = 512
"""Ciphertexts per aggregate and result page (256 KiB at 2048-bit keys): the unit read
and rewritten when a chunk is folded, and the unit released to the analyst."""

_OPEN_STATES = (QueryState.COLLECTING, QueryState.AGGREGATING)


class NotContributingError(QueryStateError):
    """An owner that is not one of the query's contributors may no longer join it.

    Nothing of this owner was ever folded into the query, so its share is in no result
    (the servicer tells the owner, which may then refund its reservation).
    """


@dataclass(frozen=True)
class QueryRecord:
    query_id: str
    analyst_id: str
    spec: dict[str, Any]
    plan: dict[str, Any]
    state: QueryState
    created_at: float
    deadline_at: float
    updated_at: float
    n_contributed: int
    failure_reason: str | None
    signature: bytes = b""
    signer: str = ""
    uploads_begun: bool = False
    """An owner began an upload: owners may have spent budget, so no refund."""

    @property
    def quorum(self) -> int:
        return int(self.spec.get("quorum", 1))


@dataclass(frozen=True)
class UploadRecord:
    query_id: str
    owner_id: str
    upload_id: str
    content_sha256: str
    n_ciphertexts: int
    public_count: int | None
    accepted_at: float


@dataclass(frozen=True)
class Contributor:
    """An owner whose upload is part of a query's result."""

    owner_id: str
    upload_id: str
    covered: int
    """Ciphertexts of its upload folded so far, from the start in wire order."""
    public_count: int | None
    joined_at: float


@dataclass(frozen=True)
class Joined:
    """What :meth:`ProxyStore.join` found or did."""

    covered: int
    """Ciphertexts of this upload already folded (chunks below are skipped)."""
    duplicate: bool = False
    """This very upload was accepted before (a retry): nothing is folded."""
    fixed: bool = False
    """This owner was the last contributor the quorum needed: the set is now fixed."""


@dataclass(frozen=True)
class Folded:
    """What :meth:`ProxyStore.fold_chunk` did."""

    folded: bool
    """False: the chunk was below the contributor's mark and skipped."""
    covered: int


@dataclass(frozen=True)
class Finalized:
    """What :meth:`ProxyStore.finalize_pages` did."""

    new_pages: int
    pages_final: int
    done: bool
    """Every page is final; the query moved to DONE."""


@dataclass(frozen=True)
class UploadCompletion:
    """What completing an upload did to its query (the servicer turns it into the
    owner's :class:`fedpca.messages.UploadReceipt`)."""

    duplicate: bool
    """True when this exact upload had already been accepted (a harmless retry)."""
    n_contributed: int
    """Owners whose uploads the query has accepted, including this one."""


class CiphertextAlgebra(Protocol):
    """The group operation on serialised ciphertexts (homomorphic addition lives in
    the codec; the store only sees fixed-width byte strings)."""

    width: int
    """Bytes per ciphertext."""

    def add(self, current: bytes, data: bytes) -> bytes:
        """Element-wise product of two equally long runs of ciphertexts."""
        ...

    def subtract(self, current: bytes, data: bytes) -> bytes:
        """Element-wise ``current · data⁻¹``: takes ``data`` out of ``current``."""
        ...


def page_count(total_ciphertexts: int, page_ciphertexts: int = PAGE_CIPHERTEXTS) -> int:
    """Pages of ``page_ciphertexts`` that hold ``total_ciphertexts``."""
    return -(-total_ciphertexts // page_ciphertexts)


class ProxyStore:
    """Thread-safe access to the proxy's SQLite database.

    One connection guarded by a lock: SQLite serialises writers anyway. Chunk folds,
    upload completions and joins go through a group commit (one fsync for all the
    operations that arrive together).

    Parameters
    ----------
    path : the database file.
    clock : wall-clock seconds (tests inject one).
    page_ciphertexts : ciphertexts per aggregate and result page.
    neighbouring : the deployment's relation (used to restate old ledgers).
    group_commit : share transactions between concurrent writers (False: one
        transaction, one fsync, per chunk; benchmarks compare the two).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        clock: Callable[[], float] = time.time,
        page_ciphertexts: int = PAGE_CIPHERTEXTS,
        neighbouring: Neighbouring = Neighbouring.ADD_REMOVE,
        group_commit: bool = True,
    ) -> None:
        self.neighbouring = Neighbouring(neighbouring)
        if page_ciphertexts < 1:
            raise ValueError(f"page_ciphertexts must be >= 1, got {page_ciphertexts}")
        self.page_ciphertexts = page_ciphertexts
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(
            str(self.path), isolation_level=None, check_same_thread=False, timeout=30.0
        )
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed transaction survives power loss, not only a process crash.
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        for statement in SCHEMA.split(";"):
            if statement.strip():
                self._conn.execute(statement)
        with self.transaction() as conn:
            row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                conn.execute(
                    "INSERT INTO meta(key, value) VALUES ('schema_version', ?)",
                    (str(SCHEMA_VERSION),),
                )
            else:
                migrate(
                    conn,
                    int(row["value"]),
                    path=self.path,
                    neighbouring=self.neighbouring,
                    page_ciphertexts=page_ciphertexts,
                )
        self._group = GroupCommit(self.transaction, enabled=group_commit)

    @property
    def commit_stats(self) -> tuple[int, int]:
        """(operations, commits) that went through the group commit so far."""
        stats = self._group.stats
        return stats.operations, stats.commits

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` transaction: committed on success, rolled back on error."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    # ---------------------------------------------------------------- owners
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

    # --------------------------------------------------------------- queries
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
    ) -> QueryRecord:
        """Create a query in state COLLECTING.

        ``before_insert`` runs inside the same transaction (the budget check uses
        it so that two concurrent submissions cannot both pass). Submitting the
        same query id again with the same spec returns the existing record;
        with a different spec it is a protocol error. Query ids are the proxy's
        keys, scoped by analyst (:meth:`fedpca.proxy.coordinator.Coordinator.submit`).
        """
        now = self._clock()
        spec_json = json.dumps(dict(spec), sort_keys=True)
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
                    "deadline_at, updated_at, signature, signer) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        query_id,
                        analyst_id,
                        spec_json,
                        json.dumps(dict(plan), sort_keys=True),
                        QueryState.COLLECTING.value,
                        now,
                        deadline_at,
                        now,
                        signature,
                        signer,
                    ),
                )
        return self.query(query_id)

    def query(self, query_id: str) -> QueryRecord:
        with self._lock:
            row = self._conn.execute(
                "SELECT * FROM queries WHERE query_id=?", (query_id,)
            ).fetchone()
        if row is None:
            raise NotFoundError(f"unknown query {query_id!r}")
        return _query_record(row)

    def queries(self, *states: QueryState) -> list[QueryRecord]:
        with self._lock:
            if states:
                marks = ",".join("?" for _ in states)
                rows = self._conn.execute(
                    f"SELECT * FROM queries WHERE state IN ({marks}) ORDER BY created_at",
                    [s.value for s in states],
                ).fetchall()
            else:
                rows = self._conn.execute("SELECT * FROM queries ORDER BY created_at").fetchall()
        return [_query_record(r) for r in rows]

    def analyst_queries(self, analyst_id: str, limit: int) -> list[QueryRecord]:
        """The analyst's ``limit`` newest queries, newest first."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT * FROM queries WHERE analyst_id=? ORDER BY created_at DESC, query_id "
                "LIMIT ?",
                (analyst_id, limit),
            ).fetchall()
        return [_query_record(r) for r in rows]

    def state_counts(self) -> dict[QueryState, int]:
        """How many queries are in each state (for monitoring)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT state, COUNT(*) AS n FROM queries GROUP BY state"
            ).fetchall()
        return {QueryState(r["state"]): int(r["n"]) for r in rows}

    def analyst_ids(self) -> list[str]:
        """Analysts with a recorded budget (every analyst that ever submitted)."""
        with self._lock:
            rows = self._conn.execute("SELECT analyst_id FROM analysts ORDER BY analyst_id")
            return [str(r["analyst_id"]) for r in rows.fetchall()]

    def has_release(self, query_id: str) -> bool:
        """Whether the query's charge is on its analyst's ledger (False once refunded)."""
        with self._lock:
            row = self._conn.execute(
                "SELECT 1 FROM releases WHERE query_id=?", (query_id,)
            ).fetchone()
        return row is not None

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
                conn.execute("DELETE FROM staged_chunks WHERE query_id=?", (query_id,))
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
        return self.query(query_id)

    # ---------------------------------------------------------- contributors
    def join(
        self,
        query_id: str,
        owner_id: str,
        upload_id: str,
        *,
        total_ciphertexts: int,
        algebra: CiphertextAlgebra,
        public_count: int | None = None,
        on_fixed: Callable[[Sequence[Contributor]], Mapping[str, Any]] | None = None,
    ) -> Joined:
        """Let an owner begin (or resume) its upload to a query.

        The first ``quorum`` owners to begin become the query's contributors; the one
        that completes the set moves the query to AGGREGATING, drops the staged chunks
        (nothing is taken out from now on) and stores ``on_fixed(contributors)`` as the
        result's metadata, in the same transaction. A contributor that comes back with
        the same upload id resumes after its mark; with another upload id it starts over
        while the set is open (its chunks are taken out) and is refused once it is fixed.

        Raises
        ------
        NotFoundError
            Unknown query.
        NotContributingError
            The owner is not a contributor and the query no longer takes new ones
            (contributors fixed, ended, or past its deadline).
        QueryStateError
            The query failed (for a contributor).
        ProtocolError
            Another upload of this owner was accepted or is being aggregated.
        """

        def operation(conn: sqlite3.Connection) -> Joined:
            query = self._query_row(conn, query_id)
            state = QueryState(query["state"])
            accepted = conn.execute(
                "SELECT upload_id FROM uploads WHERE query_id=? AND owner_id=?",
                (query_id, owner_id),
            ).fetchone()
            if accepted is not None:
                if accepted["upload_id"] == upload_id:
                    return Joined(covered=total_ciphertexts, duplicate=True)
                raise ProtocolError(
                    f"owner {owner_id!r} already contributed a different upload to query "
                    f"{query_id!r}"
                )
            mine = self._contributor(conn, query_id, owner_id)
            if mine is not None:
                if state is QueryState.FAILED:
                    raise QueryStateError(
                        f"query {query_id!r} failed: {query['failure_reason'] or 'no reason'}"
                    )
                if mine.upload_id == upload_id:
                    return Joined(covered=mine.covered)
                if state is not QueryState.COLLECTING:
                    raise ProtocolError(
                        f"upload {mine.upload_id!r} of owner {owner_id!r} is being aggregated "
                        f"into query {query_id!r}; resume it with the same upload id (a new "
                        f"upload {upload_id!r} cannot replace it)"
                    )
                self._take_out(conn, query_id, owner_id, total_ciphertexts, algebra)
                conn.execute(
                    "UPDATE contributors SET upload_id=?, covered=0, public_count=?, "
                    "joined_at=? WHERE query_id=? AND owner_id=?",
                    (upload_id, public_count, self._clock(), query_id, owner_id),
                )
                return Joined(covered=0)
            if state is not QueryState.COLLECTING:
                raise NotContributingError(
                    f"query {query_id!r} is {state.value}: its contributors are fixed"
                    if state is QueryState.AGGREGATING
                    else f"query {query_id!r} is {state.value}: uploads are no longer accepted"
                )
            if self._clock() >= float(query["deadline_at"]):
                raise NotContributingError(f"query {query_id!r}: the upload deadline has passed")
            conn.execute(
                "INSERT INTO contributors(query_id, owner_id, upload_id, covered, public_count, "
                "joined_at) VALUES (?, ?, ?, 0, ?, ?)",
                (query_id, owner_id, upload_id, public_count, self._clock()),
            )
            conn.execute("UPDATE queries SET uploads_begun=1 WHERE query_id=?", (query_id,))
            contributors = self._contributors(conn, query_id)
            quorum = int(json.loads(query["spec"]).get("quorum", 1))
            if len(contributors) < quorum:
                return Joined(covered=0)
            conn.execute("DELETE FROM staged_chunks WHERE query_id=?", (query_id,))
            conn.execute(
                "UPDATE queries SET state=?, updated_at=? WHERE query_id=?",
                (QueryState.AGGREGATING.value, self._clock(), query_id),
            )
            if on_fixed is not None:
                conn.execute(
                    "INSERT INTO result_meta(query_id, meta) VALUES (?, ?) "
                    "ON CONFLICT(query_id) DO UPDATE SET meta=excluded.meta",
                    (query_id, json.dumps(dict(on_fixed(contributors)), sort_keys=True)),
                )
            return Joined(covered=0, fixed=True)

        return self._group.run(operation)

    def contributors(self, query_id: str) -> list[Contributor]:
        """The query's contributors so far, in the order they joined."""
        with self._lock:
            return self._contributors(self._conn, query_id)

    def abandon(
        self,
        query_id: str,
        owner_id: str,
        upload_id: str,
        *,
        total_ciphertexts: int,
        algebra: CiphertextAlgebra,
    ) -> int:
        """An upload's stream broke: while the contributors are not fixed, take its chunks
        out and give its place up (it may join again); afterwards keep them, so it
        resumes. Returns the number of chunks taken out."""
        with self.transaction() as conn:
            query = self._query_row(conn, query_id)
            if QueryState(query["state"]) is not QueryState.COLLECTING:
                return 0
            mine = self._contributor(conn, query_id, owner_id)
            completed = conn.execute(
                "SELECT 1 FROM uploads WHERE query_id=? AND owner_id=?", (query_id, owner_id)
            ).fetchone()
            if mine is None or mine.upload_id != upload_id or completed is not None:
                return 0
            removed = self._take_out(conn, query_id, owner_id, total_ciphertexts, algebra)
            conn.execute(
                "DELETE FROM contributors WHERE query_id=? AND owner_id=?", (query_id, owner_id)
            )
            return removed

    def discard_partial_uploads(
        self, query_id: str, *, total_ciphertexts: int, algebra: CiphertextAlgebra
    ) -> int:
        """Proxy start-up: the streams of a COLLECTING query died with the previous
        process; take their chunks out and free their places. Returns the chunks taken
        out (0 once the contributors are fixed: they resume instead)."""
        with self.transaction() as conn:
            query = self._query_row(conn, query_id)
            if QueryState(query["state"]) is not QueryState.COLLECTING:
                return 0
            removed = 0
            for mine in self._contributors(conn, query_id):
                completed = conn.execute(
                    "SELECT 1 FROM uploads WHERE query_id=? AND owner_id=?",
                    (query_id, mine.owner_id),
                ).fetchone()
                if completed is not None:
                    continue
                removed += self._take_out(conn, query_id, mine.owner_id, total_ciphertexts, algebra)
                conn.execute(
                    "DELETE FROM contributors WHERE query_id=? AND owner_id=?",
                    (query_id, mine.owner_id),
                )
            return removed

    def partial_uploads(self, query_id: str) -> dict[str, int]:
        """owner id -> ciphertexts folded, for contributors whose upload is not complete."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT c.owner_id, c.covered FROM contributors c WHERE c.query_id=? AND NOT "
                "EXISTS (SELECT 1 FROM uploads u WHERE u.query_id=c.query_id AND "
                "u.owner_id=c.owner_id)",
                (query_id,),
            ).fetchall()
        return {str(r["owner_id"]): int(r["covered"]) for r in rows}

    # --------------------------------------------------------------- uploads
    def fold_chunk(
        self,
        query_id: str,
        owner_id: str,
        upload_id: str,
        offset: int,
        data: bytes,
        total_ciphertexts: int,
        algebra: CiphertextAlgebra,
    ) -> Folded:
        """Fold one checked chunk of a contributor's upload into the aggregate, durably.

        A chunk ending at or below the contributor's mark was folded before (a retry or
        a resumed upload) and is skipped; a chunk starting at the mark is multiplied
        into the aggregate pages and the mark moves past it in the same transaction
        (while the contributors are not fixed, a copy is staged for a take-out).
        Concurrent folds share one commit.

        Raises
        ------
        NotFoundError, QueryStateError
            Unknown query, or it no longer aggregates.
        ProtocolError
            The owner is not a contributor with this upload, or the chunk does not
            start at its mark or lies outside the layout.
        """
        count, rest = divmod(len(data), algebra.width)
        if rest or count < 1 or offset < 0 or offset + count > total_ciphertexts:
            raise ProtocolError(
                f"upload {upload_id!r}: a chunk of {len(data)} bytes at position {offset} "
                f"does not fit {total_ciphertexts} ciphertexts of {algebra.width} bytes"
            )

        def operation(conn: sqlite3.Connection) -> Folded:
            query = self._query_row(conn, query_id)
            mine = self._contributor(conn, query_id, owner_id)
            if mine is None or mine.upload_id != upload_id:
                raise ProtocolError(
                    f"upload {upload_id!r} of owner {owner_id!r} is not a contribution to "
                    f"query {query_id!r} (begin the upload again)"
                )
            if offset + count <= mine.covered:
                return Folded(folded=False, covered=mine.covered)
            if offset != mine.covered:
                raise ProtocolError(
                    f"upload {upload_id!r}: a chunk at position {offset}, the proxy holds "
                    f"the first {mine.covered} ciphertexts of this upload"
                )
            state = QueryState(query["state"])
            if state not in _OPEN_STATES:
                raise QueryStateError(
                    f"query {query_id!r} is {state.value}: uploads are no longer accepted"
                )
            self._apply(conn, query_id, offset, data, total_ciphertexts, algebra, inverse=False)
            if state is QueryState.COLLECTING:
                conn.execute(
                    "INSERT INTO staged_chunks(query_id, owner_id, start_index, data) "
                    "VALUES (?, ?, ?, ?)",
                    (query_id, owner_id, offset, data),
                )
            covered = offset + count
            conn.execute(
                "UPDATE contributors SET covered=? WHERE query_id=? AND owner_id=?",
                (covered, query_id, owner_id),
            )
            return Folded(folded=True, covered=covered)

        return self._group.run(operation)

    def complete_upload(
        self,
        query_id: str,
        owner_id: str,
        upload_id: str,
        content_sha256: str,
        n_ciphertexts: int,
        *,
        public_count: int | None = None,
    ) -> UploadCompletion:
        """Record a contributor's fully received upload as accepted, exactly once.

        A retry of an already accepted upload (same owner, upload id and ciphertexts)
        changes nothing and returns ``duplicate=True``.

        Raises
        ------
        ProtocolError
            A different upload of this owner was accepted, the folded chunks do not
            cover the layout, or these ciphertexts were accepted for another query
            (a replay; its chunks stay folded, so the query cannot finish).
        QueryStateError
            The query failed.
        """
        now = self._clock()

        def operation(conn: sqlite3.Connection) -> UploadCompletion:
            query = self._query_row(conn, query_id)
            previous = conn.execute(
                "SELECT upload_id, content_sha256 FROM uploads WHERE query_id=? AND owner_id=?",
                (query_id, owner_id),
            ).fetchone()
            if previous is not None:
                if previous["upload_id"] == upload_id:
                    if previous["content_sha256"] != content_sha256:
                        raise ProtocolError(
                            f"upload {upload_id!r} was accepted with other ciphertexts; a "
                            "retry must resend the very same upload"
                        )
                    return UploadCompletion(
                        duplicate=True, n_contributed=int(query["n_contributed"])
                    )
                raise ProtocolError(
                    f"owner {owner_id!r} already contributed a different upload to query "
                    f"{query_id!r}"
                )
            if QueryState(query["state"]) is QueryState.FAILED:
                raise QueryStateError(
                    f"query {query_id!r} failed: {query['failure_reason'] or 'no reason'}"
                )
            mine = self._contributor(conn, query_id, owner_id)
            covered = 0 if mine is None or mine.upload_id != upload_id else mine.covered
            if covered != n_ciphertexts:
                raise ProtocolError(
                    f"upload {upload_id!r}: its folded chunks cover {covered} of "
                    f"{n_ciphertexts} ciphertexts"
                )
            replay = conn.execute(
                "SELECT query_id FROM uploads WHERE content_sha256=?", (content_sha256,)
            ).fetchone()
            if replay is not None:
                raise ProtocolError(
                    f"these ciphertexts were already accepted for query {replay['query_id']!r}: "
                    "replayed uploads are refused"
                )
            conn.execute(
                "INSERT INTO uploads(query_id, owner_id, upload_id, content_sha256, "
                "n_ciphertexts, public_count, accepted_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (query_id, owner_id, upload_id, content_sha256, n_ciphertexts, public_count, now),
            )
            n_contributed = int(query["n_contributed"]) + 1
            conn.execute(
                "UPDATE queries SET n_contributed=?, updated_at=? WHERE query_id=?",
                (n_contributed, now, query_id),
            )
            return UploadCompletion(duplicate=False, n_contributed=n_contributed)

        completion = self._group.run(operation)
        if not completion.duplicate:
            logger.info(
                "query %s: accepted upload from %s (%d owners)",
                query_id,
                owner_id,
                completion.n_contributed,
            )
        return completion

    def uploads(self, query_id: str) -> list[UploadRecord]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT * FROM uploads WHERE query_id=? ORDER BY accepted_at", (query_id,)
            ).fetchall()
        return [
            UploadRecord(
                query_id=str(r["query_id"]),
                owner_id=str(r["owner_id"]),
                upload_id=str(r["upload_id"]),
                content_sha256=str(r["content_sha256"]),
                n_ciphertexts=int(r["n_ciphertexts"]),
                public_count=None if r["public_count"] is None else int(r["public_count"]),
                accepted_at=float(r["accepted_at"]),
            )
            for r in rows
        ]

    def record_decline(self, query_id: str, owner_id: str, reason: str) -> None:
        """Record an owner's decline while the query collects uploads.

        Raises
        ------
        NotFoundError
            Unknown query.
        QueryStateError
            The query no longer collects, or this owner already uploaded to it.
        """
        with self.transaction() as conn:
            row = conn.execute("SELECT state FROM queries WHERE query_id=?", (query_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"unknown query {query_id!r}")
            if QueryState(row["state"]) is not QueryState.COLLECTING:
                raise QueryStateError(
                    f"query {query_id!r} is {row['state']}: declines are no longer recorded"
                )
            if conn.execute(
                "SELECT 1 FROM uploads WHERE query_id=? AND owner_id=?", (query_id, owner_id)
            ).fetchone():
                raise QueryStateError(
                    f"query {query_id!r}: owner {owner_id!r} already uploaded; it cannot decline"
                )
            conn.execute(
                "INSERT INTO declines(query_id, owner_id, reason, declined_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(query_id, owner_id) DO UPDATE SET reason=excluded.reason",
                (query_id, owner_id, reason, self._clock()),
            )

    def declines(self, query_id: str) -> dict[str, str]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT owner_id, reason FROM declines WHERE query_id=?", (query_id,)
            ).fetchall()
        return {str(r["owner_id"]): str(r["reason"]) for r in rows}

    # ------------------------------------------------------ aggregate, results
    def aggregate(self, query_id: str) -> bytes:
        """The query's encrypted aggregate: all pages, in wire order (b"" before any fold)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT page, data FROM aggregate_pages WHERE query_id=? ORDER BY page",
                (query_id,),
            ).fetchall()
        if [int(r["page"]) for r in rows] != list(range(len(rows))):
            raise QueryStateError(f"query {query_id!r}: its aggregate has missing pages")
        return b"".join(bytes(r["data"]) for r in rows)

    def aggregated_through(self, query_id: str) -> int:
        """Ciphertexts (from the start) that every contributor has folded; 0 before the
        contributors are fixed."""
        with self._lock:
            query = self._query_row(self._conn, query_id)
            if QueryState(query["state"]) is QueryState.COLLECTING:
                return 0
            row = self._conn.execute(
                "SELECT MIN(covered) AS lowest FROM contributors WHERE query_id=?", (query_id,)
            ).fetchone()
        return int(row["lowest"] or 0)

    def finalize_pages(
        self,
        query_id: str,
        total_ciphertexts: int,
        algebra: CiphertextAlgebra,
        page_noise: Callable[[int, int, int], bytes] | None,
    ) -> Finalized:
        """Release every page of an AGGREGATING query that all contributors have covered.

        Page ``p``'s result is its aggregate times ``page_noise(p, start, count)`` (the
        encoded noise of wire positions ``start .. start + count - 1``; None: no noise,
        epsilon = inf). A released page is never changed. When the last page is final
        the query is DONE.
        """
        size = self.page_ciphertexts
        pages = page_count(total_ciphertexts, size)
        with self.transaction() as conn:
            query = self._query_row(conn, query_id)
            existing = int(
                conn.execute(
                    "SELECT COUNT(*) AS n FROM result_pages WHERE query_id=?", (query_id,)
                ).fetchone()["n"]
            )
            if QueryState(query["state"]) is not QueryState.AGGREGATING:
                return Finalized(0, existing, QueryState(query["state"]) is QueryState.DONE)
            lowest = int(
                conn.execute(
                    "SELECT MIN(covered) AS lowest FROM contributors WHERE query_id=?",
                    (query_id,),
                ).fetchone()["lowest"]
                or 0
            )
            ready = pages if lowest >= total_ciphertexts else lowest // size
            for page in range(existing, ready):
                row = conn.execute(
                    "SELECT data FROM aggregate_pages WHERE query_id=? AND page=?",
                    (query_id, page),
                ).fetchone()
                if row is None:
                    raise QueryStateError(f"query {query_id!r}: aggregate page {page} is missing")
                data = bytes(row["data"])
                start = page * size
                count = min(size, total_ciphertexts - start)
                if page_noise is not None:
                    data = algebra.add(data, page_noise(page, start, count))
                conn.execute(
                    "INSERT INTO result_pages(query_id, page, data) VALUES (?, ?, ?)",
                    (query_id, page, data),
                )
            done = ready == pages
            if done:
                conn.execute(
                    "UPDATE queries SET state=?, updated_at=? WHERE query_id=?",
                    (QueryState.DONE.value, self._clock(), query_id),
                )
        return Finalized(max(0, ready - existing), max(ready, existing), done)

    def store_result(self, query_id: str, data: bytes, meta: Mapping[str, Any]) -> QueryRecord:
        """Store a whole result computed at the end (masked mode) as pages and mark the
        query DONE, in one transaction. Only a NOISING query can receive one, so a result
        is never overwritten (a restarted proxy that already finished finds DONE)."""
        size = self.page_ciphertexts
        with self.transaction() as conn:
            query = self._query_row(conn, query_id)
            if QueryState(query["state"]) is not QueryState.NOISING:
                raise QueryStateError(
                    f"query {query_id!r} is {query['state']}: cannot store a result"
                )
            width = 2 * ((int(json.loads(query["plan"])["key_bits"]) + 7) // 8)
            step = size * width
            for page, start in enumerate(range(0, len(data), step)):
                conn.execute(
                    "INSERT INTO result_pages(query_id, page, data) VALUES (?, ?, ?)",
                    (query_id, page, data[start : start + step]),
                )
            self._merge_meta(conn, query_id, meta)
            conn.execute(
                "UPDATE queries SET state=?, updated_at=? WHERE query_id=?",
                (QueryState.DONE.value, self._clock(), query_id),
            )
        return self.query(query_id)

    def update_result_meta(self, query_id: str, meta: Mapping[str, Any]) -> None:
        """Merge ``meta`` into the metadata stored with a query's result."""
        with self.transaction() as conn:
            self._merge_meta(conn, query_id, meta)

    def result_meta(self, query_id: str) -> dict[str, Any] | None:
        """The metadata stored with a query's result (None before its contributors are
        fixed)."""
        with self._lock:
            row = self._conn.execute(
                "SELECT meta FROM result_meta WHERE query_id=?", (query_id,)
            ).fetchone()
        return None if row is None else dict(json.loads(row["meta"]))

    def result_pages(self, query_id: str, start: int = 0) -> list[bytes]:
        """The final result pages from ``start`` on, in order."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT page, data FROM result_pages WHERE query_id=? AND page>=? ORDER BY page",
                (query_id, start),
            ).fetchall()
        pages = []
        for expected, row in enumerate(rows, start):
            if int(row["page"]) != expected:
                break
            pages.append(bytes(row["data"]))
        return pages

    def pages_final(self, query_id: str) -> int:
        """How many result pages are final."""
        with self._lock:
            row = self._conn.execute(
                "SELECT COUNT(*) AS n FROM result_pages WHERE query_id=?", (query_id,)
            ).fetchone()
        return int(row["n"])

    # ---------------------------------------------------------------- budget
    def set_analyst_budget(self, analyst_id: str, epsilon: float, delta: float) -> None:
        with self.transaction() as conn:
            conn.execute(
                "INSERT INTO analysts(analyst_id, epsilon_budget, delta_budget) VALUES (?, ?, ?) "
                "ON CONFLICT(analyst_id) DO UPDATE SET epsilon_budget=excluded.epsilon_budget, "
                "delta_budget=excluded.delta_budget",
                (analyst_id, epsilon, delta),
            )

    def analyst_budget(self, analyst_id: str) -> tuple[float, float] | None:
        with self._lock:
            row = self._conn.execute(
                "SELECT epsilon_budget, delta_budget FROM analysts WHERE analyst_id=?",
                (analyst_id,),
            ).fetchone()
        return None if row is None else (float(row["epsilon_budget"]), float(row["delta_budget"]))

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

    # --------------------------------------------------------------- helpers
    def _query_row(self, conn: sqlite3.Connection, query_id: str) -> sqlite3.Row:
        row = conn.execute("SELECT * FROM queries WHERE query_id=?", (query_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"unknown query {query_id!r}")
        return row

    def _contributor(
        self, conn: sqlite3.Connection, query_id: str, owner_id: str
    ) -> Contributor | None:
        row = conn.execute(
            "SELECT * FROM contributors WHERE query_id=? AND owner_id=?", (query_id, owner_id)
        ).fetchone()
        return None if row is None else _contributor_of(row)

    def _contributors(self, conn: sqlite3.Connection, query_id: str) -> list[Contributor]:
        rows = conn.execute(
            "SELECT * FROM contributors WHERE query_id=? ORDER BY joined_at, owner_id",
            (query_id,),
        ).fetchall()
        return [_contributor_of(row) for row in rows]

    def _merge_meta(self, conn: sqlite3.Connection, query_id: str, meta: Mapping[str, Any]) -> None:
        row = conn.execute("SELECT meta FROM result_meta WHERE query_id=?", (query_id,)).fetchone()
        merged = {} if row is None else dict(json.loads(row["meta"]))
        merged.update(meta)
        conn.execute(
            "INSERT INTO result_meta(query_id, meta) VALUES (?, ?) "
            "ON CONFLICT(query_id) DO UPDATE SET meta=excluded.meta",
            (query_id, json.dumps(merged, sort_keys=True)),
        )

    def _take_out(
        self,
        conn: sqlite3.Connection,
        query_id: str,
        owner_id: str,
        total_ciphertexts: int,
        algebra: CiphertextAlgebra,
    ) -> int:
        """Multiply the inverses of an owner's staged chunks into the aggregate."""
        rows = conn.execute(
            "SELECT start_index, data FROM staged_chunks WHERE query_id=? AND owner_id=?",
            (query_id, owner_id),
        ).fetchall()
        for row in rows:
            self._apply(
                conn,
                query_id,
                int(row["start_index"]),
                bytes(row["data"]),
                total_ciphertexts,
                algebra,
                inverse=True,
            )
        conn.execute(
            "DELETE FROM staged_chunks WHERE query_id=? AND owner_id=?", (query_id, owner_id)
        )
        if rows:
            logger.info(
                "query %s: the unfinished upload of %s taken out of the aggregate (%d chunks)",
                query_id,
                owner_id,
                len(rows),
            )
        return len(rows)

    def _apply(
        self,
        conn: sqlite3.Connection,
        query_id: str,
        offset: int,
        data: bytes,
        total_ciphertexts: int,
        algebra: CiphertextAlgebra,
        *,
        inverse: bool,
    ) -> None:
        """Multiply ``data`` (or its inverse) into the aggregate pages it overlaps.

        A page holds ``page_ciphertexts`` consecutive wire positions (the last one
        fewer). It starts as encryptions of zero with unit randomness (the integer
        1, the identity of Z*_{n^2}), so chunks cut at any boundary fold in, and
        ``n_folded`` counts the chunks folded into it: a page that drops back to
        zero is deleted, leaving the store exactly as if the chunks never came.
        """
        width = algebra.width
        size = self.page_ciphertexts
        count = len(data) // width
        identity = (1).to_bytes(width, "big")
        for page in range(offset // size, (offset + count - 1) // size + 1):
            page_start = page * size
            page_length = min(size, total_ciphertexts - page_start)
            lo = max(offset, page_start)
            hi = min(offset + count, page_start + page_length)
            row = conn.execute(
                "SELECT n_folded, data FROM aggregate_pages WHERE query_id=? AND page=?",
                (query_id, page),
            ).fetchone()
            if row is None:
                if inverse:
                    raise QueryStateError(
                        f"query {query_id!r}: aggregate page {page} is missing while taking "
                        "an upload out"
                    )
                current, n_folded = identity * page_length, 0
            else:
                current, n_folded = bytes(row["data"]), int(row["n_folded"])
            a, b = (lo - page_start) * width, (hi - page_start) * width
            segment = data[(lo - offset) * width : (hi - offset) * width]
            combine = algebra.subtract if inverse else algebra.add
            updated = current[:a] + combine(current[a:b], segment) + current[b:]
            n_folded += -1 if inverse else 1
            if n_folded == 0:
                conn.execute(
                    "DELETE FROM aggregate_pages WHERE query_id=? AND page=?", (query_id, page)
                )
            else:
                conn.execute(
                    "INSERT INTO aggregate_pages(query_id, page, n_folded, data) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT(query_id, page) DO UPDATE SET "
                    "n_folded=excluded.n_folded, data=excluded.data",
                    (query_id, page, n_folded, updated),
                )


def stored_block(blocks: Mapping[str, bytes], name: str) -> bytes:
    """Block ``name`` of stored ciphertext data (an aggregate split by block, a result)."""
    data = blocks.get(name)
    if data is None:
        raise LayoutError(f"stored data has no block {name!r}")
    return data


def _query_record(row: sqlite3.Row) -> QueryRecord:
    return QueryRecord(
        query_id=str(row["query_id"]),
        analyst_id=str(row["analyst_id"]),
        spec=json.loads(row["spec"]),
        plan=json.loads(row["plan"]),
        state=QueryState(row["state"]),
        created_at=float(row["created_at"]),
        deadline_at=float(row["deadline_at"]),
        updated_at=float(row["updated_at"]),
        n_contributed=int(row["n_contributed"]),
        failure_reason=row["failure_reason"],
        signature=bytes(row["signature"]),
        signer=str(row["signer"]),
        uploads_begun=bool(row["uploads_begun"]),
    )


def _contributor_of(row: sqlite3.Row) -> Contributor:
    return Contributor(
        owner_id=str(row["owner_id"]),
        upload_id=str(row["upload_id"]),
        covered=int(row["covered"]),
        public_count=None if row["public_count"] is None else int(row["public_count"]),
        joined_at=float(row["joined_at"]),
    )
