"""Loading owner tables: CSV (header auto-detection), .npy, Parquet, and clear errors."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fedpca.data import dataset_path
from fedpca.errors import DataError
from fedpca.tables import load_columns, load_table


def _write(tmp_path: Path, text: str, name: str = "owner.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


class TestCsv:
    def test_without_header_auto(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "1,2.5,3\n-1,4,5e-1\n")
        x, y = load_table(path)
        np.testing.assert_array_equal(x, [[1, 2.5, 3], [-1, 4, 0.5]])
        assert y is None
        assert x.dtype == np.float64

    def test_with_header_auto_and_label_by_index_or_name(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "label,f1,f2\n1,0.5,0.25\n-1,2,3\n")
        x, y = load_table(path, label_column=0)
        np.testing.assert_array_equal(x, [[0.5, 0.25], [2, 3]])
        assert y is not None
        np.testing.assert_array_equal(y, [1, -1])
        x2, y2 = load_table(path, label_column="f2")
        np.testing.assert_array_equal(x2, [[1, 0.5], [-1, 2]])
        np.testing.assert_array_equal(y2, [0.25, 3])

    def test_label_column_anywhere_including_negative(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "1,2,3\n4,5,6\n")
        x, y = load_table(path, label_column=-1)
        np.testing.assert_array_equal(x, [[1, 2], [4, 5]])
        np.testing.assert_array_equal(y, [3, 6])
        x, y = load_table(path, label_column=1)
        np.testing.assert_array_equal(x, [[1, 3], [4, 6]])
        out_of_range = r"label column 3 \(0-based\) is out of range for 3 columns \(0 to 2,"
        with pytest.raises(DataError, match=out_of_range):
            load_table(path, label_column=3)
        with pytest.raises(DataError, match="by name, but no header"):
            load_table(path, label_column="y")

    def test_explicit_header_option(self, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
        path = _write(tmp_path, "1,2\n3,4\n")
        with caplog.at_level(logging.WARNING, logger="fedpca.tables"):
            x, _ = load_table(path, header=True)
        np.testing.assert_array_equal(x, [[3, 4]])
        # A header of numbers only is taken as asked, and said (review: a headerless
        # file read with header = true lost its first record without a word).
        assert "line 1 is read as a header (header = true), though every cell" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fedpca.tables"):
            load_table(_write(tmp_path, "a,b\n3,4\n", "named.csv"), header=True)
        assert caplog.text == ""
        text = _write(tmp_path, "a,b\n3,4\n", "text.csv")
        with pytest.raises(
            DataError, match=r"text\.csv: line 1, column 0 \(0-based\): 'a' is not a number"
        ):
            load_table(text, header=False)

    def test_text_labels_are_told_to_be_recoded(self, tmp_path: Path) -> None:
        """Found by review: the UCI original's 'g'/'b' labels were reported as a header
        problem, then (header = false) as "not a number", with no word on the fix."""
        path = _write(tmp_path, "0.5,0.2,g\n0.1,0.3,b\n")
        with pytest.raises(DataError, match="recode a column of text, such as class labels"):
            load_table(path)
        with pytest.raises(DataError, match=r"'g' is not a number; every cell .* numeric codes"):
            load_table(path, header=False)

    def test_mixed_first_line_is_not_guessed(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "y,1,2\n0,3,4\n")
        with pytest.raises(DataError, match=r"line 1 mixes numbers and text .*header=True"):
            load_table(path)
        # An operator reads this from `owner probe`/`serve`: it names the config setting.
        with pytest.raises(DataError, match=r"header = true or false under \[data\]"):
            load_table(path)
        x, _ = load_table(path, header=True)
        np.testing.assert_array_equal(x, [[0, 3, 4]])

    def test_a_first_line_numbering_the_columns_is_not_guessed(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Found by review: pandas writes 0, 1, ..., n-1 as the header of unnamed columns
        (``to_csv(index=False)``); it was read as a record (label 0, and its features
        clipped to the bounds) in every release."""
        for first in ("0,1,2,3,4", "1,2,3,4,5", "0.0,1.0,2.0,3.0,4.0"):
            path = _write(tmp_path, f"{first}\n-1,0.5,0.2,0.1,0.3\n", "pandas.csv")
            with pytest.raises(DataError, match=r"line 1 reads .*: column numbers .* or a record"):
                load_table(path)
            with caplog.at_level(logging.WARNING, logger="fedpca.tables"):
                x, _ = load_table(path, header=True)  # as the refusal asks: no warning
            np.testing.assert_array_equal(x, [[-1, 0.5, 0.2, 0.1, 0.3]])
            assert caplog.text == ""
        # Any other record of numbers is a record, three consecutive integers too.
        for first in ("0,1,2,4,5", "2,3,4,5,6", "1,2,3"):
            path = _write(tmp_path, f"{first}\n1,1,1{',1,1' if first != '1,2,3' else ''}\n")
            x, _ = load_table(path)
            assert x.shape[0] == 2

    def test_a_column_in_a_message_is_the_0_based_index_the_configuration_uses(
        self, tmp_path: Path
    ) -> None:
        """A new operator's review: these messages counted columns from 1, while
        data.label_column, data.n_columns and policy.allowed_columns count from 0."""
        path = _write(tmp_path, "a,b,c,d\n1,2,3,4\n5,6,seven,8\n")
        with pytest.raises(DataError) as refused:
            load_table(path)
        assert "line 3, column 2 (0-based): 'seven' is not a number" in str(refused.value)
        # The same number, as data.label_column, names that very column.
        _, labels = load_table(_write(tmp_path, "a,b,c,d\n1,2,3,4\n", "ok.csv"), label_column=2)
        assert labels is not None and labels.tolist() == [3.0]
        mixed = _write(tmp_path, "1,2,y\n3,4,5\n", "mixed.csv")
        with pytest.raises(
            DataError, match=r"mixes numbers and text \(column 2, 0-based, is 'y'\)"
        ):
            load_table(mixed)

    def test_empty_cells_are_named_as_such(self, tmp_path: Path) -> None:
        """Review: a trailing comma on every line was reported as a header that "mixes
        numbers and text (column 3 is '')"; a missing value as "'' is not a number"."""
        trailing = _write(tmp_path, "1,2,3,\n4,5,6,\n", "trailing.csv")
        with pytest.raises(DataError, match=r"line 1 ends with a separator") as refused:
            load_table(trailing)
        assert "mixes numbers and text" not in str(refused.value)
        with pytest.raises(DataError, match=r"line 2 ends with a separator"):
            load_table(_write(tmp_path, "a,b,c,\n1,2,3,\n", "named.csv"), header=True)
        missing = _write(tmp_path, "1,2,3\n4,,6\n", "missing.csv")
        with pytest.raises(DataError, match=r"line 2 has an empty cell \(column 1, 0-based\)"):
            load_table(missing)
        with pytest.raises(DataError, match=r"line 1 has an empty cell \(column 0, 0-based\)"):
            load_table(_write(tmp_path, ",2,3\n4,5,6\n", "first.csv"))

    def test_wrong_column_count_names_file_and_line(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "a,b,c\n1,2,3\n4,5\n")
        with pytest.raises(DataError, match=r"owner\.csv: line 3 has 2 columns, expected 3"):
            load_table(path)

    def test_non_numeric_cell_names_line_and_column(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "1,2,3\n\n4,x5,6\n")
        # The blank line still counts: the error is on physical line 3.
        with pytest.raises(DataError, match=r"line 3, column 1 \(0-based\): 'x5' is not a number"):
            load_table(path)

    @pytest.mark.parametrize("bad", ["nan", "NaN", "inf", "-Infinity"])
    def test_nan_and_inf_are_refused(self, tmp_path: Path, bad: str) -> None:
        path = _write(tmp_path, f"1,2,3\n4,5,6\n7,8,{bad}\n")
        with pytest.raises(
            DataError, match=rf"line 3, column 2 \(0-based\): '{bad}' is not finite"
        ):
            load_table(path)

    def test_empty_and_header_only(self, tmp_path: Path) -> None:
        with pytest.raises(DataError, match=r"empty\.csv: the file is empty"):
            load_table(_write(tmp_path, "", "empty.csv"))
        with pytest.raises(DataError, match="the file is empty"):
            load_table(_write(tmp_path, "\n\n", "blank.csv"))
        with pytest.raises(DataError, match="no records \\(only a header\\)"):
            load_table(_write(tmp_path, "a,b\n", "header.csv"))

    def test_another_separator_is_named(self, tmp_path: Path) -> None:
        # Many spreadsheets export semicolons; csv reads each such line as one cell.
        semicolons = "1;2.5;3\n-1;4;0.5\n"
        with pytest.raises(
            DataError,
            match=r"line 1, column 0 \(0-based\): .* is not a number \(the "
            r"line looks semicolon-separated, but this file is read as "
            r"comma-separated",
        ):
            load_table(_write(tmp_path, semicolons), header=False)
        with pytest.raises(DataError, match="looks semicolon-separated"):
            load_table(_write(tmp_path, "1;2.5;3\n", "one.csv"))
        with pytest.raises(DataError, match="looks tab-separated"):
            load_table(_write(tmp_path, "1\t2.5\t3\n-1\t4\t0.5\n", "tabs.csv"), header=False)
        # A .tsv is read tab-separated: commas in it are what is named.
        with pytest.raises(
            DataError, match="looks comma-separated, but this file is read as tab-separated"
        ):
            load_table(_write(tmp_path, "1,2\n3,4\n", "commas.tsv"), header=False)
        # A genuine one-column table is not second-guessed.
        with pytest.raises(DataError) as plain:
            load_table(_write(tmp_path, "1\nx\n", "single.csv"), header=False)
        assert "separated" not in str(plain.value)

    def test_a_declared_width_loads_an_empty_headerless_file(self, tmp_path: Path) -> None:
        empty = _write(tmp_path, "", "empty.csv")
        table = load_table(empty, label_column=0, allow_empty=True, n_columns=4)
        assert table.features.shape == (0, 3) and table.labels is not None
        assert table.labels.shape == (0,)
        # Without it an owner's loader refuses a headerless file, empty or not.
        for text in ("", "1,2,3,5\n"):
            path = _write(tmp_path, text, "undeclared.csv")
            with pytest.raises(DataError, match=r"needs its column count declared"):
                load_table(path, allow_empty=True)
        with pytest.raises(DataError, match="4 columns, but the configuration declares 5"):
            load_table(_write(tmp_path, "1,2,3,5\n", "wide.csv"), n_columns=5)

    def test_expected_feature_count(self, tmp_path: Path) -> None:
        path = _write(tmp_path, "1,2,3\n4,5,6\n")
        assert load_table(path, label_column=0, n_features=2).features.shape == (2, 2)
        with pytest.raises(DataError, match=r"2 feature columns \(label column excluded\), .*4"):
            load_table(path, label_column=0, n_features=4)
        with pytest.raises(DataError, match="3 feature columns, but the query expects 2"):
            load_table(path, n_features=2)

    def test_only_a_label_column(self, tmp_path: Path) -> None:
        with pytest.raises(DataError, match="no feature columns"):
            load_table(_write(tmp_path, "1\n2\n"), label_column=0)

    def test_binary_file_is_refused(self, tmp_path: Path) -> None:
        path = tmp_path / "bin.csv"
        path.write_bytes(b"1,2\n\xff\xfe,3\n")
        with pytest.raises(DataError, match=r"bin\.csv: not a UTF-8 text file"):
            load_table(path)

    def test_tsv_and_delimiter(self, tmp_path: Path) -> None:
        x, _ = load_table(_write(tmp_path, "1\t2\n3\t4\n", "t.tsv"))
        np.testing.assert_array_equal(x, [[1, 2], [3, 4]])
        x, _ = load_table(_write(tmp_path, "1;2\n3;4\n", "s.csv"), delimiter=";")
        np.testing.assert_array_equal(x, [[1, 2], [3, 4]])


class TestNpy:
    def test_round_trip_with_label(self, tmp_path: Path) -> None:
        table = np.array([[1, 0.5, 0.25], [-1, 2, 3]], dtype=np.float32)
        np.save(tmp_path / "t.npy", table)
        x, y = load_table(tmp_path / "t.npy", label_column=0, n_features=2)
        np.testing.assert_array_equal(x, table[:, 1:])
        np.testing.assert_array_equal(y, [1, -1])
        assert x.dtype == np.float64

    def test_errors(self, tmp_path: Path) -> None:
        np.save(tmp_path / "one.npy", np.zeros(3))
        with pytest.raises(DataError, match=r"one\.npy: expected a 2-D array"):
            load_table(tmp_path / "one.npy")
        bad = np.zeros((3, 2))
        bad[2, 1] = np.nan
        np.save(tmp_path / "nan.npy", bad)
        with pytest.raises(
            DataError, match=r"nan\.npy: row 2, column 1 \(both 0-based\): nan is not finite"
        ):
            load_table(tmp_path / "nan.npy")
        np.save(tmp_path / "str.npy", np.array([["a", "b"]]))
        with pytest.raises(DataError, match="not numeric"):
            load_table(tmp_path / "str.npy")
        np.save(tmp_path / "empty.npy", np.zeros((0, 3)))
        with pytest.raises(DataError, match="no records"):
            load_table(tmp_path / "empty.npy")
        (tmp_path / "junk.npy").write_bytes(b"not numpy")
        with pytest.raises(DataError, match=r"not a readable \.npy"):
            load_table(tmp_path / "junk.npy")


class TestParquet:
    def test_round_trip_label_by_name(self, tmp_path: Path) -> None:
        table = pa.table({"f1": [0.5, 2.0], "cls": [1, -1], "f2": [0.25, 3.0]})
        pq.write_table(table, tmp_path / "t.parquet")
        x, y = load_table(tmp_path / "t.parquet", label_column="cls", n_features=2)
        np.testing.assert_array_equal(x, [[0.5, 0.25], [2, 3]])
        np.testing.assert_array_equal(y, [1, -1])

    def test_null_and_text_columns(self, tmp_path: Path) -> None:
        pq.write_table(pa.table({"a": [1.0, None, 3.0], "b": [1, 2, 3]}), tmp_path / "n.parquet")
        with pytest.raises(
            DataError, match=r"n\.parquet: row 1, column 0 \(both 0-based; 'a'\) is null"
        ):
            load_table(tmp_path / "n.parquet")
        pq.write_table(pa.table({"a": [1.0], "b": ["x"]}), tmp_path / "s.parquet")
        with pytest.raises(
            DataError, match=r"column 1 \(0-based, named 'b'\) has non-numeric type"
        ):
            load_table(tmp_path / "s.parquet")
        pq.write_table(pa.table({"a": [1.0, float("inf")]}), tmp_path / "i.parquet")
        with pytest.raises(DataError, match=r"row 1, column 0 \(both 0-based\): inf is not finite"):
            load_table(tmp_path / "i.parquet")


def test_missing_file_and_unknown_suffix(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file"):
        load_table(tmp_path / "absent.csv")
    with pytest.raises(DataError, match=r"unsupported file type '\.xlsx'"):
        load_table(_write(tmp_path, "1,2\n", "t.xlsx"))


def test_real_dataset_with_label_in_column_zero() -> None:
    x, y = load_table(dataset_path("ionosphere"), label_column=0, n_features=34)
    assert x.shape == (351, 34)
    assert y is not None
    assert set(np.unique(y)) == {-1.0, 1.0}
    raw = np.loadtxt(dataset_path("ionosphere"), delimiter=",")
    np.testing.assert_array_equal(x, raw[:, 1:])
    np.testing.assert_array_equal(y, raw[:, 0])


def test_load_columns_reads_the_named_file_columns_in_order_and_the_labels(
    tmp_path: Path,
) -> None:
    table = np.arange(24, dtype=np.float64).reshape(4, 6) + 0.5  # no header-like row
    path = tmp_path / "sample.csv"
    np.savetxt(path, table, delimiter=",")
    features, labels = load_columns(path, (5, 2, 4), 0)
    np.testing.assert_array_equal(features, table[:, [5, 2, 4]])
    assert labels is not None
    np.testing.assert_array_equal(labels, table[:, 0])
    assert load_columns(path, (1,)).labels is None
    with pytest.raises(DataError, match="has 6 columns; column 6 is read"):
        load_columns(path, (1, 2), 6)
