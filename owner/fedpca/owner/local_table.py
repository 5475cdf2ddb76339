"""The owner's table, loaded once at start-up, and the columns one query reads.

:class:`LocalTable` holds every column of the owner's file (padded with zero rows up to
the owner's declared capacity), :class:`LabelIndex` where each label's records are,
and :class:`QueryColumns` the columns a query reads, named, not copied
(:mod:`fedpca.owner.compute` chooses the records and computes the statistics).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from fedpca.errors import ConfigError, PolicyError
from fedpca.owner.config import DataConfig
from fedpca.query import QueryKind, QuerySpec
from fedpca.tables import OwnerTable, load_table

__all__ = ["LabelIndex", "LocalTable", "QueryColumns"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class LabelIndex:
    """Where each label value's records are, found without a pass over the table.

    Built once when the table is loaded. A DCA query then finds each public class's
    records by binary search (O(log N)) instead of comparing every record's label with
    it (O(N) per class, on the path to the owner's first ciphertext: the proxy's clock
    saw N through it, docs/privacy.md, "Work padded to a public size"). It costs 8
    bytes per record, and a stable sort of the labels at start-up.

    Attributes
    ----------
    order : (N,) int64, the records in order of their label; records of one label in
        their order in the table (a stable sort).
    values : the distinct labels, ascending.
    starts : (len(values) + 1,) where each value's records begin in ``order``.
    """

    order: IntArray
    values: FloatArray
    starts: IntArray

    @classmethod
    def of(cls, labels: FloatArray) -> LabelIndex:
        order = np.argsort(labels, kind="stable").astype(np.int64)
        values, starts = np.unique(labels[order], return_index=True)
        ends = np.append(starts, order.size).astype(np.int64)
        for array in (order, values, ends):
            array.setflags(write=False)
        return cls(order, values, ends)

    def members(self, label: float) -> IntArray:
        """Ascending positions of the records whose label equals ``label`` (== on floats)."""
        i = int(np.searchsorted(self.values, label))
        if i == self.values.size or self.values[i] != label:
            return self.order[:0]
        return self.order[self.starts[i] : self.starts[i + 1]]


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
    label_index : the configured label column's :class:`LabelIndex` (None without one).
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
    label_index: LabelIndex | None = field(default=None, init=False, repr=False)
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
            labels = self.columns[:, self.label_column]
            object.__setattr__(self, "label_index", LabelIndex.of(labels))

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

    def columns_read(self, spec: QuerySpec) -> tuple[int, ...]:
        """The file columns ``spec`` reads (0-based): what ``policy.allowed_columns`` limits.

        PCA reads every feature column, DCA every column (the label too), an aggregate
        query the columns its aggregates name.
        """
        if spec.kind is QueryKind.AGGREGATE:
            return spec.aggregate_columns
        everything = tuple(range(self.n_columns))
        if spec.kind is QueryKind.PCA and self.label_column is not None:
            return tuple(c for c in everything if c != self.label_column)
        return everything

    def table_for(self, spec: QuerySpec) -> QueryColumns:
        """The columns ``spec`` reads (its features, and its labels for DCA), not copied.

        Only the table's schema is checked (its column count and configured label
        column, public facts the owner could declare); the records are not looked at.

        Aggregate queries read the columns they name (``spec.aggregate_columns``, in that
        order) as features; any column of the file may be read, the label column too.

        Raises
        ------
        PolicyError
            If the query's feature count does not match this owner's columns, or its
            label column does not exist or differs from the configured one, or an
            aggregate reads a column the file does not have.
        """
        if spec.kind is QueryKind.AGGREGATE:
            missing = [c for c in spec.aggregate_columns if c >= self.n_columns]
            if missing:
                raise PolicyError(
                    f"query {spec.query_id!r} reads column {missing[0]} (0-based); this "
                    f"owner's data has {self.n_columns} columns (0 to {self.n_columns - 1})"
                )
            return QueryColumns(
                self.columns, tuple(spec.aggregate_columns), None, padding=self.padded
            )
        if spec.kind is QueryKind.DCA:
            label = spec.label_column if spec.label_column is not None else self.label_column
            if label is None:
                raise PolicyError(
                    f"query {spec.query_id!r} is a DCA query without a label column, and this "
                    "owner has no data.label_column"
                )
            if not 0 <= label < self.n_columns:
                raise PolicyError(
                    f"query {spec.query_id!r} reads labels from column {label} (0-based); this "
                    f"owner's data has {self.n_columns} columns (0 to {self.n_columns - 1})"
                )
            if self.label_column is not None and label != self.label_column:
                # Using the configured label column as a feature would release labels
                # the owner declared as such under a feature's bounds.
                raise PolicyError(
                    f"query {spec.query_id!r} reads labels from column {label} (0-based); this "
                    f"owner's labels are in column {self.label_column}"
                )
        else:
            label = self.label_column
        features = tuple(c for c in range(self.n_columns) if c != label)
        if len(features) != spec.n_features:
            raise PolicyError(
                f"query {spec.query_id!r} has {spec.n_features} features; this owner's data has "
                f"{len(features)}" + (" (label column excluded)" if label is not None else "")
            )
        if spec.kind is not QueryKind.DCA:
            return QueryColumns(self.columns, features, None, padding=self.padded)
        # Labels from a column not configured as data.label_column have no index: each
        # class is then found by comparing every record's label (time linear in N).
        index = self.label_index if label == self.label_column else None
        return QueryColumns(self.columns, features, label, index)


@dataclass(frozen=True)
class QueryColumns:
    """The columns of the owner's table that one query reads, not copied yet.

    Copying the query's columns of all N records before choosing the records would
    cost time linear in N on every task, time the proxy can observe. The records are
    chosen first (:func:`contributed_rows`) and only the chosen ones are copied
    (:meth:`rows`; all of them, of consecutive columns, are read in place).

    Attributes
    ----------
    source : (N, K) the owner's read-only file columns (:attr:`LocalTable.columns`).
    feature_columns : the file columns that are the query's features, in order.
    label_column : the file column of the query's labels (DCA), else None.
    label_index : that column's :class:`LabelIndex`, if the table keeps one.
    padding : the table's :attr:`LocalTable.padded` (PCA and aggregate queries), or None.
    """

    source: FloatArray
    feature_columns: tuple[int, ...]
    label_column: int | None
    label_index: LabelIndex | None = None
    padding: FloatArray | None = None

    def padded_features(self, count: int) -> FloatArray | None:
        """The feature columns of the first ``count`` rows of the padded table (records,
        then zero rows), or None if it has fewer rows or there is none: a read-only view
        for consecutive columns, else a copy of ``count`` rows (the same work whatever N).
        """
        if self.padding is None or self.padding.shape[0] < count:
            return None
        return self._features_of(self.padding[:count])

    def _features_of(self, rows: FloatArray) -> FloatArray:
        """The feature columns of ``rows`` (rows of the table): a read-only view when
        they are consecutive, else a contiguous copy."""
        columns = list(self.feature_columns)
        first = columns[0] if columns else 0
        if columns == list(range(first, first + len(columns))):
            view = rows[:, first : first + len(columns)]
            view.flags.writeable = False
            return view
        return np.ascontiguousarray(rows[:, columns])

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

    def labels(self) -> FloatArray | None:
        """The label column as a read-only view (nothing copied), or None."""
        return None if self.label_column is None else self.source[:, self.label_column]

    def rows(self, keep: IntArray | None = None) -> OwnerTable:
        """The records ``keep`` (row indices; None: every record), in order: copies, or
        for every record of consecutive columns a read-only view of the table (a copy
        would sit beside the statistics being computed: 7.6 MiB at 500 x 2,000)."""
        if keep is None:
            labels = None if self.label_column is None else self.source[:, self.label_column]
            features = self._features_of(self.source)
        else:
            columns = np.asarray(self.feature_columns, dtype=np.int64)
            features = np.ascontiguousarray(self.source[np.ix_(keep, columns)])
            labels = None if self.label_column is None else self.source[keep, self.label_column]
        return OwnerTable(features, None if labels is None else np.array(labels))
