""":data:`COLUMNS`, the click type of every option that names file columns: the
analyst's ``--columns`` (``stats``, ``histogram``, ``linreg``) and the owner's
``--allowed-columns`` (``owner init``). Declared once so that both refuse the same
mistakes alike, as a click usage error naming the option."""

from __future__ import annotations

from typing import Any

import click

__all__ = ["COLUMNS", "ColumnList"]


class ColumnList(click.ParamType):
    """Comma-separated 0-based column indices, e.g. ``1,2,5``: every item an integer
    >= 0 (an empty item is a typo: ``1,,6`` is refused, not read as ``1,6``), none
    given twice."""

    name = "columns"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, tuple):
            return value
        try:
            columns = tuple(int(part) for part in str(value).split(","))
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of columns", param, ctx)
        if min(columns) < 0:
            self.fail("columns are 0-based indices >= 0", param, ctx)
        twice = sorted({c for n, c in enumerate(columns) if c in columns[:n]})
        if twice:
            self.fail(f"column {twice[0]} is given twice", param, ctx)
        return columns


COLUMNS = ColumnList()
