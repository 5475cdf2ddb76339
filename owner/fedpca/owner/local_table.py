"""The owner's table, loaded once at start-up, and the columns one query reads.

:class:`LocalTable` holds every column of the owner's file (padded with zero rows up to
the owner's declared capacity), and :class:`QueryColumns` the columns a query reads,
named, not copied (:mod:`fedpca.owner.compute` chooses the records and computes the
statistics).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from fedpca.errors import ConfigError
from fedpca.owner.config import DataConfig
from fedpca.query import QueryKind, QuerySpec
from fedpca.table_schema import TableSchema
from fedpca.tables import OwnerTable, load_table

__all__ = ["LocalTable", "QueryColumns"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class LocalTable:
    """Every column of the owner's file, loaded once at start-up.

    Attributes
    ----------
    columns : (N, K) float64, all columns of the file (label column included).
    label_column : 0-based index of the configured label column, or None.
    source : the file the table was read from (for messages).
    capacity : the owner's declared capacity (``data.max_records``), or None. Below it
        the table is kept padded with zero rows up to it, in one array (:attr:`padded`).
    padded : (max(N, capacity), K): the records, then zero rows at the same stride.
        A task below its cap reads its K rows from here, records and padding alike, so
        that reading a file wider than the query costs the same whatever N (found by
        review: real rows were read from the table, padding rows only written, and the
        mean of 3 columns of a 200-column file took 1.3 to 2.1 times as long with K
        records as with none). It costs memory for (capacity - N) rows.
    """

    columns: FloatArray
    label_column: int | None
    source: str
    capacity: int | None = None
    padded: FloatArray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        given = np.asarray(self.columns, dtype=np.float64)
        # No records is a valid table (an owner whose last record was removed takes part
        # as before); no columns is not.
        if given.ndim != 2 or given.shape[1] == 0:
            raise ValueError(f"{self.source}: expected a 2-D table with columns")
        # A private read-only copy (a task must never see another task's edits), padded
        # with zero rows up to the capacity. np.full writes every page (np.zeros would
        # map the zero page, which reads faster than memory the records occupy).
        padded = np.full((max(given.shape[0], self.capacity or 0), given.shape[1]), 0.0)
        padded[: given.shape[0]] = given
        padded.setflags(write=False)
        object.__setattr__(self, "padded", padded)
        object.__setattr__(self, "columns", padded[: given.shape[0]])
        if self.label_column is not None:
            k = self.n_columns
            if not -k <= self.label_column < k:
                raise ConfigError(
                    f"{self.source}: data.label_column = {self.label_column} (0-based) is out "
                    f"of range for {k} columns (0 to {k - 1}, or -1 to -{k} from the end)"
                )
            object.__setattr__(self, "label_column", self.label_column % k)

    @classmethod
    def load(cls, data: DataConfig) -> LocalTable:
        """Load the configured file (DataError with the loader's message if it is bad).

        With ``data.enforce_max_records``, a file of more than ``data.max_records``
        records is a ConfigError: the node stops before it connects, and so before any
        query, instead of sampling (docs/privacy.md, "Bounded owner tables").
        """
        table = load_table(
            data.path, header=data.header, allow_empty=True, n_columns=data.n_columns
        )
        if data.enforce_max_records and table.features.shape[0] > data.max_records:
            raise ConfigError(
                f"{data.path} holds more records than data.max_records = {data.max_records}, "
                "which data.enforce_max_records makes a hard limit. Set enforce_max_records = "
                "false (queries then use a sample); raising max_records because the table "
                "outgrew it is outside the guarantee of bounded owner tables (docs/privacy.md)"
            )
        return cls(table.features, data.label_column, str(data.path), data.max_records)

    @property
    def n_records(self) -> int:
        return int(self.columns.shape[0])

    @property
    def n_columns(self) -> int:
        return int(self.columns.shape[1])

    @property
    def n_features(self) -> int:
        """Feature columns (the configured label column excluded): a schema fact."""
        return self.n_columns - (1 if self.label_column is not None else 0)

    @property
    def schema(self) -> TableSchema:
        """The file's column count and configured label column: public facts."""
        return TableSchema(self.n_columns, self.label_column)

    def columns_read(self, spec: QuerySpec) -> tuple[int, ...]:
        """The file columns ``spec`` reads (:meth:`TableSchema.columns_read`)."""
        return self.schema.columns_read(spec)

    def table_for(self, spec: QuerySpec) -> QueryColumns:
        """The columns ``spec`` reads (its features, and its labels for DCA), not copied.

        Only the table's schema is checked (:meth:`TableSchema.query_columns`); the
        records are not looked at.

        Raises
        ------
        PolicyError
            The query does not fit this owner's columns.
        """
        features, label = self.schema.query_columns(spec)
        return QueryColumns(self.columns, features, label, padding=self.padded)


@dataclass(frozen=True)
class QueryColumns:
    """The columns of the owner's table that one query reads, not copied.

    Copying the query's columns of all N records would cost time linear in N on every
    task, time the proxy can observe: :func:`fedpca.owner.compute.chosen_rows` chooses
    the rows, and the statistics read only those, block by block.

    Attributes
    ----------
    source : (N, K) the owner's read-only file columns (:attr:`LocalTable.columns`).
    feature_columns : the file columns that are the query's features, in order.
    label_column : the file column of the query's labels (DCA), else None.
    padding : the table's :attr:`LocalTable.padded` (the records, then zero rows up to
        the public capacity), or None for an in-memory table (:meth:`of_table`).
    """

    source: FloatArray
    feature_columns: tuple[int, ...]
    label_column: int | None
    padding: FloatArray | None = None

    @classmethod
    def of_table(cls, table: OwnerTable, spec: QuerySpec) -> QueryColumns:
        """An in-memory table's columns for ``spec`` (its labels are read by DCA only)."""
        features = np.asarray(table.features, dtype=np.float64)
        n_features = features.shape[1]
        if spec.kind is not QueryKind.DCA or table.labels is None:
            return cls(features, tuple(range(n_features)), None)
        source = np.column_stack([features, np.asarray(table.labels, dtype=np.float64)])
        return cls(source, tuple(range(n_features)), n_features)

    @property
    def n_records(self) -> int:
        return int(self.source.shape[0])

    @property
    def n_features(self) -> int:
        return len(self.feature_columns)
