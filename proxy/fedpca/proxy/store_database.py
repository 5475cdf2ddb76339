"""The proxy's SQLite connection: opening (schema, migrations), transactions, group
commit, and the row helpers every part of :class:`fedpca.proxy.store.ProxyStore` uses.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sqlite3
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from fedpca.errors import ConfigError, NotFoundError
from fedpca.files import (
    DATABASE_MODE,
    ExclusiveUse,
    create_database,
    database_missing,
    distinct_values,
    holds_database,
    restrict_database,
)
from fedpca.messages import QueryState
from fedpca.proxy.group_commit import GroupCommit
from fedpca.proxy.store_records import (
    PAGE_CIPHERTEXTS,
    QUERY_HEAD,
    Contributor,
    QueryRecord,
    contributor_of,
    query_record_of,
)
from fedpca.proxy.store_schema import SCHEMA, SCHEMA_VERSION, migrate
from fedpca.query import Neighbouring

logger = logging.getLogger(__name__)

__all__ = [
    "RESTORE_PENDING_KEY",
    "StoreDatabase",
    "clear_restore_pending",
    "mark_restore_pending",
    "refuse_where_a_proxy_ran",
    "restore_pending_since",
    "scratch_copy",
    "serving_process",
    "storage_unavailable",
    "use_database",
]


_OWNER_TABLES = frozenset({"contributors", "declines", "uploads"})
"""Tables whose rows are keyed by (query_id, owner_id)."""


def _lock_path(database: Path) -> Path:
    """The lock file a serving proxy holds beside its database (and leaves there):
    beside the file itself, whatever symbolic links name it (a second proxy started on
    a link to a served database ran beside the first: review)."""
    real = database.resolve()
    return real.with_name(real.name + ".lock")


RESTORE_PENDING_KEY = "restore_pending_since"
"""``meta`` key of a copy written by ``fedpca proxy backup``: when it was taken (ISO
8601, UTC). Present, the proxy refuses to serve the database; ``fedpca proxy
import-releases`` removes it."""


def mark_restore_pending(conn: sqlite3.Connection, taken_at: datetime) -> None:
    """Mark the database of ``conn`` (a backup copy) as not to be served before the
    releases since ``taken_at`` are re-entered, and commit."""
    conn.execute(
        "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
        (RESTORE_PENDING_KEY, taken_at.isoformat(timespec="seconds")),
    )
    conn.commit()


def restore_pending_since(conn: sqlite3.Connection) -> str | None:
    """When the backup this database was restored from was taken, while the releases
    made since are not re-entered (None: the database may be served)."""
    row = conn.execute("SELECT value FROM meta WHERE key=?", (RESTORE_PENDING_KEY,)).fetchone()
    return None if row is None else str(row[0])


def clear_restore_pending(conn: sqlite3.Connection) -> None:
    """The releases since the backup are re-entered: the database may be served."""
    conn.execute("DELETE FROM meta WHERE key=?", (RESTORE_PENDING_KEY,))


def refuse_where_a_proxy_ran(database: Path) -> None:
    """Refuse to create a database a proxy has run on (its lock file is there): the
    database is gone, and a new one would start every analyst's budget at zero."""
    lock = _lock_path(database)
    if lock.exists():
        raise ConfigError(
            f"{lock} exists but {database_missing(database)}: a proxy ran on this database "
            "and it is gone. A new one would start every analyst's budget again at zero; "
            "restore it from a backup (docs/operations.md)"
        )


@contextmanager
def scratch_copy(database: Path) -> Iterator[Path]:
    """A copy of ``database`` (with its write-ahead log) in a temporary folder, deleted
    after use: what a dry run opens, since opening a database can write to it (its
    migrations, the aggregates of finished queries it drops). Only while the database
    is held (:func:`use_database`), so that no proxy writes to it during the copy."""
    # Beside the database: the system's temporary folder may be too small for it.
    with tempfile.TemporaryDirectory(prefix=".fedpca-dry-run-", dir=database.parent) as folder:
        copy = Path(folder) / database.name
        try:
            shutil.copyfile(database, copy)
            log = database.with_name(database.name + "-wal")
            if log.exists():
                shutil.copyfile(log, copy.with_name(copy.name + "-wal"))
        except OSError as exc:
            raise ConfigError(f"cannot copy {database} for a dry run: {exc}") from exc
        yield copy


def use_database(database: Path) -> ExclusiveUse:
    """Hold the proxy's database for this process: two proxies on one database would
    each admit queries against the same budgets and race for the same uploads, and a
    tool that rewrites the ledgers (``fedpca proxy import-releases``) must not run
    beside a proxy.

    Raises
    ------
    ConfigError
        Another process holds it (named by its pid), or the lock file cannot be made.
    """
    return ExclusiveUse(_lock_path(database), f"the proxy database {database}")


def recorded_relations(database: Path) -> set[str]:
    """The neighbouring relations the releases in ``database`` were recorded under,
    read without writing (``query_only``): a ledger is kept under one relation, and a
    proxy configured for another refuses every analyst with a release (``proxy init``
    says so first, as ``owner init`` does for an owner's ledger)."""
    return distinct_values(
        database, "SELECT DISTINCT json_extract(event, '$.neighbouring') FROM releases"
    )


def serving_process(database: Path) -> str | None:
    """Why ``database`` is in use (a proxy serves it, named by pid), or None; a
    database no proxy ever served is left without a lock file."""
    if not _lock_path(database).exists():
        return None
    try:
        use_database(database).release()
    except ConfigError as exc:
        return str(exc)
    return None


def _create_tables(connection: sqlite3.Connection) -> None:
    """Every table of :data:`SCHEMA` that is missing (a new database's, and those an
    older one lacks before :func:`migrate`)."""
    for statement in SCHEMA.split(";"):
        if statement.strip():
            connection.execute(statement)


def _new_database(connection: sqlite3.Connection) -> None:
    _create_tables(connection)
    connection.execute(
        "INSERT INTO meta(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
    )


class StoreDatabase:
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
    announce_creation : log a warning when the file is created (False: `proxy init`,
        whose job that is).
    read_only : read an existing database of this version, changing nothing (``proxy
        status``, which runs beside a serving proxy without its lock: it migrated the
        file under a running older proxy, found by review).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        clock: Callable[[], float] = time.time,
        page_ciphertexts: int = PAGE_CIPHERTEXTS,
        neighbouring: Neighbouring = Neighbouring.ADD_REMOVE,
        group_commit: bool = True,
        announce_creation: bool = True,
        read_only: bool = False,
    ) -> None:
        self.neighbouring = Neighbouring(neighbouring)
        if page_ciphertexts < 1:
            raise ValueError(f"page_ciphertexts must be >= 1, got {page_ciphertexts}")
        self.page_ciphertexts = page_ciphertexts
        self.path = Path(path)
        created = not holds_database(self.path)
        if created and read_only:
            raise ConfigError(f"no proxy database: {database_missing(self.path)}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot create the folder of the proxy database {self.path}: {exc}"
            ) from exc
        self._clock = clock
        self._lock = threading.RLock()
        # The latest queries this process failed, with their reasons (memory only): the
        # owners' task streams tell their contributors without a read each.
        # Under a lock of their own, not the connection's: the event loop reads them, and
        # the connection's lock is held for a whole transaction, which waits up to 30 s
        # for a busy database (a red team froze every peer's calls for as long).
        self._recent_failures: OrderedDict[str, str] = OrderedDict()
        self._recent_failures_lock = threading.Lock()
        try:
            if created and not read_only:
                # Whole or not at all: a crash while the tables are made left a file
                # with none, which the next start refused (fedpca.files).
                create_database(self.path, _new_database, DATABASE_MODE)
            elif not read_only:
                restrict_database(self.path)
            self._open(page_ciphertexts, created=created, read_only=read_only)
        except ConfigError:
            with contextlib.suppress(AttributeError, sqlite3.Error):
                self._conn.close()
            raise
        except (sqlite3.DatabaseError, OSError) as exc:
            with contextlib.suppress(AttributeError, sqlite3.Error):
                self._conn.close()
            # Not a traceback: a damaged or truncated file (a disk that failed, a copy
            # taken while the proxy ran) or one that cannot be written is named.
            advice = (
                "check that this process may create and write files in "
                f"{self.path.parent} (on Kubernetes, the volume's owner)"
                if created
                else "if the file is damaged, restore it from a backup (docs/operations.md, "
                "Backup and restore)"
            )
            raise ConfigError(
                f"cannot use the proxy database {self.path}: {exc}; {advice}"
            ) from exc
        self._group = GroupCommit(self.transaction, enabled=group_commit)
        if created and announce_creation:
            # `proxy serve` creates one only with --new-database; a new, empty ledger
            # starts every analyst's budget again at zero. Say so where the operator looks.
            logger.warning(
                "created a new, empty proxy database %s: no analyst has spent any budget "
                "in it. Expected on a first start; if this proxy ran before, [proxy] "
                "database names the wrong file: stop it and correct the path",
                self.path,
            )

    def _open(self, page_ciphertexts: int, *, created: bool, read_only: bool) -> None:
        """Connect, set the journal, create or migrate the tables (check their version,
        ``read_only``)."""
        self._conn = sqlite3.connect(
            str(self.path), isolation_level=None, check_same_thread=False, timeout=30.0
        )
        self._conn.row_factory = sqlite3.Row
        if not read_only:  # the journal mode is the file's: a reader leaves it as it is
            self._conn.execute("PRAGMA journal_mode=WAL")
        # FULL: a committed transaction survives power loss, not only a process crash.
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        # Deleted content is overwritten, not left in free pages: the aggregates without
        # noise deleted as their pages are released (and purged results) do not stay
        # in the database file. Old WAL frames are removed by truncate_wal().
        self._conn.execute("PRAGMA secure_delete=ON")
        tables = {
            str(row[0])
            for row in self._conn.execute("SELECT name FROM sqlite_master WHERE type='table'")
        }
        if "tasks" in tables and "queries" not in tables:
            # Before any table is made: the owner's file is left as it was.
            raise ConfigError(
                f"{self.path} is an owner's budget ledger, not a proxy database: check "
                "[proxy] database (or --database)"
            )
        if not tables and not created:
            # Not a new database: an SQLite file with nothing in it, e.g. a backup taken
            # of a path where no database was (which SQLite creates). Starting on it
            # would start every analyst's budget again (found by review).
            raise ConfigError(
                f"{self.path} is an SQLite file with no tables, not a proxy database (a "
                "backup taken of the wrong path?): restore the right file, or delete this "
                "one if the proxy is meant to start with a new, empty database"
            )
        if read_only:
            self._conn.execute("PRAGMA query_only=ON")
            row = self._conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None or int(row["value"]) != SCHEMA_VERSION:
                found = "none" if row is None else row["value"]
                raise ConfigError(
                    f"{self.path}: schema version {found}, this fedpca reads {SCHEMA_VERSION}; "
                    "it is migrated by `fedpca proxy serve` of this version (once the "
                    "proxy that serves it now has stopped), not by a command that reads it"
                )
            return
        _create_tables(self._conn)
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
        # After the migrations (schema 1 had no analyst column): each submission counts
        # its analyst's open and recent queries (fedpca.proxy.limits).
        self._conn.execute(
            "CREATE INDEX IF NOT EXISTS queries_by_analyst ON queries(analyst_id, created_at)"
        )
        # Earlier proxies kept every finished query's aggregate without its noise
        # beside the released pages; it is never used again (a released page is never
        # recomputed), so it does not stay on disk.
        with self.transaction() as conn:
            conn.execute(
                "DELETE FROM aggregate_pages WHERE query_id IN "
                "(SELECT query_id FROM queries WHERE state IN (?, ?))",
                (QueryState.DONE.value, QueryState.FAILED.value),
            )
        self._scrub_free_pages_once()

    def _scrub_free_pages_once(self) -> None:
        """Rewrite the database once (VACUUM) if it has free pages from before
        ``secure_delete`` was set: an SQLite built without it as its default (Debian's
        has it) left deleted aggregates in them (found by review)."""
        row = self._conn.execute("SELECT value FROM meta WHERE key='free_pages_scrubbed'")
        if row.fetchone() is not None:
            return
        free = int(self._conn.execute("PRAGMA freelist_count").fetchone()[0])
        if free:
            logger.warning(
                "%s: rewriting the database once (VACUUM, %d free pages) so that content "
                "deleted before secure deletion was on does not stay in them",
                self.path,
                free,
            )
            try:
                self._conn.execute("VACUUM")
            except sqlite3.OperationalError as exc:  # e.g. no room for the copy: next start
                logger.warning(
                    "%s: VACUUM failed (%s); tried again at the next start", self.path, exc
                )
                return
        with self.transaction() as conn:
            conn.execute("INSERT INTO meta(key, value) VALUES ('free_pages_scrubbed', '1')")

    def restore_pending_since(self) -> str | None:
        """When the backup this database was restored from was taken, while the
        releases since are not re-entered (None: it may be served)."""
        with self._lock:
            return restore_pending_since(self._conn)

    def truncate_wal(self) -> None:
        """Checkpoint the write-ahead log into the database and truncate it to zero
        bytes, so that frames of deleted content (an aggregate without noise) do not
        stay in it. Waits for readers (busy timeout); a checkpoint that cannot finish
        now is left to the next call."""
        with self._lock:
            busy, _, _ = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            logger.info("the proxy database's log was not truncated (busy): next time")

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
                self._conn.execute("COMMIT")
            except BaseException:
                # Also when COMMIT itself failed and SQLite left the transaction open.
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

    def query(self, query_id: str) -> QueryRecord:
        """The stored record of one query."""
        with self._lock:
            row = self._conn.execute(
                f"SELECT {QUERY_HEAD} FROM queries WHERE query_id=?", (query_id,)
            ).fetchone()
            if row is None:
                charged = self._conn.execute(
                    "SELECT 1 FROM releases WHERE query_id=?", (query_id,)
                ).fetchone()
        if row is None:
            if charged is not None:
                # Re-entered by `proxy import-releases` after a restore that lost the
                # query: it was "unknown" to status and fetch, yet charged (found by review).
                raise NotFoundError(
                    f"query {query_id!r} has no record here: it was lost with a restore of "
                    "the proxy's database, and its charge, re-entered from the owners' "
                    "ledgers, stands; its result cannot be fetched"
                )
            raise NotFoundError(f"unknown query {query_id!r}")
        return query_record_of(row)

    def query_spec(self, query_id: str) -> dict[str, Any]:
        """The stored statement of one query (:func:`fedpca.query_records.spec_to_dict`'s
        form): read only where it is used, as it can be megabytes (NotFoundError)."""
        with self._lock:
            row = self._conn.execute(
                "SELECT spec FROM queries WHERE query_id=?", (query_id,)
            ).fetchone()
        if row is None:
            raise NotFoundError(f"unknown query {query_id!r}")
        spec: dict[str, Any] = json.loads(row["spec"])
        return spec

    def _query_row(self, conn: sqlite3.Connection, query_id: str) -> sqlite3.Row:
        row = conn.execute(
            f"SELECT {QUERY_HEAD} FROM queries WHERE query_id=?", (query_id,)
        ).fetchone()
        if row is None:
            raise NotFoundError(f"unknown query {query_id!r}")
        return row

    def _contributor(
        self, conn: sqlite3.Connection, query_id: str, owner_id: str
    ) -> Contributor | None:
        row = conn.execute(
            "SELECT * FROM contributors WHERE query_id=? AND owner_id=?", (query_id, owner_id)
        ).fetchone()
        return None if row is None else contributor_of(row)

    def _has_owner_row(
        self, conn: sqlite3.Connection, table: str, query_id: str, owner_id: str
    ) -> bool:
        """Whether ``table`` (one of the tables keyed by query and owner) holds this
        owner's row for the query: one indexed row."""
        if table not in _OWNER_TABLES:
            raise ValueError(f"not a table keyed by query and owner: {table!r}")
        row = conn.execute(
            f"SELECT 1 FROM {table} WHERE query_id=? AND owner_id=?", (query_id, owner_id)
        ).fetchone()
        return row is not None

    def contributor(self, query_id: str, owner_id: str) -> Contributor | None:
        """One owner's place among the query's contributors, or None: one indexed row,
        so a check made for each of N owners costs N rows, not N^2."""
        with self._lock:
            return self._contributor(self._conn, query_id, owner_id)

    def contributor_count(self, query_id: str) -> int:
        """How many owners hold a place among the query's contributors."""
        with self._lock:
            return self._contributor_count(self._conn, query_id)

    def _contributor_count(self, conn: sqlite3.Connection, query_id: str) -> int:
        row = conn.execute(
            "SELECT COUNT(*) FROM contributors WHERE query_id=?", (query_id,)
        ).fetchone()
        return int(row[0])

    def _contributors(self, conn: sqlite3.Connection, query_id: str) -> list[Contributor]:
        rows = conn.execute(
            "SELECT * FROM contributors WHERE query_id=? ORDER BY joined_at, owner_id",
            (query_id,),
        ).fetchall()
        return [contributor_of(row) for row in rows]

    def _merge_meta(self, conn: sqlite3.Connection, query_id: str, meta: Mapping[str, Any]) -> None:
        row = conn.execute("SELECT meta FROM result_meta WHERE query_id=?", (query_id,)).fetchone()
        merged = {} if row is None else dict(json.loads(row["meta"]))
        merged.update(meta)
        conn.execute(
            "INSERT INTO result_meta(query_id, meta) VALUES (?, ?) "
            "ON CONFLICT(query_id) DO UPDATE SET meta=excluded.meta",
            (query_id, json.dumps(merged, sort_keys=True)),
        )


_TRANSIENT_SQLITE_ERRORS = frozenset(
    {
        5,  # SQLITE_BUSY: another connection held the write lock past the busy timeout
        6,  # SQLITE_LOCKED
        8,  # SQLITE_READONLY: the file or its folder was made read-only
        10,  # SQLITE_IOERR: the disk failed a read, write or fsync
        13,  # SQLITE_FULL: the disk is full
        14,  # SQLITE_CANTOPEN: the journal or the file could not be opened
    }
)
"""Primary SQLite result codes of a store that cannot be written *now*, not of a
request at fault: the transaction rolled back, so the caller may simply retry."""


def storage_unavailable(error: BaseException) -> bool:
    """True for an SQLite error of the proxy's storage that a retry may get past (a
    locked, full, read-only or failing database): servicers answer it UNAVAILABLE, which
    owners and analysts retry, instead of INTERNAL, which owners take as a final refusal
    (an upload already folded in part then never resumed and its query failed at its
    deadline, charged: review), and the coordinator retries its own step from its timer."""
    code = getattr(error, "sqlite_errorcode", None)
    return (
        isinstance(error, sqlite3.OperationalError)
        and code is not None
        and code & 0xFF in _TRANSIENT_SQLITE_ERRORS
    )
