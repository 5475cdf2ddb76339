"""The owners' side of the coordinator: the task feed each owner's stream reads, the
withdrawal of tasks that closed, and declines."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from fedpca.errors import (
    NotFoundError,
)
from fedpca.formatting import printable
from fedpca.messages import (
    MAX_DECLINE_DETAIL,
    QueryState,
    Task,
    TaskCancellation,
)
from fedpca.proxy.config import ProxyConfig
from fedpca.proxy.coordinator_core import CoordinatorCore
from fedpca.query import QuerySpec

__all__ = ["OwnerTasks", "SentTasks"]

logger = logging.getLogger("fedpca.proxy.coordinator")


@dataclass(frozen=True)
class _OpenQuery:
    task: Task
    deadline_at: float
    answered: frozenset[str]
    """Owners that uploaded to or declined the query."""


def _one_line(text: str) -> str:
    """A peer-supplied text as one bounded log/status line (no forged line breaks, no
    terminal control characters)."""
    cleaned = printable(" ".join(text.split()))
    if len(cleaned) > MAX_DECLINE_DETAIL:
        cleaned = cleaned[: MAX_DECLINE_DETAIL - 3] + "..."
    return cleaned


ANSWERED_WATCH_SECONDS = 60.0
"""How long past its upload deadline an answered task's query is watched for a failure
(:meth:`SentTasks.failed`): a query whose contributors are late fails at its deadline."""


class SentTasks:
    """The tasks one owner's stream has sent that were still open when last seen.

    The stream sends each open task once; a task it sent that is no longer open (the
    owner answered it, or the query closed) is reported once, so that the stream can
    tell the owner whether it was withdrawn.
    """

    def __init__(self, sent: Iterable[Task] = ()) -> None:
        self._deadlines = {task.key: task.upload_deadline.timestamp() for task in sent}
        # Closed tasks the owner answered (it contributes, or declined: withdrawn too
        # should the query fail, which costs that owner one ledger read), until their
        # deadline and a minute: their query may still fail (:meth:`failed`).
        self._answered: dict[str, float] = {}

    def unsent(self, open_tasks: Sequence[Task]) -> list[Task]:
        """The open tasks not sent yet, now counted as sent."""
        fresh = [task for task in open_tasks if task.key not in self._deadlines]
        self._deadlines.update((task.key, task.upload_deadline.timestamp()) for task in fresh)
        return fresh

    def closed(self, open_tasks: Sequence[Task]) -> list[str]:
        """Keys of sent tasks that are no longer open, each reported once."""
        open_keys = {task.key for task in open_tasks}
        gone = sorted(set(self._deadlines) - open_keys)
        for key in gone:
            self._answered[key] = self._deadlines.pop(key) + ANSWERED_WATCH_SECONDS
        return gone

    def withdrawn(self, keys: Iterable[str]) -> None:
        """Closed tasks the owner was told are withdrawn: nothing more to watch."""
        for key in keys:
            self._answered.pop(key, None)

    def failed(self, failure_of: Callable[[str], str | None], now: float) -> list[TaskCancellation]:
        """Withdrawals of answered tasks whose query has failed since (``failure_of``
        gives the reason, or None), each once; tasks past their watch are dropped.

        An owner uploading to a query that failed went on encrypting until its next
        chunk was refused: 18 to 60 s of its CPU in an operator's walkthrough (stop 42).
        """
        cancellations = []
        for key, until in list(self._answered.items()):
            reason = failure_of(key)
            if reason is not None:
                cancellations.append(TaskCancellation.failed(key, reason))
            if reason is not None or until < now:
                del self._answered[key]
        return cancellations


class OwnerTasks(CoordinatorCore):
    """Tasks offered to owners, their withdrawal, and owners' declines."""

    _snapshot: tuple[int, list[_OpenQuery]] | None = None
    """The COLLECTING queries as last read, with the change version they were read at."""

    def tasks_for(self, owner_id: str) -> list[QuerySpec]:
        """COLLECTING queries this owner has neither uploaded to nor declined."""
        return [task.query for task in self.pending_tasks(owner_id)]

    def _open_queries(self) -> list[_OpenQuery]:
        """The COLLECTING queries with who answered them, read once per change.

        Every owner's task stream asks after every change; one read of the store per
        change serves them all (a thousand streams would otherwise read it a thousand
        times).
        """
        version = self.version
        with self._lock:
            if self._snapshot is not None and self._snapshot[0] == version:
                return self._snapshot[1]
        snapshot = []
        allowed = self.config.analysts.allowed
        for record in self.store.queries(QueryState.COLLECTING):
            if allowed is not None and record.analyst_id not in allowed:
                # Its analyst was taken off [analysts] allowed: owners no longer spend
                # budget on it; it ends at its deadline (review).
                continue
            answered = self.store.answered_owners(record.query_id)
            task = Task(
                query=self._context(record.query_id).spec,
                upload_deadline=datetime.fromtimestamp(record.deadline_at, UTC),
                query_signature=record.signature,
                query_signer=record.signer,
                task_id=record.query_id,
            )
            snapshot.append(_OpenQuery(task, record.deadline_at, frozenset(answered)))
        with self._lock:
            self._snapshot = (version, snapshot)
        return snapshot

    def pending_tasks(self, owner_id: str) -> list[Task]:
        """:meth:`tasks_for` with each query's upload deadline, ready for the task stream.

        Each task carries its task id and the analyst's signature, forwarded unchanged.
        """
        if owner_id not in self.registered_owners:
            return []
        now = self.clock()
        return [
            open_query.task
            for open_query in self._open_queries()
            if open_query.deadline_at > now and owner_id not in open_query.answered
        ]

    def in_flight_answers(
        self, owner_id: str, query_ids: Sequence[str]
    ) -> list[Task | TaskCancellation]:
        """What the uploads an owner reports in flight (when its stream opens) call for.

        The task again when the query still takes that upload, so that it resumes (this
        owner is one of its contributors while it collects or aggregates) or is
        confirmed (its upload was accepted before the owner recorded it); nothing for a
        query that still collects and offers the task anyway; otherwise a withdrawal
        (the query is done or failed, closed to this owner, past its deadline, or
        unknown here), so that the owner ends the upload and deletes the share it keeps.
        """
        if owner_id not in self.registered_owners:
            return []
        now = self.clock()
        answers: list[Task | TaskCancellation] = []
        # One reason for every withdrawal: an owner may name any task id here, and learns
        # no more of a query than whether its own upload can go on.
        ended = "this upload can no longer go on at this proxy"
        for query_id in query_ids:
            try:
                record = self.store.query(query_id)
            except NotFoundError:
                answers.append(TaskCancellation(query_id, ended))
                continue
            accepted = self.store.has_upload(query_id, owner_id)
            joined = self.store.contributor(query_id, owner_id) is not None
            running = record.state in (QueryState.COLLECTING, QueryState.AGGREGATING)
            if accepted or (joined and running):
                answers.append(
                    Task(
                        query=self._context(query_id).spec,
                        upload_deadline=datetime.fromtimestamp(record.deadline_at, UTC),
                        query_signature=record.signature,
                        query_signer=record.signer,
                        task_id=query_id,
                    )
                )
            elif record.state is QueryState.COLLECTING and record.deadline_at > now:
                continue
            else:
                answers.append(TaskCancellation(query_id, ended))
        return answers

    def withdrawn_tasks(self, owner_id: str, query_ids: Sequence[str]) -> list[TaskCancellation]:
        """Cancellations for delivered tasks the owner should no longer answer.

        A task is withdrawn when its query stopped collecting (quorum reached,
        failed, done) or its deadline passed before this owner answered. A task the
        owner declined is never withdrawn, nor one it contributes to (its upload
        complete or not) unless the query failed: its upload can no longer be taken.
        """
        now = self.clock()
        cancellations = []
        for query_id in query_ids:
            try:
                record = self.store.query(query_id)
            except NotFoundError:
                continue
            # A contributor keeps its task while its upload may still stream in (or
            # resume after a restart of either side); once the query failed it is told
            # at once, so that it stops encrypting (it went on until its next chunk was
            # refused: 18 to 60 s of owners' CPU in an operator's walkthrough, stop 42).
            if self.store.has_declined(query_id, owner_id) or (
                record.state is not QueryState.FAILED
                and self.store.contributor(query_id, owner_id) is not None
            ):
                continue
            if record.state is QueryState.FAILED:
                cancellations.append(TaskCancellation.failed(query_id, record.failure_reason))
            elif record.state is not QueryState.COLLECTING:
                cancellations.append(
                    TaskCancellation(query_id, "uploads are closed (the quorum was reached)")
                )
            elif record.deadline_at <= now:
                cancellations.append(TaskCancellation(query_id, "the upload deadline has passed"))
        return cancellations

    def decline(self, owner_id: str, query_id: str, reason: str, detail: str = "") -> None:
        """Record an owner's refusal of a task (it is not offered again).

        Accepted only from an allowed owner while the query collects and before that
        owner uploaded; a repeated decline is acknowledged and changes nothing. The
        detail is cut to one line of at most
        :data:`~fedpca.messages.MAX_DECLINE_DETAIL` characters. When the declines
        leave fewer owners than the quorum, the query fails at once (the declines are
        public, so failing early releases nothing new) instead of at its deadline.

        Raises
        ------
        AuthenticationError, NotFoundError, QueryStateError
        """
        self.require_owner(owner_id)
        if (
            self.store.has_declined(query_id, owner_id)
            and self.store.query(query_id).state is QueryState.COLLECTING
        ):
            return  # repeated while it collects: reads, no write transaction (stop 42)
        line = _one_line(detail)
        if not self.store.record_decline(
            query_id, owner_id, f"{reason}: {line}" if line else reason
        ):
            return  # declined before: nothing new to say or to check
        logger.info("query %s: owner %s declined (%s)", query_id, owner_id, reason)
        self._fail_if_quorum_unreachable(query_id)
        self._notify()

    def reconfigure(self, config: ProxyConfig) -> None:
        """Serve with ``config`` from now on (a reload: its allow-lists and revoked
        certificates, checked by :func:`~fedpca.proxy.config.reload_changes`).

        Every stream is woken: each checks its peer against the new lists and ends
        if it is no longer accepted, and the owners' tasks are read again (an analyst
        taken off its list no longer has its queries handed out). A collecting query
        whose quorum the owners left can no longer reach fails at once, as at a
        restart: left collecting, the first upload of a remaining owner fixed its charge
        and its deadline failed it with nothing released (found by review).
        """
        self.config = config
        self._notify()
        for record in self.store.queries(QueryState.COLLECTING):
            self._fail_if_quorum_unreachable(record.query_id)

    def _fail_if_quorum_unreachable(self, query_id: str) -> bool:
        """Fail a collecting query that too few owners are left to reach its quorum;
        whether it did. Also called at start (:meth:`Coordinator.recover`): a process
        stopped between a decline's commit and this check left the query collecting
        to its deadline, where an owner's upload made it fail charged (found by review)."""
        record = self.store.query(query_id)
        if record.state is not QueryState.COLLECTING:
            return False
        quorum = record.quorum
        declines = self.store.declines(query_id)
        available = len(self.registered_owners - set(declines))
        if available >= quorum:
            return False
        listed = "; ".join(f"{owner}: {why}" for owner, why in sorted(declines.items()))
        reason = f"the quorum of {quorum} can no longer be reached: " + (
            f"{len(declines)} of {len(self.registered_owners)} owners declined ({listed})"
            if declines  # else the allow-list shrank below the quorum across a restart
            else f"the proxy now accepts {len(self.registered_owners)} owner(s)"
        )
        self._fail(query_id, reason)
        return True
