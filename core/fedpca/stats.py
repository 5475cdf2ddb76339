"""Sufficient-statistics specs: which sums a query needs and what one record can change.

Every fedpca query releases "a vector of per-record-bounded sums".  This module
says, for a query, which *sections* that vector has, in which order, how long
each is, and the per-record bounds the DP layer calibrates noise with and the
codec sizes packed slots with.  It also holds :class:`SufficientStatistics`, the
plaintext value object an owner computes and the analyst decrypts.

Sections and their order
------------------------
PCA: ``scatter`` (upper triangle of R = XᵀX, row-major i <= j, M(M+1)/2 values),
``sum`` (v = Σx, M values), ``count`` (N, 1 value).

DCA: ``scatter`` (as above), ``class_sums`` (v_c for every public class label c,
C×M values, row-major, classes in the order of the public ``class_labels``),
``class_counts`` (N_c, C values).  The pooled v and N are *not* sent: they are
Σ_c v_c and Σ_c N_c, so sending them would only spend budget on redundant values.

Aggregate queries: the sections of every aggregate, named ``"<part>.<name>"``, each
with its own add and swap bounds (:mod:`fedpca.aggregates`).

Per-record sensitivity (add/remove adjacency)
---------------------------------------------
Neighbouring datasets differ by adding or removing one record x, and every row
is clipped to ‖x‖₂ <= c by the owner before summing (fedpca.preprocess).  The
change of each section is therefore the contribution of that single record.

* scatter: the record adds xxᵀ; only the upper triangle is sent, so the change
  has squared L2 norm Σ_{i<=j} (x_i x_j)² = (‖x‖⁴ + Σ_i x_i⁴)/2 <= ‖x‖⁴ <= c⁴,
  because Σ_i x_i⁴ <= (Σ_i x_i²)² = ‖x‖⁴.  Sensitivity c², attained by x = c·e_1.
  Per-entry: |x_i x_j| <= (x_i² + x_j²)/2 <= c²/2 off the diagonal and x_i² <= c²
  on it, so max |entry| = c².
* sum: the record adds x, L2 change ‖x‖ <= c; max |entry| |x_i| <= c.
* count: N changes by exactly 1.
* class_sums (DCA): a record of class c changes only row c, by x: L2 <= c, max
  |entry| <= c.  The bound does *not* grow with the number of classes C because
  the rows of the other classes are untouched.
* class_counts (DCA): only N_c changes, by 1.

Joint sensitivity.  One record changes all sections at once; the squared L2
norm of the change of the concatenated vector is the sum of the per-section
squared norms, each bounded separately, so

    Δ₂ = √(Δ_scatter² + Δ_sum² + Δ_count²) = √(c⁴ + c² + 1)            (PCA)
    Δ₂ = √(Δ_scatter² + Δ_class_sums² + Δ_class_counts²) = √(c⁴ + c² + 1)  (DCA)

(√3 at c = 1).  Both are tight: x = c·e_1 attains every section bound at once.
For DCA this is the same value as for PCA although C·M + C values are sent
instead of M + 1, precisely because one record lands in one class row.  Sending
v and N *in addition* to the class sums would raise it to √(c⁴ + 2c² + 2).

Clip units and the changes a release must cover
-----------------------------------------------
Owners release every section in *clip units* (scatter in c², sums in c, counts
in 1), where one record's add/remove change is at most 1 per section, whatever
c.  A record can also be *swapped* for another with the counts unchanged: under
replace-one, and under add/remove when an owner at its public record cap samples
(unless the query is for bounded owner tables, which never sample).
:func:`worst_case_change` bounds Σ_j ‖Δq_j‖²/σ_j² over every change a relation
allows (docs/privacy.md derives each case).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Self

import numpy as np
import numpy.typing as npt

from fedpca.codec.matrix import (
    symmetric_from_upper_triangle,
    upper_triangle,
    upper_triangle_length,
)
from fedpca.errors import ConfigError, LayoutError
from fedpca.query import Aggregate, Neighbouring, QueryKind, QuerySpec

__all__ = [
    "CLASS_COUNTS",
    "CLASS_SUMS",
    "COUNT",
    "SCATTER",
    "SUM",
    "Section",
    "StatisticsSpec",
    "SufficientStatistics",
    "refuse_aggregate",
    "sum_statistics",
    "upper_triangle_length",
    "worst_case_change",
]

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]

SCATTER = "scatter"
SUM = "sum"
COUNT = "count"
CLASS_SUMS = "class_sums"
CLASS_COUNTS = "class_counts"


def _upper_triangle(matrix: FloatArray) -> FloatArray:
    # The codec owns the layout (row-major, i <= j); stats only relies on it.
    return np.asarray(upper_triangle(matrix), dtype=np.float64)


def _symmetric_from_upper_triangle(values: FloatArray, n_features: int) -> FloatArray:
    return np.asarray(symmetric_from_upper_triangle(values, n_features), dtype=np.float64)


@dataclass(frozen=True)
class Section:
    """One contiguous block of the released statistics vector.

    Attributes
    ----------
    name : protocol name of the block ("scatter", "sum", "count", "class_sums",
        "class_counts"; an aggregate query's sections are named "<part>.<name>").
    length : number of scalar values in the block.
    max_abs_per_record : largest absolute value one record can contribute to a
        single entry (what the codec needs to bound slot sums).
    l2_sensitivity : largest L2 norm of the change of the whole block when one
        record is added or removed, in real units.
    unit : the block's *clip unit*: owners release the block in multiples of it
        (times 2^-grid_bits). 0 (PCA and DCA) means ``l2_sensitivity``, so that one
        record's add/remove change is at most 1 clip unit in every block.
    swap_sensitivity : largest L2 norm of the change when one record is swapped for
        another (replace-one, or a capped owner's sample), in real units; None for the
        PCA and DCA sections, whose swap is analysed jointly (:func:`worst_case_change`).
    grid_bits : fractional bits of the block's integers; None means the query's
        ``frac_bits``. Counts of aggregate queries are released on the integer grid (0).
    """

    name: str
    length: int
    max_abs_per_record: float
    l2_sensitivity: float
    unit: float = 0.0
    swap_sensitivity: float | None = None
    grid_bits: int | None = None

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ConfigError(f"section {self.name!r}: length must be >= 1, got {self.length}")
        for attr in ("max_abs_per_record", "l2_sensitivity"):
            value = getattr(self, attr)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"section {self.name!r}: {attr} must be finite and > 0")
        if not (math.isfinite(self.unit) and self.unit >= 0):
            raise ConfigError(f"section {self.name!r}: unit must be finite and >= 0")
        swap = self.swap_sensitivity
        if swap is not None and not (math.isfinite(swap) and swap >= 0):
            raise ConfigError(f"section {self.name!r}: swap_sensitivity must be finite and >= 0")
        if self.grid_bits is not None and self.grid_bits < 0:
            raise ConfigError(f"section {self.name!r}: grid_bits must be >= 0")

    @property
    def clip_unit(self) -> float:
        """Real value of one clip unit (``unit``, or ``l2_sensitivity`` when unit is 0)."""
        return self.unit if self.unit > 0 else self.l2_sensitivity

    @property
    def add_change(self) -> float:
        """One record's add/remove change in clip units (1 for PCA and DCA)."""
        return self.l2_sensitivity / self.clip_unit

    @property
    def swap_change(self) -> float | None:
        """One record's swap change in clip units (None: analysed jointly)."""
        if self.swap_sensitivity is None:
            return None
        return self.swap_sensitivity / self.clip_unit

    @property
    def allocation_unit(self) -> float:
        """The change a budget weight is a share of: max(add, swap) in clip units.

        With reference noise allocation_unit / sqrt(omega) per section, omega_j is section
        j's share of the squared worst-case change (fedpca.dp.allocation). PCA and DCA
        sections use their add change, 1: their swap is bounded jointly.
        """
        swap = self.swap_change
        return self.add_change if swap is None else max(self.add_change, swap)

    def bits(self, frac_bits: int) -> int:
        """The grid of this block's integers: ``grid_bits``, or the query's ``frac_bits``."""
        return frac_bits if self.grid_bits is None else self.grid_bits


@dataclass(frozen=True)
class StatisticsSpec:
    """Which sums a query needs, in which order, and their per-record bounds.

    Build it with ``StatisticsSpec(kind, n_features, clip_norm, class_labels)``
    or :meth:`from_query`.  See the module docstring for the derivation of the
    sensitivities.

    Attributes
    ----------
    kind : pca or dca.
    n_features : M, the number of feature columns.
    clip_norm : c, every row has ‖x‖₂ <= c before summing.
    class_labels : the C public class labels (DCA only; empty for PCA).  Their
        order is the row order of ``class_sums`` and ``class_counts``.
    aggregates : the aggregates of an aggregate query (their sections come from
        :func:`fedpca.aggregates.aggregate_sections`).
    """

    kind: QueryKind
    n_features: int
    clip_norm: float = 1.0
    class_labels: tuple[float, ...] = ()
    aggregates: tuple[Aggregate, ...] = ()

    def __post_init__(self) -> None:
        try:
            kind = QueryKind(self.kind)
        except ValueError as exc:
            raise ConfigError(f"unknown query kind {self.kind!r}") from exc
        object.__setattr__(self, "kind", kind)
        if self.n_features < 1:
            raise ConfigError(f"n_features must be >= 1, got {self.n_features}")
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ConfigError(f"clip_norm must be finite and > 0, got {self.clip_norm}")
        labels = tuple(float(label) for label in self.class_labels)
        object.__setattr__(self, "class_labels", labels)
        object.__setattr__(self, "aggregates", tuple(self.aggregates))
        if (kind is QueryKind.AGGREGATE) != bool(self.aggregates):
            raise ConfigError("an aggregate statistics spec, and only that, has aggregates")
        if kind is QueryKind.AGGREGATE:
            if labels:
                raise ConfigError("an aggregate statistics spec takes no class_labels")
        elif kind is QueryKind.PCA:
            if labels:
                raise ConfigError("a PCA statistics spec takes no class_labels")
        else:
            if len(labels) < 2:
                raise ConfigError("a DCA statistics spec needs at least two class labels")
            if len(set(labels)) != len(labels):
                raise ConfigError(f"class_labels must be distinct, got {labels}")
            if not all(math.isfinite(label) for label in labels):
                raise ConfigError(f"class_labels must be finite, got {labels}")

    @classmethod
    def from_query(cls, query: QuerySpec) -> StatisticsSpec:
        """The statistics spec of a public query (class labels only for DCA)."""
        labels = query.class_labels if query.kind is QueryKind.DCA else ()
        return cls(query.kind, query.n_features, query.clip_norm, labels, query.aggregates)

    @property
    def n_classes(self) -> int:
        """C, the number of public class labels (0 for PCA)."""
        return len(self.class_labels)

    @property
    def sections(self) -> tuple[Section, ...]:
        """The sections of the released vector, in order."""
        if self.kind is QueryKind.AGGREGATE:
            from fedpca.aggregates import aggregate_sections  # it builds on Section

            return aggregate_sections(self.aggregates)
        c = self.clip_norm
        m = self.n_features
        scatter = Section(SCATTER, upper_triangle_length(m), c * c, c * c)
        if self.kind is QueryKind.PCA:
            return (scatter, Section(SUM, m, c, c), Section(COUNT, 1, 1.0, 1.0))
        n_classes = self.n_classes
        return (
            scatter,
            Section(CLASS_SUMS, n_classes * m, c, c),
            Section(CLASS_COUNTS, n_classes, 1.0, 1.0),
        )

    def section(self, name: str) -> Section:
        """The section called ``name``; LayoutError if this query has none."""
        for section in self.sections:
            if section.name == name:
                return section
        raise LayoutError(f"a {self.kind.value} query has no section {name!r}")

    def section_slices(self) -> dict[str, slice]:
        """Where each section sits in the vector of :meth:`SufficientStatistics.to_vector`."""
        slices: dict[str, slice] = {}
        start = 0
        for section in self.sections:
            slices[section.name] = slice(start, start + section.length)
            start += section.length
        return slices

    @property
    def value_count(self) -> int:
        """Total number of scalar values released."""
        return sum(section.length for section in self.sections)

    @property
    def l2_sensitivity(self) -> float:
        """Joint add/remove-one L2 sensitivity √(c⁴ + c² + 1) of the whole vector."""
        return math.sqrt(sum(section.l2_sensitivity**2 for section in self.sections))

    @property
    def max_abs_per_record(self) -> float:
        """Largest |entry| one record can contribute, over all sections: max(c², c, 1)."""
        return max(section.max_abs_per_record for section in self.sections)

    def worst_case_change(
        self,
        inverse_variances: Sequence[float],
        neighbouring: Neighbouring,
        *,
        bounded_owner_tables: bool = False,
    ) -> float:
        """:func:`worst_case_change` of this spec's sections (1/σ_j² in clip units)."""
        changes = None
        if self.kind is QueryKind.AGGREGATE:
            changes = []
            for section in self.sections:
                swap = section.swap_change
                assert swap is not None  # every aggregate section states its swap
                changes.append((section.add_change, swap))
        return worst_case_change(
            self.kind,
            inverse_variances,
            neighbouring,
            changes,
            bounded_owner_tables=bounded_owner_tables,
        )

    def l2_sensitivity_under(
        self, neighbouring: Neighbouring, *, bounded_owner_tables: bool = False
    ) -> float:
        """Joint L2 sensitivity in clip units when every section has the same noise.

        √(worst_case_change(kind, (1, 1, 1), relation)): √4.5 = 2.121 under either
        relation for PCA and under add/remove for DCA (the swap of a capped owner, or
        the replacement itself), √12.5 = 3.536 for DCA under replace-one (a replacement
        between classes whose two classes are both at their caps). Aggregate queries:
        the larger of √(Σ add²) and √(Σ swap²).
        """
        return math.sqrt(
            self.worst_case_change(
                [1.0] * len(self.sections),
                neighbouring,
                bounded_owner_tables=bounded_owner_tables,
            )
        )


def refuse_aggregate(spec: StatisticsSpec) -> None:
    if spec.kind is QueryKind.AGGREGATE:
        raise LayoutError(
            "aggregate queries have their own statistics (fedpca.aggregates), not R, v, N"
        )


def _as_float_array(value: npt.ArrayLike, name: str) -> FloatArray:
    frozen = isinstance(value, np.ndarray) and value.base is None and not value.flags.writeable
    if frozen and isinstance(value, np.ndarray) and value.dtype == np.float64:
        return value  # read-only and no view: nobody else can change it, so not copied
    try:
        array = np.array(value, dtype=np.float64)  # a private copy we can freeze
    except (TypeError, ValueError) as exc:
        raise LayoutError(f"{name} is not a numeric array: {exc}") from exc
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class SufficientStatistics:
    """Plaintext sufficient statistics of a set of records (one owner's, or summed).

    The arrays are private read-only copies.  For DCA use :meth:`for_classes`,
    which derives ``sums`` and ``count`` from the per-class statistics.

    Attributes
    ----------
    scatter : (M, M) symmetric, R = Σ x xᵀ.
    sums : (M,), v = Σ x.
    count : N (a float: after noise it is no longer an integer).
    class_sums : (C, M) or None, row c is v_c = Σ_{x in class c} x.
    class_counts : (C,) or None, N_c.
    """

    scatter: FloatArray
    sums: FloatArray
    count: float
    class_sums: FloatArray | None = None
    class_counts: FloatArray | None = None

    def __post_init__(self) -> None:
        scatter = _as_float_array(self.scatter, "scatter")
        if scatter.ndim != 2 or scatter.shape[0] != scatter.shape[1]:
            raise LayoutError(f"scatter must be a square matrix, got shape {scatter.shape}")
        m = scatter.shape[0]
        sums = _as_float_array(self.sums, "sums")
        if sums.shape != (m,):
            raise LayoutError(f"sums must have shape ({m},) to match scatter, got {sums.shape}")
        object.__setattr__(self, "scatter", scatter)
        object.__setattr__(self, "sums", sums)
        object.__setattr__(self, "count", float(self.count))
        if (self.class_sums is None) != (self.class_counts is None):
            raise LayoutError("class_sums and class_counts must be given together")
        if self.class_sums is not None and self.class_counts is not None:
            class_sums = _as_float_array(self.class_sums, "class_sums")
            class_counts = _as_float_array(self.class_counts, "class_counts")
            if class_sums.ndim != 2 or class_sums.shape[1] != m:
                raise LayoutError(f"class_sums must have shape (C, {m}), got {class_sums.shape}")
            if class_counts.shape != (class_sums.shape[0],):
                raise LayoutError(
                    f"class_counts must have shape ({class_sums.shape[0]},), "
                    f"got {class_counts.shape}"
                )
            object.__setattr__(self, "class_sums", class_sums)
            object.__setattr__(self, "class_counts", class_counts)

    @classmethod
    def for_classes(
        cls, scatter: npt.ArrayLike, class_sums: npt.ArrayLike, class_counts: npt.ArrayLike
    ) -> Self:
        """DCA statistics; the pooled v = Σ_c v_c and N = Σ_c N_c are derived."""
        class_sums_arr = _as_float_array(class_sums, "class_sums")
        class_counts_arr = _as_float_array(class_counts, "class_counts")
        if class_sums_arr.ndim != 2:
            raise LayoutError(f"class_sums must be 2-D (C, M), got shape {class_sums_arr.shape}")
        return cls(
            scatter=np.asarray(scatter, dtype=np.float64),
            sums=class_sums_arr.sum(axis=0),
            count=float(class_counts_arr.sum()),
            class_sums=class_sums_arr,
            class_counts=class_counts_arr,
        )

    @classmethod
    def zeros(cls, spec: StatisticsSpec) -> Self:
        """Statistics of the empty set of records, shaped for ``spec``."""
        refuse_aggregate(spec)
        m = spec.n_features
        if spec.kind is QueryKind.PCA:
            return cls(np.zeros((m, m)), np.zeros(m), 0.0)
        c = spec.n_classes
        return cls.for_classes(np.zeros((m, m)), np.zeros((c, m)), np.zeros(c))

    @property
    def n_features(self) -> int:
        return int(self.scatter.shape[0])

    @property
    def n_classes(self) -> int:
        """C, or 0 if there are no per-class statistics."""
        return 0 if self.class_sums is None else int(self.class_sums.shape[0])

    def _check_matches(self, spec: StatisticsSpec) -> None:
        refuse_aggregate(spec)
        if self.n_features != spec.n_features:
            raise LayoutError(
                f"statistics have {self.n_features} features, the spec has {spec.n_features}"
            )
        if spec.kind is QueryKind.DCA and self.n_classes != spec.n_classes:
            raise LayoutError(
                f"a DCA spec with {spec.n_classes} classes needs per-class statistics for "
                f"{spec.n_classes} classes, these have {self.n_classes}"
            )

    def to_vector(self, spec: StatisticsSpec) -> FloatArray:
        """Flatten into the released vector, sections in ``spec.sections`` order.

        Returns
        -------
        (spec.value_count,) float64.  The scatter is represented by its upper
        triangle (row-major, i <= j); class rows follow ``spec.class_labels``.
        """
        self._check_matches(spec)
        parts: list[FloatArray] = [_upper_triangle(self.scatter)]
        if spec.kind is QueryKind.PCA:
            parts += [self.sums, np.array([self.count])]
        else:
            assert self.class_sums is not None and self.class_counts is not None
            parts += [self.class_sums.reshape(-1), self.class_counts]
        return np.concatenate(parts)

    @classmethod
    def from_vector(cls, spec: StatisticsSpec, vector: npt.ArrayLike) -> Self:
        """Inverse of :meth:`to_vector`; the scatter is mirrored from its upper triangle.

        Parameters
        ----------
        spec : the spec the vector was laid out with.
        vector : (spec.value_count,) values, e.g. the decrypted noisy sums.
        """
        refuse_aggregate(spec)
        values = np.asarray(vector, dtype=np.float64)
        if values.shape != (spec.value_count,):
            raise LayoutError(
                f"a {spec.kind.value} vector for M={spec.n_features}"
                + (f", C={spec.n_classes}" if spec.n_classes else "")
                + f" has {spec.value_count} values, got shape {values.shape}"
            )
        slices = spec.section_slices()
        m = spec.n_features
        scatter = _symmetric_from_upper_triangle(values[slices[SCATTER]], m)
        scatter.setflags(write=False)  # fresh: adopted, not copied
        if spec.kind is QueryKind.PCA:
            return cls(scatter, values[slices[SUM]], float(values[slices[COUNT]][0]))
        class_sums = values[slices[CLASS_SUMS]].reshape(spec.n_classes, m)
        return cls.for_classes(scatter, class_sums, values[slices[CLASS_COUNTS]])

    def __add__(self, other: object) -> SufficientStatistics:
        if not isinstance(other, SufficientStatistics):
            return NotImplemented
        if self.n_features != other.n_features:
            raise LayoutError(
                f"cannot add statistics over {self.n_features} and {other.n_features} features"
            )
        if self.n_classes != other.n_classes:
            raise LayoutError(
                f"cannot add statistics with {self.n_classes} and {other.n_classes} classes"
            )
        if self.class_sums is None or other.class_sums is None:
            return SufficientStatistics(
                self.scatter + other.scatter, self.sums + other.sums, self.count + other.count
            )
        assert self.class_counts is not None and other.class_counts is not None
        return SufficientStatistics(
            self.scatter + other.scatter,
            self.sums + other.sums,
            self.count + other.count,
            self.class_sums + other.class_sums,
            self.class_counts + other.class_counts,
        )


def worst_case_change(
    kind: QueryKind,
    inverse_variances: Sequence[float],
    neighbouring: Neighbouring,
    changes: Sequence[tuple[float, float]] | None = None,
    *,
    bounded_owner_tables: bool = False,
) -> float:
    """Largest Σ_j ‖Δq_j‖² w_j of one neighbouring change, in clip units.

    Parameters
    ----------
    kind : pca or dca (the sections are scatter, sums, counts or their class forms),
        or aggregate (any sections, each with its own bounds in ``changes``).
    inverse_variances : w_j = 1/σ_j² of the sections (three for PCA and DCA), σ_j in
        clip units; every w_j must be > 0 (aggregates: inf, no noise, is allowed).
    neighbouring : the relation whose changes must be covered.
    changes : aggregate queries only: (a_j, b_j) per section, the largest L2 change of
        section j in clip units when one record is added or removed (a_j) and when
        one record is swapped for another (b_j).
    bounded_owner_tables : add/remove only: no owner holds more records than its cap,
        so none samples and an added record never displaces another (no swap case).

    Returns
    -------
    float
        The bound 1/z² of the release whose noise has these variances: z = 1/√(result)
        is its noise multiplier.

    Notes
    -----
    With ‖x‖, ‖y‖ <= 1 (clip units), t = ⟨x, y⟩, a = w_scatter, b = w_sums,
    g = w_counts: add a + b + g; a swap within a class a(2 − 2t²) + b(2 − 2t), at most
    2a + 2b + b²/(2a) (t = −b/(2a), b <= 2a) or 4b (t = −1); a replacement between
    classes (DCA, replace-one), with s = 4a + 2b + b²/(4a) (b <= 4a) or 4b: 2a + 2b + 2g
    when neither class is at its cap, s + 2a + b + g when one is, 2s when both are (two
    same-class swaps at once). Add/remove needs the add case and, unless owner
    tables are bounded, the same-class swap of an owner at its cap (per class for
    DCA); replace-one needs the swaps, and for DCA the add case (a replaced record of
    an unlisted label was left out). Aggregates bound each section on its own: add
    Σ_j w_j a_j², swap Σ_j w_j b_j². docs/privacy.md derives every case.
    """
    if bounded_owner_tables and neighbouring is not Neighbouring.ADD_REMOVE:
        raise ConfigError("bounded owner tables change the add/remove calibration only")
    if kind is QueryKind.AGGREGATE:
        return _aggregate_worst_case(inverse_variances, neighbouring, changes, bounded_owner_tables)
    if changes is not None:
        raise ConfigError(f"{kind.value} sections are bounded jointly; changes are for aggregates")
    if len(inverse_variances) != 3:
        raise ConfigError(f"need 3 inverse variances, got {len(inverse_variances)}")
    a, b, g = (float(w) for w in inverse_variances)
    if not all(math.isfinite(w) and w > 0 for w in (a, b, g)):
        raise ConfigError(f"inverse variances must be finite and > 0, got {(a, b, g)}")
    add = a + b + g
    if bounded_owner_tables:
        return add
    swap = 2 * a + 2 * b + b * b / (2 * a) if b <= 2 * a else 4 * b
    cases = [swap]
    if kind is QueryKind.DCA and neighbouring is Neighbouring.REPLACE_ONE:
        # x of class a replaces y of class b; each class is sampled at its own cap, so
        # neither, one or both samples swap a record (‖A + B‖² <= 2‖A‖² + 2‖B‖²).
        one = 4 * a + 2 * b + b * b / (4 * a) if b <= 4 * a else 4 * b
        cases += [2 * a + 2 * b + 2 * g, one + 2 * a + b + g, 2 * one]
    if neighbouring is Neighbouring.ADD_REMOVE or kind is QueryKind.DCA:
        cases.append(add)
    return max(cases)


def _aggregate_worst_case(
    inverse_variances: Sequence[float],
    neighbouring: Neighbouring,
    changes: Sequence[tuple[float, float]] | None,
    bounded_owner_tables: bool,
) -> float:
    if changes is None or len(changes) != len(inverse_variances) or not changes:
        raise ConfigError(
            "an aggregate query needs one (add, swap) change per section and as many "
            "inverse variances"
        )
    weights = [float(w) for w in inverse_variances]
    # w = inf is a section without noise: allowed, and free, where its change is 0.
    if not all(w > 0 for w in weights):
        raise ConfigError(f"inverse variances must be > 0, got {tuple(weights)}")
    for add, swap in changes:
        if not (math.isfinite(add) and add > 0 and math.isfinite(swap) and swap >= 0):
            raise ConfigError(f"section changes must be finite, add > 0, swap >= 0: {changes}")

    def term(w: float, change: float) -> float:
        return 0.0 if change == 0 else w * change * change

    add_case = math.fsum(term(w, a) for w, (a, _) in zip(weights, changes, strict=True))
    swap_case = math.fsum(term(w, b) for w, (_, b) in zip(weights, changes, strict=True))
    if neighbouring is Neighbouring.REPLACE_ONE:
        return swap_case
    return add_case if bounded_owner_tables else max(add_case, swap_case)


def sum_statistics(parts: Iterable[SufficientStatistics]) -> SufficientStatistics:
    """Σ of several owners' statistics (what the proxy computes under encryption)."""
    iterator = iter(parts)
    try:
        total = next(iterator)
    except StopIteration:
        raise LayoutError("cannot sum an empty collection of statistics") from None
    for part in iterator:
        total = total + part
    return total
