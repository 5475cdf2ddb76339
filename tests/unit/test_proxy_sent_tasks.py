"""What one owner's task stream sends: each open task once, each closed one reported once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from fedpca.proxy.owner_tasks import SentTasks


def _tasks(*keys: str) -> list[Any]:
    return [SimpleNamespace(key=key) for key in keys]


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
