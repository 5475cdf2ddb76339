"""One process at a time on a daemon's state.

A new operator's walkthrough: a second ``fedpca owner serve`` on the same configuration
ran beside the first, the two taking the task stream from each other every second on
one ledger, and a second ``fedpca proxy serve`` on the same database was not refused
either. (The owner's case is tested with its node in ``test_owner_node.py`` and
``test_owner_node_cli.py``.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fedpca.errors import ConfigError
from fedpca.files import ExclusiveUse
from fedpca.proxy.init import write_proxy_folder
from fedpca.transport.certs import init_certificates
from helpers import wait_for_log

_FEDPCA = (sys.executable, "-c", "from fedpca.app.cli import main; main()")


def test_a_held_lock_is_refused_naming_its_holder_until_released(tmp_path: Path) -> None:
    path = tmp_path / "state.lock"
    first = ExclusiveUse(path, "the state folder s")
    held = rf"the state folder s is in use by process {os.getpid()}"
    with pytest.raises(ConfigError, match=held):
        ExclusiveUse(path, "the state folder s")
    first.release()
    first.release()  # twice is harmless
    with ExclusiveUse(path, "the state folder s"), pytest.raises(ConfigError, match="in use"):
        ExclusiveUse(path, "the state folder s")
    ExclusiveUse(path, "the state folder s").release()  # free again after the with


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    """The lock is the kernel's: it ends with the process, even one killed with SIGKILL."""
    path = tmp_path / "state.lock"
    code = (
        "import sys, time; from pathlib import Path; from fedpca.files import ExclusiveUse; "
        f"held = ExclusiveUse(Path({str(path)!r}), 'x'); print('held', flush=True); "
        "time.sleep(600)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError, match=f"in use by process {holder.pid}"):
            ExclusiveUse(path, "x")
    finally:
        holder.kill()
        holder.wait(30)
    ExclusiveUse(path, "x").release()


def test_a_second_proxy_on_the_same_database_stops_at_start(tmp_path: Path) -> None:
    init_certificates(tmp_path / "certs", ["owner-1"], ["alice"])
    write_proxy_folder(
        tmp_path / "proxy", owners=["owner-1"], certs=tmp_path / "certs", listen="127.0.0.1:0"
    )
    config = str(tmp_path / "proxy" / "proxy.toml")
    command = [*_FEDPCA, "proxy", "serve", "--config", config]
    log = tmp_path / "first.log"
    with log.open("wb") as out:
        first = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_log(first, log, "proxy listening on", timeout=120)
        second = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1, second.stderr
        database = tmp_path / "proxy" / "state" / "proxy.sqlite3"
        assert (
            f"Error: cannot start the proxy: the proxy database {database} is in use by "
            f"process {first.pid}" in second.stderr
        ), second.stderr
        assert "Traceback" not in second.stderr
        assert first.poll() is None  # the first proxy serves on
        first.send_signal(signal.SIGTERM)
        assert first.wait(60) == 0, log.read_text()
    finally:
        if first.poll() is None:
            first.kill()


def test_a_symbolic_link_to_a_served_database_is_refused(tmp_path: Path) -> None:
    """Found by review: the proxy's lock file was named from the database's path as
    given, so a second proxy started on a symbolic link to the database a proxy serves
    took its own lock and ran beside the first. (An owner's lock is a file inside its
    state folder, the same file whatever link names the folder.)"""
    from fedpca.proxy.store_database import use_database

    database = tmp_path / "state" / "proxy.sqlite3"
    database.parent.mkdir()
    database.write_bytes(b"")
    link = tmp_path / "link.sqlite3"
    link.symlink_to(database)
    with use_database(database), pytest.raises(ConfigError, match="in use by process"):
        use_database(link)
    with use_database(link), pytest.raises(ConfigError, match="in use by process"):
        use_database(database)
