"""The owner's budget ledger database: its tables and the migrations from earlier
fedpca versions (the history is in :mod:`fedpca.owner.ledger`'s docstring)."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

from fedpca.errors import ConfigError
from fedpca.files import copy_database
from fedpca.query import Neighbouring

__all__ = [
    "LEGACY_MIGRATION_FACTOR",
    "RELEASE_CHANGES_KEY",
    "SCHEMA",
    "SCHEMA_VERSION",
    "create_or_migrate",
    "keep_copy_before_migrating",
]

logger = logging.getLogger("fedpca.owner.ledger")

SCHEMA_VERSION = 7

LEGACY_MIGRATION_FACTOR = 0.5
"""Schema 1 noise multipliers are multiplied by this when a ledger is migrated."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS releases (
    query_id TEXT PRIMARY KEY,
    analyst TEXT NOT NULL,
    noise_multiplier REAL NOT NULL,
    epsilon REAL NOT NULL,
    delta REAL NOT NULL,
    recorded_at REAL NOT NULL,
    not_private INTEGER NOT NULL CHECK (not_private IN (0, 1)),
    spec_digest TEXT NOT NULL,
    neighbouring TEXT NOT NULL DEFAULT 'add-remove',
    sensitivity REAL NOT NULL DEFAULT 1.0,
    delta_extra REAL NOT NULL DEFAULT 0.0
);
CREATE INDEX IF NOT EXISTS releases_by_analyst ON releases (analyst);
CREATE INDEX IF NOT EXISTS releases_by_digest ON releases (spec_digest);
CREATE TABLE IF NOT EXISTS tasks (
    query_id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    detail TEXT NOT NULL,
    upload_id TEXT,
    upload_started INTEGER NOT NULL DEFAULT 0,
    updated_at REAL NOT NULL,
    seed BLOB,
    capacity INTEGER,
    spec_digest TEXT,
    upload_deadline REAL
);
CREATE TABLE IF NOT EXISTS task_starts (
    query_id TEXT PRIMARY KEY,
    analyst TEXT NOT NULL,
    started_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS task_starts_by_time ON task_starts (started_at);
CREATE INDEX IF NOT EXISTS task_starts_by_analyst ON task_starts (analyst, started_at);
"""


def create_or_migrate(
    connection: sqlite3.Connection, path: Path, neighbouring: Neighbouring, *, existed: bool
) -> None:
    """Create the tables, or bring an older ledger to :data:`SCHEMA_VERSION` (inside
    the caller's open transaction). ``existed``: the file held content before it was
    opened (:func:`fedpca.files.holds_database`)."""
    _checked_tables(connection, path, existed=existed)
    # executescript would commit the open transaction; run statements singly.
    for statement in SCHEMA.split(";"):
        if statement.strip():
            connection.execute(statement)
    row = connection.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is None:
        connection.execute(
            "INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
        )
    elif int(row[0]) in (1, 2, 3, 4, 5, 6):
        if int(row[0]) == 1:
            _migrate_schema_1(connection, path, neighbouring)
        _migrate_tasks(connection)
        _migrate_task_starts(connection)
        # Said, as the proxy says its own: an operator upgrading saw nothing of it.
        logger.warning(
            "%s: migrated the budget ledger from schema version %s to %d (one way: an "
            "earlier fedpca no longer reads it)",
            path,
            row[0],
            SCHEMA_VERSION,
        )
    elif int(row[0]) != SCHEMA_VERSION:
        raise ConfigError(
            f"{path}: ledger schema version {row[0]}, this fedpca understands "
            f"{SCHEMA_VERSION}{_kept_copy_hint(path)}"
        )
    # After the migrations: tasks.spec_digest exists from schema 5 on. The replay lookup
    # of every new task (answered_under) searches it instead of scanning every task.
    connection.execute("CREATE INDEX IF NOT EXISTS tasks_by_digest ON tasks (spec_digest)")
    # The open tasks a node names at every connection (unfinished_tasks) and ends past
    # their deadline are found by state, in time that grows with them, not with every
    # task the ledger has recorded.
    connection.execute("CREATE INDEX IF NOT EXISTS tasks_by_state ON tasks (state)")
    _count_release_changes(connection)


RELEASE_CHANGES_KEY = "releases_changes"
"""The ``meta`` row counting every write to ``releases`` (see :func:`_count_release_changes`)."""


def _count_release_changes(connection: sqlite3.Connection) -> None:
    """Triggers that add one to ``meta.releases_changes`` at every insert, update and
    delete of a release, by any connection, whatever fedpca version it runs.

    They live in the database file, so a ledger with budget shares knows whether anyone
    has written a release since it last looked by reading one row, where the largest
    rowid missed a writer that removed the latest release and added another in its
    place (SQLite can give it the same rowid). Added to ledgers of any schema without a
    version change: an older node writing to the file fires them too.
    """
    connection.execute(
        "INSERT OR IGNORE INTO meta (key, value) VALUES (?, '0')", (RELEASE_CHANGES_KEY,)
    )
    for event in ("INSERT", "UPDATE", "DELETE"):
        connection.execute(
            f"CREATE TRIGGER IF NOT EXISTS releases_{event.lower()}_counted "
            f"AFTER {event} ON releases BEGIN "
            "UPDATE meta SET value = CAST(value AS INTEGER) + 1 "
            f"WHERE key = '{RELEASE_CHANGES_KEY}'; END"
        )


def _migrate_schema_1(
    connection: sqlite3.Connection, path: Path, neighbouring: Neighbouring
) -> None:
    """Schema 1 -> 2 inside the open transaction (see :mod:`fedpca.owner.ledger`)."""
    columns = {row[1] for row in connection.execute("PRAGMA table_info(releases)")}
    for name, declaration in (
        ("neighbouring", "TEXT NOT NULL DEFAULT 'add-remove'"),
        ("sensitivity", "REAL NOT NULL DEFAULT 1.0"),
        ("delta_extra", "REAL NOT NULL DEFAULT 0.0"),
    ):
        if name not in columns:
            connection.execute(f"ALTER TABLE releases ADD COLUMN {name} {declaration}")
    migrated = connection.execute(
        "UPDATE releases SET noise_multiplier = noise_multiplier * ?, neighbouring = ?",
        (LEGACY_MIGRATION_FACTOR, neighbouring.value),
    ).rowcount
    connection.execute(
        "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),)
    )
    logger.warning(
        "%s: migrated a schema-1 ledger: %d recorded releases now count with half their "
        "noise multiplier under %s adjacency (docs/privacy.md, 'Ledgers of fedpca 0.1')",
        path,
        migrated,
        neighbouring.value,
    )


def keep_copy_before_migrating(
    connection: sqlite3.Connection, path: Path, *, existed: bool
) -> Path | None:
    """Copy a ledger of an earlier schema, before :func:`create_or_migrate` changes it, to
    ``<name>.schema-<version>.bak`` beside it (0600); return the copy's path, or None for a
    ledger of this version. A migration is one way: the copy is what an operator who did
    not back up before upgrading goes back to with the earlier fedpca (docs/operations.md,
    Upgrading the proxy). A copy already there, from an earlier start that failed, is kept.
    """
    # The checks create_or_migrate starts with: another file (a proxy's database) is
    # refused before anything is copied.
    if "meta" not in _checked_tables(connection, path, existed=existed):
        return None
    row = connection.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is None or not str(row[0]).isdigit() or int(row[0]) >= SCHEMA_VERSION:
        return None
    copy = _kept_copy(path, int(row[0]))
    if not copy.exists():
        copy_database(connection, copy)
    logger.warning(
        "%s: the ledger of schema version %s, as it was before this version migrates it, "
        "is kept in %s (an earlier fedpca reads it; releases made after now are not in it)",
        path,
        row[0],
        copy,
    )
    return copy


def _kept_copy(path: Path, version: int) -> Path:
    """Where the ledger of schema ``version`` is kept before a later one migrates it."""
    return path.with_name(f"{path.name}.schema-{version}.bak")


def _kept_copy_hint(path: Path) -> str:
    """Where the copy a later fedpca kept before migrating lies, if it is there: going
    back to this version means going back to it (an operator's walkthrough, stop 42:
    the error did not say the copy existed)."""
    copy = _kept_copy(path, SCHEMA_VERSION)
    if not copy.is_file():
        return ""
    return (
        f". A later fedpca migrated it and kept the ledger as it was in {copy}: to go "
        "back to this version, run the later one, or restore that copy (the releases "
        "made since are then forgotten: docs/operations.md, Upgrading)"
    )


def check_version(connection: sqlite3.Connection, path: Path) -> None:
    """Refuse a ledger a reader cannot read as it is: not a ledger, or of another
    version (which only the node of this version migrates, holding the folder)."""
    _checked_tables(connection, path, existed=True)
    row = connection.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    found = "none" if row is None else row[0]
    if str(found).isdigit() and int(found) > SCHEMA_VERSION:
        raise ConfigError(
            f"{path}: ledger schema version {found}, this fedpca reads {SCHEMA_VERSION}: a "
            f"later fedpca wrote it; run that version's command{_kept_copy_hint(path)}"
        )
    if found != str(SCHEMA_VERSION):
        raise ConfigError(
            f"{path}: ledger schema version {found}, this fedpca reads {SCHEMA_VERSION}; it "
            "is migrated by `fedpca owner serve` of this version (once the node that "
            "serves it now has stopped), not by a command that reads it"
        )


def _checked_tables(connection: sqlite3.Connection, path: Path, *, existed: bool) -> set[str]:
    tables = {
        str(row[0])
        for row in connection.execute("SELECT name FROM sqlite_master WHERE type='table'")
    }
    if "queries" in tables:
        # Before any table is made: the proxy's file is left as it was.
        raise ConfigError(
            f"{path} is a proxy database, not an owner's budget ledger: check [owner] "
            "state_dir (or --state-dir)"
        )
    if existed and not tables:
        # An SQLite file with nothing in it (a backup taken of a path where no ledger
        # was, which SQLite creates): made a new ledger of it, the budget spent would be
        # forgotten (found by review).
        raise ConfigError(
            f"{path} is an SQLite file with no tables, not a budget ledger (a backup taken "
            "of the wrong path?): restore the right file, or delete this one if the owner "
            "has never released anything"
        )
    return tables


def _migrate_tasks(connection: sqlite3.Connection) -> None:
    """Schemas 2 to 5 -> 6: tasks keep the secret seed of their sample of rows
    (schema 3) and the capacity it was drawn under (4), so an upload interrupted by
    a restart resumes with exactly the values it began with, the digest of the
    signed query a declined task carried (5), so a replay of it under another task id
    is recognised after any number of others and across restarts, and the task's
    upload deadline (6), so a restarted node ends a task left open whose proxy never
    delivers it again (rows written before have none, and wait for the proxy)."""
    columns = {row[1] for row in connection.execute("PRAGMA table_info(tasks)")}
    for name, declaration in (
        ("seed", "BLOB"),
        ("capacity", "INTEGER"),
        ("spec_digest", "TEXT"),
        ("upload_deadline", "REAL"),
    ):
        if name not in columns:
            connection.execute(f"ALTER TABLE tasks ADD COLUMN {name} {declaration}")
    connection.execute(
        "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),)
    )


def _migrate_task_starts(connection: sqlite3.Connection) -> None:
    """Schemas 1 to 6 -> 7: the daily task cap counts the tasks an owner began computing
    (``task_starts``), a refunded one against its own analyst; before, it counted the
    releases held, which a refund removes. The releases held are the tasks known to
    have begun."""
    connection.execute(
        "INSERT OR IGNORE INTO task_starts (query_id, analyst, started_at) "
        "SELECT query_id, analyst, recorded_at FROM releases"
    )
