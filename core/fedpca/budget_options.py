"""The ``--delta`` and ``--query-delta`` options of ``fedpca analyst budget`` and
``fedpca owner budget``, and :data:`NUMBER`, the type of the budget flags of the
``init`` commands (a number, never NaN: a NaN budget reached the configuration writer
as a traceback, found by review).

Both commands report the epsilon spent at a delta and what a next query stating a delta
may ask for; the two options are declared once here so that both commands accept the
same values and refuse the others alike: a click usage error (exit code 2) naming the
option, as every other bad option value is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from fedpca.query import DEFAULT_QUERY_DELTA

__all__ = ["DELTA", "NUMBER", "Delta", "Number", "budget_delta_options"]

_Command = TypeVar("_Command", bound=Callable[..., Any])


class Delta(click.ParamType):
    """A delta: a number in the open interval (0, 1)."""

    name = "delta"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, float):
            delta = value
        else:
            try:
                delta = float(value)
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not a number in (0, 1)", param, ctx)
        if not 0 < delta < 1:  # NaN too
            self.fail(f"must be in (0, 1), got {value}", param, ctx)
        return delta


DELTA = Delta()


class Number(click.ParamType):
    """A number (``inf`` allowed: an unlimited budget), not NaN; its range is checked
    where it is used, with the other settings."""

    name = "number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if number != number:
            self.fail("must be a number, got nan", param, ctx)
        return number


NUMBER = Number()


def budget_delta_options(cap: str) -> Callable[[_Command], _Command]:
    """Add ``--delta`` and ``--query-delta`` (both :data:`DELTA`, default None).

    Parameters
    ----------
    cap : str
        Whose per-query delta cap bounds the default query delta, for the help text
        (e.g. "this owner's").
    """

    def decorate(command: _Command) -> _Command:
        query_delta = click.option(
            "--query-delta",
            type=DELTA,
            default=None,
            help="The delta a next query would state: the epsilon it may ask for depends "
            f"on it [{DEFAULT_QUERY_DELTA:g}, the estimators' default, or {cap} per-query "
            "delta cap if lower].",
        )
        delta = click.option(
            "--delta",
            type=DELTA,
            default=None,
            help="Report the epsilon spent at this delta [the budget's delta].",
        )
        return delta(query_delta(command))

    return decorate
