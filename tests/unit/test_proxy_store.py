"""The proxy's SQLite store: atomic folds, idempotent uploads, replay refusal, durability."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fedpca.errors import NotFoundError, ProtocolError, QueryStateError
from fedpca.proxy.store import ProxyStore, QueryState


def concat_fold(name: str, current: bytes | None, upload: bytes) -> bytes:
    """A stand-in for homomorphic addition that makes every fold visible."""
    return (current or b"") + b"|" + upload


@pytest.fixture
def store(tmp_path: Path) -> ProxyStore:
    s = ProxyStore(tmp_path / "proxy.sqlite3")
    s.create_query("q1", "alice", {"k": 1}, {"blocks": []}, deadline_at=1e12)
    return s


def test_upload_is_folded_once_and_retry_is_duplicate(store: ProxyStore) -> None:
    first = store.accept_upload("q1", "o1", "u1", "h1", {"scatter": b"A"}, 1, concat_fold)
    retry = store.accept_upload("q1", "o1", "u1", "h1", {"scatter": b"A"}, 1, concat_fold)
    assert (first.duplicate, first.n_contributed) == (False, 1)
    assert (retry.duplicate, retry.n_contributed) == (True, 1)
    assert store.aggregate("q1") == {"scatter": b"|A"}
    assert store.query("q1").n_contributed == 1


def test_second_different_upload_from_same_owner_is_refused(store: ProxyStore) -> None:
    store.accept_upload("q1", "o1", "u1", "h1", {"scatter": b"A"}, 1, concat_fold)
    with pytest.raises(ProtocolError, match="different upload"):
        store.accept_upload("q1", "o1", "u2", "h2", {"scatter": b"B"}, 1, concat_fold)
    assert store.aggregate("q1") == {"scatter": b"|A"}


def test_replay_into_another_query_is_refused(store: ProxyStore) -> None:
    store.create_query("q2", "alice", {"k": 2}, {"blocks": []}, deadline_at=1e12)
    store.accept_upload("q1", "o1", "u1", "h1", {"scatter": b"A"}, 1, concat_fold)
    with pytest.raises(ProtocolError, match="replayed"):
        store.accept_upload("q2", "o1", "u9", "h1", {"scatter": b"A"}, 1, concat_fold)
    assert store.aggregate("q2") == {}
    assert store.query("q2").n_contributed == 0


def test_failed_fold_leaves_state_untouched(store: ProxyStore) -> None:
    store.accept_upload("q1", "o1", "u1", "h1", {"scatter": b"A"}, 1, concat_fold)

    def broken(name: str, current: bytes | None, upload: bytes) -> bytes:
        if name == "sum":
            raise RuntimeError("boom in the middle of a multi-block fold")
        return concat_fold(name, current, upload)

    with pytest.raises(RuntimeError):
        store.accept_upload("q1", "o2", "u2", "h2", {"scatter": b"B", "sum": b"b"}, 2, broken)
    assert store.aggregate("q1") == {"scatter": b"|A"}
    assert [u.owner_id for u in store.uploads("q1")] == ["o1"]
    assert store.query("q1").n_contributed == 1


def test_late_upload_to_finished_query_is_refused(store: ProxyStore) -> None:
    store.set_state("q1", QueryState.NOISING, expect=(QueryState.COLLECTING,))
    with pytest.raises(QueryStateError, match="no longer accepted"):
        store.accept_upload("q1", "o1", "u1", "h1", {"scatter": b"A"}, 1, concat_fold)


def test_result_is_stored_once_and_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "p.sqlite3"
    s = ProxyStore(path)
    s.create_query("q", "alice", {}, {}, deadline_at=1e12)
    s.accept_upload("q", "o1", "u1", "h1", {"scatter": b"A"}, 1, concat_fold)
    s.set_state("q", QueryState.NOISING, expect=(QueryState.COLLECTING,))
    s.store_result("q", {"scatter": b"noised"}, {"n_owners": 1})
    with pytest.raises(QueryStateError):
        s.store_result("q", {"scatter": b"again"}, {"n_owners": 1})
    s.close()
    reopened = ProxyStore(path)
    blocks, meta = reopened.result("q")
    assert blocks == {"scatter": b"noised"} and meta == {"n_owners": 1}
    assert reopened.query("q").state is QueryState.DONE


def test_unknown_query_and_conflicting_resubmission(store: ProxyStore) -> None:
    with pytest.raises(NotFoundError):
        store.query("nope")
    with pytest.raises(NotFoundError):
        store.accept_upload("nope", "o1", "u", "h", {"s": b""}, 0, concat_fold)
    assert store.create_query("q1", "alice", {"k": 1}, {"blocks": []}, 1e12).query_id == "q1"
    with pytest.raises(ProtocolError, match="different spec"):
        store.create_query("q1", "alice", {"k": 2}, {"blocks": []}, 1e12)


def test_before_insert_runs_in_the_same_transaction(store: ProxyStore) -> None:
    def refuse(conn: sqlite3.Connection) -> None:
        raise PermissionError("over budget")

    with pytest.raises(PermissionError):
        store.create_query("q3", "alice", {}, {}, 1e12, before_insert=refuse)
    with pytest.raises(NotFoundError):
        store.query("q3")


def test_wal_mode_is_on(store: ProxyStore) -> None:
    conn = sqlite3.connect(str(store.path))
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_before_fold_sees_the_count_and_can_refuse_inside_the_transaction(
    store: ProxyStore,
) -> None:
    seen: list[int] = []

    def at_most_one(n_contributed: int) -> None:
        seen.append(n_contributed)
        if n_contributed >= 1:
            raise QueryStateError("full")

    store.accept_upload(
        "q1", "o1", "u1", "h1", {"scatter": b"A"}, 1, concat_fold, before_fold=at_most_one
    )
    with pytest.raises(QueryStateError, match="full"):
        store.accept_upload(
            "q1", "o2", "u2", "h2", {"scatter": b"B"}, 1, concat_fold, before_fold=at_most_one
        )
    assert seen == [0, 1]
    assert store.aggregate("q1") == {"scatter": b"|A"}
    assert [u.owner_id for u in store.uploads("q1")] == ["o1"]
    # A retry of the accepted upload is a duplicate, not refused by the hook.
    retry = store.accept_upload(
        "q1", "o1", "u1", "h1", {"scatter": b"A"}, 1, concat_fold, before_fold=at_most_one
    )
    assert retry.duplicate and seen == [0, 1]
