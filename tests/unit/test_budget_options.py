"""``fedpca analyst budget`` and ``fedpca owner budget`` take ``--delta`` and
``--query-delta`` alike: one click type, the same usage error (exit code 2)."""

from __future__ import annotations

import math
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from fedpca.analyst.cli import analyst_group
from fedpca.budget_options import DELTA
from fedpca.owner.cli import owner_group


def _error_line(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("Error:"))


@pytest.mark.parametrize("option", ["--delta", "--query-delta"])
@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("2", "must be in (0, 1), got 2"),
        ("0", "must be in (0, 1), got 0"),
        ("1", "must be in (0, 1), got 1"),
        ("-1e-6", "must be in (0, 1), got -1e-6"),
        ("nan", "must be in (0, 1), got nan"),
        ("x", "'x' is not a number in (0, 1)"),
    ],
)
def test_both_budget_commands_refuse_a_bad_delta_alike(
    tmp_path: Path, option: str, value: str, message: str
) -> None:
    # Refused while the options are parsed: neither command reads its config or
    # dials the proxy first.
    owner = CliRunner().invoke(
        owner_group, ["budget", "--config", str(tmp_path / "none.toml"), option, value]
    )
    analyst = CliRunner().invoke(
        analyst_group, ["budget", "--proxy", "127.0.0.1:9", "--insecure", option, value]
    )
    expected = f"Error: Invalid value for '{option}': {message}"
    for result in (owner, analyst):
        assert result.exit_code == 2, result.output
        assert _error_line(result.output) == expected


def test_a_delta_converts_once() -> None:
    assert DELTA.convert("1e-6", None, None) == 1e-6
    assert DELTA.convert(1e-6, None, None) == 1e-6
    with pytest.raises(click.BadParameter):
        DELTA.convert(math.inf, None, None)
