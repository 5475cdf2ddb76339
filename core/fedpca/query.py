"""The query an analyst submits, as a frozen value object shared by every role.

A query fixes everything public about one release: which statistics are summed,
the public bounds that make per-record sensitivity finite, the privacy
parameters, the protocol mode, and the analyst key the owners must encrypt to.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from fedpca.errors import ConfigError
from fedpca.query_checks import check_bounds, check_span, column_indices, finite_numbers

QUERY_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")
"""Query ids appear in log lines, file names and the proxy's keys: a safe alphabet."""

DEFAULT_QUERY_DELTA = 1e-6
"""A query's delta when its caller states none: the estimators' default, and the delta
the budget commands assume for the next query (capped by the per-query delta cap)."""


MIN_CLIP_NORM = 1e-100
"""The smallest clip norm a query may ask for. Below about 1e-154 the squares of a row's
entries are subnormal, the norm is imprecise and clipping shaves the rows that hold
records in extra passes that zero rows never need, so an owner's time showed how many
of its rows were records (found by review). Rows are compared with the clip norm after
scaling by the query's bounds, to [-1, 1]; a norm this small has no use."""


class QueryKind(StrEnum):
    PCA = "pca"
    DCA = "dca"
    AGGREGATE = "aggregate"
    """One or more private aggregates (:class:`Aggregate`) released together."""


class AggregateKind(StrEnum):
    """What one part of an aggregate query releases (owners allow or forbid each)."""

    STATS = "stats"
    """Descriptive statistics of columns: count, sums and (optionally) second moments."""
    HISTOGRAM = "histogram"
    """Counts over public bins of one or two columns, optionally per public category."""
    LINREG = "linreg"
    """Sufficient statistics of a linear regression: N, Σx, Σy, XᵀX, Xᵀy."""


class Moments(StrEnum):
    """How far a ``stats`` aggregate goes beyond the count and the sums."""

    MEAN = "mean"
    """Count and sums: means only."""
    VARIANCE = "variance"
    """Also the sums of squares: means and variances."""
    COVARIANCE = "covariance"
    """Also every product x_i x_j (upper triangle): covariance and correlation matrices."""


ReleaseKind = QueryKind | AggregateKind
"""What an owner's policy allows: a PCA/DCA query kind or an aggregate kind."""

RELEASE_KINDS: tuple[ReleaseKind, ...] = (
    QueryKind.PCA,
    QueryKind.DCA,
    AggregateKind.STATS,
    AggregateKind.HISTOGRAM,
    AggregateKind.LINREG,
)
"""Every kind an owner's ``policy.allowed_kinds`` may name."""

MAX_AGGREGATES = 64
"""Most aggregates one query may combine."""
MAX_HISTOGRAM_CELLS = 1 << 20
"""Most cells one histogram may have (bins times categories)."""


def release_kind(name: str) -> ReleaseKind:
    """The release kind called ``name`` (ConfigError naming the choices otherwise)."""
    for kind in RELEASE_KINDS:
        if kind.value == name:
            return kind
    raise ConfigError(
        f"unknown release kind {name!r}; choose from {', '.join(k.value for k in RELEASE_KINDS)}"
    )


class ProtocolMode(StrEnum):
    STATS = "stats"
    """Noisy sufficient statistics: noise on R, v, N (per-class sums for DCA)."""
    MASKED = "masked"
    """Corrected Wang & Chang protocol: mean masking + symmetric noise on the scatter."""


class Calibration(StrEnum):
    """How the noise multiplier of a release is derived from its (epsilon, delta)."""

    ZCDP = "zcdp"
    """Default. The discrete Gaussian's zero-concentrated DP (rho = 1/(2 z^2), Canonne,
    Kamath & Steinke 2020) converted to (epsilon, delta) with the best known conversion:
    a proven bound for the mechanism fedpca runs."""
    ANALYTIC = "analytic"
    """Balle & Wang's exact condition for the *continuous* Gaussian; for the discrete
    sampler fedpca uses it is a close approximation, not a proof (docs/privacy.md)."""
    CLASSIC = "classic"
    """Dwork & Roth's tail bound for the continuous Gaussian, epsilon < 1 only."""


class Neighbouring(StrEnum):
    """The neighbouring relation a deployment states its guarantee for (docs/privacy.md)."""

    ADD_REMOVE = "add-remove"
    """Default: D' is D with one record added or removed (counts are private)."""
    REPLACE_ONE = "replace-one"
    """D' is D with one record replaced by another (record counts are public)."""


class Accountant(StrEnum):
    """How a ledger composes releases (:mod:`fedpca.dp.accounting`; defined here, with the
    deployment's other public choices, so that naming one does not import dp_accounting)."""

    ZCDP = "zcdp"
    """Default: rho-zCDP of the discrete Gaussian, converted by dp_accounting's RDP
    accountant (a proven bound)."""
    PLD_CONTINUOUS = "pld-continuous"
    """dp_accounting's PLD accountant for the continuous Gaussian (labelled option)."""


@dataclass(frozen=True)
class Aggregate:
    """One private aggregate of an aggregate query: its columns and public parameters.

    Columns are 0-based indices into the owners' files (the configured label column is
    a column like any other). Everything here is public; nothing may be derived from
    the private rows. Build one with :meth:`statistics`, :meth:`histogram` or
    :meth:`linear_regression`.

    Attributes
    ----------
    kind : stats, histogram or linreg.
    columns : stats: the described columns; histogram: one or two binned columns;
        linreg: the feature columns.
    lower, upper : stats and linreg: public bounds per column; values outside are
        clipped to them.
    moments : stats only: mean, variance or covariance.
    bin_edges : histogram only: the public, strictly increasing bin edges of each
        binned column (bins are [e_i, e_i+1), the last one closed, as numpy's); a value
        outside the edges is counted in the nearest edge bin.
    group_column, categories : histogram only, optional: a public categorical column
        and its public categories; records of other categories are left out.
    target_column, target_lower, target_upper : linreg only: the target and its
        public bounds.
    """

    kind: AggregateKind
    columns: tuple[int, ...]
    lower: tuple[float, ...] = ()
    upper: tuple[float, ...] = ()
    moments: Moments | None = None
    bin_edges: tuple[tuple[float, ...], ...] = ()
    group_column: int | None = None
    categories: tuple[float, ...] = ()
    target_column: int | None = None
    target_lower: float | None = None
    target_upper: float | None = None

    def __post_init__(self) -> None:
        try:
            kind = AggregateKind(self.kind)
        except ValueError:
            raise ConfigError(
                f"unknown aggregate kind {self.kind!r}; choose from "
                f"{', '.join(k.value for k in AggregateKind)}"
            ) from None
        what = kind.value
        columns = column_indices(self.columns, f"{what}: columns")
        lower = finite_numbers(self.lower, f"{what}: lower")
        upper = finite_numbers(self.upper, f"{what}: upper")
        edges = tuple(
            finite_numbers(e, f"{what}: bin_edges[{i}]") for i, e in enumerate(self.bin_edges)
        )
        categories = finite_numbers(self.categories, f"{what}: categories")
        moments = None if self.moments is None else Moments(self.moments)
        group = None if self.group_column is None else column_indices((self.group_column,), what)[0]
        target = (
            None if self.target_column is None else column_indices((self.target_column,), what)[0]
        )
        for name, value in (
            ("kind", kind),
            ("columns", columns),
            ("lower", lower),
            ("upper", upper),
            ("moments", moments),
            ("bin_edges", edges),
            ("group_column", group),
            ("categories", categories),
            ("target_column", target),
        ):
            object.__setattr__(self, name, value)
        if not columns:
            raise ConfigError(f"{what}: needs at least one column")
        if len(set(self.read_columns)) != len(self.read_columns):
            for role, column in (("target", target), ("group", group)):
                if column is not None and column in columns:
                    raise ConfigError(
                        f"{what}: the {role} column {column} is also one of the columns "
                        f"{columns}: leave it out of them"
                    )
            raise ConfigError(f"{what}: a column may be read only once, got {self.read_columns}")
        if kind is AggregateKind.HISTOGRAM:
            self._check_histogram()
        else:
            check_bounds(lower, upper, columns, what)
            if edges or group is not None or categories:
                raise ConfigError(
                    f"{what}: bin_edges, group_column and categories are for histograms"
                )
        if kind is AggregateKind.STATS:
            if moments is None:
                raise ConfigError("stats: moments must be mean, variance or covariance")
            if target is not None or self.target_lower is not None or self.target_upper is not None:
                raise ConfigError("stats: a target is for linreg")
        elif moments is not None:
            raise ConfigError(f"{what}: moments are for stats")
        if kind is AggregateKind.LINREG:
            if target is None or self.target_lower is None or self.target_upper is None:
                raise ConfigError("linreg: needs target_column, target_lower and target_upper")
            bounds = finite_numbers((self.target_lower, self.target_upper), "linreg: target bounds")
            if not bounds[0] < bounds[1]:
                raise ConfigError(
                    f"linreg: target bounds must have lower < upper, got [{bounds[0]}, {bounds[1]}]"
                )
            check_span(bounds[0], bounds[1], "linreg: target")
            object.__setattr__(self, "target_lower", bounds[0])
            object.__setattr__(self, "target_upper", bounds[1])
        elif target is not None or self.target_lower is not None or self.target_upper is not None:
            raise ConfigError(f"{what}: a target is for linreg")

    def _check_histogram(self) -> None:
        if not 1 <= len(self.columns) <= 2:
            raise ConfigError(
                f"histogram: one column, or two for a joint table, got {len(self.columns)}"
            )
        if self.lower or self.upper:
            raise ConfigError("histogram: its bounds are its bins' edges (bounds are for stats)")
        if len(self.bin_edges) != len(self.columns):
            raise ConfigError(f"histogram: bins: one list per column, got {len(self.bin_edges)}")
        for column, edges in zip(self.columns, self.bin_edges, strict=True):  # as --bins
            if len(edges) < 2 or any(b <= a for a, b in itertools.pairwise(edges)):
                raise ConfigError(
                    f"histogram: the bins of column {column} must be at least two strictly "
                    f"increasing edges, got [{', '.join(f'{edge:g}' for edge in edges)}]"
                )
        if (self.group_column is None) != (not self.categories):
            raise ConfigError("histogram: groupby (the group column) and categories go together")
        if len(set(self.categories)) != len(self.categories):
            raise ConfigError("histogram: categories must be distinct")
        if self.n_cells > MAX_HISTOGRAM_CELLS:
            raise ConfigError(
                f"histogram: {self.n_cells} cells, at most {MAX_HISTOGRAM_CELLS} are supported"
            )

    # ------------------------------------------------------------ constructors
    @classmethod
    def statistics(
        cls,
        columns: Sequence[int],
        lower: Sequence[float],
        upper: Sequence[float],
        moments: Moments | str = Moments.COVARIANCE,
    ) -> Aggregate:
        """Count, sums and (per ``moments``) second moments of ``columns``."""
        return cls(
            AggregateKind.STATS, tuple(columns), tuple(lower), tuple(upper), Moments(moments)
        )

    @classmethod
    def histogram(
        cls,
        columns: Sequence[int],
        bin_edges: Sequence[Sequence[float]],
        group_column: int | None = None,
        categories: Sequence[float] = (),
    ) -> Aggregate:
        """Counts over the public bins of one or two columns (per public category)."""
        return cls(
            AggregateKind.HISTOGRAM,
            tuple(columns),
            bin_edges=tuple(tuple(e) for e in bin_edges),
            group_column=group_column,
            categories=tuple(categories),
        )

    @classmethod
    def linear_regression(
        cls,
        columns: Sequence[int],
        lower: Sequence[float],
        upper: Sequence[float],
        target_column: int,
        target_lower: float,
        target_upper: float,
    ) -> Aggregate:
        """N, Σx, Σy, XᵀX and Xᵀy of features ``columns`` and target ``target_column``."""
        return cls(
            AggregateKind.LINREG,
            tuple(columns),
            tuple(lower),
            tuple(upper),
            target_column=target_column,
            target_lower=target_lower,
            target_upper=target_upper,
        )

    # ------------------------------------------------------------- properties
    @property
    def read_columns(self) -> tuple[int, ...]:
        """Every file column this aggregate reads (the owner's policy must allow each)."""
        extra: tuple[int, ...] = (self.group_column,) if self.group_column is not None else ()
        if self.target_column is not None:
            extra += (self.target_column,)
        return self.columns + extra

    @property
    def bins_per_column(self) -> tuple[int, ...]:
        """Histogram: the number of bins of each binned column."""
        return tuple(len(e) - 1 for e in self.bin_edges)

    @property
    def n_cells(self) -> int:
        """Histogram: cells of the released table (categories x bins of each column)."""
        return math.prod(self.bins_per_column) * max(1, len(self.categories))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (what the proxy stores; :meth:`from_dict` reads it back)."""
        record: dict[str, Any] = {}
        for spec_field in dataclasses.fields(self):
            value = getattr(self, spec_field.name)
            if isinstance(value, StrEnum):
                value = value.value
            elif spec_field.name == "bin_edges":
                value = [list(e) for e in value]
            elif isinstance(value, tuple):
                value = list(value)
            record[spec_field.name] = value
        return record

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Aggregate:
        """Inverse of :meth:`to_dict` (ConfigError on unknown keys or bad values)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(record) - names)
        if unknown:
            raise ConfigError(f"aggregate has unknown keys {unknown}")
        if "kind" not in record or "columns" not in record:
            raise ConfigError("an aggregate needs kind and columns")
        try:
            return cls(**record)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid aggregate: {exc}") from None


MAX_DEADLINE_SECONDS = 366 * 24 * 3600.0
"""The longest upload deadline a query may ask for: one year."""

LAST_ISSUED_AT = 253_370_764_800.0 - 2 * MAX_DEADLINE_SECONDS
"""Signing times end two years before 9999-01-01 (UTC), so that a deadline after one is
still a date."""


@dataclass(frozen=True)
class QuerySpec:
    """Public description of one query.

    Attributes
    ----------
    kind : pca or dca.
    n_features : number of feature columns M (the label column excluded).
    feature_lower, feature_upper : public per-feature bounds, each of length M, or
        both empty for "no bounds" (raw values are used, only the row clip applies).
    clip_norm : every row is scaled down to L2 norm <= clip_norm before summing.
    epsilon, delta : privacy parameters of this release; ``epsilon = inf`` means
        no noise at all (verification only, NOT PRIVATE).
    calibration : zcdp (default, proven for the discrete Gaussian), analytic or classic.
    neighbouring : the neighbouring relation (epsilon, delta) refer to; the proxy and
        every owner refuse a query stated for another relation than their deployment's.
    bounded_owner_tables : add/remove only. Calibrate for owners whose tables never
        exceed their public capacity, so no owner ever samples and one added record is
        the only change to cover (no swap: the noise of a central curator). Only owners
        that enforce their capacity (``data.enforce_max_records``) take part, and the
        query's ``max_records_per_owner`` must not be below any owner's capacity
        (docs/privacy.md, "Bounded owner tables").
    mode : stats or masked.
    n_components : number of components the analyst asks for.
    label_column : column holding the class label (DCA), counted in the owners' files.
    class_labels : the public list of class labels (DCA); an owner leaves records of
        other labels out of its statistics (the sensitivity accounts for it).
    feature_columns : PCA and DCA: the owners' file columns (0-based) that are the M
        features, in order; empty (the default) for every column but the label.
    quorum : minimum number of owners that must contribute.
    deadline_seconds : how long the proxy waits for uploads after the query is published.
    issued_at : UNIX time the analyst's client signed the query at (it sets it when it
        submits; None before). Owners answer a query only until ``issued_at +
        deadline_seconds`` (plus an allowance for clocks), so a proxy cannot keep signed
        queries and deliver them later, or state a later upload deadline.
    max_records_per_owner, max_owners : public bounds used to size packed slots; an
        owner holding more records contributes a uniform sample of this many.
    frac_bits : fixed-point fractional bits.
    analyst_public_key_n : the analyst's Paillier modulus n.
    analyst_key_fingerprint : fingerprint of that key (owners pin it).
    query_id : unique id assigned by the analyst client.
    aggregates : the aggregates of an ``aggregate`` query, released together with one
        budget (empty for PCA and DCA). Such a query carries its bounds per aggregate;
        its ``n_features`` is the number of distinct columns it reads
        (:attr:`aggregate_columns`) and ``n_components`` is 1.
    """

    query_id: str
    kind: QueryKind
    n_features: int
    epsilon: float
    delta: float
    n_components: int
    analyst_public_key_n: int
    analyst_key_fingerprint: str
    feature_lower: tuple[float, ...] = ()
    feature_upper: tuple[float, ...] = ()
    clip_norm: float = 1.0
    calibration: Calibration = Calibration.ZCDP
    neighbouring: Neighbouring = Neighbouring.ADD_REMOVE
    bounded_owner_tables: bool = False
    mode: ProtocolMode = ProtocolMode.STATS
    label_column: int | None = None
    class_labels: tuple[float, ...] = ()
    feature_columns: tuple[int, ...] = ()
    quorum: int = 1
    deadline_seconds: float = 300.0
    max_records_per_owner: int = 1 << 20
    max_owners: int = 1 << 8
    frac_bits: int = 32
    noise_weights: tuple[float, ...] = field(default=())
    aggregates: tuple[Aggregate, ...] = ()
    issued_at: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "aggregates", tuple(self.aggregates))
        # Before year 9999 (so that it is a datetime, and the deadline after it too).
        if self.issued_at is not None and not (0 < self.issued_at < LAST_ISSUED_AT):
            raise ConfigError(
                f"issued_at must be a UNIX time before year 9999, got {self.issued_at!r}"
            )
        if not QUERY_ID_PATTERN.fullmatch(self.query_id):
            raise ConfigError(
                f"query_id must be 1 to 128 letters, digits, '.', '_' or '-', got "
                f"{self.query_id[:40]!r}" + ("..." if len(self.query_id) > 40 else "")
            )
        if self.n_features < 1:
            raise ConfigError(f"n_features must be >= 1, got {self.n_features}")
        if not (self.epsilon > 0):
            raise ConfigError(f"epsilon must be > 0 (or inf for no noise), got {self.epsilon}")
        if math.isfinite(self.epsilon) and not (0 < self.delta < 1):
            raise ConfigError(f"delta must be in (0, 1), got {self.delta}")
        if not (0 <= self.delta < 1):  # epsilon = inf: delta unused, but still a number
            raise ConfigError(f"delta must be in [0, 1) when epsilon = inf, got {self.delta}")
        if not (1 <= self.n_components <= self.n_features):
            raise ConfigError(
                f"n_components must be in [1, {self.n_features}], got {self.n_components}"
            )
        if len(self.feature_lower) != len(self.feature_upper):
            raise ConfigError("feature_lower and feature_upper must have the same length")
        if self.feature_lower and len(self.feature_lower) != self.n_features:
            raise ConfigError(
                f"bounds given for {len(self.feature_lower)} features, query has {self.n_features}"
            )
        for j, (lo, hi) in enumerate(zip(self.feature_lower, self.feature_upper, strict=True)):
            if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
                raise ConfigError(f"feature {j}: bounds must be finite with lower < upper")
            check_span(lo, hi, f"feature {j}")
        if not (math.isfinite(self.clip_norm) and self.clip_norm >= MIN_CLIP_NORM):
            raise ConfigError(
                f"clip_norm must be finite and at least {MIN_CLIP_NORM:g}, got {self.clip_norm}"
            )
        if not all(math.isfinite(label) for label in self.class_labels):
            raise ConfigError("class_labels must be finite numbers")
        if self.kind is QueryKind.PCA and self.class_labels:
            raise ConfigError("a PCA query takes no class_labels")
        if self.kind is QueryKind.DCA:
            if self.label_column is None:
                raise ConfigError("a DCA query needs label_column")
            if len(self.class_labels) < 2:
                raise ConfigError("a DCA query needs at least two public class labels")
            if len(set(self.class_labels)) != len(self.class_labels):
                raise ConfigError("class_labels must be distinct")
        if self.quorum < 1 or self.quorum > self.max_owners:
            raise ConfigError(f"quorum must be in [1, max_owners={self.max_owners}]")
        # The deadline travels as a timestamp (task stream, query status) and owners add
        # it to the signing time: a query whose deadline lay past year 9999 was stored
        # and charged, and then every status and task stream failed (datetime out of
        # range); a signed one of 1e12 s ended owners' sessions (found by review).
        if not (0 < self.deadline_seconds <= MAX_DEADLINE_SECONDS):
            raise ConfigError(
                f"deadline_seconds must be > 0 and at most {MAX_DEADLINE_SECONDS:.0f} (one "
                f"year), got {self.deadline_seconds!r}"
            )
        if self.max_records_per_owner < 1:
            raise ConfigError("max_records_per_owner must be >= 1")
        if not (8 <= self.frac_bits <= 48):
            raise ConfigError(f"frac_bits must be in [8, 48], got {self.frac_bits}")
        if any(not (w > 0 and math.isfinite(w)) for w in self.noise_weights):
            raise ConfigError("noise_weights must be positive and finite")
        if self.bounded_owner_tables and self.neighbouring is not Neighbouring.ADD_REMOVE:
            raise ConfigError(
                "bounded_owner_tables changes the add/remove calibration only: under "
                "replace-one the swap of a record is the relation itself"
            )
        self._check_feature_columns()
        self._check_aggregates()

    def _check_feature_columns(self) -> None:
        columns = column_indices(self.feature_columns, "feature_columns")
        object.__setattr__(self, "feature_columns", columns)  # 1.0 read back from JSON: 1
        if not columns:
            return
        if self.kind is QueryKind.AGGREGATE:
            raise ConfigError("an aggregate query names its columns per aggregate")
        if len(set(columns)) != len(columns):
            raise ConfigError(f"feature_columns names a column twice: {list(columns)}")
        if len(columns) != self.n_features:
            raise ConfigError(
                f"feature_columns names {len(columns)} columns, the query has "
                f"n_features = {self.n_features}"
            )
        if self.label_column is not None and self.label_column in columns:
            raise ConfigError(
                f"the label column {self.label_column} cannot also be a feature column"
            )

    def _check_aggregates(self) -> None:
        if self.kind is not QueryKind.AGGREGATE:
            if self.aggregates:
                raise ConfigError(f"a {self.kind.value} query takes no aggregates")
            return
        if not self.aggregates:
            raise ConfigError("an aggregate query needs at least one aggregate")
        if len(self.aggregates) > MAX_AGGREGATES:
            raise ConfigError(f"at most {MAX_AGGREGATES} aggregates per query")
        for index, part in enumerate(self.aggregates):
            if not isinstance(part, Aggregate):
                raise ConfigError(f"aggregates[{index}] is not an Aggregate")
        if self.mode is not ProtocolMode.STATS:
            raise ConfigError("aggregate queries run in stats mode only")
        if self.has_bounds or self.clip_norm != 1.0 or self.label_column is not None:
            raise ConfigError(
                "an aggregate query carries its bounds and columns per aggregate: leave "
                "feature_lower/feature_upper, clip_norm and label_column at their defaults"
            )
        if self.n_features != len(self.aggregate_columns):
            raise ConfigError(
                f"an aggregate query reading columns {list(self.aggregate_columns)} has "
                f"n_features = {len(self.aggregate_columns)}, got {self.n_features}"
            )
        if self.n_components != 1:
            raise ConfigError("an aggregate query has n_components = 1 (it has no components)")

    @property
    def private(self) -> bool:
        """False only for the verification mode epsilon = inf (no noise at all)."""
        return math.isfinite(self.epsilon)

    @property
    def has_bounds(self) -> bool:
        return bool(self.feature_lower)

    @property
    def n_classes(self) -> int:
        return len(self.class_labels)

    @property
    def aggregate_columns(self) -> tuple[int, ...]:
        """Sorted distinct file columns every aggregate of the query reads together."""
        return tuple(sorted({c for part in self.aggregates for c in part.read_columns}))

    @property
    def release_kinds(self) -> tuple[ReleaseKind, ...]:
        """The kinds an owner's policy must allow: the query's, or each aggregate's."""
        if self.kind is QueryKind.AGGREGATE:
            return tuple(dict.fromkeys(part.kind for part in self.aggregates))
        return (self.kind,)


def stamped(spec: QuerySpec) -> QuerySpec:
    """``spec`` with its signing time (``issued_at``) now, unless it carries one."""
    if spec.issued_at is not None:
        return spec
    return dataclasses.replace(spec, issued_at=time.time())


def spec_digest(spec: QuerySpec) -> str:
    """``sha256:<hex>`` over every public parameter of ``spec``, canonically encoded.

    What the analyst signs and what an owner's ledger keys a release by: two specs with
    the same digest describe the same release.
    """
    # The fields as dataclasses.asdict gives them, without its deep copy of every
    # value (a copy of each bound of a 500-feature query took ~30 ms, three times per
    # task on the owner's path to its first ciphertext): only the aggregates are
    # dataclasses themselves.
    fields: dict[str, Any] = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    # A PCA or DCA query hashes exactly as before aggregates existed, so signatures by
    # older analyst clients still verify.
    if spec.aggregates:
        fields["aggregates"] = [dataclasses.asdict(part) for part in spec.aggregates]
    else:
        del fields["aggregates"]
    # Likewise a query that does not ask for bounded owner tables, or carries no signing
    # time (stored queries of analysts before wire protocol 5).
    if not spec.bounded_owner_tables:
        del fields["bounded_owner_tables"]
    if spec.issued_at is None:
        del fields["issued_at"]
    if not spec.feature_columns:  # every column but the label, as before they existed
        del fields["feature_columns"]
    text = json.dumps(fields, sort_keys=True, default=str, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()
