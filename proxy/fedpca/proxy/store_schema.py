"""The proxy database's tables and the migrations from earlier fedpca versions.

Schema history:

1. one aggregate blob per block (fedpca 0.1);
2. the aggregate in pages, chunks of uploads in progress staged for an exact take-out;
3. queries keyed by analyst (``analyst/query``), their signatures, whether an upload
   began, and every recorded release's neighbouring relation;
4. contributors fixed per query with how far each one's chunks are folded (uploads
   resume after a break instead of starting over), chunks staged only until the
   contributors are fixed, and results kept as pages that become final one by one.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

from fedpca.errors import QueryStateError
from fedpca.messages import QueryState
from fedpca.proxy.store_records import query_summary, stored_size
from fedpca.query import Neighbouring

__all__ = ["SCHEMA", "SCHEMA_VERSION", "migrate"]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 5

SCHEMA = """
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
    uploads_begun INTEGER NOT NULL DEFAULT 0,
    summary TEXT NOT NULL DEFAULT '{}',
    stored_bytes INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS contributors (
    query_id TEXT NOT NULL REFERENCES queries(query_id),
    owner_id TEXT NOT NULL,
    upload_id TEXT NOT NULL,
    covered INTEGER NOT NULL DEFAULT 0,
    public_count INTEGER,
    joined_at REAL NOT NULL,
    PRIMARY KEY (query_id, owner_id)
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
CREATE TABLE IF NOT EXISTS staged_chunks (
    query_id TEXT NOT NULL REFERENCES queries(query_id),
    owner_id TEXT NOT NULL,
    start_index INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (query_id, owner_id, start_index)
);
CREATE TABLE IF NOT EXISTS result_pages (
    query_id TEXT NOT NULL REFERENCES queries(query_id),
    page INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (query_id, page)
);
CREATE TABLE IF NOT EXISTS purged_results (
    query_id TEXT PRIMARY KEY REFERENCES queries(query_id),
    purged_at REAL NOT NULL
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
CREATE TABLE IF NOT EXISTS signers (
    signer TEXT PRIMARY KEY,
    analyst_id TEXT NOT NULL,
    first_seen REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS releases (
    query_id TEXT PRIMARY KEY,
    analyst_id TEXT NOT NULL,
    event TEXT NOT NULL,
    recorded_at REAL NOT NULL
);
"""


def migrate(
    conn: sqlite3.Connection,
    version: int,
    *,
    path: Path,
    neighbouring: Neighbouring,
    page_ciphertexts: int,
) -> None:
    """Bring a database of schema ``version`` to :data:`SCHEMA_VERSION` (inside ``conn``'s
    transaction). Versions 1 to 3 can only be migrated with no query in flight; version
    4 at any time (:func:`_queries_summarised`).

    Raises
    ------
    QueryStateError
        An unknown version, or queries still collecting or being noised.
    """
    if version == SCHEMA_VERSION:
        return
    if version == 4:
        _queries_summarised(conn)
        _set_version(conn, path, version)
        return
    if version not in (1, 2, 3):
        raise QueryStateError(
            f"{path}: schema version {version} is not supported (this proxy expects "
            f"{SCHEMA_VERSION})"
        )
    in_flight = conn.execute(
        "SELECT query_id FROM queries WHERE state IN (?, ?)",
        (QueryState.COLLECTING.value, QueryState.NOISING.value),
    ).fetchall()
    if in_flight:
        names = ", ".join(str(r["query_id"]) for r in in_flight)
        raise QueryStateError(
            f"{path}: schema version {version} with queries still in flight ({names}); "
            "let the previous fedpca version finish them (or their deadlines pass), "
            "then start this version"
        )
    if version == 1:
        conn.execute("DROP TABLE IF EXISTS aggregates")
    if version <= 2:
        _restate_releases(conn, path, neighbouring)
    _results_as_pages(conn, page_ciphertexts)
    conn.execute("DROP TABLE IF EXISTS upload_chunks")
    _queries_summarised(conn)
    _set_version(conn, path, version)


def _set_version(conn: sqlite3.Connection, path: Path, version: int) -> None:
    conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))
    logger.warning("%s: migrated from schema version %d to %d", path, version, SCHEMA_VERSION)


def _queries_summarised(conn: sqlite3.Connection) -> None:
    """Version 5 keeps each query's :func:`~fedpca.proxy.store_records.query_summary` and
    stored size in columns of their own (its status and listing no longer read the
    query; the analyst's daily allowance of stored bytes counts the size)."""
    columns = {row["name"] for row in conn.execute("PRAGMA table_info(queries)")}
    for name, declaration in (
        ("summary", "TEXT NOT NULL DEFAULT '{}'"),
        ("stored_bytes", "INTEGER NOT NULL DEFAULT 0"),
    ):
        if name not in columns:
            conn.execute(f"ALTER TABLE queries ADD COLUMN {name} {declaration}")
    # One query at a time: a database this version is meant for may hold gigabytes
    # of them. One this version cannot read gets an empty summary (its status still
    # shows; the listing leaves it out), not a proxy that cannot start.
    keys = [str(row["query_id"]) for row in conn.execute("SELECT query_id FROM queries")]
    for key in keys:
        row = conn.execute(
            "SELECT spec, plan, signature FROM queries WHERE query_id=?", (key,)
        ).fetchone()
        try:
            summary = query_summary(json.loads(row["spec"]), json.loads(row["plan"]))
        except Exception as exc:  # any row: the proxy must start (review: an infinite count)
            logger.warning(
                "query %s: cannot summarise it (%s); its listing leaves it out", key, exc
            )
            summary = _quorum_only(row["spec"])
        conn.execute(
            "UPDATE queries SET summary=?, stored_bytes=? WHERE query_id=?",
            (
                json.dumps(summary, sort_keys=True),
                stored_size(row["spec"], row["plan"], bytes(row["signature"])),
                key,
            ),
        )


def _restate_releases(conn: sqlite3.Connection, path: Path, neighbouring: Neighbouring) -> None:
    """Version 3 keys queries by analyst, stores each query's signature and whether an
    upload began, and states every recorded release's neighbouring relation.

    Releases of version 2 recorded no relation; they are restated under this
    deployment's (docs/privacy.md, "Ledgers of fedpca 0.1"): a stats-mode release keeps
    its add/remove noise multiplier under add/remove and counts with half of it under
    replace-one; a masked-mode release keeps its replace-one multiplier under
    replace-one and counts as NOT PRIVATE (infinite epsilon) under add/remove, where
    publishing N has no finite epsilon. Queries already in the database count as having
    had uploads (no refund), and are renamed to their analyst-scoped keys.
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
    relation = neighbouring.value
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
    for table in ("uploads", "declines", "aggregate_pages", "results", "result_meta"):
        exists = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (table,)
        ).fetchone()
        if exists is None:
            continue
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
        "UPDATE queries SET query_id = analyst_id || '/' || query_id WHERE instr(query_id, '/') = 0"
    )
    logger.warning(
        "%s: %d recorded releases restated under %s adjacency", path, len(rows), relation
    )


def _results_as_pages(conn: sqlite3.Connection, page_ciphertexts: int) -> None:
    """Version 4 keeps results as pages in wire order: concatenate each stored result's
    blocks in its plan's order and cut them into pages."""
    exists = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type='table' AND name='results'"
    ).fetchone()
    if exists is None:
        return
    for query in conn.execute("SELECT DISTINCT query_id FROM results").fetchall():
        query_id = query["query_id"]
        plan = json.loads(
            conn.execute("SELECT plan FROM queries WHERE query_id=?", (query_id,)).fetchone()[
                "plan"
            ]
        )
        blocks = {
            str(r["block"]): bytes(r["data"])
            for r in conn.execute("SELECT block, data FROM results WHERE query_id=?", (query_id,))
        }
        data = b"".join(blocks[b["name"]] for b in plan["result_blocks"])
        width = 2 * ((int(plan["key_bits"]) + 7) // 8)
        size = page_ciphertexts * width
        for page, start in enumerate(range(0, len(data), size)):
            conn.execute(
                "INSERT INTO result_pages(query_id, page, data) VALUES (?, ?, ?)",
                (query_id, page, data[start : start + size]),
            )
    conn.execute("DROP TABLE results")


def _quorum_only(spec_text: str) -> dict[str, Any]:
    """The summary of a query that cannot be summarised: its quorum if that can be read
    (else none, which no number of owners reaches: ``store_records.quorum_of``)."""
    try:
        quorum = json.loads(spec_text).get("quorum")
    except Exception:
        return {}
    return {"quorum": quorum} if isinstance(quorum, int) and quorum >= 1 else {}
