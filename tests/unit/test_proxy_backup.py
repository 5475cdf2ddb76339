"""``fedpca proxy backup`` (fedpca.proxy.backup): a copy taken only when the database
holds no upload or aggregate without its noise, mode 0600.

Found by an operator's review: the documented `sqlite3 .backup` taken while a query ran
kept each owner's staged chunks and the unnoised aggregate (ciphertexts the analyst's
key decrypts into exact per-owner statistics) in a file readable by every user."""

from __future__ import annotations

import re
import sqlite3
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedpca.codec import CryptoPool
from fedpca.errors import ConfigError
from fedpca.proxy.backup import backup_database
from fedpca.proxy.cli import proxy_group
from fedpca.proxy.config import load_config
from fedpca.proxy.server import ProxyServer
from fedpca.proxy.store import ProxyStore
from fedpca.proxy.store_database import restore_pending_since


def _database(tmp_path: Path) -> Path:
    path = tmp_path / "state" / "proxy.sqlite3"
    store = ProxyStore(path, announce_creation=False)
    store.create_query("alice/q1", "alice", {}, {}, deadline_at=1e12)
    store.close()
    return path


def _stage(path: Path, table: str) -> None:
    """A query's upload in flight (staged chunk) or its aggregate without noise."""
    raw = sqlite3.connect(path)
    if table == "staged_chunks":
        raw.execute(
            "INSERT INTO staged_chunks(query_id, owner_id, start_index, data) "
            "VALUES ('alice/q1', 'owner-1', 0, x'0102')"
        )
    else:
        raw.execute(
            "INSERT INTO aggregate_pages(query_id, page, n_folded, data) "
            "VALUES ('alice/q1', 0, 1, x'0304')"
        )
    raw.commit()
    raw.close()


def _clear(path: Path) -> None:
    raw = sqlite3.connect(path)
    raw.execute("DELETE FROM staged_chunks")
    raw.execute("DELETE FROM aggregate_pages")
    raw.commit()
    raw.close()


@pytest.mark.parametrize("table", ["staged_chunks", "aggregate_pages"])
def test_a_backup_waits_until_nothing_unnoised_is_held(tmp_path: Path, table: str) -> None:
    path = _database(tmp_path)
    _stage(path, table)
    out = tmp_path / "backups" / "proxy-1.sqlite3"
    with pytest.raises(ConfigError, match=r"queries are running .*no file was written"):
        backup_database(path, out)
    assert list(out.parent.iterdir()) == []  # nor a temporary left

    # With --wait: taken again once the query is done (here, after the first pause).
    pauses: list[float] = []

    def query_finishes(seconds: float) -> None:
        pauses.append(seconds)
        _clear(path)

    report = backup_database(path, out, wait_seconds=60.0, sleep=query_finishes)
    assert report.attempts == 2 and pauses == [1.0] and report.queries == 1
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    copy = sqlite3.connect(out)
    for name in ("staged_chunks", "aggregate_pages"):
        assert copy.execute(f"SELECT COUNT(*) FROM {name}").fetchone()[0] == 0
    assert copy.execute("SELECT query_id FROM queries").fetchall() == [("alice/q1",)]
    copy.close()
    restored = ProxyStore(out, read_only=True)  # a backup the proxy reads as it is
    assert [q.query_id for q in restored.queries()] == ["alice/q1"]
    restored.close()
    with pytest.raises(ConfigError, match="exists: name a new file"):
        backup_database(path, out)


def test_the_command_backs_up_a_proxy_folder(tmp_path: Path) -> None:
    path = _database(tmp_path)
    config = tmp_path / "proxy.toml"
    config.write_text(
        f'[proxy]\nid = "proxy"\nlisten = "127.0.0.1:0"\ndatabase = "{path}"\n'
        '[owners]\nallowed = ["owner-1"]\n[tls]\ninsecure = true\n'
    )
    out = tmp_path / "b.sqlite3"
    result = CliRunner().invoke(proxy_group, ["backup", "--config", str(config), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "backed up 1 queries" in result.output and "(mode 0600)" in result.output
    _stage(path, "staged_chunks")
    again = CliRunner().invoke(
        proxy_group, ["backup", "--config", str(config), "--out", str(tmp_path / "c.sqlite3")]
    )
    assert again.exit_code == 1 and "1 with staged chunks" in again.output


def test_the_proxy_database_is_readable_by_its_user_only(tmp_path: Path) -> None:
    """It holds the same unnoised content while queries run: made 0600 (SQLite's 0644
    let every user of the host read it), and an older 0644 one is made so at start."""
    path = _database(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    wal = path.with_name(path.name + "-wal")
    wal.write_bytes(b"")
    wal.chmod(0o644)
    ProxyStore(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not wal.exists() or stat.S_IMODE(wal.stat().st_mode) == 0o600
    reader = ProxyStore(path, read_only=True)  # a reader changes nothing, mode included
    reader.close()


def test_a_restored_backup_is_served_only_after_its_releases_are_reentered(
    tmp_path: Path, pool: CryptoPool
) -> None:
    """Review: a backup put back in place was served at once, so an operator who started
    the proxy before `import-releases` let the analysts spend the forgotten releases
    again (docs only said to import first). A copy by `proxy backup` is marked; the
    proxy refuses to serve it until an import has run, and the source is unmarked."""
    path = _database(tmp_path)
    restored = tmp_path / "restored" / "proxy.sqlite3"
    config = tmp_path / "proxy.toml"
    config.write_text(
        f'[proxy]\nid = "proxy"\nlisten = "127.0.0.1:0"\ndatabase = "{restored}"\n'
        '[owners]\nallowed = ["owner-1"]\n[tls]\ninsecure = true\n'
    )
    backup_database(path, restored)
    assert _restore_pending(path) is None  # the serving proxy's own database
    taken = _restore_pending(restored)
    assert taken is not None

    proxy_config = load_config(config)
    refusal = rf"is a backup taken on {re.escape(taken)} .*import-releases"
    with pytest.raises(ConfigError, match=refusal):
        ProxyServer(proxy_config, pool=pool).start()

    runner = CliRunner()
    arguments = ["import-releases", "--config", str(config)]
    neither = runner.invoke(proxy_group, arguments)
    assert neither.exit_code == 2 and "--no-owner-exports" in neither.output
    dry = runner.invoke(proxy_group, [*arguments, "--dry-run", "--no-owner-exports"])
    assert dry.exit_code == 0, dry.output
    assert f"would then serve this database (a backup taken on {taken})" in dry.output
    assert _restore_pending(restored) == taken  # a dry run changes nothing

    imported = runner.invoke(proxy_group, [*arguments, "--no-owner-exports"])
    assert imported.exit_code == 0, imported.output
    assert "will now serve this database" in imported.output
    assert _restore_pending(restored) is None
    server = ProxyServer(proxy_config, pool=pool)
    server.start()
    try:
        assert [q.query_id for q in server.coordinator.store.queries()] == ["alice/q1"]
    finally:
        server.stop(grace=1.0)


def _restore_pending(path: Path) -> str | None:
    raw = sqlite3.connect(path)
    try:
        return restore_pending_since(raw)
    finally:
        raw.close()
