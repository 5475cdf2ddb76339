"""Reads of the owner's budget ledger about single tasks: how each ended, which are
still open, the digest a task was reserved or declined under.

:class:`LedgerTaskReads` is a part of :class:`fedpca.owner.ledger.BudgetLedger`, which
owns the connection; every write, and every read that decides a reservation, stays
there.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager

from fedpca.owner.ledger_records import TaskOutcome, TaskRecord

__all__ = ["LedgerTaskReads"]


_OPEN = "(state = ? AND upload_id IS NOT NULL OR state = ?)"
"""A task left open: an upload in flight, or reserved before one began (its parameters
are :data:`_OPEN_STATES`)."""
_OPEN_STATES = (TaskOutcome.UPLOADING.value, TaskOutcome.RESERVED.value)


class LedgerTaskReads:
    """Task reads of :class:`~fedpca.owner.ledger.BudgetLedger`."""

    _connect: Callable[[], AbstractContextManager[sqlite3.Connection]]

    def reserved_digest(self, query_id: str) -> str | None:
        """The signed-query digest ``query_id`` was reserved for (None: not reserved).

        One row by its key: what a resumed upload checks its task against, read in the
        same time whatever else the ledger holds."""
        with self._connect() as connection:
            row = connection.execute(
                "SELECT spec_digest FROM releases WHERE query_id = ?", (query_id,)
            ).fetchone()
        return None if row is None else str(row[0])

    def task(self, query_id: str) -> TaskRecord | None:
        """The recorded state of a task, or None if it was never seen."""
        with self._connect() as connection:
            row = connection.execute(
                "SELECT query_id, state, detail, upload_id, upload_started, updated_at, seed, "
                "capacity FROM tasks WHERE query_id = ?",
                (query_id,),
            ).fetchone()
        if row is None:
            return None
        return TaskRecord(
            row[0],
            TaskOutcome(row[1]),
            row[2],
            row[3],
            bool(row[4]),
            row[5],
            None if row[6] is None else bytes(row[6]),
            row[7],
        )

    def release_outcomes(self) -> dict[str, TaskOutcome]:
        """Query id -> recorded task state of every release that has a task record, in
        one read (a release without one is absent)."""
        with self._connect() as connection:
            rows = connection.execute(
                "SELECT tasks.query_id, tasks.state FROM tasks "
                "JOIN releases ON releases.query_id = tasks.query_id"
            ).fetchall()
        return {query_id: TaskOutcome(state) for query_id, state in rows}

    def uploads_in_flight(self) -> dict[str, str]:
        """Task key -> upload id of the tasks whose upload began and has no outcome yet."""
        with self._connect() as connection:
            rows = connection.execute(
                "SELECT query_id, upload_id FROM tasks WHERE state = ? AND upload_id IS NOT "
                "NULL ORDER BY updated_at DESC",
                (TaskOutcome.UPLOADING.value,),
            ).fetchall()
        return {row[0]: row[1] for row in rows}

    def unfinished_tasks(self) -> list[str]:
        """Task keys a node names when its task stream opens: the uploads in flight and
        the tasks reserved before any upload began (the proxy answers each with the task
        again or a withdrawal), newest first."""
        with self._connect() as connection:
            rows = connection.execute(
                f"SELECT query_id FROM tasks WHERE {_OPEN} ORDER BY updated_at DESC", _OPEN_STATES
            ).fetchall()
        return [str(row[0]) for row in rows]

    def open_task_deadlines(self) -> dict[str, float]:
        """Task key -> upload deadline (POSIX seconds) of the tasks left open (an upload
        in flight, or reserved before one began) whose row keeps one (schema 6 on)."""
        with self._connect() as connection:
            rows = connection.execute(
                "SELECT query_id, upload_deadline FROM tasks WHERE upload_deadline IS NOT "
                f"NULL AND {_OPEN}",
                _OPEN_STATES,
            ).fetchall()
        return {str(row[0]): float(row[1]) for row in rows}

    def answered_under(self, digest: str) -> str | None:
        """The task id the signed query with ``spec_digest`` ``digest`` was reserved or
        declined under, or None (read only: looked up for every arriving task)."""
        with self._connect() as connection:
            row = connection.execute(
                "SELECT query_id FROM releases WHERE spec_digest = ? "
                "UNION ALL SELECT query_id FROM tasks WHERE spec_digest = ? LIMIT 1",
                (digest, digest),
            ).fetchone()
        return None if row is None else str(row[0])

    def has_reservation(self, query_id: str) -> bool:
        """True if a release is reserved under ``query_id`` (read only)."""
        with self._connect() as connection:
            row = connection.execute(
                "SELECT 1 FROM releases WHERE query_id = ? LIMIT 1", (query_id,)
            ).fetchone()
        return row is not None

    def is_handled(self, query_id: str) -> bool:
        """True if the task reached a final outcome (it must not be redone)."""
        record = self.task(query_id)
        return record is not None and record.outcome.final
