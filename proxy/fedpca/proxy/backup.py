"""``fedpca proxy backup``: a copy of the proxy's database that holds nothing unnoised.

While a query runs, the database holds each owner's staged chunks and the aggregate
pages before their noise: ciphertexts under the analyst's key that the analyst would
decrypt into exact per-owner statistics. A copy taken then (SQLite's backup API, as
docs/operations.md said) kept them, readable by every user of the host (found by an
operator's review). This copy is taken only when the database holds none: a consistent
snapshot is made with SQLite's backup API (safe beside the serving proxy and its WAL),
checked, and kept only if it holds no staged chunk and no aggregate page; otherwise it
is discarded and taken again until ``wait_seconds`` have passed. The file is written
0600 under a hidden name and renamed into place once flushed.

The copy is marked as a backup (:func:`~fedpca.proxy.store_database.mark_restore_pending`):
put back in place, it forgets the releases made since it was taken, so the proxy
refuses to serve it until ``fedpca proxy import-releases`` has re-entered them from
the owners' ledgers (an operator could otherwise start it first and let the analysts
spend those releases again).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from fedpca.errors import ConfigError
from fedpca.files import copy_database, database_missing, holds_database
from fedpca.proxy.store_database import mark_restore_pending

__all__ = ["BACKUP_MODE", "BackupReport", "backup_database"]

BACKUP_MODE = 0o600
"""A backup's permissions: the proxy's state, for the proxy's user only."""

_UNNOISED_TABLES = ("staged_chunks", "aggregate_pages")


@dataclass(frozen=True)
class BackupReport:
    """What :func:`backup_database` wrote."""

    path: Path
    queries: int
    bytes: int
    attempts: int


def _unnoised(connection: sqlite3.Connection) -> dict[str, int]:
    """Queries per table holding content without its noise (none: an empty dict)."""
    found = {}
    for table in _UNNOISED_TABLES:
        row = connection.execute(f"SELECT COUNT(DISTINCT query_id) FROM {table}").fetchone()
        if row[0]:
            found[table] = int(row[0])
    return found


def backup_database(
    database: Path,
    out: Path,
    *,
    wait_seconds: float = 0.0,
    poll_seconds: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> BackupReport:
    """Copy ``database`` to ``out`` once it holds nothing unnoised.

    Raises
    ------
    ConfigError
        No database at ``database``, ``out`` exists, or queries still held staged chunks
        or aggregate pages after ``wait_seconds`` (nothing is written then).
    """
    if not holds_database(database):
        raise ConfigError(f"no proxy database: {database_missing(database)}")
    if out.exists():
        raise ConfigError(f"{out} exists: name a new file (a backup never replaces one)")
    out.parent.mkdir(parents=True, exist_ok=True)
    source = sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=30.0)
    started = clock()
    attempts = 0
    held: dict[str, int] = {}
    queries = 0

    def inspect(copy: sqlite3.Connection) -> bool:
        """Whether the copy holds nothing unnoised (then it is marked and kept)."""
        nonlocal held, queries
        held = _unnoised(copy)
        queries = int(copy.execute("SELECT COUNT(*) FROM queries").fetchone()[0])
        mark_restore_pending(copy, datetime.now(UTC))
        return not held

    try:
        while True:
            attempts += 1
            if copy_database(source, out, BACKUP_MODE, prepare=inspect):
                return BackupReport(out, queries, out.stat().st_size, attempts)
            if clock() - started >= wait_seconds:
                what = ", ".join(f"{n} with {table.replace('_', ' ')}" for table, n in held.items())
                raise ConfigError(
                    f"queries are running ({what}): a backup now would hold owners' "
                    "uploads and aggregates without their noise, which the analyst's key "
                    "decrypts. Try again when they are done, or wait for them with --wait "
                    "SECONDS (no file was written)"
                )
            sleep(poll_seconds)
    finally:
        source.close()
