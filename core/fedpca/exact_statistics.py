"""Exact fixed-point statistics: what an owner computes from its rows and releases.

Each row is scaled with the query's public bounds, clipped, and quantised so that its
norm bound holds *exactly* in integers; the statistics of the quantised rows are exact
integers on the 2^-f grid, so one record changes each section by at most one clip unit
with no rounding slack (the sensitivities of :mod:`fedpca.stats`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fedpca.codec.matrix import upper_triangle
from fedpca.errors import LayoutError
from fedpca.preprocess import preprocess_for_query
from fedpca.query import QueryKind, QuerySpec
from fedpca.stats import StatisticsSpec, refuse_aggregate

__all__ = [
    "ROW_BITS_MAX",
    "ChosenRows",
    "FixedPointStatistics",
    "fixed_point_statistics",
    "padded_blocks",
    "quantize_unit_rows",
    "real_rows",
    "row_bits",
]

FloatArray = npt.NDArray[np.float64]


ROW_BITS_MAX = 20
"""Largest number of fractional bits of a quantised row coordinate (see row_bits)."""


def row_bits(frac_bits: int) -> int:
    """Fractional bits g of each coordinate of a quantised row: min(f // 2, 20).

    Products of two coordinates then sit on the 2^(2g) grid, at most f, and a block
    of up to 2^(53 − 2g) >= 8192 rows sums them exactly in float64 (every partial sum
    is an integer below 2^53).
    """
    return min(frac_bits // 2, ROW_BITS_MAX)


def quantize_unit_rows(unit_rows: FloatArray, bits: int) -> npt.NDArray[np.int64]:
    """Rows with ‖u‖₂ <= 1 (up to float rounding) as integers q with ‖q‖₂ <= 2^bits exactly.

    Each coordinate is truncated toward zero (|q_i| <= |u_i| 2^bits), which keeps the
    norm; a row that float rounding left a hair above 1 has its largest |q_i| lowered
    by 1 until Σ q_i² <= 4^bits holds in exact integer arithmetic.
    """
    q = np.trunc(np.ldexp(unit_rows, bits)).astype(np.int64)
    limit = 1 << (2 * bits)
    squared = np.einsum("ij,ij->i", q, q)
    for r in np.flatnonzero(squared > limit):
        row = q[r]
        while int(np.dot(row, row)) > limit:
            j = int(np.argmax(np.abs(row)))
            row[j] -= np.sign(row[j])
    return q


@dataclass(frozen=True, eq=False)
class FixedPointStatistics:
    """Exact integer sufficient statistics in 2^-f clip units (what an owner releases).

    Attributes
    ----------
    frac_bits : f.
    scatter : (M, M) int64, Σ q qᵀ shifted onto the 2^f grid (symmetric).
    sums : (M,) int64.
    count : number of records (not scaled).
    class_sums : (C, M) int64 or None (DCA).
    class_counts : (C,) int64 or None (DCA, not scaled).
    """

    frac_bits: int
    scatter: npt.NDArray[np.int64]
    sums: npt.NDArray[np.int64]
    count: int
    class_sums: npt.NDArray[np.int64] | None = None
    class_counts: npt.NDArray[np.int64] | None = None

    def to_vector(self, spec: StatisticsSpec) -> npt.NDArray[np.int64]:
        """The released integer vector, sections in ``spec.sections`` order (2^-f clip units)."""
        refuse_aggregate(spec)
        f = self.frac_bits
        if spec.kind is QueryKind.PCA:
            rest = [self.sums, np.array([self.count << f], dtype=np.int64)]
        else:
            if self.class_sums is None or self.class_counts is None:
                raise LayoutError("DCA statistics need class sums and class counts")
            rest = [self.class_sums.reshape(-1), self.class_counts.astype(np.int64) << f]
        # Written in place: the triangle is most of the vector (16 MiB at M = 2,000).
        m = self.scatter.shape[0]
        triangle = m * (m + 1) // 2
        vector = np.empty(triangle + sum(part.size for part in rest), dtype=np.int64)
        upper_triangle(self.scatter, out=vector[:triangle])
        np.concatenate(rest, out=vector[triangle:], casting="same_kind")
        return vector


_GRAM_STRIP = 256
"""Columns of the Gram matrix computed at a time: a strip of M x 256 float64 (4 MiB at
M = 2,000) instead of a whole M x M product and its integer copy."""


def _add_upper_gram(gram: npt.NDArray[np.int64], rows: FloatArray) -> None:
    """``gram += rowsᵀ rows`` on and above the diagonal, strip by strip of columns.

    Every entry of a strip is an exact float64 sum (the caller's block size keeps it
    below 2^53), so converting it to int64 loses nothing. The addition is done in
    int64, converting the strip a few thousand entries at a time (no int64 copy of
    the whole strip: 4 MiB less at the owner's peak for M = 2,000).
    """
    m = gram.shape[0]
    for start in range(0, m, _GRAM_STRIP):
        stop = min(m, start + _GRAM_STRIP)
        target = gram[:stop, start:stop]
        strip = rows[:, :stop].T @ rows[:, start:stop]
        np.add(target, strip, out=target, dtype=np.int64, casting="unsafe")


def _mirror_upper(matrix: npt.NDArray[np.int64]) -> None:
    """Copy the upper triangle onto the lower one, in place, row by row."""
    for i in range(matrix.shape[0] - 1):
        matrix[i + 1 :, i] = matrix[i, i + 1 :]


def real_rows(x: FloatArray, n_real: int | None) -> int:
    """How many of the rows of ``x`` are records: all, or the first ``n_real`` (the
    rest zero rows of the owner's padded table, read like the records)."""
    if n_real is None:
        return int(x.shape[0])
    if not 0 <= n_real <= x.shape[0]:
        raise LayoutError(f"n_real = {n_real} is not within the {x.shape[0]} rows given")
    return n_real


def padded_blocks(
    x: FloatArray, n: int, total: int, block: int
) -> Iterator[tuple[int, FloatArray, int]]:
    """``total`` rows in blocks of at most ``block``: the rows of ``x`` (its first ``n``
    the records), then zero rows; yields each block's first row, its rows (one buffer,
    overwritten by the next block) and how many of them are records. Every block is
    the same work whatever ``n`` (the statistics of PCA, DCA and aggregates use it)."""
    buffer = np.zeros((block, x.shape[1]), dtype=np.float64)
    for start in range(0, total, block):
        size = min(block, total - start)
        present = max(0, min(size, x.shape[0] - start))  # rows of x: records, or padding
        buffer[:present] = x[start : start + present]
        buffer[present:] = 0.0
        yield start, buffer[:size], max(0, min(size, n - start))


@dataclass(frozen=True)
class ChosenRows:
    """Rows of a table chosen by position, which the statistics read block by block (a
    copy of them all would cost memory for every chosen row at once).

    The first ``n_real`` positions are the records; the rows at the other positions
    are read exactly like them and then left out of every statistic, so the work
    depends on the number of positions, not on ``n_real``.

    Attributes
    ----------
    table : (U, width) the rows chosen from (read-only).
    positions : (total,) int64, the rows read, in this order.
    n_real : how many of the first positions are records.
    columns : the columns of ``table`` read, in the query's order.
    labels : (n_real,) the records' labels (DCA), else None.
    """

    table: FloatArray
    positions: npt.NDArray[np.int64]
    n_real: int
    columns: tuple[int, ...]
    labels: FloatArray | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.n_real <= self.positions.size:
            raise LayoutError(f"n_real = {self.n_real} of {self.positions.size} positions")
        if self.labels is not None and self.labels.shape != (self.n_real,):
            raise LayoutError(f"{self.n_real} records but labels of shape {self.labels.shape}")

    @property
    def total(self) -> int:
        return int(self.positions.size)

    def blocks(self, block: int) -> Iterator[tuple[int, FloatArray, int]]:
        """As :func:`padded_blocks`: each block's first row, its rows, its records."""
        columns = np.asarray(self.columns, dtype=np.int64)
        for start in range(0, self.total, block):
            chosen = self.positions[start : start + block]
            rows = self.table[np.ix_(chosen, columns)]
            yield start, rows, max(0, min(chosen.size, self.n_real - start))


def fixed_point_statistics(
    features: npt.ArrayLike | ChosenRows,
    labels: npt.ArrayLike | None,
    query: QuerySpec,
    *,
    pad_to: int = 0,
    n_real: int | None = None,
) -> FixedPointStatistics:
    """Exact fixed-point statistics of raw records under a query (what an owner releases).

    Each record is scaled with the query's public bounds and clipped to norm c
    (:func:`fedpca.preprocess.preprocess_for_query`), divided by c, and quantised to
    ``row_bits(f)`` fractional bits with ‖q‖ <= 1 *exactly*
    (:func:`quantize_unit_rows`). The statistics of the quantised rows are then exact
    integers: no rounding happens after quantisation, so one record changes each
    section by at most 1 clip unit (2^f integer units) — the sensitivity the noise
    is calibrated with, without any rounding slack.

    Parameters
    ----------
    features : (N, M) raw records, or the rows chosen from the owner's table
        (:class:`ChosenRows`, which then brings its labels and number of records).
    labels : (N,) labels for DCA, each one of ``query.class_labels``; None for PCA.
    query : the public query (bounds, clip norm, kind, class labels, frac_bits).
    pad_to : process at least this many rows, the extra ones all-zero and left out of
        every statistic: the work done (and the time taken) depends on
        max(N, pad_to) only, not on N.
    n_real : PCA only: the first ``n_real`` rows of ``features`` are the records, the
        rest zero rows of the same table that pad them (read like the records, so that
        reading a wide table costs the same whatever N; left out of every statistic).

    Returns
    -------
    FixedPointStatistics
    """
    spec = StatisticsSpec.from_query(query)
    refuse_aggregate(spec)
    blocks_of: Callable[[int], Iterator[tuple[int, FloatArray, int]]]
    if isinstance(features, ChosenRows):
        labels, n, total = features.labels, features.n_real, features.total
        m = len(features.columns)
        blocks_of = features.blocks
    else:
        x = np.asarray(features, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != spec.n_features:
            raise LayoutError(f"records must have shape (N, {spec.n_features}), got {x.shape}")
        if n_real is not None and spec.kind is QueryKind.DCA:
            raise LayoutError("n_real is for PCA queries (DCA gathers each class's records)")
        n, m = real_rows(x, n_real), x.shape[1]
        total = max(n, pad_to)
        blocks_of = functools.partial(padded_blocks, x, n, total)
    if m != spec.n_features:
        raise LayoutError(f"records must have {spec.n_features} features, got {m}")
    f = query.frac_bits
    g = row_bits(f)
    # Blocks small enough for exact float64 sums (<= 2^(53-2g) rows) and about 2 MiB
    # (each of the few arrays one block's rows pass through has that size).
    block = max(1, min(4096, 1 << (53 - 2 * g), max(64, (1 << 18) // m)))
    gram = np.zeros((m, m), dtype=np.int64)
    sums = np.zeros(m, dtype=np.int64)
    class_index: npt.NDArray[np.int64] | None = None
    class_sums: npt.NDArray[np.int64] | None = None
    class_counts: npt.NDArray[np.int64] | None = None
    if spec.kind is QueryKind.DCA:
        if labels is None:
            raise LayoutError("a DCA query needs a label for every record")
        y = np.asarray(labels, dtype=np.float64).reshape(-1)
        if y.shape != (n,):
            raise LayoutError(f"{n} records but {y.shape[0]} labels")
        # Every row up to max(N, pad_to) is looked up, padding rows with the first class
        # (they are zeroed below), by comparing it with every class: the same work for
        # every row whatever its label. (numpy's binary search branched on the labels,
        # so their mix and order showed in the time; found by review.)
        classes = np.asarray(spec.class_labels, dtype=np.float64)
        padded = np.full(total, classes[0])
        padded[:n] = y
        class_index = np.zeros(total, dtype=np.int64)
        matches = np.zeros(total, dtype=np.int64)
        for c, label in enumerate(classes):
            equal = padded == label
            class_index += equal * c
            matches += equal
        if not np.all(matches == 1):  # class labels are distinct: 0 means none matched
            raise LayoutError("every label must be one of the query's class labels")
        class_sums = np.zeros((spec.n_classes, m), dtype=np.int64)
        class_counts = np.zeros(spec.n_classes, dtype=np.int64)
    inverse_clip = 1.0 / query.clip_norm
    for start, rows, real in blocks_of(block):
        size = rows.shape[0]
        # The same work for real and padding rows; padding is zeroed after scaling.
        unit = preprocess_for_query(rows, query) * inverse_clip
        q = quantize_unit_rows(unit, g)
        q *= (np.arange(size) < real)[:, None]
        qf = q.astype(np.float64)
        _add_upper_gram(gram, qf)
        sums += q.sum(axis=0)
        if class_index is not None and class_sums is not None and class_counts is not None:
            onehot = np.zeros((size, spec.n_classes), dtype=np.float64)
            onehot[np.arange(size), class_index[start : start + size]] = 1.0
            onehot[real:] = 0.0
            class_sums += (onehot.T @ qf).astype(np.int64)
            class_counts += onehot.sum(axis=0).astype(np.int64)
    _mirror_upper(gram)
    scatter = np.left_shift(gram, f - 2 * g, out=gram)
    if class_sums is not None:
        class_sums = class_sums << (f - g)
    return FixedPointStatistics(
        frac_bits=f,
        scatter=scatter,
        sums=sums << (f - g),
        count=n,
        class_sums=class_sums,
        class_counts=class_counts,
    )
