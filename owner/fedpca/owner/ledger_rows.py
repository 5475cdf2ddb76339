"""Rows of the owner's budget ledger database (:mod:`fedpca.owner.ledger`): releases read
as :class:`~fedpca.dp.mechanisms.PrivacyEvent` (every analyst's or one analyst's), and a
task's row written inside a caller's transaction."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from fedpca.dp.mechanisms import PrivacyEvent
from fedpca.errors import ConfigError
from fedpca.files import distinct_values
from fedpca.owner.ledger_records import Reentered, TaskOutcome
from fedpca.owner.ledger_schema import RELEASE_CHANGES_KEY

__all__ = [
    "EVENT_COLUMNS",
    "OWN_RELEASES_SQL",
    "TASK_STARTS_KEPT_SECONDS",
    "event_from_row",
    "insert_release",
    "read_events",
    "recorded_relations",
    "reenter_release",
    "release_changes",
    "write_task_row",
]

EVENT_COLUMNS = (
    "query_id, analyst, noise_multiplier, epsilon, delta, recorded_at, neighbouring, "
    "sensitivity, delta_extra"
)


def event_from_row(row: tuple[object, ...]) -> PrivacyEvent:
    """The release of a ``releases`` row whose first columns are :data:`EVENT_COLUMNS`."""
    return PrivacyEvent.from_dict(
        {
            "query_id": row[0],
            "analyst": row[1],
            "noise_multiplier": row[2],
            "epsilon": row[3],
            "delta": row[4],
            "timestamp": row[5],
            "neighbouring": row[6],
            "sensitivity": row[7],
            "delta_extra": row[8],
        }
    )


OWN_RELEASES_SQL = (
    f"SELECT {EVENT_COLUMNS} FROM releases WHERE analyst = ? ORDER BY recorded_at, query_id"
)
"""One analyst's releases: a search of the ``releases_by_analyst`` index, whose time
grows with that analyst's releases only (``WHERE ? IS NULL OR analyst = ?`` scanned
the whole table)."""


def read_events(connection: sqlite3.Connection, analyst: str | None = None) -> list[PrivacyEvent]:
    """Every recorded release (only ``analyst``'s if given), verification ones included
    (they compose to inf)."""
    if analyst is not None:
        rows = connection.execute(OWN_RELEASES_SQL, (analyst,)).fetchall()
    else:
        rows = connection.execute(
            f"SELECT {EVENT_COLUMNS} FROM releases ORDER BY recorded_at, query_id"
        ).fetchall()
    return [event_from_row(row) for row in rows]


def release_changes(connection: sqlite3.Connection) -> int:
    """How many times any connection has written to ``releases`` (one ``meta`` row kept
    by triggers, :func:`fedpca.owner.ledger_schema.create_or_migrate`)."""
    row = connection.execute(
        "SELECT value FROM meta WHERE key = ?", (RELEASE_CHANGES_KEY,)
    ).fetchone()
    return int(row[0])


def write_task_row(
    connection: sqlite3.Connection,
    query_id: str,
    outcome: TaskOutcome,
    detail: str,
    upload_id: str | None,
    spec_digest: str | None,
    seed: bytes | None = None,
    capacity: int | None = None,
    upload_deadline: float | None = None,
) -> None:
    """Insert or update a task's row, inside the caller's transaction
    (:meth:`fedpca.owner.ledger.BudgetLedger.record_task` says what each column holds)."""
    now = time.time()
    connection.execute(
        "INSERT INTO tasks (query_id, state, detail, upload_id, upload_started, "
        "updated_at, seed, capacity, spec_digest, upload_deadline) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
        "ON CONFLICT (query_id) DO UPDATE SET state = excluded.state, "
        "detail = excluded.detail, "
        "upload_id = COALESCE(excluded.upload_id, tasks.upload_id), "
        "upload_started = MAX(tasks.upload_started, excluded.upload_started), "
        "updated_at = excluded.updated_at, "
        "seed = COALESCE(excluded.seed, tasks.seed), "
        "capacity = COALESCE(excluded.capacity, tasks.capacity), "
        "spec_digest = COALESCE(excluded.spec_digest, tasks.spec_digest), "
        "upload_deadline = COALESCE(excluded.upload_deadline, tasks.upload_deadline)",
        (
            query_id,
            outcome.value,
            detail,
            upload_id,
            # UPLOADING alone does not start it: mark_upload_started does, when the
            # proxy accepted the header, before any chunk may leave.
            int(outcome is TaskOutcome.UPLOADED),
            now,
            seed,
            capacity,
            spec_digest,
            upload_deadline,
        ),
    )


def recorded_relations(ledger: Path) -> set[str]:
    """The neighbouring relations the ledger file's releases were recorded under, read
    without writing (no migration; ``query_only``). A ledger is kept under one relation,
    and a node configured for another declines every query: ``owner init --force`` and
    ``owner probe`` say so first (found by review)."""
    return distinct_values(ledger, "SELECT DISTINCT neighbouring FROM releases")


TASK_STARTS_KEPT_SECONDS = 2 * 24 * 3600.0
"""How long a task's start is kept for ``policy.max_tasks_per_day``: past its 24 hours,
with a day to spare for a clock set back."""


def insert_release(connection: sqlite3.Connection, event: PrivacyEvent, spec_digest: str) -> None:
    """Insert a release's row and its task's start, inside the caller's transaction.

    The start stays when a refund removes the release: the daily task cap counts the
    tasks an owner computed for, so that queries cancelled before anything was sent
    (charged nothing) cannot keep an owner computing without bound. Starts older than
    :data:`TASK_STARTS_KEPT_SECONDS` are dropped here, keeping the table small.
    """
    connection.execute(
        "DELETE FROM task_starts WHERE started_at < ?", (time.time() - TASK_STARTS_KEPT_SECONDS,)
    )
    connection.execute(
        "INSERT OR IGNORE INTO task_starts (query_id, analyst, started_at) VALUES (?, ?, ?)",
        (event.query_id, event.analyst, event.timestamp),
    )
    connection.execute(
        "INSERT INTO releases (query_id, analyst, noise_multiplier, epsilon, delta, "
        "recorded_at, not_private, spec_digest, neighbouring, sensitivity, delta_extra) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            event.query_id,
            event.analyst,
            event.noise_multiplier,
            event.epsilon,
            event.delta,
            event.timestamp,
            int(event.noise_multiplier == 0),
            spec_digest,
            event.neighbouring.value,
            event.sensitivity,
            event.delta_extra,
        ),
    )


REENTERED = "re-entered by `fedpca owner import-releases` from the proxy's export"
"""The detail of the task row of a release re-entered after a restore."""


def reenter_release(
    connection: sqlite3.Connection,
    event: PrivacyEvent,
    digest: str,
    done: Reentered,
    *,
    dry_run: bool,
    chargeable: bool = True,
) -> None:
    """One release of :meth:`fedpca.owner.ledger.BudgetLedger.reenter`, inside its
    transaction: charged if missing (and ``chargeable``), its task marked begun if
    held or charged; recorded in ``done``.

    Raises
    ------
    ConfigError
        The ledger holds the same signed query under another task id: a node answers
        a query once, whatever its task id, so an export listing it again would charge
        it twice (found by review: one query under 300 ids drained a budget).
    """
    query_id = event.query_id
    other = connection.execute(
        "SELECT query_id FROM releases WHERE spec_digest = ? AND query_id != ?",
        (digest, query_id),
    ).fetchone()
    if other is not None:
        raise ConfigError(
            f"release {query_id!r} is the query this ledger holds as {other[0]!r}: a "
            "signed query is answered once, whatever its task id; nothing was re-entered"
        )
    known = connection.execute("SELECT 1 FROM releases WHERE query_id = ?", (query_id,))
    task = connection.execute(
        "SELECT upload_started FROM tasks WHERE query_id = ?", (query_id,)
    ).fetchone()
    if known.fetchone() is None:
        if not chargeable:
            done.left_out.append(query_id)
            return
        done.entered.append(query_id)
        if not dry_run:
            insert_release(connection, event, digest)
    else:
        done.already_recorded.append(query_id)
        if task is None or not task[0]:
            done.kept_charged.append(query_id)
    if not dry_run:
        connection.execute(
            "INSERT INTO tasks (query_id, state, detail, upload_started, updated_at, "
            "spec_digest) VALUES (?, ?, ?, 1, ?, ?) "
            "ON CONFLICT (query_id) DO UPDATE SET upload_started = 1, "
            # A task held as reserved is final now, abandoned (its upload began, as the
            # proxy shows, and cannot go on from here): left open, a proxy delivering it
            # again had it answered with a new share (review). One uploading resumes
            # its own upload, the same share.
            "state = CASE WHEN state = ? THEN ? ELSE state END, "
            "detail = CASE WHEN state = ? THEN excluded.detail ELSE detail END",
            (
                query_id,
                TaskOutcome.UPLOADED.value,
                REENTERED,
                time.time(),
                digest,
                TaskOutcome.RESERVED.value,
                TaskOutcome.ABANDONED.value,
                TaskOutcome.RESERVED.value,
            ),
        )
