"""What one owner's task stream sends: each open task once, each closed one reported once,
and a withdrawal of an answered one whose query failed since."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from fedpca.proxy.owner_tasks import ANSWERED_WATCH_SECONDS, SentTasks

DEADLINE = 1_000.0


def _tasks(*keys: str) -> list[Any]:
    due = datetime.fromtimestamp(DEADLINE, UTC)
    return [SimpleNamespace(key=key, upload_deadline=due) for key in keys]


def test_each_open_task_is_sent_once_and_each_closed_one_reported_once() -> None:
    sent = SentTasks(_tasks("a"))  # sent when the stream opened
    assert [task.key for task in sent.unsent(_tasks("a", "b"))] == ["b"]
    assert sent.closed(_tasks("a", "b")) == []
    assert sent.unsent(_tasks("a", "b")) == []
    # "a" was answered or its query closed: reported once, then forgotten.
    assert sent.closed(_tasks("b")) == ["a"]
    assert sent.closed(_tasks("b")) == []
    # Every task gone at once: reported in a stable order.
    sent.unsent(_tasks("c"))
    assert sent.closed([]) == ["b", "c"]
    # A task that reopens under a key already reported is a new task to send.
    assert [task.key for task in sent.unsent(_tasks("a"))] == ["a"]


def test_an_answered_task_whose_query_fails_later_is_withdrawn_once() -> None:
    """An operator's walkthrough (stop 42): an owner uploading to a query that then
    failed was never told, and encrypted on until its next chunk was refused."""
    failures: dict[str, str] = {}
    sent = SentTasks(_tasks("a", "b", "c"))
    assert sent.closed([]) == ["a", "b", "c"]
    sent.withdrawn(["c"])  # told at once: not watched
    assert sent.failed(failures.get, DEADLINE) == []
    failures.update(a="deadline passed", c="cancelled by the analyst")
    (told,) = sent.failed(failures.get, DEADLINE)
    assert (told.query_id, told.reason) == ("a", "query failed: deadline passed")
    assert sent.failed(failures.get, DEADLINE) == []  # once
    # "b" is watched until its deadline and a minute, then forgotten.
    failures["b"] = "late"
    later = DEADLINE + ANSWERED_WATCH_SECONDS + 1
    assert sent.failed(lambda key: None, later) == []
    assert sent.failed(failures.get, later) == []
