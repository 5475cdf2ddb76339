"""``fedpca analyst stats|histogram|linreg|combined``: private aggregates from the command line.

Commands::

    fedpca analyst stats --columns 1,2,6 --bounds 0:17,0:200,0:70 \\
        [--moments mean|variance|covariance] --epsilon E --delta D ... --out stats.json
    fedpca analyst histogram --columns 8 --bins 20,30,40,50,60,90 \\
        [--columns 8,6 --bins ... --bins ...] [--group-by 0 --categories -1,1] ...
    fedpca analyst linreg --columns 1,3,4 --bounds 0:17,0:130,0:100 \\
        --target 2 --target-bounds 0:200 [--alpha auto|A] [--no-intercept] ...
    fedpca analyst combined aggregates.toml ...   (several in one release)

Columns are 0-based indices into the owners' files. Connection, key and query
options are those of ``fedpca analyst pca``; the JSON written is described in
:mod:`fedpca.analyst.aggregate_report`. Importing this module registers the commands
on :data:`fedpca.analyst.cli.analyst_group`.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from fedpca.analyst import cli as analyst_cli
from fedpca.analyst.cli_connection import connection_options
from fedpca.analyst.cli_output import result_out_option, written_or_fetchable
from fedpca.analyst.release_summary import print_owners
from fedpca.budget_options import DELTA
from fedpca.column_options import COLUMNS
from fedpca.query import Calibration, Moments, Neighbouring

__all__ = ["combined_command", "histogram_command", "linreg_command", "stats_command"]

F = TypeVar("F", bound=Callable[..., Any])


def _numbers(value: str, what: str) -> tuple[float, ...]:
    parsed = []
    for piece in value.split(","):
        try:
            parsed.append(float(piece))
        except ValueError:
            # Quoted at most 80 characters (a user's 3 KB edges list was echoed whole).
            shown = repr(value) if len(value) <= 80 else f"{value[:77]!r}..."
            hint = " (give --bins once per column)" if what == "--bins" else ""
            raise click.BadParameter(
                f"{what} {shown} is not a comma-separated list of numbers: {piece[:40]!r}{hint}"
            ) from None
    numbers = tuple(parsed)
    if what == "--bins" and (
        len(numbers) < 2 or any(b <= a for a, b in itertools.pairwise(numbers))
    ):
        raise click.BadParameter(
            f"--bins {value!r}: give the bins' edges, at least two strictly increasing numbers"
        )
    return numbers


def _pair(_: click.Context, __: click.Parameter, value: str | None) -> tuple[float, float] | None:
    if value is None:
        return None
    pieces = value.split(":")
    try:
        lo, hi = (float(p) for p in pieces)
    except ValueError:
        raise click.BadParameter(f"expected LO:HI, got {value!r}") from None
    return lo, hi


def _split(_: click.Context, __: click.Parameter, value: str | None) -> dict[str, float] | None:
    if value is None:
        return None
    weights: dict[str, float] = {}
    for item in value.split(","):
        name, _separator, weight = item.partition("=")
        try:
            weights[name.strip()] = float(weight)
        except ValueError:
            raise click.BadParameter(f"expected NAME=WEIGHT,…, got {value!r}") from None
    return weights


def _aggregate_query_options(function: F) -> F:
    options: list[Callable[[Any], Any]] = [
        click.option(
            "--epsilon",
            required=True,
            callback=analyst_cli._parse_epsilon,
            help="Privacy loss of this release ('inf' = no noise, NOT PRIVATE).",
        ),
        click.option(
            "--delta", type=DELTA, help="Privacy failure probability (required unless inf)."
        ),
        click.option(
            "--calibration",
            type=click.Choice([c.value for c in Calibration]),
            default=Calibration.ZCDP.value,
            show_default=True,
            help="zcdp: proven for the discrete Gaussian; analytic, classic: continuous.",
        ),
        click.option(
            "--neighbouring",
            type=click.Choice([n.value for n in Neighbouring]),
            default=None,
            help="The relation (epsilon, delta) are stated for; it must be the deployment's "
            "[the deployment's, asked from the proxy].",
        ),
        *analyst_cli.COLLECTION_OPTIONS,
        click.option(
            "--workers", type=click.IntRange(min=1), help="Decryption processes [all cores]."
        ),
        result_out_option("result.json to write."),
    ]
    for option in reversed(options):
        function = option(function)
    return connection_options(function)


def _fit(estimator_factory: Callable[..., Any], params: dict[str, Any]) -> Any:
    """Connect, fit and write result.json; return the fitted estimator."""
    from fedpca.analyst.aggregate_report import write_aggregate_result
    from fedpca.analyst.querying import MissingOwnersWarning

    epsilon: float = params["epsilon"]
    delta: float | None = params["delta"]
    if math.isfinite(epsilon) and delta is None:
        raise click.UsageError("--delta is required with a finite --epsilon")
    if not math.isfinite(epsilon):
        analyst_cli._warn_not_private()
    with analyst_cli._errors():
        connection = analyst_cli._estimator_connection(params)
        estimator = estimator_factory(
            **analyst_cli._estimator_settings(params, connection, epsilon, delta)
        )
        with warnings.catch_warnings():
            # The summary below prints the warning in red; Python's copy would repeat it.
            warnings.simplefilter("ignore", MissingOwnersWarning)
            estimator.fit()
        with written_or_fetchable(estimator.query_id_):
            path = write_aggregate_result(params["out"], estimator)
    click.echo(f"query:       {estimator.query_id_}")
    print_owners(estimator)
    return estimator, path


def _finish(estimator: Any, path: Path) -> None:
    if estimator.not_private_:
        click.secho("release: NOT PRIVATE (epsilon = inf)", fg="red", bold=True)
    else:
        click.echo(f"release: ({estimator.epsilon_:g}, {estimator.delta_:g})-DP")
    click.echo(str(path))


@click.command("stats")
@click.option(
    "--columns", required=True, type=COLUMNS, help="Columns to describe (0-based, a,b,…)."
)
@click.option(
    "--bounds",
    required=True,
    help="Public bounds: LO:HI (every column) or LO:HI,LO:HI,… (one per column).",
)
@click.option(
    "--moments",
    type=click.Choice([m.value for m in Moments]),
    default=Moments.COVARIANCE.value,
    show_default=True,
    help="mean: count and sums; variance: + squares; covariance: + every product.",
)
@click.option(
    "--ddof",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Divide variances by N - DDOF (1: the sample variance); post-processing.",
)
@click.option("--no-clip", is_flag=True, help="Report the raw noisy values (no clipping).")
@click.option(
    "--budget-split",
    callback=_split,
    help="Section weights, e.g. count=1,sums=2,products=2 (default equal).",
)
@_aggregate_query_options
def stats_command(
    columns: tuple[int, ...],
    bounds: str,
    moments: str,
    ddof: int,
    no_clip: bool,
    budget_split: dict[str, float] | None,
    **params: Any,
) -> None:
    """Private count, means, variances and covariance/correlation of columns."""
    from fedpca.analyst.aggregate_summary import echo_summary
    from fedpca.analyst.statistics import FederatedStatistics

    def factory(**kwargs: Any) -> FederatedStatistics:
        return FederatedStatistics(
            columns,
            bounds=bounds,
            moments=moments,
            ddof=ddof,
            clip=not no_clip,
            budget_split=budget_split,
            **kwargs,
        )

    estimator, path = _fit(factory, params)
    echo_summary(estimator)
    _finish(estimator, path)


@click.command("histogram")
@click.option("--columns", required=True, type=COLUMNS, help="One column, or two (a,b) jointly.")
@click.option(
    "--bins",
    "bins",
    required=True,
    multiple=True,
    help="Public bin edges of a column, increasing (e1,e2,…); once per column. A value "
    "outside the edges is counted in the first or the last bin.",
)
@click.option("--group-by", type=click.IntRange(min=0), help="A public categorical column.")
@click.option("--categories", help="Its public categories, comma-separated.")
@click.option("--no-clamp", is_flag=True, help="Keep negative noisy counts.")
@_aggregate_query_options
def histogram_command(
    columns: tuple[int, ...],
    bins: tuple[str, ...],
    group_by: int | None,
    categories: str | None,
    no_clamp: bool,
    **params: Any,
) -> None:
    """Private counts over public bins of one column, or two jointly (per category)."""
    from fedpca.analyst.aggregate_summary import echo_summary
    from fedpca.analyst.statistics import FederatedHistogram

    edges = [_numbers(b, "--bins") for b in bins]
    if (group_by is None) != (categories is None):
        raise click.UsageError("--group-by and --categories go together")
    listed = _numbers(categories, "--categories") if categories is not None else None

    def factory(**kwargs: Any) -> FederatedHistogram:
        return FederatedHistogram(
            columns, bins=edges, groupby=group_by, categories=listed, clamp=not no_clamp, **kwargs
        )

    estimator, path = _fit(factory, params)
    echo_summary(estimator)
    _finish(estimator, path)


@click.command("linreg")
@click.option("--columns", required=True, type=COLUMNS, help="Feature columns (0-based).")
@click.option(
    "--bounds", required=True, help="Public feature bounds: LO:HI or LO:HI,LO:HI,… (per column)."
)
@click.option("--target", required=True, type=click.IntRange(min=0), help="Target column.")
@click.option("--target-bounds", required=True, callback=_pair, help="Public target bounds LO:HI.")
@click.option(
    "--alpha",
    default="auto",
    show_default=True,
    help="Ridge regulariser: auto (the noise's spectral bound) or a number >= 0.",
)
@click.option("--no-intercept", is_flag=True, help="Fit through the origin.")
@click.option(
    "--budget-split",
    callback=_split,
    help="Section weights over count, x_sums, y_sum, xtx, xty (default equal).",
)
@_aggregate_query_options
def linreg_command(
    columns: tuple[int, ...],
    bounds: str,
    target: int,
    target_bounds: tuple[float, float],
    alpha: str,
    no_intercept: bool,
    budget_split: dict[str, float] | None,
    **params: Any,
) -> None:
    """Private linear (ridge) regression from noisy sufficient statistics."""
    from fedpca.analyst.aggregate_summary import echo_summary
    from fedpca.analyst.regression import FederatedLinearRegression

    if alpha != "auto":
        try:
            regulariser: float | str = float(alpha)
        except ValueError:
            raise click.BadParameter(f"--alpha must be 'auto' or a number, got {alpha!r}") from None
    else:
        regulariser = alpha

    def factory(**kwargs: Any) -> FederatedLinearRegression:
        return FederatedLinearRegression(
            columns,
            bounds=bounds,
            target=target,
            target_bounds=target_bounds,
            alpha=regulariser,
            fit_intercept=not no_intercept,
            budget_split=budget_split,
            **kwargs,
        )

    estimator, path = _fit(factory, params)
    echo_summary(estimator)
    _finish(estimator, path)


@click.command("combined")
@click.argument(
    "query_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), metavar="FILE"
)
@_aggregate_query_options
def combined_command(query_file: Path, **params: Any) -> None:
    """Several aggregates in one release, charged once: the stats, histograms and
    regressions FILE lists as [[aggregate]] tables (kind, optional weight, and the
    parameters of its Python estimator; docs/aggregation.md shows one).

    The options set the whole release, which is (epsilon, delta)-DP as one Gaussian
    release: the weights (default equal) set each aggregate's share of the noise
    budget (docs/privacy.md gives the allocation). A later fetch applies its own
    post-processing options (--ddof, --no-clip, ...), not the file's.
    """
    from fedpca.analyst.aggregate_estimators import FederatedQuery
    from fedpca.analyst.aggregate_summary import echo_aggregates
    from fedpca.analyst.query_file import read_query_file
    from fedpca.errors import ConfigError

    try:
        listed = read_query_file(query_file)
    except ConfigError as exc:  # before keys or the network
        raise click.BadParameter(str(exc), param_hint="FILE") from None

    def factory(**kwargs: Any) -> FederatedQuery:
        return FederatedQuery(list(listed.estimators), weights=list(listed.weights), **kwargs)

    fitted, path = _fit(factory, params)
    echo_aggregates(fitted)
    _finish(fitted, path)


for _command in (stats_command, histogram_command, linreg_command, combined_command):
    analyst_cli.analyst_group.add_command(_command)
