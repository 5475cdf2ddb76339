"""Writing a file so that a crash leaves either the old file or the whole new one.

Used for key and certificate files and the owners' kept shares: the file is written
to a temporary file in the same folder (created with mode 0600, so private material is
never readable by others), flushed to disk, given its final mode, renamed into place,
and the folder is flushed so that the rename itself survives a power loss.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["write_atomically"]


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
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
