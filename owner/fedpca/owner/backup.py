"""``fedpca owner backup``: a copy of an owner's state beside a serving node (no gRPC).

What an owner restores after losing its state folder (docs/operations.md, Backup and
restore): its budget ledger, copied with SQLite's backup API (committed content, the
write-ahead log's included), and after it the shares of its uploads in flight, which
let an upload resume with the values it began with. The proxy has
:mod:`fedpca.proxy.backup`; owners had only a one-line Python command in the docs,
which wrote the copy beside the ledger unless told otherwise (an operator's walkthrough,
stop 42).
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from fedpca.errors import ConfigError
from fedpca.files import copy_database, holds_database, sync_folder
from fedpca.owner.config import OwnerConfig
from fedpca.owner.ledger import owner_ledger
from fedpca.owner.share_snapshots import SHARES_FOLDER, ShareSnapshots

__all__ = ["OwnerBackup", "backup_owner_state"]


@dataclass(frozen=True)
class OwnerBackup:
    """What :func:`backup_owner_state` wrote."""

    folder: Path
    releases: int
    shares: int


def backup_owner_state(config: OwnerConfig, out: Path) -> OwnerBackup:
    """Copy the ledger, then the kept shares, into the new folder ``out`` (0700; the
    ledger 0600, as in the state folder). Nothing is left at ``out`` on failure.

    Raises
    ------
    ConfigError
        No ledger at the configuration's state folder, one this version cannot read,
        or ``out`` exists.
    """
    ledger_path = config.ledger_path
    if not holds_database(ledger_path):
        raise ConfigError(
            f"no budget ledger at {ledger_path}: check [owner] state_dir in the configuration"
        )
    releases = len(owner_ledger(config, read_only=True).events())  # a ledger of this version
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.mkdir(mode=0o700)
    except FileExistsError:
        raise ConfigError(f"{out} exists: give a new folder for the backup") from None
    except OSError as exc:
        raise ConfigError(f"cannot create {out}: {exc.strerror or exc}") from exc
    try:
        source = sqlite3.connect(f"file:{ledger_path}?mode=ro", uri=True)
        try:
            copy_database(source, out / ledger_path.name)  # named as in the state folder
        finally:
            source.close()
        # After the ledger: a share of an upload that ended meanwhile is deleted by the
        # restored node at its start; one missing would make an upload start over.
        shares = _copy_shares(
            ShareSnapshots(config.owner.state_dir / SHARES_FOLDER), out / SHARES_FOLDER
        )
        sync_folder(out)
    except (OSError, sqlite3.Error) as exc:
        shutil.rmtree(out, ignore_errors=True)
        raise ConfigError(f"backup to {out} failed, nothing kept: {exc}") from exc
    return OwnerBackup(out, releases, shares)


def _copy_shares(shares: ShareSnapshots, out: Path) -> int:
    """Copy the kept shares (not files being written, nor anything else there)."""
    out.mkdir(mode=0o700)
    copied = 0
    for share in shares.kept_files():
        # A share whose upload ends while it is copied is deleted under us.
        with contextlib.suppress(FileNotFoundError):
            shutil.copy2(share, out / share.name)
            (out / share.name).chmod(0o600)
            copied += 1
    sync_folder(out)
    return copied
