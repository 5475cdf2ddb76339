"""Kept shares of uploads in flight (fedpca.owner.share_snapshots)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpca.owner import share_snapshots
from fedpca.owner.share_snapshots import KeptShare, ShareSnapshots
from fedpca.protocol import ReleasePlan
from helpers import make_query

UPLOAD = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def plan(test_only_keypair_512: tuple[Any, Any]) -> ReleasePlan:
    public_key, _ = test_only_keypair_512
    return ReleasePlan.for_query(make_query(public_key), public_key.n.bit_length())


def share_for(plan: ReleasePlan, record_count: int | None = None) -> KeptShare:
    rng = np.random.default_rng(0)
    values = {
        block.name: rng.integers(-(2**40), 2**40, block.layout.value_count, dtype=np.int64)
        for block in plan.owner_blocks
    }
    return KeptShare(values, record_count)


@pytest.mark.parametrize("record_count", [None, 0, 17])
def test_a_saved_share_loads_as_it_was(
    tmp_path: Path, plan: ReleasePlan, record_count: int | None
) -> None:
    shares = ShareSnapshots(tmp_path / "shares")
    saved = share_for(plan, record_count)
    shares.save(UPLOAD, saved)
    loaded = shares.load(UPLOAD, plan)
    assert loaded is not None and loaded.record_count == record_count
    assert loaded.values.keys() == saved.values.keys()
    for name, values in saved.values.items():
        np.testing.assert_array_equal(loaded.values[name], values, strict=True)
    assert (tmp_path / "shares" / f"{UPLOAD}.npz").stat().st_mode & 0o077 == 0
    # A second save under the same id keeps the first share.
    shares.save(UPLOAD, share_for(plan, 99))
    again = shares.load(UPLOAD, plan)
    assert again is not None and again.record_count == record_count


def test_a_missing_unreadable_or_misfitting_share_is_not_used(
    tmp_path: Path, plan: ReleasePlan, caplog: pytest.LogCaptureFixture
) -> None:
    shares = ShareSnapshots(tmp_path / "shares")
    assert shares.load(UPLOAD, plan) is None  # never saved
    shares.save(UPLOAD, share_for(plan))
    path = tmp_path / "shares" / f"{UPLOAD}.npz"
    path.write_bytes(path.read_bytes()[:100])  # truncated
    assert shares.load(UPLOAD, plan) is None
    assert "unreadable" in caplog.text
    path.unlink()
    short = {name: values[:-1] for name, values in share_for(plan).values.items()}
    shares.save(UPLOAD, KeptShare(short))
    assert shares.load(UPLOAD, plan) is None
    assert "does not fit" in caplog.text


def test_only_upload_ids_name_files(tmp_path: Path, plan: ReleasePlan) -> None:
    shares = ShareSnapshots(tmp_path / "shares")
    for bad in ("../ledger.sqlite3", "", UPLOAD.upper(), UPLOAD + "0"):
        with pytest.raises(ValueError, match="not an upload id"):
            shares.save(bad, share_for(plan))


def test_prune_keeps_only_uploads_in_flight(tmp_path: Path, plan: ReleasePlan) -> None:
    shares = ShareSnapshots(tmp_path / "shares")
    assert shares.prune(set()) == 0  # no folder yet
    other = "f" * 32
    shares.save(UPLOAD, share_for(plan))
    shares.save(other, share_for(plan))
    (tmp_path / "shares" / "x.tmp").write_bytes(b"")
    assert shares.prune({UPLOAD}) == 2
    assert [path.name for path in (tmp_path / "shares").iterdir()] == [f"{UPLOAD}.npz"]
    shares.discard(UPLOAD)
    shares.discard(UPLOAD)  # nothing left: no error
    assert list((tmp_path / "shares").iterdir()) == []


def test_a_snapshot_is_the_archive_numpy_writes(tmp_path: Path) -> None:
    """The snapshot writer streams each array's memory instead of np.savez's 16 MiB
    copies; np.load reads back the same names, dtypes, shapes and values as from
    np.savez, for arrays spanning several 1 MiB writes and for empty ones."""
    rng = np.random.default_rng(1)
    arrays = {
        "big": rng.integers(-(2**62), 2**62, 300_000, dtype=np.int64),  # 2.3 MiB
        "grid": rng.integers(0, 9, (7, 5), dtype=np.int64),
        "empty": np.zeros(0, dtype=np.int64),
    }
    ours, numpys = tmp_path / "ours.npz", tmp_path / "numpys.npz"
    with ours.open("wb") as handle:
        share_snapshots._write_npz(handle, arrays)
    np.savez(numpys, **arrays)
    with np.load(ours, allow_pickle=False) as mine, np.load(numpys, allow_pickle=False) as theirs:
        assert mine.files == theirs.files
        for name in theirs.files:
            np.testing.assert_array_equal(mine[name], theirs[name], strict=True)
