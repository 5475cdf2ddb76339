"""Durable proxy state in SQLite.

Everything the proxy must not lose lives here: enrolled owners, queries and their
lifecycle, accepted uploads, the running encrypted aggregates, noise-added
results, and each analyst's privacy-budget ledger.

Crash safety rests on two rules:

* every state change that must be atomic is one ``BEGIN IMMEDIATE`` transaction
  (WAL journal, ``synchronous=FULL``), so a ``kill -9`` leaves either the state
  before or the state after it;
* folding an upload into the aggregate and recording that upload as accepted are
  the *same* transaction, so an upload is counted exactly once: a retry after a
  lost acknowledgement finds its record and is answered "duplicate".

Ciphertexts are stored as opaque fixed-width byte strings; the fold itself is a
callable supplied by the caller (homomorphic addition lives in the codec).
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
from enum import StrEnum
from pathlib import Path
from typing import Any

from fedpca.errors import NotFoundError, ProtocolError, QueryStateError

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1

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
    failure_reason TEXT
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
CREATE TABLE IF NOT EXISTS aggregates (
    query_id TEXT NOT NULL REFERENCES queries(query_id),
    block TEXT NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (query_id, block)
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


class QueryState(StrEnum):
    COLLECTING = "collecting"
    """Published to owners; uploads are being folded into the aggregate."""
    NOISING = "noising"
    """Uploads closed; noise (and in masked mode the mask) is being added."""
    DONE = "done"
    """The noise-added result is stored and can be fetched by the analyst."""
    FAILED = "failed"
    """The query ended without a result; ``failure_reason`` says why."""

    @property
    def terminal(self) -> bool:
        return self in (QueryState.DONE, QueryState.FAILED)


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
class UploadReceipt:
    """What the proxy answers to a completed upload."""

    duplicate: bool
    """True when this exact upload had already been accepted (a harmless retry)."""
    n_contributed: int
    """Owners whose uploads the query has accepted, including this one."""


BlockFold = Callable[[str, bytes | None, bytes], bytes]
"""``fold(block_name, aggregate_or_None, upload_block) -> new aggregate``."""


class ProxyStore:
    """Thread-safe access to the proxy's SQLite database.

    One connection guarded by a lock: SQLite serialises writers anyway, and the
    proxy's writes are few and short (the homomorphic fold of one upload).
    """

    def __init__(self, path: str | Path, *, clock: Callable[[], float] = time.time) -> None:
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
            elif int(row["value"]) != SCHEMA_VERSION:
                raise QueryStateError(
                    f"{self.path}: schema version {row['value']} is not supported "
                    f"(this proxy expects {SCHEMA_VERSION})"
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
        before_insert: Callable[[sqlite3.Connection], None] | None = None,
    ) -> QueryRecord:
        """Create a query in state COLLECTING.

        ``before_insert`` runs inside the same transaction (the budget check uses
        it so that two concurrent submissions cannot both pass). Submitting the
        same query id again with the same spec returns the existing record;
        with a different spec it is a protocol error.
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
                    "deadline_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        query_id,
                        analyst_id,
                        spec_json,
                        json.dumps(dict(plan), sort_keys=True),
                        QueryState.COLLECTING.value,
                        now,
                        deadline_at,
                        now,
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

    def set_state(
        self,
        query_id: str,
        state: QueryState,
        *,
        expect: tuple[QueryState, ...] = (),
        failure_reason: str | None = None,
    ) -> QueryRecord:
        """Move a query to ``state``; refuse if it is not currently in one of ``expect``."""
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
            conn.execute(
                "UPDATE queries SET state=?, failure_reason=?, updated_at=? WHERE query_id=?",
                (state.value, failure_reason, self._clock(), query_id),
            )
        return self.query(query_id)

    # --------------------------------------------------------------- uploads
    def accept_upload(
        self,
        query_id: str,
        owner_id: str,
        upload_id: str,
        content_sha256: str,
        blocks: Mapping[str, bytes],
        n_ciphertexts: int,
        fold: BlockFold,
        *,
        public_count: int | None = None,
        before_fold: Callable[[int], None] | None = None,
    ) -> UploadReceipt:
        """Fold one complete, validated upload into the query's aggregate, exactly once.

        The fold and the upload record are one transaction. A retry of an
        already-accepted upload (same owner, same upload id and content hash)
        changes nothing and returns ``duplicate=True``. A second, different
        upload from the same owner, or the same ciphertexts replayed into
        another query, is refused.

        ``before_fold(n_contributed)`` runs inside the transaction, after those
        checks and before anything is folded, with the number of uploads accepted
        so far; raising refuses the upload (the proxy checks max_owners here, so
        concurrent uploads cannot both take the last place).
        """
        now = self._clock()
        with self.transaction() as conn:
            row = conn.execute(
                "SELECT state, n_contributed FROM queries WHERE query_id=?", (query_id,)
            ).fetchone()
            if row is None:
                raise NotFoundError(f"unknown query {query_id!r}")
            previous = conn.execute(
                "SELECT upload_id, content_sha256 FROM uploads WHERE query_id=? AND owner_id=?",
                (query_id, owner_id),
            ).fetchone()
            if previous is not None:
                if (
                    previous["upload_id"] == upload_id
                    and previous["content_sha256"] == content_sha256
                ):
                    return UploadReceipt(duplicate=True, n_contributed=int(row["n_contributed"]))
                raise ProtocolError(
                    f"owner {owner_id!r} already contributed a different upload to query "
                    f"{query_id!r}"
                )
            state = QueryState(row["state"])
            if state is not QueryState.COLLECTING:
                raise QueryStateError(
                    f"query {query_id!r} is {state.value}: uploads are no longer accepted"
                )
            replay = conn.execute(
                "SELECT query_id FROM uploads WHERE content_sha256=?", (content_sha256,)
            ).fetchone()
            if replay is not None:
                raise ProtocolError(
                    f"these ciphertexts were already accepted for query {replay['query_id']!r}: "
                    "replayed uploads are refused"
                )
            if before_fold is not None:
                before_fold(int(row["n_contributed"]))
            logger.debug("query %s: folding upload %s from %s", query_id, upload_id, owner_id)
            for name, data in blocks.items():
                current = conn.execute(
                    "SELECT data FROM aggregates WHERE query_id=? AND block=?", (query_id, name)
                ).fetchone()
                folded = fold(name, None if current is None else bytes(current["data"]), data)
                conn.execute(
                    "INSERT INTO aggregates(query_id, block, data) VALUES (?, ?, ?) "
                    "ON CONFLICT(query_id, block) DO UPDATE SET data=excluded.data",
                    (query_id, name, folded),
                )
            conn.execute(
                "INSERT INTO uploads(query_id, owner_id, upload_id, content_sha256, "
                "n_ciphertexts, public_count, accepted_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (query_id, owner_id, upload_id, content_sha256, n_ciphertexts, public_count, now),
            )
            n_contributed = int(row["n_contributed"]) + 1
            conn.execute(
                "UPDATE queries SET n_contributed=?, updated_at=? WHERE query_id=?",
                (n_contributed, now, query_id),
            )
        logger.info(
            "query %s: accepted upload from %s (%d owners)", query_id, owner_id, n_contributed
        )
        return UploadReceipt(duplicate=False, n_contributed=n_contributed)

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
        with self.transaction() as conn:
            if (
                conn.execute("SELECT 1 FROM queries WHERE query_id=?", (query_id,)).fetchone()
                is None
            ):
                raise NotFoundError(f"unknown query {query_id!r}")
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

    def aggregate(self, query_id: str) -> dict[str, bytes]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT block, data FROM aggregates WHERE query_id=?", (query_id,)
            ).fetchall()
        return {str(r["block"]): bytes(r["data"]) for r in rows}

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

    def releases(
        self, analyst_id: str, conn: sqlite3.Connection | None = None
    ) -> list[dict[str, Any]]:
        """The analyst's recorded releases (pass ``conn`` inside a transaction)."""
        if conn is None:
            with self._lock:
                rows = self._conn.execute(
                    "SELECT event FROM releases WHERE analyst_id=? ORDER BY recorded_at",
                    (analyst_id,),
                ).fetchall()
        else:
            rows = conn.execute(
                "SELECT event FROM releases WHERE analyst_id=? ORDER BY recorded_at",
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
    )
