"""Numbers in messages that compare them: never two different values printed alike.

A refusal such as "epsilon = 1 ... above the cap 1" reads as a bug: both numbers were
rounded to a few significant digits, and the one above the cap by less than the rounding
printed as the cap. :func:`distinct` prints every number of one message with as few
significant digits as it can (at least ``digits``, so "1" and "1e-05" stay short) and as
many as it must for values that differ to print differently (at most 17, where every
double prints as itself).

:func:`printable` shows a peer's text (a decline's reason, a status's details) with its
control characters escaped, so that it cannot move the cursor, retitle a window or
forge a log line wherever it is printed.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations

__all__ = ["distinct", "exact", "first_of", "printable", "shortened"]

_MAX_DIGITS = 17
"""Significant digits at which every double prints distinctly (IEEE 754 binary64)."""


def distinct(*values: float, digits: int = 6) -> tuple[str, ...]:
    """The values as text, different values as different text.

    Parameters
    ----------
    *values : float
        The numbers one message shows (and a reader compares).
    digits : int
        The fewest significant digits used, in ``[1, 17]``.

    Returns
    -------
    tuple of str
        In the order given, in ``g`` format (``1``, ``0.983423``, ``1e-05``, ``inf``)
        with the smallest precision from ``digits`` on at which every two values that
        differ (``!=``) print differently; equal values print alike (but 0.0 and -0.0).

    Raises
    ------
    ValueError
        ``digits`` out of range.
    """
    if not 1 <= digits <= _MAX_DIGITS:
        raise ValueError(f"digits must be in [1, {_MAX_DIGITS}], got {digits!r}")
    pairs = [(i, j) for i, j in combinations(range(len(values)), 2) if values[i] != values[j]]
    precision = digits
    while True:
        texts = tuple(f"{float(value):.{precision}g}" for value in values)
        # At 17 digits every double prints as itself (NaN, never equal, stops here too).
        if precision == _MAX_DIGITS or all(texts[i] != texts[j] for i, j in pairs):
            return texts
        precision += 1


def exact(value: float) -> str:
    """``value`` with every digit it has (Python's shortest round-trip form), without a
    trailing ``.0``: a class label or category a query must name exactly (``1`` and
    ``1.0000000001`` differ, ``-0.0`` equals ``0``)."""
    return repr(float(value) + 0.0).removesuffix(".0")


def first_of(items: Sequence[str], shown: int) -> str:
    """The first ``shown`` of ``items``, comma-separated, and how many more:
    ``"a, b and 3 more"`` (a list of hundreds of owners or labels would fill the line)."""
    more = len(items) - shown
    return ", ".join(items[:shown]) + (f" and {more} more" if more > 0 else "")


def printable(text: str) -> str:
    """``text`` with every character that is not printable (control characters such as
    ESC, BEL or a line break, format characters) shown as its Python escape (``\\x1b``);
    spaces stay."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shortened(text: str, characters: int) -> str:
    """``text`` cut to at most ``characters``, ending in "…" where it was cut (a cut
    list read as a whole one)."""
    if len(text) <= characters:
        return text
    return text[: characters - 1].rstrip() + "…"


def column_ranges(columns: Sequence[int]) -> str:
    """0-based column indices as runs, in the order given: ``"0-3, 7, 9-10"`` (an
    owner allowing 2,000 columns would otherwise print 2,000 numbers)."""
    runs: list[list[int]] = []
    for column in columns:
        if runs and column == runs[-1][1] + 1:
            runs[-1][1] = column
        else:
            runs.append([column, column])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
