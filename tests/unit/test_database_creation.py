"""A new database (the proxy's store, an owner's budget ledger) is created whole or not
at all (fedpca.files.create_database).

A process killed while it made the tables of a new database left a file that SQLite
had begun (its header written) with no tables in it; every later start refused that
file as "an SQLite file with no tables" (rightly: it cannot be told from a backup of
the wrong path), and the operator had to delete it by hand.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fedpca.files import create_database
from fedpca.owner.ledger import BudgetLedger
from fedpca.proxy.store import ProxyStore

# The child is killed (SIGKILL: no handler, no finally) at the first CREATE TABLE of
# any connection it opens, i.e. while the new database's tables are being made.
_KILLED_AT_FIRST_TABLE = textwrap.dedent(
    """
    import os, signal, sqlite3, sys

    _connect = sqlite3.connect

    def _kill_at_create(statement):
        if statement.lstrip().upper().startswith("CREATE TABLE"):
            os.kill(os.getpid(), signal.SIGKILL)

    def connect(*args, **kwargs):
        connection = _connect(*args, **kwargs)
        connection.set_trace_callback(_kill_at_create)
        return connection

    sqlite3.connect = connect
    path = sys.argv[2]
    if sys.argv[1] == "proxy":
        from fedpca.proxy.store import ProxyStore
        ProxyStore(path)
    else:
        from fedpca.owner.ledger import BudgetLedger
        BudgetLedger(path)
    """
)


@pytest.mark.parametrize("role", ["proxy", "owner"])
def test_a_process_killed_while_making_a_new_database_leaves_none(
    tmp_path: Path, role: str
) -> None:
    path = tmp_path / "state" / "database.sqlite3"
    path.parent.mkdir()
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_AT_FIRST_TABLE, role, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    # Nothing at the path, or nothing SQLite would take for a database (zero bytes):
    # either way the next start makes a new one instead of refusing a table-less file.
    assert not path.exists() or path.stat().st_size == 0
    if role == "proxy":
        store = ProxyStore(path)
        assert store.queries() == []
        store.close()
    else:
        ledger = BudgetLedger(path)
        assert ledger.events() == []
    with sqlite3.connect(path) as check:
        tables = {row[0] for row in check.execute("SELECT name FROM sqlite_master")}
    check.close()
    assert "meta" in tables


def test_create_database_keeps_a_database_another_process_made(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"

    def made_meanwhile(connection: sqlite3.Connection) -> None:
        connection.execute("CREATE TABLE mine (x)")
        # Another process creates the database while this one builds its own.
        other = sqlite3.connect(path)
        other.execute("CREATE TABLE theirs (x)")
        other.commit()
        other.close()

    create_database(path, made_meanwhile)
    with sqlite3.connect(path) as check:
        tables = {row[0] for row in check.execute("SELECT name FROM sqlite_master")}
    check.close()
    assert tables == {"theirs"}
    assert [p.name for p in tmp_path.iterdir()] == ["db.sqlite3"]


def test_create_database_replaces_an_empty_file_and_cleans_up_on_failure(
    tmp_path: Path,
) -> None:
    path = tmp_path / "db.sqlite3"
    path.touch()  # zero bytes: no database (fedpca.files.holds_database)

    def failing(connection: sqlite3.Connection) -> None:
        connection.execute("CREATE TABLE t (x)")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        create_database(path, failing)
    assert path.stat().st_size == 0
    assert [p.name for p in tmp_path.iterdir()] == ["db.sqlite3"]  # no temporary left

    old_umask = os.umask(0o027)
    try:
        create_database(path, lambda connection: connection.execute("CREATE TABLE t (x)"))
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    with sqlite3.connect(path) as check:
        assert check.execute("SELECT name FROM sqlite_master").fetchall() == [("t",)]
    check.close()
