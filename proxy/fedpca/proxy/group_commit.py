"""Group commit: concurrent writes share one SQLite transaction, hence one fsync.

Every chunk an owner uploads is acknowledged only once it is durable (the proxy's
store runs with ``synchronous=FULL``), and one fsync per chunk would cap the proxy at
the disk's sync rate whatever the CPU could fold. With many owners uploading at once
their chunks arrive together: the first writer to find no transaction running becomes
the *leader*, takes every operation queued so far (its own and those of the writers
waiting behind it), runs each in a savepoint of one transaction and commits once;
the waiting writers return when that commit is on disk. Operations arriving during
the commit form the next group. One failing operation rolls back to its own
savepoint and fails alone.

No thread of its own: a leader is always a caller, so nothing runs when nothing is
written.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

__all__ = ["GroupCommit", "GroupCommitStats"]

_T = TypeVar("_T")


@dataclass
class _Pending(Generic[_T]):
    operation: Callable[[sqlite3.Connection], _T]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


@dataclass
class GroupCommitStats:
    """How many operations and commits went through (for benchmarks and logs)."""

    operations: int = 0
    commits: int = 0


class GroupCommit:
    """Runs write operations in shared transactions.

    Parameters
    ----------
    transaction : opens one write transaction on the store's connection (committed
        when the block ends without error, rolled back otherwise).
    enabled : False runs every operation in a transaction of its own (one fsync per
        operation; benchmarks compare the two).
    """

    def __init__(
        self,
        transaction: Callable[[], AbstractContextManager[sqlite3.Connection]],
        *,
        enabled: bool = True,
    ) -> None:
        self._transaction = transaction
        self._enabled = enabled
        self._lock = threading.Condition()
        self._queue: list[_Pending[Any]] = []
        self._leading = False
        self.stats = GroupCommitStats()

    def run(self, operation: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``operation(conn)`` inside a transaction and return once it is durable.

        Raises whatever ``operation`` raised (its writes are then rolled back), or the
        commit's error.
        """
        pending: _Pending[_T] = _Pending(operation)
        if not self._enabled:
            self._execute([pending])
        else:
            with self._lock:
                self._queue.append(pending)
            self._lead_or_wait(pending)
        if pending.error is not None:
            raise pending.error
        return pending.result

    def _lead_or_wait(self, pending: _Pending[Any]) -> None:
        """Commit groups while leading, until ``pending`` is done; else wait for it.

        A leader leads only until its own operation is durable, then hands over to a
        waiting writer, so no caller is kept serving others for ever.
        """
        while True:
            with self._lock:
                while not pending.done.is_set() and self._leading:
                    self._lock.wait()
                if pending.done.is_set():
                    return
                self._leading = True
                batch, self._queue = self._queue, []
            try:
                self._execute(batch)
            finally:
                with self._lock:
                    self._leading = False
                    self._lock.notify_all()

    def _execute(self, batch: list[_Pending[Any]]) -> None:
        try:
            with self._transaction() as conn:
                for index, pending in enumerate(batch):
                    savepoint = f"op{index}"
                    conn.execute(f"SAVEPOINT {savepoint}")
                    try:
                        pending.result = pending.operation(conn)
                    except BaseException as exc:
                        conn.execute(f"ROLLBACK TO {savepoint}")
                        pending.error = exc
                    conn.execute(f"RELEASE {savepoint}")
        except BaseException as exc:  # the commit itself failed: nothing is durable
            for pending in batch:
                if pending.error is None:
                    pending.error = exc
        with self._lock:
            self.stats.operations += len(batch)
            self.stats.commits += 1
        for pending in batch:
            pending.done.set()
