"""Checks of the lists a query carries (column indices, bounds), shared by
:class:`fedpca.query.QuerySpec` and its aggregates. Each raises ConfigError naming
what it checked."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedpca.errors import ConfigError

__all__ = ["check_bounds", "check_span", "column_indices", "finite_numbers"]


def column_indices(values: Any, what: str) -> tuple[int, ...]:
    try:
        items = tuple(values)
    except TypeError:
        raise ConfigError(f"{what} must be a sequence of column indices") from None
    out = []
    for value in items:
        whole = isinstance(value, int | np.integer) or (
            isinstance(value, float | np.floating) and float(value).is_integer()
        )
        if isinstance(value, bool) or not whole:
            raise ConfigError(f"{what} must hold whole column indices, got {value!r}")
        if value < 0:
            raise ConfigError(f"{what} must hold column indices >= 0, got {value!r}")
        out.append(int(value))
    return tuple(out)


def finite_numbers(values: Any, what: str) -> tuple[float, ...]:
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a sequence of numbers") from None
    if not all(math.isfinite(v) for v in out):
        raise ConfigError(f"{what} must be finite numbers")
    return out


def check_bounds(
    lower: tuple[float, ...], upper: tuple[float, ...], columns: tuple[int, ...], what: str
) -> None:
    n = len(columns)
    if len(lower) != n or len(upper) != n:
        raise ConfigError(
            f"{what}: need one public lower and upper bound per column ({n}), got "
            f"{len(lower)} and {len(upper)}"
        )
    # Named by file column, not by position in the list (an analyst's walkthrough).
    for column, lo, hi in zip(columns, lower, upper, strict=True):
        if not lo < hi:
            raise ConfigError(
                f"{what}: column {column}: bounds must have lower < upper, got [{lo}, {hi}]"
            )
        check_span(lo, hi, f"{what}: column {column}")


def check_span(lo: float, hi: float, what: str) -> None:
    # Owners scale values by 2 (x - lower) / (upper - lower). A span whose double
    # overflows is refused with the query, before anything is charged: found by the
    # owner's encoder, it would fail after the owner's budget was reserved.
    if not math.isfinite(2.0 * (hi - lo)):
        raise ConfigError(
            f"{what}: bounds [{lo}, {hi}] span more than a float can scale "
            "(2 x (upper - lower) overflows)"
        )
