"""Red-team findings (second pass) on what an observer sees of an owner's records
(fedpca.owner.local_table.LocalTable, fedpca.tables.load_table).

They fail on the code they were written against (98d67ee); REDTEAM2.md describes each
finding and a fix. Nothing here is marked xfail.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedpca.errors import FedpcaError
from fedpca.owner.config import DataConfig
from fedpca.owner.local_table import LocalTable


def _starts(config: DataConfig) -> str:
    """What a node's start makes of ``config``'s table: "starts", or the error's class."""
    try:
        LocalTable.load(config)
    except (FedpcaError, ValueError) as exc:
        return type(exc).__name__
    return "starts"


@pytest.mark.parametrize("header", [False, "auto"])
def test_a_headerless_csv_owner_without_records_starts_as_one_with_a_record(
    tmp_path: Path, header: bool | str
) -> None:
    """REDTEAM.md finding 1, left open for headerless CSV files. privacy.md: "An
    owner's last record is no exception: a node whose table has no records ... starts,
    connects and answers exactly as one with records".

    A headerless CSV (``header = false``, or the default ``"auto"`` with an export that
    writes no header; ``fedpca owner init --header no|auto``) that holds one record is
    one line; the same export without the record is an empty file, which
    ``load_table`` refuses ("the file is empty"), so the node does not start. Whether
    the owner holds its last record is visible again to anyone who watches which
    owners connect, with certainty and outside any noise.
    """
    record = np.array([[1.0, 0.25, -0.5, 0.75]])  # label in column 0, three features
    one = tmp_path / "one.csv"
    np.savetxt(one, record, delimiter=",", fmt="%.17g")
    none = tmp_path / "none.csv"
    np.savetxt(none, record[:0], delimiter=",", fmt="%.17g")  # the same export, no rows

    def config(path: Path) -> DataConfig:
        return DataConfig(path, header=header, label_column=0, max_records=10)

    with_record, without = _starts(config(one)), _starts(config(none))
    assert with_record == without, (
        f"with its one record the node {with_record}; without it: {without} (header = {header!r})"
    )
