"""A proxy whose database cannot be written for a while (locked by another process past
the busy timeout, disk full, read-only, I/O errors) answers UNAVAILABLE, not INTERNAL.

Found by review with real processes: another process held the proxy's database for 35 s
(longer than its 30 s busy timeout) while an owner streamed the chunks of an upload whose
header had been accepted and made it a contributor. The fold failed with "database is
locked", the proxy answered INTERNAL, and the owner took that as a final refusal
(REJECTED, its kept share deleted): the upload never resumed, the query waited for it
until its deadline and failed with every ledger charged.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpca.codec import CryptoPool
from fedpca.messages import QueryState
from fedpca.owner.ledger import owner_ledger
from fedpca.owner.ledger_records import TaskOutcome
from fedpca.proxy.store_database import storage_unavailable
from helpers import sqlite_error, wait_until
from inprocess import deployment, labelled, unit_box_queries

M = 6


def test_only_storage_errors_count_as_unavailable(tmp_path: Path) -> None:
    assert storage_unavailable(sqlite_error(tmp_path, "locked"))
    assert storage_unavailable(sqlite_error(tmp_path, "full"))
    connection = sqlite3.connect(":memory:")
    with pytest.raises(sqlite3.OperationalError) as bug:
        connection.execute("SELECT * FROM no_such_table")
    assert not storage_unavailable(bug.value)  # a bug, not the storage
    assert not storage_unavailable(ValueError("database is locked"))


@pytest.mark.parametrize("kind", ["locked", "full"])
def test_an_upload_whose_fold_meets_an_unavailable_database_resumes(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
) -> None:
    public_key, _ = test_only_keypair_512
    error = sqlite_error(tmp_path, kind)
    tables = {"owner-1": labelled(np.random.default_rng(1).uniform(-0.3, 0.3, size=(30, M)))}
    spec = unit_box_queries(M)(public_key, "locked", quorum=1, deadline_seconds=20.0)
    with deployment(
        workdir=tmp_path / "run", tables=tables, pool=pool, public_key=public_key
    ) as running:
        assert running.proxy is not None
        store = running.proxy.coordinator.store
        fold = store.fold_chunk
        failures = [0]

        def fold_once_unavailable(*args: Any, **kwargs: Any) -> Any:
            if failures[0] == 0:  # the first fold: the owner has joined, the query is fixed
                failures[0] += 1
                raise error
            return fold(*args, **kwargs)

        monkeypatch.setattr(store, "fold_chunk", fold_once_unavailable)
        outcome = running.run(spec, timeout=60.0)
        assert failures[0] == 1
        assert (outcome.state, outcome.owners_contributed) == (QueryState.DONE.value, 1), outcome
        ledger = owner_ledger(running.nodes["owner-1"].config)
        wait_until(
            lambda: (
                (record := ledger.task("alice/locked")) is not None
                and record.outcome is TaskOutcome.UPLOADED
            ),
            "the owner's upload recorded as uploaded",
        )
        assert [e.event.query_id for e in ledger.events()] == ["alice/locked"]


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_damaged_database_is_named_at_start(tmp_path: Path, damage: str) -> None:
    """Found by review: a damaged proxy database or owner ledger (random bytes, or the
    file cut short) stopped ``serve`` with a raw ``sqlite3.DatabaseError`` traceback.
    Now it is a ConfigError naming the file and the way out (restore a backup)."""
    from fedpca.errors import ConfigError
    from fedpca.owner.ledger import BudgetLedger
    from fedpca.proxy.store import ProxyStore

    proxy_path, ledger_path = tmp_path / "proxy.sqlite3", tmp_path / "ledger.sqlite3"
    ProxyStore(proxy_path).close()
    BudgetLedger(ledger_path)
    for path in (proxy_path, ledger_path):
        data = path.read_bytes()
        damaged = np.random.default_rng(0).bytes(len(data)) if damage == "garbage" else data[:4096]
        path.write_bytes(damaged)
        for extra in ("-wal", "-shm"):
            path.with_name(path.name + extra).unlink(missing_ok=True)
    with pytest.raises(ConfigError, match=r"cannot use the proxy database .*restore it"):
        ProxyStore(proxy_path)
    with pytest.raises(ConfigError, match=r"cannot use the budget ledger .*restore it"):
        BudgetLedger(ledger_path)


def test_a_new_empty_proxy_database_is_announced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: a typo in ``[proxy] database`` silently started the proxy on a
    new, empty file, every analyst's budget spent forgotten. Creating one now logs a
    warning naming the file; reopening an existing one does not (the owner's ledger:
    test_owner_node.py::test_a_new_empty_ledger_is_announced)."""
    from fedpca.proxy.store import ProxyStore

    path = tmp_path / "stat" / "proxy.sqlite3"
    with caplog.at_level("WARNING"):
        ProxyStore(path).close()
    assert f"created a new, empty proxy database {path}" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        ProxyStore(path).close()
    assert "created a new" not in caplog.text


def test_the_last_pages_a_locked_database_held_back_are_made_final_by_the_timer(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: after the last fold committed, making the last pages final met
    a locked database; the owner's retry found every chunk folded, nothing tried the
    step again, and the query failed at its deadline, charged. The serving proxy's
    timer now tries it again."""
    public_key, _ = test_only_keypair_512
    error = sqlite_error(tmp_path, "locked")
    tables = {"owner-1": labelled(np.random.default_rng(1).uniform(-0.3, 0.3, size=(30, M)))}
    spec = unit_box_queries(M)(public_key, "lastpages", quorum=1, deadline_seconds=60.0)
    with deployment(
        workdir=tmp_path / "run", tables=tables, pool=pool, public_key=public_key
    ) as running:
        assert running.proxy is not None
        store = running.proxy.coordinator.store
        finalize = store.finalize_pages
        failures = [0]

        def locked_when_finishing(query_id: str, total: int, *args: Any, **kwargs: Any) -> Any:
            if not failures[0] and store.aggregated_through(query_id) >= total:
                failures[0] += 1
                raise error
            return finalize(query_id, total, *args, **kwargs)

        monkeypatch.setattr(store, "finalize_pages", locked_when_finishing)
        outcome = running.run(spec, timeout=30.0)  # well before the query's deadline
        assert failures[0] == 1
        assert (outcome.state, outcome.owners_contributed) == (QueryState.DONE.value, 1), outcome
