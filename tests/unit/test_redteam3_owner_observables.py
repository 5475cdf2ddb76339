"""Red-team findings (third pass) on what an observer sees of an owner's records
(fedpca.owner.local_table.LocalTable, fedpca.tables.load_table).

They fail on the code they were written against (0cde958); REDTEAM3.md describes each
finding and a fix. Nothing here is marked xfail.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedpca.errors import FedpcaError
from fedpca.owner.config import DataConfig
from fedpca.owner.local_table import LocalTable

RECORDS = [[1.0, 0.25, -0.5, 0.75]]  # label in column 0, three features
NAMES = ["label", "x1", "x2", "x3"]


def _starts(config: DataConfig) -> str:
    """What a node's start makes of ``config``'s table: "starts", or the error's class."""
    try:
        LocalTable.load(config)
    except (FedpcaError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "starts"


def _parquet_export(path: Path, records: list[list[float]]) -> DataConfig:
    """An export that builds its Parquet file column by column from the records, as a
    script does with ``pa.table({name: [...]})`` (or pandas from a SQL result)."""
    pq.write_table(pa.table({n: [r[j] for r in records] for j, n in enumerate(NAMES)}), path)
    return DataConfig(path, label_column=0, max_records=10)


def _npy_export(path: Path, records: list[list[float]]) -> DataConfig:
    """``np.save(path, np.array(records))``, with the width declared in the config."""
    np.save(path, np.array(records))
    return DataConfig(path, label_column=0, max_records=10, n_columns=len(NAMES))


@pytest.mark.parametrize(
    ("export", "suffix"), [(_parquet_export, ".parquet"), (_npy_export, ".npy")]
)
def test_an_owner_without_records_starts_as_one_with_a_record_whatever_its_export(
    tmp_path: Path, export: Callable[[Path, list[list[float]]], DataConfig], suffix: str
) -> None:
    """privacy.md: "An owner's last record is no exception"; REDTEAM.md finding 1 and
    REDTEAM2.md finding 2, fixed for CSV files (a header, or ``data.n_columns``).

    The same export code with one record and with none gives a loadable file in the
    first case and a refused one in the second, so the node with the record starts and
    the node without it does not, which anyone who watches which owners connect sees:

    * Parquet built column by column from Python lists (``pa.table({name: values})``,
      pandas ``DataFrame(records, columns=...)`` / ``read_sql`` of an empty result):
      without values every column has Arrow type ``null``, which ``_load_parquet``
      refuses as "non-numeric", although the file's schema names every column;
    * ``np.save(path, np.array(records))``: without records the array has shape (0,),
      refused as "expected a 2-D array" even with ``data.n_columns`` declared, which
      ``load_table`` documents as "an empty file is a table of this width".
    """
    with_record = _starts(export(tmp_path / f"one{suffix}", RECORDS))
    without = _starts(export(tmp_path / f"none{suffix}", []))
    assert with_record == "starts"
    assert without == with_record, f"with its one record the node starts; without it: {without}"
