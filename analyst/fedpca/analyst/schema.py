"""The public schema an analyst's estimator is given, in every form it accepts: the
number of features and their bounds (PCA/DCA), or the columns and their bounds
(aggregates). Each is checked here, before anything is submitted."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from fedpca.errors import ConfigError
from fedpca.preprocess import FeatureBounds

__all__ = [
    "BoundsParam",
    "ColumnBoundsParam",
    "FeatureBoundsParam",
    "check_schema",
    "column_bounds",
    "column_indices",
    "parse_bounds",
    "required",
    "resolve_bounds",
]

T = TypeVar("T")

BoundsParam = str | FeatureBounds | Sequence[Any] | None
"""Public bounds, in the forms every estimator takes (PCA and DCA per feature, the
aggregates per column); :func:`parse_bounds` reads them all:

* ``"LO:HI"`` (the same for every feature) or ``"LO:HI,LO:HI,…"`` (one per feature);
* ``(lo, hi)``: a pair of numbers, for every feature;
* ``[(lo, hi), …]``: one pair per feature (an array of shape (M, 2));
* ``(lower, upper)``: two sequences of M bounds each (shape (2, M)), for M other than 2:
  a 2 × 2 is one pair per feature, as the aggregates always read it;
* :class:`~fedpca.preprocess.FeatureBounds`;
* ``None`` or ``"none"``: no bounds (PCA and DCA only: raw units, only the row clip).
"""

FeatureBoundsParam = BoundsParam
"""A PCA/DCA estimator's ``bounds`` (:data:`BoundsParam`)."""

ColumnBoundsParam = BoundsParam
"""An aggregate's ``bounds`` (:data:`BoundsParam`, None excepted)."""


def parse_bounds(
    bounds: BoundsParam, n: int | None, what: str = "bounds", unit: str = "feature"
) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """(lower, upper) of ``n`` features (or columns) from any :data:`BoundsParam`, or
    None for no bounds. With ``n`` None the number is the one the bounds give, and a
    form that applies to every feature is refused.

    Raises
    ------
    ConfigError
        Not one of the forms, not numbers, or bounds for another number than ``n``.
        Whether each lower bound is below its upper one is checked where the bounds
        are used (:class:`~fedpca.preprocess.FeatureBounds`, the aggregate).
    """
    if bounds is None or (isinstance(bounds, str) and bounds.strip().lower() == "none"):
        return None
    if isinstance(bounds, FeatureBounds):
        lower, upper = bounds.lower, bounds.upper
    elif isinstance(bounds, str):
        parsed = FeatureBounds.parse(bounds, n)
        lower, upper = parsed.lower, parsed.upper
    else:
        array = _bounds_array(bounds, what, unit)
        if array.ndim == 1:
            if n is None:
                raise ConfigError(
                    f"{what} {bounds!r} apply to every {unit}: give the number of {unit}s"
                )
            lower, upper = (float(array[0]),) * n, (float(array[1]),) * n
        else:
            lower, upper = _lower_upper(array)
    if n is not None and len(lower) != n:
        raise ConfigError(
            f"{what} cover {len(lower)} {unit}s, not {n}: give one (lo, hi) pair per "
            f"{unit}, or one pair for every {unit}"
        )
    return lower, upper


def _bounds_array(bounds: Any, what: str, unit: str) -> npt.NDArray[np.float64]:
    """A non-text ``bounds`` as a (2,) pair, (k, 2) pairs or (2, k) lower and upper rows."""
    forms = (
        f"{what} must be 'LO:HI' or 'LO:HI,LO:HI,…', a (lo, hi) pair, one (lo, hi) pair per "
        f"{unit}, (lower, upper) sequences of one bound per {unit}, or FeatureBounds"
    )
    try:
        array = np.asarray(bounds, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError(f"{forms}; got {bounds!r}") from None
    if array.ndim == 1 and array.shape[0] == 2:
        return array
    if array.ndim == 2 and 2 in array.shape and array.size > 0:
        return array
    raise ConfigError(f"{forms}; got {bounds!r}")


def _lower_upper(array: npt.NDArray[np.float64]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Lower and upper bounds of (k, 2) pairs, or of (2, k) lower and upper rows."""
    rows = array if array.shape[1] == 2 else array.T
    return tuple(rows[:, 0].tolist()), tuple(rows[:, 1].tolist())


def resolve_bounds(bounds: FeatureBoundsParam, n_features: int) -> FeatureBounds | None:
    """A PCA/DCA estimator's bounds for ``n_features`` features (None: no bounds)."""
    parsed = parse_bounds(bounds, n_features)
    if parsed is None:
        return None
    try:
        return FeatureBounds(*parsed)
    except ConfigError as exc:
        if isinstance(bounds, Sequence | np.ndarray) and np.shape(bounds) == (2, 2):
            raise ConfigError(
                f"{exc} (a 2 x 2 bounds is one (lo, hi) pair per feature; give (lower, "
                "upper) sequences as FeatureBounds.from_arrays(lower, upper))"
            ) from None
        raise


def _bounds_length(bounds: FeatureBoundsParam) -> int | None:
    """M implied by per-feature bounds, if they are given per feature."""
    if bounds is None:
        return None
    if isinstance(bounds, str):
        pairs = [p for p in bounds.split(",") if p.strip()]
        return len(pairs) if len(pairs) > 1 and bounds.strip().lower() != "none" else None
    if isinstance(bounds, FeatureBounds):
        return bounds.n_features
    array = _bounds_array(bounds, "bounds", "feature")
    return None if array.ndim == 1 else len(_lower_upper(array)[0])


def check_schema(n_features: Any, bounds: FeatureBoundsParam) -> int:
    if n_features is not None and not isinstance(n_features, int | np.integer):
        raise ConfigError(
            "fit() takes the public schema, not data: the rows stay with their owners. "
            f"Call fit(n_features=M); got {type(n_features).__name__}"
        )
    implied = _bounds_length(bounds)
    if n_features is None:
        if implied is None:
            raise ConfigError("give n_features (or per-feature bounds that imply it)")
        return implied
    if implied is not None and implied != n_features:
        raise ConfigError(f"n_features={n_features} but bounds cover {implied} features")
    return int(n_features)


# ---------------------------------------------------------------------- base


def column_bounds(
    bounds: ColumnBoundsParam | None, columns: Sequence[int], what: str
) -> tuple[tuple[float, ...], ...]:
    """(lower, upper) of the file ``columns`` from any :data:`BoundsParam` but None.

    An error about the i-th pair names its file column (it said "feature 0" of
    ``--columns 1 --bounds 5:1``; an analyst's walkthrough)."""
    try:
        parsed = parse_bounds(bounds, len(columns), what, unit="column")
    except ConfigError as exc:
        named = re.match(r"feature (\d+): ", str(exc))
        if named is None or int(named.group(1)) >= len(columns):
            raise
        column = columns[int(named.group(1))]
        raise ConfigError(f"{what} of column {column}: {str(exc)[named.end() :]}") from None
    if parsed is None:
        raise ConfigError(
            f"give {what}: an aggregate needs public bounds of its columns, "
            '"LO:HI" or one (lo, hi) per column (there is no default)'
        )
    return parsed


def required(value: T | None, name: str, what: str) -> T:
    """``value``, which has no default: a public fact only the analyst knows (a
    column, its bounds, bin edges). Defaults of [0, 1] had silently clipped every
    value of a wider column into them, and spent the budget doing so (review)."""
    if value is None:
        raise ConfigError(f"give {name}: {what} (there is no default)")
    return value


def column_indices(columns: int | Sequence[int] | None, what: str) -> tuple[int, ...]:
    """The column indices ``columns`` names (one index or a sequence of them)."""
    if columns is None:
        raise ConfigError(f"give {what}: the 0-based file columns to read (there is no default)")
    if isinstance(columns, int | np.integer):
        return (int(columns),)
    try:
        return tuple(int(c) for c in columns)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a column index or a sequence of them") from None
