"""``fedpca analyst combined FILE``: the aggregates of a query file, checked before keys
or the network, each error naming the file, the aggregate and what to change."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from fedpca.analyst.cli import analyst_group
from fedpca.analyst.query_file import read_query_file
from fedpca.analyst.regression import FederatedLinearRegression
from fedpca.analyst.statistics import FederatedHistogram, FederatedStatistics
from fedpca.errors import ConfigError
from helpers import LINREG_AGGREGATE

VALID = """
[[aggregate]]
kind = "stats"
columns = [1, 6]
bounds = "0:17,0:70"
ddof = 1
budget_split = { count = 1, sums = 2, products = 2 }

[[aggregate]]
kind = "histogram"
weight = 0.5
columns = [8]
bins = [[20, 30, 40, 90]]
groupby = 0
categories = [-1, 1]

[[aggregate]]
kind = "linreg"
weight = 3
columns = [6, 8]
bounds = [[0, 70], [20, 90]]
target = 2
target_bounds = [0, 200]
alpha = 4.0
fit_intercept = false
"""

LINREG = LINREG_AGGREGATE


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "aggregates.toml"
    path.write_text(text)
    return path


def test_a_query_file_makes_its_estimators_in_order_with_their_weights(tmp_path: Path) -> None:
    listed = read_query_file(_file(tmp_path, VALID))
    stats, ages, model = listed.estimators
    assert listed.weights == (1.0, 0.5, 3.0)
    assert isinstance(stats, FederatedStatistics) and stats.ddof == 1
    assert stats.aggregate().columns == (1, 6) and stats.aggregate().upper == (17.0, 70.0)
    assert stats.section_weights() == pytest.approx([0.2, 0.4, 0.4])
    assert isinstance(ages, FederatedHistogram) and ages.aggregate().group_column == 0
    assert isinstance(model, FederatedLinearRegression)
    assert (model.alpha, model.fit_intercept) == (4.0, False)
    assert model.aggregate().target_upper == 200.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no aggregates: list each as an [[aggregate]] table"),
        ("aggregates = 1", "unknown keys in the top level: aggregates"),
        (
            "[[aggregate]]\ncolumns = [1]",
            "aggregate 1: kind must be one of stats, histogram, linreg; it has none",
        ),
        ("epsilon = 1\n" + LINREG, "epsilon is set for the whole release by the command's"),
        (
            '[[aggregate]]\nkind = "histogram"\ncolumns = [8]\nbins = "123"',
            "aggregate 1 (histogram): bins must be numbers: one list of edges, or one list "
            "per column, got '123'",
        ),
        (
            '[[aggregate]]\nkind = "histogram"\ncolumns = [8]\nbins = ["20,30,40"]',
            "bins must be numbers",
        ),
        (
            '[[aggregate]]\nkind = "histogram"\ncolumns = [8]\nbins = [1, 2]\ngroupby = 0\n'
            'categories = "12"',
            "categories must be numbers, got '12'",
        ),
        ('[[aggregate]]\nkind = "pca"', "kind must be one of stats, histogram, linreg; got 'pca'"),
        (LINREG + "colums = [1]", "aggregate 1 (linreg): unknown keys colums (known: alpha,"),
        (
            LINREG + "epsilon = 5",
            "unknown keys epsilon (known: alpha, bounds, budget_split, columns, fit_intercept, "
            "kind, tail_probability, target, target_bounds, weight); epsilon is set for the "
            "whole release, by the command's options",
        ),
        (LINREG + "weight = 0", "aggregate 1 (linreg): weight must be a number > 0, got 0"),
        (LINREG + "weight = true", "weight must be a number > 0, got True"),
        (LINREG + "weight = nan", "weight must be a number > 0, got nan"),
        (
            LINREG + '[[aggregate]]\nkind = "stats"\ncolumns = [1]',
            "aggregate 2 (stats): ",
        ),
        (LINREG + "alpha = -1.0", "aggregate 1 (linreg): alpha must be"),
        (LINREG.replace("[0, 200]", "[200, 0]"), "target bounds must have lower < upper"),
        ('[[aggregate]]\nkind = "histogram"\ncolumns = [8]\nbins = 3', "aggregate 1 (histogram)"),
        ("[[aggregate]\n", "invalid TOML"),
    ],
)
def test_a_query_file_error_names_the_file_and_the_aggregate(
    tmp_path: Path, text: str, message: str
) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        read_query_file(path)
    assert str(caught.value).startswith(str(path)) and message in str(caught.value)


@pytest.mark.parametrize(
    ("text", "suggestion"),
    [
        (LINREG + "colums = [1]", "; did you mean columns for colums?"),
        (
            LINREG + "fit_intercep = false\ntarget_bound = [0, 1]",
            "; did you mean fit_intercept for fit_intercep, target_bounds for target_bound?",
        ),
        ("aggregates = 1", "; did you mean aggregate for aggregates?"),
        ('[[aggregate]]\nkind = "histogramm"', "; did you mean histogram for histogramm?"),
    ],
)
def test_a_misspelt_key_or_kind_gets_the_name_it_is_closest_to(
    tmp_path: Path, text: str, suggestion: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        read_query_file(_file(tmp_path, text))
    assert str(caught.value).endswith(suggestion)


def test_a_key_close_to_no_known_one_gets_no_suggestion(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        read_query_file(_file(tmp_path, LINREG + "colour = 1"))
    assert "did you mean" not in str(caught.value)


def test_the_command_refuses_a_bad_file_before_keys_or_the_network(tmp_path: Path) -> None:
    path = _file(tmp_path, LINREG + "colums = [1]")
    result = CliRunner().invoke(
        analyst_group,
        [
            *("combined", str(path), "--proxy", "192.0.2.1:1", "--insecure"),
            *("--key-dir", str(tmp_path), "--epsilon", "1", "--delta", "1e-6"),
            *("--out", str(tmp_path / "out.json")),
        ],
    )
    assert result.exit_code == 2, result.output
    assert "Invalid value for FILE" in result.output and "unknown keys colums" in result.output
    missing = CliRunner().invoke(analyst_group, ["combined", str(tmp_path / "none.toml")])
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_the_file_shown_in_the_docs_is_valid(tmp_path: Path) -> None:
    text = (Path(__file__).parents[2] / "docs" / "aggregation.md").read_text()
    block = text.split("```toml\n[[aggregate]]", 1)[1].split("```", 1)[0]
    listed = read_query_file(_file(tmp_path, "[[aggregate]]" + block))
    assert [type(e).__name__ for e in listed.estimators] == [
        "FederatedStatistics",
        "FederatedHistogram",
        "FederatedLinearRegression",
    ]
    assert listed.weights == (2.0, 1.0, 1.0)
