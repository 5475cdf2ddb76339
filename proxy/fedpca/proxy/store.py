"""Durable proxy state in SQLite.

Everything the proxy must not lose lives here: enrolled owners, queries and their
lifecycle, accepted uploads, the running encrypted aggregates, noise-added
results, and each analyst's privacy-budget ledger.

Crash safety rests on two rules:

* every state change that must be atomic is one ``BEGIN IMMEDIATE`` transaction
  (WAL journal, ``synchronous=FULL``), so a ``kill -9`` leaves either the state
  before or the state after it;
* an upload is counted exactly once. Each chunk is folded into the aggregate as
  it arrives, and in the same transaction a copy of it is staged in
  ``upload_chunks``. Completing the upload inserts its record and drops the
  copies in one transaction (a retry after a lost acknowledgement finds the
  record and is answered "duplicate"). An upload that never completes (stream
  broken, bad chunk, superseded by the owner's reconnect, query closed, proxy
  restarted) is taken out again by multiplying its staged chunks' inverses into
  the aggregate, in the transaction that ends it. Modular arithmetic is exact,
  so the aggregate is then byte for byte what it was before.

The aggregate lives in pages of :data:`PAGE_CIPHERTEXTS` ciphertexts, so folding
a chunk reads and rewrites only the pages it touches: the proxy's memory holds
one chunk (bounded by the gRPC message size) and one page per upload in flight,
never a whole upload, and the aggregate grows with the number of ciphertexts, not
with owners x ciphertexts.

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
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fedpca.errors import (
    FedpcaError,
    LayoutError,
    NotFoundError,
    ProtocolError,
    QueryStateError,
)
from fedpca.messages import QueryState
from fedpca.query import Neighbouring

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 3

PAGE_CIPHERTEXTS = 512
"""Ciphertexts per aggregate page (256 KiB at 2048-bit keys): the unit read and
rewritten when a chunk is folded."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS owners (
    owner_id TEXT PRIMARY KEY,
    first_seen REAL NOT NULL,
    last_seen REAL NOT NULL,
    info TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS queries (
    query_id TEXT PRIMARY KEY,
    analyst_id TEXT NOT NULL,
    spec TEXT NOT NULL,
    plan TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    deadline_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    n_contributed INTEGER NOT NULL DEFAULT 0,
    failure_reason TEXT,
    signature BLOB NOT NULL DEFAULT x'',
    signer TEXT NOT NULL DEFAULT '',
    uploads_begun INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS uploads (
    query_id TEXT NOT NULL REFERENCES queries(query_id),
    owner_id TEXT NOT NULL,
    upload_id TEXT NOT NULL,
    content_sha256 TEXT NOT NULL,
    n_ciphertexts INTEGER NOT NULL,
    public_count INTEGER,
    accepted_at REAL NOT NULL,
    PRIMARY KEY (query_id, owner_id)
);
CREATE UNIQUE INDEX IF NOT EXISTS uploads_content ON uploads(content_sha256);
CREATE TABLE IF NOT EXISTS declines (
    query_id TEXT NOT NULL REFERENCES queries(query_id),
    owner_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    declined_at REAL NOT NULL,
    PRIMARY KEY (query_id, owner_id)
);
CREATE TABLE IF NOT EXISTS aggregate_pages (
    query_id TEXT NOT NULL REFERENCES queries(query_id),
    page INTEGER NOT NULL,
    n_folded INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (query_id, page)
);
CREATE TABLE IF NOT EXISTS upload_chunks (
    query_id TEXT NOT NULL REFERENCES queries(query_id),
    owner_id TEXT NOT NULL,
    upload_id TEXT NOT NULL,
    stream INTEGER NOT NULL,
    start_index INTEGER NOT NULL,
    total INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (query_id, owner_id, stream, start_index)
);
CREATE TABLE IF NOT EXISTS results (
    query_id TEXT NOT NULL REFERENCES queries(query_id),
    block TEXT NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (query_id, block)
);
CREATE TABLE IF NOT EXISTS result_meta (
    query_id TEXT PRIMARY KEY REFERENCES queries(query_id),
    meta TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS analysts (
    analyst_id TEXT PRIMARY KEY,
    epsilon_budget REAL NOT NULL,
    delta_budget REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS releases (
    query_id TEXT PRIMARY KEY,
    analyst_id TEXT NOT NULL,
    event TEXT NOT NULL,
    recorded_at REAL NOT NULL
);
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


class ProxyStore:
    """Thread-safe access to the proxy's SQLite database.

    One connection guarded by a lock: SQLite serialises writers anyway, and the
    proxy's writes are few and short (the homomorphic fold of one upload).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        clock: Callable[[], float] = time.time,
        page_ciphertexts: int = PAGE_CIPHERTEXTS,
        neighbouring: Neighbouring = Neighbouring.ADD_REMOVE,
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
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                self._conn.execute(statement)
        with self.transaction() as conn:
            row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                conn.execute(
                    "INSERT INTO meta(key, value) VALUES ('schema_version', ?)",
                    (str(SCHEMA_VERSION),),
                )
            elif int(row["value"]) in (1, 2):
                if int(row["value"]) == 1:
                    self._migrate_from_version_1(conn)
                self._migrate_from_version_2(conn)
            elif int(row["value"]) != SCHEMA_VERSION:
                raise QueryStateError(
                    f"{self.path}: schema version {row['value']} is not supported "
                    f"(this proxy expects {SCHEMA_VERSION})"
                )

    def _migrate_from_version_1(self, conn: sqlite3.Connection) -> None:
        """Version 1 kept one aggregate blob per block; version 2 pages it and stages
        the chunks of uploads in progress.

        Only an aggregate still to be noised matters, and a version-1 one cannot be
        paged without the query's plan, so the migration runs only when no query is
        COLLECTING or NOISING; it then drops the old aggregates (finished queries keep
        their results, uploads and releases).
        """
        in_flight = conn.execute(
            "SELECT query_id FROM queries WHERE state IN (?, ?)",
            (QueryState.COLLECTING.value, QueryState.NOISING.value),
        ).fetchall()
        if in_flight:
            names = ", ".join(str(r["query_id"]) for r in in_flight)
            raise QueryStateError(
                f"{self.path}: schema version 1 with queries still in flight ({names}); "
                "let the previous fedpca version finish them (or their deadlines pass), "
                "then start this version"
            )
        conn.execute("DROP TABLE IF EXISTS aggregates")
        logger.warning("%s: migrated from schema version 1 to 2", self.path)

    def _migrate_from_version_2(self, conn: sqlite3.Connection) -> None:
        """Version 3 keys queries by analyst, stores each query's signature and whether
        an upload began, and states every recorded release's neighbouring relation.

        Releases of version 2 recorded no relation; they are restated under this
        deployment's (docs/privacy.md, "Ledgers of fedpca 0.1"): a stats-mode release
        keeps its add/remove noise multiplier under add/remove and counts with half of
        it under replace-one; a masked-mode release keeps its replace-one multiplier
        under replace-one and counts as NOT PRIVATE (infinite epsilon) under
        add/remove, where publishing N has no finite epsilon. Queries already in the
        database count as having had uploads (no refund), and are renamed to their
        analyst-scoped keys (``analyst/query``).
        """
        columns = {row["name"] for row in conn.execute("PRAGMA table_info(queries)")}
        for name, declaration in (
            ("signature", "BLOB NOT NULL DEFAULT x''"),
            ("signer", "TEXT NOT NULL DEFAULT ''"),
            ("uploads_begun", "INTEGER NOT NULL DEFAULT 0"),
        ):
            if name not in columns:
                conn.execute(f"ALTER TABLE queries ADD COLUMN {name} {declaration}")
        conn.execute("UPDATE queries SET uploads_begun=1")
        relation = self.neighbouring.value
        rows = conn.execute(
            "SELECT r.query_id, r.analyst_id, r.event, q.spec FROM releases r "
            "LEFT JOIN queries q ON q.query_id = r.query_id"
        ).fetchall()
        for row in rows:
            event = json.loads(row["event"])
            masked = row["spec"] is not None and json.loads(row["spec"]).get("mode") == "masked"
            if "neighbouring" not in event:
                if masked and relation == "add-remove":
                    event.update(noise_multiplier=0.0, epsilon="inf")
                elif not masked and relation == "replace-one":
                    event["noise_multiplier"] = event["noise_multiplier"] / 2
                event["neighbouring"] = relation
            if "/" not in str(event["query_id"]):
                event["query_id"] = f"{row['analyst_id']}/{event['query_id']}"
            conn.execute(
                "UPDATE releases SET event=? WHERE query_id=?",
                (json.dumps(event, sort_keys=True), row["query_id"]),
            )
        conn.execute("PRAGMA defer_foreign_keys=ON")
        for table in (
            "uploads",
            "declines",
            "aggregate_pages",
            "upload_chunks",
            "results",
            "result_meta",
        ):
            conn.execute(
                f"UPDATE {table} SET query_id = (SELECT q.analyst_id FROM queries q "
                f"WHERE q.query_id = {table}.query_id) || '/' || query_id "
                "WHERE instr(query_id, '/') = 0"
            )
        conn.execute(
            "UPDATE releases SET query_id = analyst_id || '/' || query_id "
            "WHERE instr(query_id, '/') = 0"
        )
        conn.execute(
            "UPDATE queries SET query_id = analyst_id || '/' || query_id "
            "WHERE instr(query_id, '/') = 0"
        )
        conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
        logger.warning(
            "%s: migrated to schema version %d; %d recorded releases restated under %s adjacency",
            self.path,
            SCHEMA_VERSION,
            len(rows),
            relation,
        )

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
        algebra: CiphertextAlgebra | None = None,
    ) -> QueryRecord:
        """Move a query to ``state``; refuse if it is not currently in one of ``expect``.

        Leaving COLLECTING ends every upload still in progress: in the same
        transaction their folded chunks are taken out of the aggregate (with
        ``algebra``; required when moving to NOISING with uploads in progress) or,
        for a query that fails, simply dropped.
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
            if current is QueryState.COLLECTING and state is not QueryState.COLLECTING:
                if algebra is None and state is not QueryState.FAILED:
                    partial = conn.execute(
                        "SELECT 1 FROM upload_chunks WHERE query_id=?", (query_id,)
                    ).fetchone()
                    if partial is not None:
                        raise QueryStateError(
                            f"query {query_id!r}: uploads in progress can only be taken out "
                            "with the query's ciphertext algebra"
                        )
                removed = self._unfold(conn, query_id, algebra)
                if removed:
                    logger.info(
                        "query %s: %d chunks of unfinished uploads taken out of the aggregate",
                        query_id,
                        removed,
                    )
            if state is QueryState.FAILED:
                # Refunded only if no owner ever began an upload: then no owner spent
                # budget on it and the analyst received nothing but a failure that
                # depends on public facts (docs/privacy.md, "Refunds"). Once an upload
                # began, the analyst pays for what the owners spent.
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

    # --------------------------------------------------------------- uploads
    def fold_chunk(
        self,
        query_id: str,
        owner_id: str,
        upload_id: str,
        stream: int,
        offset: int,
        data: bytes,
        total_ciphertexts: int,
        algebra: CiphertextAlgebra,
    ) -> bool:
        """Fold one checked chunk of an upload in progress into the aggregate.

        The chunk's ciphertexts (wire positions ``offset`` onwards) are multiplied
        into the aggregate pages and kept in ``upload_chunks`` in the same
        transaction, so that the upload can be taken out again exactly if it never
        completes (:meth:`discard_stream`). ``stream`` numbers upload streams,
        newer streams higher: an owner that reconnects and resends supersedes its
        older stream, whose chunks are taken out here; a chunk of the older stream
        arriving later is refused.

        Returns
        -------
        False, folding nothing, when this owner's upload ``upload_id`` was already
        accepted (a retry racing its own acknowledgement: :meth:`complete_upload`
        then answers "duplicate"); True otherwise.

        Raises
        ------
        NotFoundError, QueryStateError
            Unknown query, or not COLLECTING.
        ProtocolError
            The owner already contributed a different upload, a newer stream of
            this owner is in progress, or the chunk lies outside the layout.
        """
        count, rest = divmod(len(data), algebra.width)
        if rest or count < 1 or offset < 0 or offset + count > total_ciphertexts:
            raise ProtocolError(
                f"upload {upload_id!r}: a chunk of {len(data)} bytes at position {offset} "
                f"does not fit {total_ciphertexts} ciphertexts of {algebra.width} bytes"
            )
        with self.transaction() as conn:
            # A retry racing its own acceptance is answered "duplicate", even when that
            # acceptance closed the query.
            self._collecting(conn, query_id, allow_accepted=(owner_id, upload_id))
            previous = conn.execute(
                "SELECT upload_id FROM uploads WHERE query_id=? AND owner_id=?",
                (query_id, owner_id),
            ).fetchone()
            if previous is not None:
                if previous["upload_id"] == upload_id:
                    return False
                raise ProtocolError(
                    f"owner {owner_id!r} already contributed a different upload to query "
                    f"{query_id!r}"
                )
            newest = conn.execute(
                "SELECT MAX(stream) AS newest FROM upload_chunks WHERE query_id=? AND owner_id=?",
                (query_id, owner_id),
            ).fetchone()["newest"]
            if newest is not None and newest > stream:
                raise ProtocolError(
                    f"upload {upload_id!r}: superseded by a newer upload stream of owner "
                    f"{owner_id!r}"
                )
            if newest is not None and newest < stream:
                removed = self._unfold(conn, query_id, algebra, owner_id=owner_id, below=stream)
                logger.info(
                    "query %s: a new upload stream of %s took over (%d chunks of the old "
                    "one taken out)",
                    query_id,
                    owner_id,
                    removed,
                )
            logger.debug(
                "query %s: folding upload %s from %s (chunk at %d)",
                query_id,
                upload_id,
                owner_id,
                offset,
            )
            self._apply(conn, query_id, offset, data, total_ciphertexts, algebra, inverse=False)
            conn.execute(
                "INSERT INTO upload_chunks(query_id, owner_id, upload_id, stream, start_index, "
                "total, data) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (query_id, owner_id, upload_id, stream, offset, total_ciphertexts, data),
            )
        return True

    def complete_upload(
        self,
        query_id: str,
        owner_id: str,
        upload_id: str,
        stream: int,
        content_sha256: str,
        n_ciphertexts: int,
        algebra: CiphertextAlgebra,
        *,
        public_count: int | None = None,
        before_accept: Callable[[int], None] | None = None,
    ) -> UploadCompletion:
        """Record a fully received, hash-verified upload as accepted, exactly once.

        Its chunks, folded as they arrived (:meth:`fold_chunk`), become permanent:
        the upload record is inserted and the staged chunk copies are dropped in one
        transaction. A retry of an already-accepted upload (same owner, upload id
        and content hash) changes nothing and returns ``duplicate=True``.

        ``before_accept(n_contributed)`` runs inside the transaction with the number
        of uploads accepted so far; raising refuses the upload (the proxy checks
        max_owners here, so concurrent uploads cannot both take the last place). A
        refused upload (that, a replay of ciphertexts accepted for another query,
        or chunks that do not cover the layout) is taken out of the aggregate
        before the error is raised.
        """
        now = self._clock()
        refusal: Exception | None = None
        with self.transaction() as conn:
            row = self._collecting(conn, query_id, allow_accepted=(owner_id, upload_id))
            previous = conn.execute(
                "SELECT upload_id, content_sha256 FROM uploads WHERE query_id=? AND owner_id=?",
                (query_id, owner_id),
            ).fetchone()
            if previous is not None:
                if (
                    previous["upload_id"] == upload_id
                    and previous["content_sha256"] == content_sha256
                ):
                    return UploadCompletion(duplicate=True, n_contributed=int(row["n_contributed"]))
                raise ProtocolError(
                    f"owner {owner_id!r} already contributed a different upload to query "
                    f"{query_id!r}"
                )
            staged = conn.execute(
                "SELECT stream, start_index, length(data) AS size FROM upload_chunks "
                "WHERE query_id=? AND owner_id=? ORDER BY start_index",
                (query_id, owner_id),
            ).fetchall()
            covered = 0
            for chunk in staged:
                if chunk["stream"] != stream or chunk["start_index"] != covered:
                    break
                covered += chunk["size"] // algebra.width
            replay = conn.execute(
                "SELECT query_id FROM uploads WHERE content_sha256=?", (content_sha256,)
            ).fetchone()
            if covered != n_ciphertexts or len(staged) == 0:
                refusal = ProtocolError(
                    f"upload {upload_id!r}: its folded chunks cover {covered} of "
                    f"{n_ciphertexts} ciphertexts (superseded by a newer stream, or incomplete)"
                )
            elif replay is not None:
                refusal = ProtocolError(
                    f"these ciphertexts were already accepted for query {replay['query_id']!r}: "
                    "replayed uploads are refused"
                )
            elif before_accept is not None:
                try:
                    before_accept(int(row["n_contributed"]))
                except FedpcaError as exc:
                    refusal = exc
            if refusal is not None:
                self._unfold(conn, query_id, algebra, owner_id=owner_id, stream=stream)
            else:
                conn.execute(
                    "DELETE FROM upload_chunks WHERE query_id=? AND owner_id=?",
                    (query_id, owner_id),
                )
                conn.execute(
                    "INSERT INTO uploads(query_id, owner_id, upload_id, content_sha256, "
                    "n_ciphertexts, public_count, accepted_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        query_id,
                        owner_id,
                        upload_id,
                        content_sha256,
                        n_ciphertexts,
                        public_count,
                        now,
                    ),
                )
                n_contributed = int(row["n_contributed"]) + 1
                conn.execute(
                    "UPDATE queries SET n_contributed=?, updated_at=? WHERE query_id=?",
                    (n_contributed, now, query_id),
                )
        if refusal is not None:
            raise refusal
        logger.info(
            "query %s: accepted upload from %s (%d owners)", query_id, owner_id, n_contributed
        )
        return UploadCompletion(duplicate=False, n_contributed=n_contributed)

    def discard_stream(
        self, query_id: str, owner_id: str, stream: int, algebra: CiphertextAlgebra
    ) -> int:
        """Take an unfinished upload stream's chunks out of the aggregate; returns how many.

        Used when a stream fails (bad chunk, hash mismatch, lost connection). A no-op
        if the query is gone from COLLECTING (the state change already took the
        chunks out) or the stream was superseded.
        """
        with self.transaction() as conn:
            return self._unfold(conn, query_id, algebra, owner_id=owner_id, stream=stream)

    def discard_partial_uploads(self, query_id: str, algebra: CiphertextAlgebra) -> int:
        """Take every unfinished upload of a query out of its aggregate (proxy start-up:
        the streams that sent them died with the previous process)."""
        with self.transaction() as conn:
            return self._unfold(conn, query_id, algebra)

    def partial_uploads(self, query_id: str) -> dict[str, int]:
        """owner id -> chunks folded by its upload in progress (for status and tests)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT owner_id, COUNT(*) AS n FROM upload_chunks WHERE query_id=? "
                "GROUP BY owner_id",
                (query_id,),
            ).fetchall()
        return {str(r["owner_id"]): int(r["n"]) for r in rows}

    def _collecting(
        self,
        conn: sqlite3.Connection,
        query_id: str,
        allow_accepted: tuple[str, str] | None = None,
    ) -> sqlite3.Row:
        row = conn.execute(
            "SELECT state, n_contributed FROM queries WHERE query_id=?", (query_id,)
        ).fetchone()
        if row is None:
            raise NotFoundError(f"unknown query {query_id!r}")
        state = QueryState(row["state"])
        if state is QueryState.COLLECTING:
            return row
        if allow_accepted is not None:
            owner_id, upload_id = allow_accepted
            accepted = conn.execute(
                "SELECT 1 FROM uploads WHERE query_id=? AND owner_id=? AND upload_id=?",
                (query_id, owner_id, upload_id),
            ).fetchone()
            if accepted is not None:
                return row  # a retry of an accepted upload is answered "duplicate"
        raise QueryStateError(
            f"query {query_id!r} is {state.value}: uploads are no longer accepted"
        )

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

        A page holds PAGE_CIPHERTEXTS consecutive wire positions (the last one
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

    def _unfold(
        self,
        conn: sqlite3.Connection,
        query_id: str,
        algebra: CiphertextAlgebra | None,
        *,
        owner_id: str | None = None,
        stream: int | None = None,
        below: int | None = None,
    ) -> int:
        """Take staged chunks out of the aggregate (inside ``conn``'s transaction).

        Selects the query's chunks, optionally of one owner, of one stream or of
        streams older than ``below``. Without ``algebra`` they are only deleted
        (for a query that fails: its aggregate is never used).
        """
        where, args = "query_id=?", list[str | int]([query_id])
        if owner_id is not None:
            where, args = where + " AND owner_id=?", [*args, owner_id]
        if stream is not None:
            where, args = where + " AND stream=?", [*args, stream]
        if below is not None:
            where, args = where + " AND stream<?", [*args, below]
        rows = conn.execute(
            f"SELECT start_index, total, data FROM upload_chunks WHERE {where}", args
        ).fetchall()
        if algebra is not None:
            for row in rows:
                self._apply(
                    conn,
                    query_id,
                    int(row["start_index"]),
                    bytes(row["data"]),
                    int(row["total"]),
                    algebra,
                    inverse=True,
                )
        conn.execute(f"DELETE FROM upload_chunks WHERE {where}", args)
        return len(rows)

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

    def mark_upload_begun(self, query_id: str) -> None:
        """Record that an owner began an upload (from then on the query is never refunded)."""
        with self.transaction() as conn:
            conn.execute("UPDATE queries SET uploads_begun=1 WHERE query_id=?", (query_id,))

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

    # --------------------------------------------------------------- results
    def store_result(
        self, query_id: str, blocks: Mapping[str, bytes], meta: Mapping[str, Any]
    ) -> QueryRecord:
        """Store the noise-added result and mark the query DONE, in one transaction.

        Only a query in NOISING can receive a result, so a result is never
        overwritten (a restarted proxy that already finished finds DONE).
        """
        with self.transaction() as conn:
            row = conn.execute("SELECT state FROM queries WHERE query_id=?", (query_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"unknown query {query_id!r}")
            if QueryState(row["state"]) is not QueryState.NOISING:
                raise QueryStateError(
                    f"query {query_id!r} is {row['state']}: cannot store a result"
                )
            for name, data in blocks.items():
                conn.execute(
                    "INSERT INTO results(query_id, block, data) VALUES (?, ?, ?)",
                    (query_id, name, data),
                )
            conn.execute(
                "INSERT INTO result_meta(query_id, meta) VALUES (?, ?)",
                (query_id, json.dumps(dict(meta), sort_keys=True)),
            )
            conn.execute(
                "UPDATE queries SET state=?, updated_at=? WHERE query_id=?",
                (QueryState.DONE.value, self._clock(), query_id),
            )
        return self.query(query_id)

    def result(self, query_id: str) -> tuple[dict[str, bytes], dict[str, Any]]:
        record = self.query(query_id)
        if record.state is not QueryState.DONE:
            raise QueryStateError(f"query {query_id!r} is {record.state.value}: no result yet")
        with self._lock:
            rows = self._conn.execute(
                "SELECT block, data FROM results WHERE query_id=?", (query_id,)
            ).fetchall()
            meta_row = self._conn.execute(
                "SELECT meta FROM result_meta WHERE query_id=?", (query_id,)
            ).fetchone()
        meta: dict[str, Any] = json.loads(meta_row["meta"]) if meta_row else {}
        return {str(r["block"]): bytes(r["data"]) for r in rows}, meta

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
