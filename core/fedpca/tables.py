"""Loading an owner's table: CSV (with or without header), ``.npy`` and Parquet.

Every failure is a :class:`~fedpca.errors.DataError` that names the file and,
when it is about one cell, where it is. Columns are counted from 0, like
``data.label_column``, ``data.n_columns`` and ``policy.allowed_columns`` in an
owner's configuration, and the message says "(0-based)"; a CSV row is named by its
physical line number, as an editor shows it (from 1, a header is line 1), and a row
of a ``.npy`` or Parquet file by its 0-based index.  Nothing is repaired silently: a
statistic computed over a table that was half-understood would still be released
under the owner's budget.
"""

from __future__ import annotations

import csv
import gzip
import logging
import math
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from fedpca.errors import DataError

__all__ = ["HeaderOption", "OwnerTable", "describe_columns", "load_columns", "load_table"]

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]
HeaderOption = bool | Literal["auto"]

_CSV_SUFFIXES = {".csv", ".txt", ".tsv"}
_PARQUET_SUFFIXES = {".parquet", ".pq"}


class OwnerTable(NamedTuple):
    """Features and (optional) labels of one owner; unpacks as ``(X, y)``.

    Attributes
    ----------
    features : (N, M) float64.
    labels : (N,) float64, or None when no label column was requested.
    """

    features: FloatArray
    labels: FloatArray | None


_UNDECLARED_WIDTH = (
    "{file}: a .npy file, or a CSV file without a header row, needs its column count "
    "declared (data.n_columns = {width}, the label column included), so that an export "
    "without records loads like one with records (docs/privacy.md, add/remove adjacency)"
)


class _EmptyFile(DataError):
    """A text file without a single non-blank line: not even its width is known."""


def describe_columns(n_columns: int, label_column: int | None) -> str:
    """A table's layout in the words every owner message uses: columns are what the
    file holds, features are the columns a PCA reads (the label column excluded).

    ``label_column`` is the 0-based index (not negative), or None without a label column.
    """
    if label_column is None:
        return f"{n_columns} columns, all features (no label column)"
    return (
        f"{n_columns} columns: {n_columns - 1} features and the label in column "
        f"{label_column} (0-based)"
    )


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _resolve_label_column(
    label_column: int | str | None, n_columns: int, names: Sequence[str] | None, path: Path
) -> int | None:
    """Column index (0-based) of the label, accepting negative indices and header names."""
    if label_column is None:
        return None
    if isinstance(label_column, str):
        if names is None:
            raise DataError(f"{path}: label column {label_column!r} given by name, but no header")
        stripped = [name.strip() for name in names]
        if label_column not in stripped:
            raise DataError(f"{path}: no column named {label_column!r} (columns: {stripped})")
        return stripped.index(label_column)
    if not -n_columns <= label_column < n_columns:
        raise DataError(
            f"{path}: label column {label_column} (0-based) is out of range for {n_columns} "
            f"columns (0 to {n_columns - 1}, or -1 to -{n_columns} from the end)"
        )
    return label_column % n_columns


def _split(
    table: FloatArray,
    label_index: int | None,
    n_features: int | None,
    path: Path,
) -> OwnerTable:
    if label_index is None:
        features, labels = table, None
    else:
        features = np.delete(table, label_index, axis=1)
        labels = table[:, label_index].copy()
    if features.shape[1] == 0:
        raise DataError(f"{path}: no feature columns besides the label column")
    if n_features is not None and features.shape[1] != n_features:
        raise DataError(
            f"{path}: {features.shape[1]} feature columns"
            + (" (label column excluded)" if label_index is not None else "")
            + f", but the query expects {n_features}"
        )
    return OwnerTable(np.ascontiguousarray(features, dtype=np.float64), labels)


def _open_text(path: Path) -> IO[str]:
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rt", newline="", encoding="utf-8-sig")
    return path.open(newline="", encoding="utf-8-sig")


def _load_csv(
    path: Path, header: HeaderOption, delimiter: str
) -> tuple[FloatArray, list[str] | None]:
    """The table of a text file: numpy's C parser, or the checked reader's verdict.

    :func:`_read_csv_fast` reads a well-formed file with numpy's C parser, without
    holding every value as a Python float (a large table's peak memory is its array,
    not four times it); whenever it declines,
    :func:`_read_csv_checked` reads the file line by line, either accepting it (a
    form numpy does not parse, such as whitespace-only lines) or refusing it with the
    line and column at fault. Both give the same table for any file both accept.
    """
    fast = _read_csv_fast(path, header, delimiter)
    return fast if fast is not None else _read_csv_checked(path, header, delimiter)


_TEXT_HINT = (
    "; every cell of a record must be a number: recode a column of text, such as class "
    "labels written as words, as numeric codes (e.g. 0 and 1)"
)
"""Said with both errors of a text cell (found by review: text labels were reported as
a header problem, then as "not a number", with no word on what to do)."""


def _empty_cell_error(path: Path, line: int, cells: Sequence[str]) -> DataError | None:
    """The error for a record with an empty cell, or None when every cell has text.

    A trailing separator on every line (a spreadsheet's export of an empty last column)
    was reported as a header that "mixes numbers and text", naming a cell '' (found by
    review)."""
    empty = [j for j, cell in enumerate(cells) if not cell.strip()]
    if not empty:
        return None
    if empty == [len(cells) - 1]:
        what = "ends with a separator (an empty last column): remove the trailing separator"
    else:
        what = (
            f"has an empty cell (column {empty[0]}, 0-based): a missing value; fill it "
            "in or leave the record out"
        )
    return DataError(f"{path}: line {line} {what}")


def _header_decision(cells: Sequence[str], header: HeaderOption) -> bool | None:
    """Whether the first record is a header; None for an auto header that mixes kinds
    or numbers its columns (:func:`_numbers_its_columns`)."""
    if header != "auto":
        return bool(header)
    numeric = [_is_number(cell) for cell in cells]
    if all(numeric):
        return None if _numbers_its_columns(cells) else False
    if not any(numeric):
        return True
    return None


def _numbers_its_columns(cells: Sequence[str]) -> bool:
    """The record reads 0, 1, 2, 3, ... or 1, 2, 3, 4, ... (at least four columns): the header
    pandas writes for unnamed columns (``to_csv(index=False)``), which was read as a
    record, label 0 and all (found by review)."""
    if len(cells) < 4:  # a real record of three small integers is not rare
        return False
    try:
        numbers = [float(cell) for cell in cells]
    except ValueError:
        return False
    first = numbers[0]
    return first in (0.0, 1.0) and numbers == [first + i for i in range(len(numbers))]


def _read_csv_fast(
    path: Path, header: HeaderOption, delimiter: str
) -> tuple[FloatArray, list[str] | None] | None:
    """A whole well-formed table at once, or None for the checked reader to decide.

    The first non-blank record goes through the same csv reader and header rule as
    the checked reader; the rest through ``numpy.loadtxt`` (its C parser, the same
    float syntax for every cell it accepts). Anything unusual (a parse error, a
    ragged row, a non-finite value, no records) returns None: the checked reader then
    either accepts the file or names the offending line and column.
    """
    with _open_text(path) as handle:
        reader = csv.reader(handle, delimiter=delimiter)
        cells: list[str] | None = None
        for row in reader:
            if row and any(cell.strip() for cell in row):
                cells = row
                break
        if cells is None:
            return None
        header_here = _header_decision(cells, header)
        if header_here is None:
            return None
        try:
            first = None if header_here else np.array([float(cell) for cell in cells])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "input contained no data"
                rest = np.loadtxt(
                    handle,
                    dtype=np.float64,
                    delimiter=delimiter,
                    comments=None,
                    quotechar='"',
                    ndmin=2,
                )
        except ValueError:
            return None
    if rest.size == 0:
        if first is None:
            return None
        table = first.reshape(1, -1)
    elif rest.shape[1] != len(cells):
        return None
    else:
        table = rest if first is None else np.vstack([first, rest])
    if not np.isfinite(table).all():
        return None
    return np.ascontiguousarray(table), list(cells) if header_here else None


_SEPARATOR_NAMES = {",": "comma", ";": "semicolon", "\t": "tab", "|": "vertical bar"}


def _separator_hint(cells: Sequence[str], delimiter: str) -> str:
    """A note when a record read as one cell looks separated by another character."""
    if len(cells) != 1:
        return ""
    expected = _SEPARATOR_NAMES.get(delimiter, repr(delimiter))
    for separator, name in _SEPARATOR_NAMES.items():
        if separator != delimiter and separator in cells[0]:
            return (
                f" (the line looks {name}-separated, but this file is read as "
                f"{expected}-separated: export it with {expected}s between values)"
            )
    return ""


def _read_csv_checked(
    path: Path, header: HeaderOption, delimiter: str
) -> tuple[FloatArray, list[str] | None]:
    """Line by line with Python's csv reader; every refusal names its line and column."""
    with _open_text(path) as handle:
        reader = csv.reader(handle, delimiter=delimiter)
        rows: list[list[float]] = []
        names: list[str] | None = None
        n_columns: int | None = None
        first = True
        for cells in reader:
            line = reader.line_num
            if not cells or all(not cell.strip() for cell in cells):
                continue  # blank lines carry no record
            if first:
                first = False
                header_here = _header_decision(cells, header)
                if header_here is None and _numbers_its_columns(cells):
                    raise DataError(
                        f"{path}: line {line} reads {cells[0]}, {cells[1]}, ..., {cells[-1]}: "
                        "column numbers (the header pandas writes for unnamed columns) or a "
                        "record? Say which (header = true or false under [data] in owner.toml, "
                        "--header yes|no for `fedpca owner init`, header=True or False in "
                        "Python)"
                    )
                if header_here is None:
                    empty_cell = _empty_cell_error(path, line, cells)
                    if empty_cell is not None:
                        raise empty_cell
                    bad = next(j for j, cell in enumerate(cells) if not _is_number(cell))
                    raise DataError(
                        f"{path}: line {line} mixes numbers and text (column {bad}, 0-based, "
                        f"is {cells[bad]!r}); cannot tell whether it is a header: say which "
                        "(header = true or false under [data] in owner.toml, --header yes|no for "
                        "`fedpca owner init`, header=True or False in Python)"
                        + (_separator_hint(cells, delimiter) or _TEXT_HINT)
                    )
                n_columns = len(cells)
                if header_here:
                    names = list(cells)
                    continue
            assert n_columns is not None
            if len(cells) != n_columns:
                raise DataError(
                    f"{path}: line {line} has {len(cells)} columns, expected {n_columns}"
                )
            try:
                values = [float(cell) for cell in cells]
            except ValueError:
                empty_cell = _empty_cell_error(path, line, cells)
                if empty_cell is not None:
                    raise empty_cell from None
                bad = next(j for j, cell in enumerate(cells) if not _is_number(cell))
                raise DataError(
                    f"{path}: line {line}, column {bad} (0-based): {cells[bad]!r} is not a number"
                    + (_separator_hint(cells, delimiter) or _TEXT_HINT)
                ) from None
            if not all(math.isfinite(value) for value in values):
                bad = next(j for j, value in enumerate(values) if not math.isfinite(value))
                raise DataError(
                    f"{path}: line {line}, column {bad} (0-based): {cells[bad].strip()!r} "
                    "is not finite"
                )
            rows.append(values)
    if first:
        raise _EmptyFile(f"{path}: the file is empty")
    assert n_columns is not None
    # A header without records is a table of known width and no rows (load_table decides).
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), n_columns), names


def _check_finite(table: FloatArray, path: Path) -> None:
    bad = np.argwhere(~np.isfinite(table))
    if bad.size:
        r, j = bad[0]
        raise DataError(f"{path}: row {r}, column {j} (both 0-based): {table[r, j]} is not finite")


def _load_npy(path: Path) -> FloatArray:
    try:
        with path.open("rb") as handle:
            # read_array, not np.load: np.load also opens .npz archives (a mapping,
            # not an array) and dispatches on the file's first bytes.
            raw = np.lib.format.read_array(handle, allow_pickle=False)
    except OSError as exc:
        raise DataError(f"{path}: not a readable .npy array: {exc}") from exc
    except Exception as exc:
        # numpy's header parser reports a malformed file with whatever its tools
        # raise: ValueError, EOFError, SyntaxError, tokenize.TokenError, ...
        raise DataError(f"{path}: not a readable .npy array: {type(exc).__name__}: {exc}") from exc
    if raw.ndim == 1 and raw.size == 0:
        # np.save(path, np.array(records)) of no records: no rows, and no width either
        # (load_table takes the declared one).
        return np.zeros((0, 0))
    if raw.ndim != 2:
        raise DataError(f"{path}: expected a 2-D array, got shape {raw.shape}")
    if not (np.issubdtype(raw.dtype, np.number) or raw.dtype == np.bool_):
        raise DataError(f"{path}: array dtype {raw.dtype} is not numeric")
    if np.iscomplexobj(raw):
        raise DataError(f"{path}: complex values are not supported")
    table = np.asarray(raw, dtype=np.float64)
    _check_finite(table, path)
    return table


def _load_parquet(path: Path) -> tuple[FloatArray, list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        arrow_table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file: {exc}") from exc
    names = list(arrow_table.column_names)
    if not names:
        raise DataError(f"{path}: the file has no columns")
    columns: list[FloatArray] = []
    for j, name in enumerate(names):
        column = arrow_table.column(j)
        kind = column.type
        if pa.types.is_null(kind) and arrow_table.num_rows == 0:
            # A column built from no values has no type; without rows it holds nothing.
            columns.append(np.zeros(0))
            continue
        if not (
            pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
        ):
            raise DataError(
                f"{path}: column {j} (0-based, named {name!r}) has non-numeric type {kind}"
            )
        if column.null_count:
            mask = column.is_null().to_numpy(zero_copy_only=False)
            r = int(np.flatnonzero(mask)[0])
            raise DataError(f"{path}: row {r}, column {j} (both 0-based; {name!r}) is null")
        columns.append(np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64))
    table = np.column_stack(columns).reshape(arrow_table.num_rows, len(names))
    _check_finite(table, path)
    return table, names


def load_table(
    path: str | os.PathLike[str],
    *,
    label_column: int | str | None = None,
    header: HeaderOption = "auto",
    n_features: int | None = None,
    delimiter: str | None = None,
    allow_empty: bool = False,
    n_columns: int | None = None,
) -> OwnerTable:
    """Load an owner's records and, optionally, their labels.

    Parameters
    ----------
    path : a ``.csv``/``.txt``/``.tsv`` file (optionally gzip-compressed,
        ``.csv.gz``), a ``.npy`` array, or a
        ``.parquet``/``.pq`` file (decided by the suffix).
    label_column : the column holding the class label: an index into the
        file's columns (negative counts from the end), a column name (CSV with a
        header, Parquet), or None (default, PCA) when every column is a feature.
    header : CSV only.  "auto" (default) treats the first non-blank line as a
        header when none of its cells is a number, as data when all are (unless they
        number the columns, 0, 1, 2, 3, ... or 1, 2, 3, 4, ...: the header pandas
        writes, which is refused as ambiguous), and refuses a mixed line; True/False
        force the choice.
    n_features : if given, the expected number of feature columns M (the label
        column excluded); any other count is refused.
    delimiter : CSV field separator; default "," (tab for ``.tsv``).
    allow_empty : accept a table without records whose columns are known (a CSV
        header, an ``.npy`` array of shape (0, K), a Parquet schema). An owner node
        does: under add/remove adjacency an owner without records is a neighbour of one
        with a single record, and must take part in the same way. A CSV file without a
        header row and a ``.npy`` file then need ``n_columns``: without records an
        export of either may carry no width (an empty file, an array of shape (0,)).
    n_columns : the file's column count (label included), declared; a table of
        another width is refused, and an empty file is a table of this width.

    Returns
    -------
    OwnerTable(features (N, M) float64, labels (N,) float64 or None); it unpacks
    as ``X, y = load_table(...)``.

    Raises
    ------
    DataError
        Missing or empty file, wrong column count, non-numeric / NaN / inf cells,
        or a feature count different from ``n_features``.  The message names the
        file and, for a single cell, its 0-based column and its row (a CSV file's
        line number, from 1; a 0-based row index otherwise).
    """
    file = Path(path)
    if not file.is_file():
        raise DataError(f"{file}: no such file")
    suffix = file.suffix.lower()
    if suffix == ".gz":  # gzip-compressed text: the suffix before .gz decides
        suffix = Path(file.stem).suffix.lower()
        if suffix not in _CSV_SUFFIXES:
            raise DataError(f"{file}: only compressed text tables (.csv.gz, .tsv.gz) are read")
    names: Sequence[str] | None = None
    sep = ","
    if suffix in _CSV_SUFFIXES:
        sep = delimiter if delimiter is not None else ("\t" if suffix == ".tsv" else ",")
        try:
            table, names = _load_csv(file, header, sep)
            if (
                header is True
                and names is not None
                and all(map(_is_number, names))
                and not _numbers_its_columns(names)  # asked for by the refusal under auto
            ):
                # Said, not refused: numbers can name columns (review: a headerless
                # file read with header = true silently lost its first record).
                logger.warning(
                    "%s: line 1 is read as a header (header = true), though every cell of "
                    "it is a number; if the file has no header, that record is left out "
                    "(set header = false or auto)",
                    file,
                )
        except _EmptyFile:
            if not allow_empty:
                raise
            if n_columns is None:
                raise DataError(_UNDECLARED_WIDTH.format(file=file, width="N")) from None
            table, names = np.zeros((0, n_columns)), None
        except UnicodeDecodeError as exc:
            raise DataError(f"{file}: not a UTF-8 text file ({exc.reason})") from exc
        except (gzip.BadGzipFile, EOFError) as exc:
            raise DataError(f"{file}: not a readable gzip file: {exc}") from exc
        except csv.Error as exc:
            raise DataError(f"{file}: malformed CSV: {exc}") from exc
    elif suffix == ".npy":
        table = _load_npy(file)
    elif suffix in _PARQUET_SUFFIXES:
        table, names = _load_parquet(file)
    else:
        raise DataError(f"{file}: unsupported file type {suffix!r} (use .csv, .npy or .parquet)")
    if table.shape == (0, 0) and n_columns is not None:
        table = np.zeros((0, n_columns))  # an empty array of unknown width
    if n_columns is not None and table.shape[1] != n_columns:
        raise DataError(
            f"{file}: {table.shape[1]} columns, but the configuration declares {n_columns} "
            "(data.n_columns): if the export's columns changed, set it to the new count, "
            "check policy.allowed_columns, and start the node again"
        )
    if (
        allow_empty
        and n_columns is None
        and (suffix == ".npy" or (suffix in _CSV_SUFFIXES and names is None))
    ):
        # An owner's export without records is an empty file: only a declared width lets
        # it load as a table, so the node starts with or without its last record.
        raise DataError(_UNDECLARED_WIDTH.format(file=file, width=table.shape[1]))
    if table.shape[0] == 0 and not allow_empty:
        raise DataError(
            f"{file}: the table has no records"
            + (" (only a header)" if names is not None and table.shape[1] else "")
            + ("" if names is None else _separator_hint(names, sep))
        )
    if table.shape[1] == 0:
        raise DataError(f"{file}: the table has no columns")
    label_index = _resolve_label_column(label_column, table.shape[1], names, file)
    result = _split(table, label_index, n_features, file)
    # Only the label column this call was told of is known here (an owner node loads
    # every column and picks its label later): without one, columns, not features.
    # No record count: it is a statistic of an owner's data, and an owner's logs carry
    # only its public capacity (they may be collected by others than the owner).
    logger.info(
        "loaded %s: %s",
        file,
        f"{table.shape[1]} columns"
        if label_index is None
        else describe_columns(table.shape[1], label_index),
    )
    return result


def load_columns(
    path: str | os.PathLike[str], columns: Sequence[int], label_column: int | None = None
) -> OwnerTable:
    """Some columns of a table in the owners' file layout: ``columns`` (0-based file
    columns, in this order) as its features, and ``label_column`` as its labels (None:
    no labels), as a query that names its feature columns reads them."""
    table = load_table(path).features
    wanted = [*columns, *(() if label_column is None else (label_column,))]
    if max(wanted) >= table.shape[1]:
        raise DataError(f"{path} has {table.shape[1]} columns; column {max(wanted)} is read")
    labels = None if label_column is None else table[:, label_column]
    return OwnerTable(table[:, list(columns)], labels)
