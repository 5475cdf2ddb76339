"""Aggregate queries: their released sections, sensitivities and exact owner statistics.

An aggregate query (:class:`fedpca.query.QuerySpec` of kind ``aggregate``) carries one
or more :class:`fedpca.query.Aggregate`; their sections are concatenated into the one
released vector, noised with one budget (:class:`fedpca.protocol.ReleasePlan` splits
it with the query's ``noise_weights``). Section names are ``"<part>.<name>"`` with the
aggregate's index in the query.

Scaling. Every bounded column of a ``stats`` or ``linreg`` aggregate is clipped to its
public bounds [lo, hi] and mapped affinely onto [-1, 1] (u = 2(x - lo)/(hi - lo) - 1),
then truncated toward zero onto the grid of g = ``row_bits(f)`` fractional bits, so
|q| <= 2^g exactly. Sums and products of these integers are exact (float64 sums of
integers below 2^53 in blocks, accumulated in int64) and shifted onto the 2^-f grid;
counts stay on the integer grid. One record therefore changes every section by at most
its bound below, exactly, with no rounding slack.

Sections and their per-record changes (clip unit 1 in the scaled space; d columns):

=========================  =========  ==============  ==================  ===========
aggregate                  section    length          add/remove          swap
=========================  =========  ==============  ==================  ===========
stats                      count      1               1                   0
stats                      sums       d               √d                  2√d
stats, moments=variance    squares    d               √d                  √d
stats, moments=covariance  products   d(d+1)/2        √(d(d+1)/2)         √(d² + d/2)
histogram                  counts     cells           1                   √2
linreg                     count      1               1                   0
linreg                     x_sums     d               √d                  2√d
linreg                     y_sum      1               1                   2
linreg                     xtx        d(d+1)/2        √(d(d+1)/2)         √(d² + d/2)
linreg                     xty        d               √d                  2√d
=========================  =========  ==============  ==================  ===========

docs/privacy.md ("Aggregate queries") derives each bound; :func:`fedpca.stats.worst_case_change`
combines them into the release's noise multiplier.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fedpca.errors import LayoutError
from fedpca.exact_statistics import ChosenRows, padded_blocks, real_rows, row_bits
from fedpca.preprocess import FeatureBounds, scale_to_unit_box
from fedpca.query import Aggregate, AggregateKind, Moments, QueryKind, QuerySpec
from fedpca.stats import Section, upper_triangle_length

__all__ = [
    "AggregateIntegers",
    "aggregate_sections",
    "fixed_point_aggregates",
    "histogram_cells",
    "part_sections",
    "scaled_columns",
]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# Section names inside one aggregate (the released name is "<part>.<name>").
COUNT = "count"
SUMS = "sums"
SQUARES = "squares"
PRODUCTS = "products"
COUNTS = "counts"
X_SUMS = "x_sums"
Y_SUM = "y_sum"
XTX = "xtx"
XTY = "xty"


def _counts(name: str, length: int, swap: float) -> Section:
    # Counts are released on the integer grid: a noisy count is an integer.
    return Section(name, length, 1.0, 1.0, unit=1.0, swap_sensitivity=swap, grid_bits=0)


def _sums(name: str, d: int) -> Section:
    # Each coordinate is in [-1, 1]: an added u has ‖u‖ <= √d, a swap u - u' <= 2√d.
    return Section(name, d, 1.0, math.sqrt(d), unit=1.0, swap_sensitivity=2 * math.sqrt(d))


def _products(name: str, d: int) -> Section:
    # Upper triangle of uuᵀ: Σ_{i<=j} (u_i u_j)² = (‖u‖⁴ + Σ u_i⁴)/2 <= (d² + d)/2. Swap:
    # A = uuᵀ - u'u'ᵀ has ‖A‖_F² <= ‖u‖⁴ + ‖u'‖⁴ <= 2d² and diagonal entries in [-1, 1],
    # and the upper triangle of a symmetric A has squared norm (‖A‖_F² + Σ A_ii²)/2.
    return Section(
        name,
        upper_triangle_length(d),
        1.0,
        math.sqrt(d * (d + 1) / 2),
        unit=1.0,
        swap_sensitivity=math.sqrt(d * d + d / 2),
    )


def part_sections(part: Aggregate) -> tuple[Section, ...]:
    """The sections of one aggregate, unprefixed, in release order."""
    d = len(part.columns)
    if part.kind is AggregateKind.STATS:
        sections = [_counts(COUNT, 1, 0.0), _sums(SUMS, d)]
        if part.moments is Moments.VARIANCE:
            # u_j² in [0, 1]: add <= √d, and a swap moves each by at most 1.
            sections.append(
                Section(SQUARES, d, 1.0, math.sqrt(d), unit=1.0, swap_sensitivity=math.sqrt(d))
            )
        elif part.moments is Moments.COVARIANCE:
            sections.append(_products(PRODUCTS, d))
        return tuple(sections)
    if part.kind is AggregateKind.HISTOGRAM:
        # One record is in one cell (or in none, if its category is not listed).
        return (_counts(COUNTS, part.n_cells, math.sqrt(2.0)),)
    # linreg: u (features) and v (target), both in [-1, 1].
    return (
        _counts(COUNT, 1, 0.0),
        _sums(X_SUMS, d),
        Section(Y_SUM, 1, 1.0, 1.0, unit=1.0, swap_sensitivity=2.0),
        _products(XTX, d),
        # |u_j v| <= 1, and u_j v - u'_j v' in [-2, 2].
        Section(XTY, d, 1.0, math.sqrt(d), unit=1.0, swap_sensitivity=2 * math.sqrt(d)),
    )


def aggregate_sections(aggregates: Sequence[Aggregate]) -> tuple[Section, ...]:
    """Every section of an aggregate query, named ``"<part>.<name>"``, in release order."""
    out: list[Section] = []
    for index, part in enumerate(aggregates):
        for section in part_sections(part):
            out.append(
                Section(
                    f"{index}.{section.name}",
                    section.length,
                    section.max_abs_per_record,
                    section.l2_sensitivity,
                    unit=section.unit,
                    swap_sensitivity=section.swap_sensitivity,
                    grid_bits=section.grid_bits,
                )
            )
    return tuple(out)


def split_parts(
    aggregates: Sequence[Aggregate], values: Mapping[str, FloatArray]
) -> list[dict[str, FloatArray]]:
    """Per aggregate, its section values by unprefixed name (from a ``"<part>.<name>"`` map)."""
    parts: list[dict[str, FloatArray]] = []
    for index, part in enumerate(aggregates):
        own: dict[str, FloatArray] = {}
        for section in part_sections(part):
            key = f"{index}.{section.name}"
            if key not in values:
                raise LayoutError(f"the release has no section {key!r}")
            own[section.name] = np.asarray(values[key], dtype=np.float64)
        parts.append(own)
    return parts


# ----------------------------------------------------------------- owner side
def scaled_columns(raw: FloatArray, lower: Sequence[float], upper: Sequence[float]) -> FloatArray:
    """Columns clipped to their public bounds and mapped onto [-1, 1]."""
    return scale_to_unit_box(raw, FeatureBounds(tuple(lower), tuple(upper)))


def histogram_cells(
    part: Aggregate,
    raw: FloatArray,
    group: FloatArray | None,
    tables: Sequence[FloatArray] | None = None,
) -> IntArray:
    """Cell of every row (row-major over category, bins of column 0, bins of column 1).

    A value outside the edges counts in the nearest edge bin; a row whose category is
    not one of the public categories gets -1 (left out). ``tables``: the part's
    :func:`edge_tables`, when made once for many blocks of rows.
    """
    if tables is None:
        tables = edge_tables(part)
    cell = np.zeros(raw.shape[0], dtype=np.int64)
    for j, edges in enumerate(part.bin_edges):
        bins = len(edges) - 1
        # Bins [e_i, e_i+1), the last one closed (numpy's convention); outside values
        # fall to the first or last bin.
        index = _edges_at_or_below(tables[j], raw[:, j]) - 1
        cell = cell * bins + np.clip(index, 0, bins - 1)
    if part.group_column is None:
        return cell
    assert group is not None
    per_group = math.prod(part.bins_per_column)
    # Arithmetic, not masked writes or np.where: their cost grew with how the rows fall
    # into categories (branches on the data), which the proxy's clock sees (found by
    # review). The categories are distinct, so a row matches one of them at most.
    listed = np.zeros(raw.shape[0], dtype=np.int64)  # its category + 1, 0 if unlisted
    for c, value in enumerate(part.categories):
        listed += (group == value) * (c + 1)
    return (listed > 0) * (listed * per_group - per_group + cell + 1) - 1


def edge_tables(part: Aggregate) -> list[FloatArray]:
    """Each column's edges padded with +inf (which no finite value reaches) to a power
    of two above their count, as :func:`_edges_at_or_below` searches them."""
    tables = []
    for edges in part.bin_edges:
        table = np.full(1 << len(edges).bit_length(), np.inf)
        table[: len(edges)] = edges
        tables.append(table)
    return tables


def _edges_at_or_below(table: FloatArray, values: FloatArray) -> IntArray:
    """How many of the sorted edges in ``table`` (:func:`edge_tables`) are <= each
    value: numpy's ``searchsorted(edges, values, side="right")``, doing the same steps
    for every value.

    Written here because numpy's binary search branches on the data: a column of spread
    values took 2.8 times as long as a constant one (7.9 against 2.7 ms for a 1,000-bin
    histogram of 100,000 records), and the owner's time to its upload header is seen by
    the proxy (found by review). This search takes log2 of the table's size steps, each
    the same comparisons and writes for every value. Which entries a step reads still
    depends on the values: while the table and the cells stay in the processor's caches
    that costs the same, but not for the largest histograms (docs/privacy.md).
    """
    size = len(table)
    found = np.zeros(values.shape, dtype=np.int64)
    step = size // 2
    while step:
        # found + step edges are <= the value if the (found + step)-th one is.
        found += step * (table[found + step - 1] <= values)
        step //= 2
    return found


COUNTING_LANES = 4
"""Rows counted into this many copies of the cells, in turn (:func:`_cell_counts`)."""


def _cell_counts(cell: IntArray, kept: npt.NDArray[np.bool_], n_cells: int) -> FloatArray:
    """Rows kept per cell: ``np.bincount(cell, weights=kept, minlength=n_cells)``,
    with consecutive rows counted into different copies of the cells.

    Plain ``bincount`` adds every row to its cell in turn, so rows of one cell wait for
    each other's addition: 100,000 rows in one cell took 0.25 ms, spread over 1,000 cells
    0.10 ms, and the proxy sees the owner's time to its upload header (found by review).
    With the rows dealt over :data:`COUNTING_LANES` copies the two took 0.19 and 0.20 ms
    (by hand, this machine; ``benchmarks/owner_task_timing.py`` measures the whole task).
    """
    lane = np.arange(cell.shape[0]) % COUNTING_LANES
    counts = np.bincount(
        cell * COUNTING_LANES + lane, weights=kept, minlength=n_cells * COUNTING_LANES
    )
    return counts.reshape(n_cells, COUNTING_LANES).sum(axis=1)


@dataclass(frozen=True, eq=False)
class AggregateIntegers:
    """An owner's exact integer statistics of an aggregate query, in release order.

    Attributes
    ----------
    frac_bits : f of the query.
    values : (value_count,) int64, each section on its own grid (2^-f clip units, or
        plain integers for counts).
    """

    frac_bits: int
    values: IntArray

    def to_vector(self, spec: object) -> IntArray:
        """The released integer vector (``spec`` is accepted for the plan's interface)."""
        return self.values


class _PartAccumulator:
    """Exact integer sums of one aggregate over blocks of rows."""

    def __init__(self, part: Aggregate, positions: Mapping[int, int], g: int) -> None:
        self.part = part
        self.g = g
        self.columns = [positions[c] for c in part.columns]
        self.group = None if part.group_column is None else positions[part.group_column]
        self.target = None if part.target_column is None else positions[part.target_column]
        d = len(part.columns)
        width = d + (1 if part.kind is AggregateKind.LINREG else 0)
        self.count = 0
        self.sums = np.zeros(width, dtype=np.int64)
        self.products = np.zeros((width, width), dtype=np.int64)
        self.squares = np.zeros(width, dtype=np.int64)
        self.cells = np.zeros(part.n_cells if part.kind is AggregateKind.HISTOGRAM else 0, np.int64)
        self.tables = edge_tables(part) if part.kind is AggregateKind.HISTOGRAM else []

    def add(self, block: FloatArray, real: int) -> None:
        """Add the first ``real`` rows of ``block``; the rest pad (same work, left out)."""
        part = self.part
        if part.kind is AggregateKind.HISTOGRAM:
            group = None if self.group is None else block[:, self.group]
            cell = histogram_cells(part, block[:, self.columns], group, self.tables)
            # The same work whatever is left out: every row is counted with weight 0 or 1.
            kept = (cell >= 0) & (np.arange(cell.shape[0]) < real)
            counts = _cell_counts(cell * kept, kept, part.n_cells)
            self.cells += counts.astype(np.int64)  # exact: integers below 2^53
            return
        unit = scaled_columns(block[:, self.columns], part.lower, part.upper)
        if self.target is not None:
            assert part.target_lower is not None and part.target_upper is not None
            target = scaled_columns(
                block[:, [self.target]], (part.target_lower,), (part.target_upper,)
            )
            unit = np.hstack([unit, target])
        # |u| <= 1 and truncation toward zero keep |q| <= 2^g exactly.
        q = np.trunc(np.ldexp(unit, self.g)).astype(np.int64)
        q *= (np.arange(q.shape[0]) < real)[:, None]  # the same work whatever is real
        self.count += real
        self.sums += q.sum(axis=0)
        qf = q.astype(np.float64)
        if part.kind is AggregateKind.LINREG or part.moments is Moments.COVARIANCE:
            self.products += (qf.T @ qf).astype(np.int64)
        elif part.moments is Moments.VARIANCE:
            self.squares += (qf * qf).sum(axis=0).astype(np.int64)

    def integers(self, f: int) -> list[IntArray]:
        """The aggregate's sections in release order, on their grids."""
        part = self.part
        if part.kind is AggregateKind.HISTOGRAM:
            return [self.cells.copy()]
        g = self.g
        count = np.array([self.count], dtype=np.int64)
        sums = self.sums << (f - g)
        products = self.products << (f - 2 * g)
        upper = products[np.triu_indices(products.shape[0])]
        if part.kind is AggregateKind.STATS:
            out = [count, sums]
            if part.moments is Moments.VARIANCE:
                out.append(self.squares << (f - 2 * g))
            elif part.moments is Moments.COVARIANCE:
                out.append(upper)
            return out
        d = len(part.columns)
        xtx = products[:d, :d][np.triu_indices(d)]
        return [count, sums[:d], sums[d:], xtx, products[:d, d]]


def fixed_point_aggregates(
    columns: npt.ArrayLike | ChosenRows,
    query: QuerySpec,
    *,
    pad_to: int = 0,
    n_real: int | None = None,
) -> AggregateIntegers:
    """Exact integer statistics of an owner's rows for an aggregate query.

    Parameters
    ----------
    columns : (N, K) raw values of the query's columns, in the order of
        ``query.aggregate_columns`` (the file columns it reads, sorted), or the rows
        chosen from the owner's table (:class:`~fedpca.exact_statistics.ChosenRows`).
    query : the public aggregate query.
    pad_to : process at least this many rows, the extra ones left out of every
        statistic: the work done depends on max(N, pad_to) only, not on N.
    n_real : the first ``n_real`` rows of ``columns`` are the records, the rest zero
        rows of the same table that pad them (read like the records, so that reading a
        wide table costs the same whatever N; left out of every statistic).

    Returns
    -------
    AggregateIntegers
    """
    if query.kind is not QueryKind.AGGREGATE:
        raise LayoutError(f"a {query.kind.value} query has no aggregates")
    width = len(query.aggregate_columns)
    blocks_of: Callable[[int], Iterator[tuple[int, FloatArray, int]]]
    if isinstance(columns, ChosenRows):
        shape: tuple[int, ...] = (columns.total, len(columns.columns))
        blocks_of = columns.blocks
    else:
        x = np.asarray(columns, dtype=np.float64)
        n, shape = real_rows(x, n_real), x.shape
        blocks_of = functools.partial(padded_blocks, x, n, max(n, pad_to))
    if len(shape) != 2 or shape[1] != width:
        raise LayoutError(f"the query reads {width} columns, got values of shape {shape}")
    f = query.frac_bits
    g = row_bits(f)
    positions = {column: j for j, column in enumerate(query.aggregate_columns)}
    accumulators = [_PartAccumulator(part, positions, g) for part in query.aggregates]
    # Products of two coordinates sit on the 2^(2g) grid: blocks of at most 2^(53 - 2g)
    # rows keep every partial float64 sum an exact integer.
    block = max(1, min(4096, 1 << (53 - 2 * g)))
    for _, rows, real in blocks_of(block):
        for accumulator in accumulators:
            accumulator.add(rows, real)
    parts = [array for acc in accumulators for array in acc.integers(f)]
    return AggregateIntegers(f, np.concatenate(parts).astype(np.int64))
