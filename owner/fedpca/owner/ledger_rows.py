"""Reading releases from the owner's budget ledger database (:mod:`fedpca.owner.ledger`):
rows to :class:`~fedpca.dp.mechanisms.PrivacyEvent`, every analyst's or one analyst's."""

from __future__ import annotations

import sqlite3

from fedpca.dp.mechanisms import PrivacyEvent
from fedpca.owner.ledger_schema import RELEASE_CHANGES_KEY

__all__ = ["EVENT_COLUMNS", "OWN_RELEASES_SQL", "event_from_row", "read_events", "release_changes"]

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
