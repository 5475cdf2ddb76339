"""The public schema an analyst's estimator is given, in every form it accepts: the
number of features and their bounds (PCA/DCA), or the columns and their bounds
(aggregates). Each is checked here, before anything is submitted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fedpca.errors import ConfigError
from fedpca.preprocess import FeatureBounds

__all__ = [
    "ColumnBoundsParam",
    "FeatureBoundsParam",
    "check_schema",
    "column_bounds",
    "column_indices",
    "resolve_bounds",
]

FeatureBoundsParam = str | tuple[Any, Any] | FeatureBounds | None
"""A PCA/DCA estimator's ``bounds``: "LO:HI[,…]", a (lower, upper) pair of numbers or of
length-M sequences, :class:`~fedpca.preprocess.FeatureBounds`, or None."""

ColumnBoundsParam = str | Sequence[Any]
"""An aggregate's ``bounds``: "LO:HI[,…]", a (lo, hi) pair, or one pair per column."""


def resolve_bounds(bounds: FeatureBoundsParam, n_features: int) -> FeatureBounds | None:
    if bounds is None:
        return None
    if isinstance(bounds, FeatureBounds):
        bounds = bounds
    elif isinstance(bounds, str):
        if bounds.strip().lower() == "none":
            return None
        bounds = FeatureBounds.parse(bounds, n_features)
    else:
        try:
            lower, upper = bounds
        except (TypeError, ValueError):
            raise ConfigError(
                "bounds must be None, 'LO:HI', a (lower, upper) pair of numbers "
                f"or of length-M sequences, got {bounds!r}"
            ) from None
        if np.ndim(lower) == 0 and np.ndim(upper) == 0:
            bounds = FeatureBounds((float(lower),) * n_features, (float(upper),) * n_features)
        else:
            bounds = FeatureBounds.from_arrays(lower, upper)
    if bounds.n_features != n_features:
        raise ConfigError(f"bounds cover {bounds.n_features} features, not {n_features}")
    return bounds


def _bounds_length(bounds: FeatureBoundsParam) -> int | None:
    """M implied by per-feature bounds, if they are given per feature."""
    if isinstance(bounds, FeatureBounds):
        return bounds.n_features
    if isinstance(bounds, str):
        pairs = [p for p in bounds.split(",") if p.strip()]
        return len(pairs) if len(pairs) > 1 else None
    if bounds is not None:
        try:
            lower, _ = bounds
        except (TypeError, ValueError):
            return None
        if np.ndim(lower) == 1:
            return len(lower)
    return None


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


def column_bounds(bounds: ColumnBoundsParam, n: int, what: str) -> tuple[tuple[float, ...], ...]:
    """(lower, upper) of ``n`` columns from "LO:HI[,…]", a (lo, hi) pair or pairs."""
    if isinstance(bounds, str):
        parsed = FeatureBounds.parse(bounds, n)
        return parsed.lower, parsed.upper
    try:
        items = list(bounds)
    except TypeError:
        raise ConfigError(
            f"{what} must be 'LO:HI', a (lo, hi) pair or one pair per column"
        ) from None
    if len(items) == 2 and all(np.ndim(v) == 0 for v in items):
        lo, hi = float(items[0]), float(items[1])
        return (lo,) * n, (hi,) * n
    if len(items) != n or not all(np.ndim(v) == 1 and len(v) == 2 for v in items):
        raise ConfigError(f"{what}: need one (lo, hi) pair per column ({n}), got {bounds!r}")
    return tuple(float(p[0]) for p in items), tuple(float(p[1]) for p in items)


def column_indices(columns: int | Sequence[int], what: str) -> tuple[int, ...]:
    """The column indices ``columns`` names (one index or a sequence of them)."""
    if isinstance(columns, int | np.integer):
        return (int(columns),)
    try:
        return tuple(int(c) for c in columns)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a column index or a sequence of them") from None
