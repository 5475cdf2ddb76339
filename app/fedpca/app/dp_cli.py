"""``fedpca dp``: calibration and accounting from the command line.

Each command prints explanatory lines and then its result alone on the last line
(a plain float repr), so scripts can take ``tail -n 1``.
"""

from __future__ import annotations

import math

import click

from fedpca.dp.calibration import calibrate_sigma, classic_gaussian_sigma
from fedpca.errors import CalibrationError, FedpcaError
from fedpca.query import Calibration

__all__ = ["dp_group"]


@click.group("dp")
def dp_group() -> None:
    """Differential-privacy calibration and accounting."""


@dp_group.command("calibrate")
@click.option(
    "--epsilon",
    type=click.FloatRange(min=0.0, min_open=True),
    required=True,
    help="Target epsilon (> 0; inf = no noise).",
)
@click.option(
    "--delta",
    type=click.FloatRange(min=0.0, max=1.0, min_open=True, max_open=True),
    required=True,
    help="Target delta, in (0, 1).",
)
@click.option(
    "--sensitivity", type=float, default=1.0, show_default=True, help="L2 sensitivity Delta."
)
@click.option(
    "--mechanism",
    type=click.Choice([c.value for c in Calibration]),
    default=Calibration.ZCDP.value,
    show_default=True,
    help="zcdp (proven for the discrete Gaussian fedpca samples), or the continuous "
    "Gaussian's analytic (Balle & Wang 2018) or classic (epsilon < 1 only) calibration.",
)
def calibrate_command(epsilon: float, delta: float, sensitivity: float, mechanism: str) -> None:
    """Print the Gaussian noise sigma for one release of --epsilon, --delta."""
    calibration = Calibration(mechanism)
    try:
        sigma = calibrate_sigma(epsilon, delta, sensitivity, calibration)
    except CalibrationError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"mechanism: {calibration.value} Gaussian")
    click.echo(f"epsilon={epsilon!r} delta={delta!r} L2 sensitivity={sensitivity!r}")
    if sigma == 0:
        click.echo("epsilon = inf: no noise, the release is NOT PRIVATE")
    else:
        click.echo(f"noise multiplier z = sigma / sensitivity = {sigma / sensitivity!r}")
        if calibration is not Calibration.CLASSIC and epsilon < 1:
            classic = classic_gaussian_sigma(epsilon, delta, sensitivity)
            click.echo(f"(classic calibration would need sigma = {classic!r})")
    click.echo("sigma:")
    click.echo(repr(sigma))


@dp_group.command("compose")
@click.argument("noise_multipliers", nargs=-1, type=float, required=True)
@click.option("--delta", type=float, required=True, help="Delta at which epsilon is reported.")
@click.option(
    "--accountant",
    type=click.Choice(["zcdp", "pld-continuous"]),
    default="zcdp",
    show_default=True,
    help="zcdp (proven for the discrete Gaussian, the default) or pld-continuous "
    "(tight for the continuous Gaussian).",
)
def compose_command(noise_multipliers: tuple[float, ...], delta: float, accountant: str) -> None:
    """Print the epsilon at DELTA of composing Gaussian releases with these NOISE_MULTIPLIERS."""
    # dp_accounting takes about a second to import; only this command needs it.
    from fedpca.dp.accounting import compose_epsilon

    try:
        epsilon = compose_epsilon(noise_multipliers, delta, accountant)
    except FedpcaError as exc:  # CalibrationError too: z below what PLD supports
        raise click.ClickException(str(exc)) from None
    click.echo(f"{len(noise_multipliers)} Gaussian release(s), {accountant} accountant")
    if math.isinf(epsilon):
        click.echo("a release with noise multiplier 0 makes the composition NOT PRIVATE")
    click.echo(f"epsilon at delta={delta!r}:")
    click.echo(repr(epsilon))
