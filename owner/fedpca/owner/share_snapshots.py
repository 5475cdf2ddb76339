"""The values of every upload in flight, kept on the owner's disk until the upload ends.

A restarted node resumes an upload under the same upload id: the proxy keeps the
chunks it already folded and expects the rest of *the same share*. Encoding the share
again from the data file would mix two shares in one contribution whenever the file
changed in between (a nightly export, a corrected record). So the encoded share is
written here, durably, before the upload is recorded as begun (and before any chunk
may leave), and a resume encrypts exactly these values again, whatever the file holds
by then.

A snapshot holds an aggregate of the owner's own records (the fixed-point statistics
it encrypts), on the owner's own disk next to its ledger and its data: it is written
with mode 0600 and deleted as soon as the upload ends (accepted, refused, cancelled),
and a node's start deletes any left by an upload that no longer runs.
"""

from __future__ import annotations

import logging
import re
import zipfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fedpca.files import write_atomically
from fedpca.protocol import ReleasePlan

__all__ = ["SHARES_FOLDER", "KeptShare", "ShareSnapshots"]

SHARES_FOLDER = "shares"
"""The folder of the shares of uploads in flight, in the node's state folder."""

logger = logging.getLogger(__name__)

IntArray = npt.NDArray[np.int64]

_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")  # messages.new_upload_id: 16 random bytes in hex
_SUFFIX = ".npz"
# The archive entry holding the record count (no block is named so: block names are
# identifiers such as "shares" and "class_sums").
_RECORD_COUNT = "__record_count__"


@dataclass(frozen=True)
class KeptShare:
    """An encoded share and what its upload header declares with it.

    Attributes
    ----------
    values : block name -> the block's int64 fixed-point values.
    record_count : masked mode's public count of the records the share covers (the
        upload header carries it); None in stats mode.
    """

    values: Mapping[str, IntArray]
    record_count: int | None = None


class ShareSnapshots:
    """Encoded shares by upload id, in one folder (created on first use).

    Parameters
    ----------
    folder : the node's ``<state_dir>/shares``.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, upload_id: str) -> Path:
        if not _UPLOAD_ID.fullmatch(upload_id):
            raise ValueError(f"not an upload id: {upload_id!r}")
        return self.folder / f"{upload_id}{_SUFFIX}"

    def save(self, upload_id: str, share: KeptShare) -> None:
        """Write ``share`` durably under ``upload_id``; an existing snapshot stays.

        Written to a temporary file, flushed to disk, then renamed into place and the
        folder flushed: after a crash the snapshot is either whole or absent.
        """
        path = self._path(upload_id)
        if path.exists():
            return
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        arrays: dict[str, Any] = {name: np.asarray(v, np.int64) for name, v in share.values.items()}
        count = -1 if share.record_count is None else share.record_count
        arrays[_RECORD_COUNT] = np.array([count], dtype=np.int64)
        write_atomically(path, lambda handle: _write_npz(handle, arrays), 0o600)

    def load(self, upload_id: str, plan: ReleasePlan) -> KeptShare | None:
        """The saved share of ``upload_id`` if there is one that fits ``plan``, else None.

        None when no snapshot exists (an upload begun by a version that kept none) or
        when it cannot be read or does not have the plan's blocks and sizes (logged).
        """
        path = self._path(upload_id)
        if not path.exists():
            return None
        try:
            with np.load(path, allow_pickle=False) as archive:
                values = {name: archive[name] for name in archive.files}
            count = values.pop(_RECORD_COUNT)
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
            logger.warning("share snapshot %s is unreadable (%s); not used", path, exc)
            return None
        expected = {block.name: block.layout.value_count for block in plan.owner_blocks}
        found = {name: array.shape for name, array in values.items()}
        if (
            found != {name: (size,) for name, size in expected.items()}
            or any(array.dtype != np.int64 for array in values.values())
            or count.shape != (1,)
        ):
            logger.warning(
                "share snapshot %s does not fit the query's layout (%s); not used", path, found
            )
            return None
        record_count = int(count[0])
        return KeptShare(values, None if record_count < 0 else record_count)

    def discard(self, upload_id: str) -> None:
        """Delete the snapshot of an upload that ended (nothing if there is none)."""
        self._path(upload_id).unlink(missing_ok=True)

    def kept_files(self) -> list[Path]:
        """The snapshot files in the folder (temporary files being written left out)."""
        if not self.folder.is_dir():
            return []
        return sorted(
            path
            for path in self.folder.iterdir()
            if path.suffix == _SUFFIX
            and _UPLOAD_ID.fullmatch(path.name.removesuffix(_SUFFIX))
            and path.is_file()
        )

    def prune(self, in_flight: Collection[str]) -> int:
        """Delete every snapshot (and stray temporary file) not of an upload in flight.

        Returns the number of files deleted.
        """
        if not self.folder.is_dir():
            return 0
        removed = 0
        for path in self.folder.iterdir():
            upload_id = path.name.removesuffix(_SUFFIX)
            if path.suffix == _SUFFIX and upload_id in in_flight:
                continue
            if path.is_file():
                path.unlink(missing_ok=True)
                removed += 1
        return removed


_WRITE_BYTES = 1 << 20


def _write_npz(handle: Any, arrays: Mapping[str, npt.NDArray[Any]]) -> None:
    """What ``np.savez(handle, **arrays)`` writes (``np.load`` reads it), without its
    copies: numpy copies each array to bytes 16 MiB at a time before writing it to an
    archive member, a 16 MiB copy beside a share of that size (M = 2,000) at the very
    moment the owner holds the most. Here each member gets numpy's own ``.npy`` header
    and then the array's memory, 1 MiB at a time, uncopied."""
    with zipfile.ZipFile(handle, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            contiguous = np.ascontiguousarray(array)
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                header = np.lib.format.header_data_from_array_1_0(contiguous)
                np.lib.format.write_array_header_1_0(member, header)
                data = contiguous.data.cast("B")
                for start in range(0, len(data), _WRITE_BYTES):
                    member.write(data[start : start + _WRITE_BYTES])
