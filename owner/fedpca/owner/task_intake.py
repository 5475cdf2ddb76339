"""What an owner does with a task the moment it arrives, before its worker sees it.

The proxy chooses what it sends, and a malicious one sent tasks faster than the node's
one worker could answer them: every task with a new task id was queued in full (up to
the 8 MiB a message may hold) before anything checked it, so 40 unsigned tasks took
1.5 GB, and each declined one left a row in the ledger for ever (10,000 rows in 30 s).
The stream thread therefore decides here, from cheap checks, whether a task is worth
the worker's time and the ledger's space:

* at most :data:`MAX_WAITING_TASKS` tasks wait for the worker; more are dropped with a
  warning (a proxy re-delivers outstanding tasks when the stream opens again). Only
  tasks signed by a pinned analyst, one per signed query, can wait, so an honest load
  stays far below it;
* a task whose query is not signed by a pinned analyst is kept only as its task id and
  the reason (cut to what a decline carries), declined, and not recorded in the ledger;
  so is one without a signing time or signed in the future of its clock; and a task's
  stated upload deadline never extends the signed one (``issued_at +
  deadline_seconds``, plus an allowance for clocks), so a task delivered after it ends
  as expired (no ledger row if the node never saw it): a proxy cannot keep signed
  queries and deliver them later;
* a signed query this node already answered (reserved, or declined) or holds under
  another task id is declined as a replay, also without a ledger row: a proxy that
  replays one signed query under fresh task ids gets no second answer. Reserved and
  declined queries are looked up in the ledger (durable, across restarts); the others
  (expired or cancelled before they were looked at) in a bounded memory of
  :data:`REMEMBERED_QUERIES` digests.

Nothing here depends on the node's records: it reads the task and the ledger only.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from fedpca.errors import PolicyError, UntrustedKeyError
from fedpca.logs import SparseLog
from fedpca.messages import MAX_DECLINE_DETAIL, DeclineReason, Task
from fedpca.owner.policy import check_signature, within_signed_deadline
from fedpca.owner.policy_config import PolicyConfig
from fedpca.query import spec_digest

__all__ = [
    "MAX_WAITING_TASKS",
    "REMEMBERED_QUERIES",
    "RefusedTask",
    "TaskIntake",
]

logger = logging.getLogger(__name__)

MAX_WAITING_TASKS = 256
"""Tasks waiting for the worker at most. An honest proxy has at most each analyst's
open queries outstanding (4 by default, ``limits.max_open_queries_per_analyst``)."""

REMEMBERED_QUERIES = 4096
"""Signed queries (digests) remembered as answered under a task id, newest kept."""


@dataclass(frozen=True)
class RefusedTask:
    """A task to decline without a ledger row: its id, the public reason and the detail
    (cut to :data:`~fedpca.messages.MAX_DECLINE_DETAIL`), without its query."""

    key: str
    reason: DeclineReason
    detail: str


class TaskIntake:
    """Admits arriving tasks for the worker (see the module docstring).

    Parameters
    ----------
    policy : the owner's policy (its pinned query signers).
    answered_under : ledger lookup: the task id a signed query (digest) was reserved or
        declined under, or None.
    """

    def __init__(
        self,
        policy: PolicyConfig,
        answered_under: Callable[[str], str | None],
        *,
        max_waiting: int = MAX_WAITING_TASKS,
        remembered: int = REMEMBERED_QUERIES,
    ) -> None:
        self.policy = policy
        self.answered_under = answered_under
        self.max_waiting = max_waiting
        self.remembered = remembered
        self._lock = threading.Lock()  # admit() on the stream thread, the rest on the worker
        self._answered: OrderedDict[str, str] = OrderedDict()  # digest -> task id
        # While queued: digest -> task id, and task id -> digest (each query hashed once).
        self._waiting_digests: dict[str, str] = {}
        self._waiting: dict[str, str] = {}
        self._dropped = SparseLog()  # tasks dropped (too many waiting)
        self._replays = SparseLog()  # signed queries already answered under another id

    def admit(self, task: Task, waiting: int) -> Task | RefusedTask | None:
        """What to queue for ``task`` (None: nothing), with ``waiting`` tasks queued.

        Called from one thread (the task stream's)."""
        if waiting >= self.max_waiting:
            self._drop(task.key, f"{waiting} tasks already wait for this node's worker; dropped")
            return None
        try:
            check_signature(task, self.policy)
        except UntrustedKeyError as exc:
            return RefusedTask(
                task.key, DeclineReason.UNSIGNED_QUERY, str(exc)[:MAX_DECLINE_DETAIL]
            )
        try:
            task = within_signed_deadline(task, datetime.now(UTC))
        except PolicyError as exc:
            return RefusedTask(
                task.key, DeclineReason.POLICY_REFUSAL, str(exc)[:MAX_DECLINE_DETAIL]
            )
        digest = spec_digest(task.query)
        with self._lock:
            earlier = self._waiting_digests.get(digest) or self._answered.get(digest)
        if earlier is None:
            earlier = self.answered_under(digest)
        if earlier is not None and earlier != task.key:
            detail = (
                f"task {task.key[:80]!r} carries the same signed query as task "
                f"{earlier[:80]!r}; a query is answered once, whatever task id it comes under"
            )
            if self._replays.due():  # a proxy may replay at will: logged sparingly
                logger.warning("%s (%d replay(s) so far)", detail, self._replays.count)
            return RefusedTask(task.key, DeclineReason.POLICY_REFUSAL, detail)
        with self._lock:
            self._waiting_digests[digest] = task.key
            self._waiting[task.key] = digest
        return task

    def done(self, task: Task) -> None:
        """The worker finished ``task`` (answered, or gave up until a re-delivery)."""
        with self._lock:
            digest = self._waiting.pop(task.key, None)
            if digest is not None and self._waiting_digests.get(digest) == task.key:
                del self._waiting_digests[digest]

    def answered(self, task: Task) -> None:
        """``task`` was declined or its budget reserved: a replay is dropped."""
        with self._lock:
            digest = self._waiting.get(task.key) or spec_digest(task.query)
            self._answered[digest] = task.key
            self._answered.move_to_end(digest)
            while len(self._answered) > self.remembered:
                self._answered.popitem(last=False)

    @property
    def dropped(self) -> int:
        """Tasks dropped so far (too many waiting)."""
        return self._dropped.count

    def _drop(self, key: str, why: str) -> None:
        # Logged for the first drop and then sparingly: a flood must not flood the log.
        if self._dropped.due():
            logger.warning("task %s: %s (%d task(s) dropped so far)", key[:80], why, self.dropped)
