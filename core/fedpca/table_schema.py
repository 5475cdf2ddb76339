"""An owner's table as a query sees it before any record is read: its schema.

The schema is the file's column count and the column the owner configured as its labels:
public facts an owner states (:class:`fedpca.owner_terms.OwnerTerms`). Which columns a
query reads, and whether this table has them, follows from the schema alone, so the
owner's node decides it here and the analyst can ask the same question of an owner's
stated terms before it submits.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedpca.errors import PolicyError
from fedpca.query import QueryKind, QuerySpec

__all__ = ["TableSchema"]


@dataclass(frozen=True)
class TableSchema:
    """The schema of one owner's file.

    Attributes
    ----------
    n_columns : columns of the file, the label column counted.
    label_column : 0-based index of the configured label column, or None.
    """

    n_columns: int
    label_column: int | None = None

    def columns_read(self, spec: QuerySpec) -> tuple[int, ...]:
        """The file columns ``spec`` reads (0-based): what ``policy.allowed_columns`` limits.

        PCA reads every feature column, DCA every column (the label too), unless the
        query names its feature columns (then those, and DCA's label); an aggregate
        query reads the columns its aggregates name.

        Raises
        ------
        PolicyError
            A DCA query whose label column this table does not have (:meth:`dca_label`).
        """
        if spec.kind is QueryKind.AGGREGATE:
            return spec.aggregate_columns
        if spec.feature_columns:
            label = () if spec.kind is QueryKind.PCA else (self.dca_label(spec),)
            return tuple(sorted({*spec.feature_columns, *label}))
        everything = tuple(range(self.n_columns))
        if spec.kind is QueryKind.PCA and self.label_column is not None:
            return tuple(c for c in everything if c != self.label_column)
        return everything

    def query_columns(self, spec: QuerySpec) -> tuple[tuple[int, ...], int | None]:
        """The file columns that are ``spec``'s features, in order, and its label column
        (DCA only, else None), checked against this schema.

        Aggregate queries read the columns they name (``spec.aggregate_columns``, in that
        order) as features; any column of the file may be read, the label column too.

        Raises
        ------
        PolicyError
            If the query's feature count does not match this table's columns, or its
            label column does not exist or differs from the configured one, or it reads
            a column the file does not have.
        """
        if spec.kind is QueryKind.AGGREGATE:
            missing = [c for c in spec.aggregate_columns if c >= self.n_columns]
            if missing:
                raise PolicyError(
                    f"query {spec.query_id!r} reads column {missing[0]} (0-based); this "
                    f"owner's data has {self._range()}"
                )
            return tuple(spec.aggregate_columns), None
        if spec.feature_columns:
            missing = [c for c in spec.feature_columns if c >= self.n_columns]
            if missing:
                raise PolicyError(
                    f"query {spec.query_id!r} reads feature column {missing[0]} (0-based); "
                    f"this owner's data has {self._range()}"
                )
        label = self.dca_label(spec) if spec.kind is QueryKind.DCA else self.label_column
        if label is not None and label in spec.feature_columns:
            # The column the owner declared as its labels is not a PCA feature (nor a
            # DCA one: a query's own label column is never among its features).
            raise PolicyError(
                f"query {spec.query_id!r} reads column {label}, this owner's label column, "
                "as a feature"
            )
        features = spec.feature_columns or tuple(c for c in range(self.n_columns) if c != label)
        if len(features) != spec.n_features:
            raise PolicyError(
                f"query {spec.query_id!r} has {spec.n_features} features; this owner's data has "
                f"{len(features)}" + (" (label column excluded)" if label is not None else "")
            )
        return features, (label if spec.kind is QueryKind.DCA else None)

    def dca_label(self, spec: QuerySpec) -> int:
        """The column a DCA query reads its labels from, checked against the schema.

        Raises
        ------
        PolicyError
        """
        label = spec.label_column if spec.label_column is not None else self.label_column
        if label is None:
            raise PolicyError(
                f"query {spec.query_id!r} is a DCA query without a label column, and this "
                "owner has no data.label_column"
            )
        if not 0 <= label < self.n_columns:
            raise PolicyError(
                f"query {spec.query_id!r} reads labels from column {label} (0-based); this "
                f"owner's data has {self._range()}"
            )
        if self.label_column is not None and label != self.label_column:
            # Using the configured label column as a feature would release labels
            # the owner declared as such under a feature's bounds.
            raise PolicyError(
                f"query {spec.query_id!r} reads labels from column {label} (0-based); this "
                f"owner's labels are in column {self.label_column}"
            )
        return label

    def _range(self) -> str:
        return f"{self.n_columns} columns (0 to {self.n_columns - 1})"
