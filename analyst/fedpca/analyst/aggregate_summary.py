"""What ``fedpca analyst stats|histogram|linreg|fetch`` print about a fitted aggregate:
every number the release computed, labelled with its file column (an analyst walkthrough
found the covariance, the histogram's counts and the coefficients' columns only in
result.json, and ``fetch`` printing none of them).

:func:`summary_lines` returns the lines, each with the colour of a warning line, and
:func:`echo_summary` prints them. Large tables are cut to :data:`MAX_ROWS` rows
(result.json has them all).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import click
import numpy as np

from fedpca.aggregates import COUNTS
from fedpca.analyst.release_summary import records_line
from fedpca.analyst.schema import column_indices

__all__ = [
    "MAX_ROWS",
    "SummaryLine",
    "echo_aggregates",
    "echo_summary",
    "histogram_total_line",
    "summary_lines",
]

MAX_ROWS = 40
"""Rows of a matrix or of a histogram's cells printed at most."""

SummaryLine = tuple[str, str | None]
"""A line and its colour (None, or "yellow" for a note on post-processing)."""

_WIDTH = 13  # the widest %.6g, -1.23457e-05, is 12: one space always separates


def summary_lines(estimator: Any) -> list[SummaryLine]:
    """The summary of a fitted statistics, histogram or regression estimator."""
    from fedpca.analyst.regression import FederatedLinearRegression
    from fedpca.analyst.statistics import FederatedHistogram, FederatedStatistics

    if isinstance(estimator, FederatedStatistics):
        return _statistics(estimator)
    if isinstance(estimator, FederatedHistogram):
        return _histogram(estimator)
    if isinstance(estimator, FederatedLinearRegression):
        return _regression(estimator)
    raise TypeError(f"no summary for {type(estimator).__name__}")


def echo_summary(estimator: Any) -> None:
    """Print :func:`summary_lines` of ``estimator`` (warnings in their colour)."""
    for line, colour in summary_lines(estimator):
        if colour is None:
            click.echo(line)
        else:
            click.secho(line, fg=colour)


def echo_aggregates(fitted: Any) -> None:
    """Print the summary of every aggregate of a fitted combined query (or of one
    estimator), each under a line naming its kind and columns."""
    estimators = getattr(fitted, "estimators_", [fitted])
    parts = [estimator.aggregate() for estimator in estimators]
    click.echo(f"aggregates:  {', '.join(part.kind.value for part in parts)}")
    for estimator, part in zip(estimators, parts, strict=True):
        click.echo(f"--- {part.kind.value} of columns {','.join(map(str, part.columns))}")
        echo_summary(estimator)


def _cell(value: float, digits: int = 6) -> str:
    return f"{value:>{_WIDTH}.{digits}g}"


def _header(columns: Sequence[int], first: str) -> str:
    return f"{first:<14}" + "".join(f"{f'col {c}':>{_WIDTH}}" for c in columns)


def _matrix(name: str, columns: Sequence[int], matrix: Any) -> list[SummaryLine]:
    lines: list[SummaryLine] = [(f"{name}:", None), (_header(columns, ""), None)]
    shown = min(len(columns), MAX_ROWS)
    for i in range(shown):
        row = "".join(_cell(v) for v in matrix[i][:MAX_ROWS])
        lines.append((f"{f'  col {columns[i]}':<14}{row}", None))
    if len(columns) > shown:
        lines.append((f"  … {len(columns) - shown} more rows in result.json", None))
    return lines


def _records_line(estimator: Any) -> SummaryLine:
    """N, and whether it is noisy (with its noise sd) or exact, and why."""
    line = records_line(estimator.n_samples_, estimator.n_samples_noise_sd_, estimator.not_private_)
    return (line, None)


def _statistics(estimator: Any) -> list[SummaryLine]:
    columns = list(estimator.columns_)
    # A new analyst could not tell a noisy mean's third digit from its noise: each
    # estimate's noise sd is printed under it (post-processing, see aggregates.py).
    private = not estimator.not_private_
    lines: list[SummaryLine] = [_records_line(estimator)]
    shown = columns[:MAX_ROWS]
    lines.append((_header(shown, "column"), None))
    lines.append(("mean          " + "".join(_cell(v) for v in estimator.mean_[:MAX_ROWS]), None))
    if private and estimator.mean_noise_sd_ is not None:
        spread = estimator.mean_noise_sd_[:MAX_ROWS]
        lines.append(("  noise sd    " + "".join(_cell(v, 3) for v in spread), None))
    if estimator.variance_ is not None:
        variance = estimator.variance_[:MAX_ROWS]
        lines.append(("variance      " + "".join(_cell(v) for v in variance), None))
        if private and estimator.variance_noise_sd_ is not None:
            spread = estimator.variance_noise_sd_[:MAX_ROWS]
            lines.append(("  noise sd    " + "".join(_cell(v, 3) for v in spread), None))
        deviation = np.sqrt(np.maximum(variance, 0.0))
        lines.append(("std           " + "".join(_cell(v) for v in deviation), None))
    if private:
        lines.append(
            (
                "noise sd:    one standard deviation of the privacy noise in the value above "
                "it (first order; not the records' sampling error)",
                None,
            )
        )
    if len(columns) > len(shown):
        lines.append((f"… {len(columns) - len(shown)} more columns in result.json", None))
    if estimator.covariance_ is not None and len(columns) > 1:
        lines += _matrix("covariance", columns, estimator.covariance_)
        lines += _matrix("correlation", columns, estimator.correlation_)
    if estimator.clip_moved_:
        # Found by a new user: a mean clipped to its bound read as a measurement.
        lines.append(
            (
                f"clipped:     {', '.join(estimator.clip_moved_)}: noisy values outside "
                "their public ranges were moved into them (a value at its bound says so, "
                "not the data); --no-clip (clip = false in a combined file) keeps the raw "
                "values, a larger epsilon makes it rarer",
                "yellow",
            )
        )
    return lines


def _bin_labels(edges: Any) -> list[str]:
    """Each bin as the values it counts: the first and the last bins also count the
    values beyond the outer edges (a new user read ``[30, 40)`` as ages 30 to 39, where
    it held every age below 40)."""
    last = len(edges) - 2
    return [
        f"{'(-inf' if i == 0 else f'[{edges[i]:.6g}'}, "
        f"{'inf)' if i == last else f'{edges[i + 1]:.6g})'}"
        for i in range(len(edges) - 1)
    ]


def _histogram(estimator: Any) -> list[SummaryLine]:
    counts = np.asarray(estimator.counts_)
    columns = list(estimator.columns_)
    lines: list[SummaryLine] = [(f"cells:       {counts.size} (shape {counts.shape})", None)]
    tables = [counts] if estimator.categories_ is None else list(counts)
    names = (
        [None]
        if estimator.categories_ is None
        else [f"category {c:.6g} of col {estimator.groupby}:" for c in estimator.categories_]
    )
    rows_left = MAX_ROWS
    for position, (name, table) in enumerate(zip(names, tables, strict=True)):
        if rows_left <= 0:
            lines.append(("… more tables in result.json", None))
            break
        if name is not None:
            lines.append((name, None))
            if (weak := _weak_category(estimator, position)) is not None:
                lines.append((weak, "yellow"))
        first = _bin_labels(estimator.bin_edges_[0])
        if table.ndim == 1:
            lines.append((f"  col {columns[0]} bin".ljust(24) + "count", None))
            for label, value in list(zip(first, table, strict=True))[:rows_left]:
                lines.append((f"  {label:<22}{value:.6g}", None))
        else:
            second = _bin_labels(estimator.bin_edges_[1])
            lines.append((f"  rows: col {columns[0]} bins, columns: col {columns[1]} bins", None))
            lines.append((" " * 24 + "".join(f"{s:>18}" for s in second[:MAX_ROWS]), None))
            for label, row in list(zip(first, table, strict=True))[:rows_left]:
                lines.append(
                    (f"  {label:<22}" + "".join(f"{v:>18.6g}" for v in row[:MAX_ROWS]), None)
                )
        rows_left -= min(len(first), rows_left)
        if len(first) > MAX_ROWS:
            lines.append(("  … more bins in result.json", None))
    outer = ", ".join(f"{e[0]:.6g} to {e[-1]:.6g}" for e in estimator.bin_edges_)
    lines.append((f"edges:       {outer}; values beyond them count in the outer bins", None))
    lines.append((histogram_total_line(estimator), None))
    if not estimator.not_private_ and (sigma := estimator.noise_sigmas_.get(COUNTS)):
        lines.append((f"noise sd:    {sigma:.3g} in each count (the privacy noise's)", None))
    if estimator.clamped_ and bool(np.any(np.asarray(estimator.raw_counts_) < 0)):
        # Only when a count changed: exact releases said so with nothing negative.
        lines.append(
            (
                "clamped:     negative noisy counts were set to 0 (--no-clamp, or clamp = false "
                "in a combined file, keeps them)",
                "yellow",
            )
        )
    return lines


def _weak_category(estimator: Any, position: int) -> str | None:
    """A warning for a category whose noisy counts sum to within 3 sigma of zero: the
    owners may hold none of its records (a category that is no value of the column gave
    a table of noise without a word, where DCA warns of such a class: a new analyst's
    walkthrough). ``position``: the category's index; its raw counts are summed."""
    sigma = estimator.noise_sigmas_.get(COUNTS)
    if estimator.not_private_ or not sigma:
        return None
    raw = np.asarray(estimator.raw_counts_[position])
    spread = 3.0 * sigma * math.sqrt(raw.size)
    if float(raw.sum()) >= spread:
        return None
    return (
        f"  its counts sum to {float(raw.sum()):.0f}, within 3 sigma ({spread:.3g}) of zero: "
        "the owners may hold no records of this category (is it a value of the column?)"
    )


def histogram_total_line(estimator: Any) -> str:
    """The summary's total of a fitted :class:`~fedpca.analyst.statistics.FederatedHistogram`.

    It sums the released noisy counts as they are, negative ones included: their noise
    has mean 0, so the sum is unbiased, with k cells of noise sigma s adding noise of
    sigma s·√k. The counts clamped at 0 are not summed: clamping raises the mean of a
    near-empty cell by about 0.4 s, so over many cells their sum is mostly noise (two
    columns of 400 bins each at epsilon 0.1 summed to millions for 768 records).
    """
    raw = estimator.raw_counts_
    total = f"total count: {float(raw.sum()):.0f}"
    if estimator.not_private_:
        return f"{total} (exact: NOT PRIVATE)"
    sigma = estimator.noise_sigmas_.get(COUNTS)
    spread = "" if sigma is None else f", noise sd {sigma * math.sqrt(raw.size):.3g}"
    return f"{total} (noisy: the sum of the {raw.size} counts, negative ones included{spread})"


def _regression(estimator: Any) -> list[SummaryLine]:
    columns = column_indices(estimator.columns, "columns")
    # Its N was in result.json only (a review of stop 47).
    lines: list[SummaryLine] = [
        _records_line(estimator),
        (f"target:      col {int(estimator.target)}", None),
    ]
    lines.append(("coefficient   " + "".join(f"{f'col {c}':>{_WIDTH}}" for c in columns), None))
    lines.append(("              " + "".join(_cell(v) for v in estimator.coef_), None))
    draws = estimator.noise_sd_draws_
    if draws:
        lines.append(
            ("  noise sd    " + "".join(_cell(v, 3) for v in estimator.coef_noise_sd_), None)
        )
        intercept_sd = f" (noise sd {estimator.intercept_noise_sd_:.3g})"
    else:
        intercept_sd = ""
    lines.append((f"intercept:   {estimator.intercept_:.6g}{intercept_sd}", None))
    lines.append((f"alpha:       {estimator.alpha_:.6g}", None))
    if estimator.alpha_ > 0:
        lines.append(
            (
                "ridge:       alpha > 0 shrinks the coefficients toward 0 (the price of a "
                "regulariser that keeps the noisy XᵀX invertible); --alpha 0 (alpha = 0 in a "
                "combined file) for least "
                "squares on the noisy statistics",
                "yellow",
            )
        )
    if draws:
        lines.append(
            (
                "noise sd:    one standard deviation of the privacy noise in each value, from "
                f"{draws} simulated releases (not the records' sampling error)",
                None,
            )
        )
    return lines
