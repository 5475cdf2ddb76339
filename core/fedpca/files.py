"""Writing a file so that a crash leaves either the old file or the whole new one, and
undoing what a failed command created.

:func:`write_atomically` is used for key and certificate files and the owners' kept
shares: the file is written to a temporary file in the same folder (created with mode
0600, so private material is never readable by others), flushed to disk, given its
final mode, renamed into place, and the folder is flushed so that the rename itself
survives a power loss.

:func:`undone_on_failure` is used by the ``init`` commands: a run that fails half-way
removes what it created and puts back the files it replaced, so the command can simply
be run again.

:func:`create_database` makes a new SQLite database (the proxy's store, an owner's
budget ledger) whole or not at all: a crash while its tables are made leaves no file
that reads as "an SQLite file with no tables", which a later start must refuse.

:class:`ExclusiveUse` is held by a running daemon on its state (the owner node's state
folder, the proxy's database): a second daemon started on the same state stops at
start-up with a message naming the first, instead of both running on one ledger.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import sqlite3
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from fedpca.errors import ConfigError

__all__ = [
    "DATABASE_MODE",
    "ExclusiveUse",
    "copy_database",
    "create_database",
    "database_missing",
    "distinct_values",
    "holds_database",
    "restrict_database",
    "sync_folder",
    "undone_on_failure",
    "write_atomically",
]


logger = logging.getLogger(__name__)

DATABASE_MODE = 0o600
"""The permissions of a node's database (the proxy's, an owner's budget ledger). The
proxy's holds owners' uploads and aggregates without their noise while a query runs,
which the analyst's key decrypts, and an owner's lists every query it answered (0644,
SQLite's default, let every user of the host read them; an operator's reviews)."""


def restrict_database(path: Path) -> None:
    """Make an existing database (and its ``-wal`` and ``-shm``) :data:`DATABASE_MODE`,
    if others may read it; a file this process does not own is left, with a warning."""
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            if file.stat().st_mode & 0o077:
                os.chmod(file, DATABASE_MODE)
                logger.info("made %s readable by this user only (mode 0600)", file)
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("cannot make %s readable by this user only: %s", file, exc)


def write_atomically(path: Path, write: Callable[[BinaryIO], object], mode: int) -> None:
    """Create or replace ``path`` with what ``write`` writes to the open binary file.

    Parameters
    ----------
    path : the file; its folder must exist.
    write : called once with the temporary file open for writing.
    mode : the file's permissions once in place (e.g. 0o600 or 0o644).
    """
    descriptor, temporary = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
    )
    try:
        with os.fdopen(descriptor, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


def sync_folder(folder: Path) -> None:
    """Flush ``folder`` itself, so that a file created or renamed in it survives a
    power loss."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def holds_database(path: Path) -> bool:
    """Whether the database file ``path`` exists and has content.

    SQLite writes a WAL database's header when it creates it, so a file of zero bytes
    (a restore that failed, a full disk, ``: > ledger.sqlite3``) holds no state: it
    counts as missing, since opening it would silently make a new, empty database.
    """
    try:
        return path.stat().st_size > 0
    except (FileNotFoundError, NotADirectoryError):
        return False


def distinct_values(database: Path, sql: str) -> set[str]:
    """The non-null values of the one-column query ``sql`` on ``database``, read without
    writing (no migration; ``query_only``); empty where no database is, or one that
    cannot be read (the callers' other checks name that).

    Not ``mode=ro``: a read-only connection to a WAL database leaves its -wal and -shm
    files behind, in a folder a probe must not write to (review).
    """
    if not holds_database(database):
        return set()
    try:
        connection = sqlite3.connect(database)
        try:
            connection.execute("PRAGMA query_only = 1")
            rows = connection.execute(sql).fetchall()
        finally:
            connection.close()
    except sqlite3.Error:
        return set()
    return {str(row[0]) for row in rows if row[0] is not None}


def create_database(
    path: Path, build: Callable[[sqlite3.Connection], object], mode: int | None = None
) -> None:
    """Create the SQLite database ``path`` with what ``build`` writes, or leave none.

    ``mode``: the file's permissions (None: those SQLite gives a file it creates, 0666
    less the umask; SQLite gives its ``-wal`` and ``-shm`` files the database's).

    ``build`` runs in one transaction on a new file beside ``path`` (rollback journal,
    synchronous commits), which is then linked to ``path`` and the folder flushed. A
    crash before the link leaves only that hidden file (``.NAME.*.creating``, which
    holds nothing but empty tables), never a ``path`` without its tables. If another
    process made ``path`` meanwhile, its database is kept and this one discarded; a
    ``path`` of zero bytes (no database, :func:`holds_database`) is replaced.

    Raises
    ------
    OSError, sqlite3.Error
        From the folder or SQLite; nothing is left at ``path``.
    """
    descriptor, temporary = tempfile.mkstemp(
        prefix=f".{path.name}.", suffix=".creating", dir=path.parent
    )
    os.close(descriptor)
    try:
        connection = sqlite3.connect(temporary, isolation_level=None)
        try:
            connection.execute("PRAGMA synchronous=FULL")
            connection.execute("BEGIN IMMEDIATE")
            build(connection)
            connection.execute("COMMIT")
        finally:
            connection.close()
        os.chmod(temporary, 0o666 & ~_umask() if mode is None else mode)
        try:
            os.link(temporary, path)  # never over a database another process made
        except FileExistsError:
            if not holds_database(path):
                os.replace(temporary, path)
        sync_folder(path.parent)
    finally:
        Path(temporary).unlink(missing_ok=True)


def copy_database(
    source: sqlite3.Connection,
    out: Path,
    mode: int = 0o600,
    prepare: Callable[[sqlite3.Connection], bool] | None = None,
) -> bool:
    """Write what the database open in ``source`` holds (its committed content, the
    write-ahead log's included: SQLite's backup API) to the new file ``out``, flushed,
    with ``mode``.

    ``prepare`` is given the copy before it is put in place, to read or mark it; if it
    returns False the copy is discarded and nothing is written. Returns whether ``out``
    was written.

    Raises
    ------
    FileExistsError
        ``out`` exists: it is never replaced.
    OSError, sqlite3.Error
        From the folder or SQLite; nothing is left at ``out``.
    """
    descriptor, temporary = tempfile.mkstemp(
        prefix=f".{out.name}.", suffix=".partial", dir=out.parent
    )
    os.close(descriptor)  # mkstemp made it 0600; SQLite writes into it
    try:
        copy = sqlite3.connect(temporary)
        try:
            source.backup(copy)
            if prepare is not None and not prepare(copy):
                return False
        finally:
            copy.close()
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.chmod(temporary, mode)
        os.link(temporary, out)  # never over a file that appeared meanwhile
        sync_folder(out.parent)
        return True
    finally:
        Path(temporary).unlink(missing_ok=True)


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it, for every
    thread, while it reads it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def database_missing(path: Path) -> str:
    """How the database ``path``, for which :func:`holds_database` is False, is missing."""
    if path.exists():
        return f"{path} is empty (0 bytes: a copy or restore that failed, or a full disk?)"
    return f"{path} does not exist"


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` (or ``path`` itself) that does not exist yet."""
    missing = None
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            break
        missing = candidate
    return missing


def _entries(root: Path) -> set[Path]:
    """``root`` and everything under it (symbolic links are not followed)."""
    found = {root}
    for folder, folders, files in os.walk(root):
        found.update(Path(folder, name) for name in (*folders, *files))
    return found


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def undone_on_failure(roots: Iterable[Path], replaced: Iterable[Path] = ()) -> Iterator[None]:
    """Undo, if the body raises, what it created under ``roots`` and its replacements.

    Parameters
    ----------
    roots : folders the body may create or write into. A root that does not exist
        yet is removed on failure with the folders made for it; under one that
        exists, only what did not exist before is removed.
    replaced : files the body may overwrite (a configuration, TLS files): those that
        exist are read now and, on failure, written back with their permissions.

    Nothing that existed before is removed. The exception is raised again.
    """
    created: list[Path] = []
    before: dict[Path, set[Path]] = {}
    for root in roots:
        absolute = Path(os.path.abspath(root))
        missing = _first_missing(absolute)
        if missing is not None:
            created.append(missing)
        elif absolute.is_dir():
            before[absolute] = _entries(absolute)
    kept: dict[Path, tuple[bytes, int]] = {}
    for path in replaced:
        absolute = Path(os.path.abspath(path))
        if absolute.is_file() and not absolute.is_symlink():
            kept[absolute] = (absolute.read_bytes(), stat.S_IMODE(absolute.stat().st_mode))
    try:
        yield
    except BaseException:
        for path in created:
            _remove(path)
        for root, entries in before.items():
            # Outermost first: a new folder goes with everything in it.
            for path in sorted(_entries(root) - entries, key=lambda p: len(p.parts)):
                if path.exists() or path.is_symlink():
                    _remove(path)
        for path, (content, mode) in kept.items():
            if path.is_file() and path.read_bytes() == content:
                os.chmod(path, mode)
            else:
                write_atomically(path, _writer(content), mode)
        raise


def _writer(content: bytes) -> Callable[[BinaryIO], object]:
    return lambda handle: handle.write(content)


class ExclusiveUse:
    """A lock file that one process at a time holds while it uses some state.

    The lock is the operating system's (``flock``), so it ends with the process that
    holds it, however that process ends: a crashed daemon never leaves a stale lock
    behind. The holder's process id is written into the file to name it in the error
    another process gets. (Advisory: it binds only processes that ask for it, and it
    holds across processes of one host; two hosts sharing a network folder are not
    covered.)

    Parameters
    ----------
    path : the lock file (created if missing, with its folder).
    what : what it guards, for the error message (e.g. "the state folder state/owner-1").

    Raises
    ------
    ConfigError
        Another process holds the lock, or the file cannot be opened.
    """

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self._descriptor: int | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConfigError(f"cannot open the lock file {path} of {what}: {exc}") from exc
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 32, 0).decode("ascii", "replace").strip()
            os.close(descriptor)
            by = f"process {holder}" if holder.isdigit() else "another process"
            raise ConfigError(
                f"{what} is in use by {by} (lock file {path}): stop that process first; "
                "two processes on the same state would share one ledger"
            ) from None
        except BaseException:
            os.close(descriptor)
            raise
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode("ascii"), 0)
        self._descriptor = descriptor

    def release(self) -> None:
        """Let another process take the lock; safe to call twice."""
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is not None:
            os.close(descriptor)  # closing the only descriptor releases the flock

    def __enter__(self) -> ExclusiveUse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()
