"""What the ``pca`` and ``dca`` commands (and ``fetch`` of such a result) print after
a release is decrypted: the owners, the record count, the spectrum, the privacy of
the release, timings and the files written; also the owners' line that the aggregate
commands print. No gRPC here: it reads a fitted estimator.
"""

from __future__ import annotations

import math
import time
from typing import Any

import click

__all__ = [
    "measure_component_noise",
    "print_owners",
    "print_release_summary",
    "records_line",
]


def print_owners(estimator: Any) -> None:
    """The summary's owners line: k of n registered (quorum q), and a red warning when
    fewer than the registered owners contributed."""
    from fedpca.analyst.querying import missing_owners_message

    registered = estimator.n_owners_registered_
    if registered is None:
        click.echo(f"owners:      {estimator.n_owners_} (quorum {estimator.quorum_})")
    else:
        click.echo(
            f"owners:      {estimator.n_owners_} of {registered} registered "
            f"(quorum {estimator.quorum_})"
        )
        if estimator.n_owners_ < registered:
            click.secho(
                "WARNING: "
                + missing_owners_message(
                    estimator.query_id_, estimator.n_owners_, registered, estimator.quorum_
                ),
                fg="red",
                bold=True,
                err=True,
            )


def records_line(n_samples: float, noise_sd: float, not_private: bool) -> str:
    """The summaries' ``records N`` line: a noisy N with its noise sd, or an exact N (a
    whole number) and why it is exact: no noise at all (epsilon = inf; not public, a
    review found it called so), or public under replace-one (masked PCA, aggregates)."""
    if not_private:
        return f"records N:   {n_samples:.0f} (exact: NOT PRIVATE)"
    if noise_sd:
        return f"records N:   {n_samples:.1f} (noisy, noise sd {noise_sd:.3g})"
    return f"records N:   {n_samples:.0f} (exact: public under replace-one)"


def measure_component_noise(estimator: Any, draws: int | None) -> None:
    """The components' noise spread (``estimator.component_noise``), with a progress bar
    on a terminal: at a few thousand features each draw takes a second or more. ``draws``
    0: not measured (nothing is printed or written of it)."""
    from tqdm.auto import tqdm

    from fedpca.analyst.component_noise import default_draws

    if draws == 0 or estimator.not_private_:
        return
    total = default_draws(estimator.n_features_in_) if draws is None else draws
    started = time.perf_counter()
    with tqdm(total=total, desc="noise sd", unit="draw", disable=None, leave=False) as bar:
        estimator.component_noise(total, progress=bar.update)
    # Said with the others (a walkthrough's DCA spent 2 s here, its timings said 0.01 s).
    estimator.timings_["noise sd"] = time.perf_counter() - started


def _numbers(values: Any) -> str:
    return ", ".join(f"{v:.4g}" for v in values)


def _print_component_noise(estimator: Any, values: Any, values_name: str) -> None:
    """The noise sd of the components' values (``values``) and the angles the noise
    turns them by; for PCA the values' noise bound."""
    spread = getattr(estimator, "component_noise_", None)
    if spread is None or not spread.draws:
        return
    if spread.values_sd is None or spread.angles_degrees is None:
        click.secho(
            f"noise sd:    not available: redraw {spread.draws + 1} of the noise could not "
            f"be solved ({spread.failure}); the noise can make this release unusable",
            fg="yellow",
        )
        return
    click.echo(f"  noise sd:  {_numbers(spread.values_sd)}")
    angles = ", ".join(f"{a:.1f}" for a in spread.angles_degrees)
    click.echo(f"noise angle: {angles} degrees")
    shift = f"pushes the leading {values_name}s up, by more than their sd when the angles are large"
    if spread.values_bound is None:
        shift += ": the sd is their spread, not that shift (docs/analyst.md)"
    else:
        shift += (
            ": the sd is their spread, not that shift; the bound below covers both "
            "(docs/analyst.md)"
        )
    click.echo(
        f"             how far the privacy noise alone moves each {values_name} and turns "
        f"each component: sd and rms angle over {spread.draws} simulated releases (near "
        f"90 degrees: the noise decides that component). The noise also {shift}"
    )
    if spread.values_bound is not None:
        _print_noise_bound(spread.values_bound, values, values_name)


def _print_noise_bound(bound: float, values: Any, values_name: str) -> None:
    """The values' noise bound, and which components are within it of 0."""
    click.echo(
        f"noise bound: +/- {bound:.4g} on every {values_name} at once: in 95 % of the "
        "simulated releases the noise moved none of them further (Weyl's inequality)"
    )
    # The values are in descending order: those within the bound are the trailing ones.
    within = [rank for rank, value in enumerate(values, start=1) if value <= bound]
    if within:
        which = (
            f"component {within[0]}"
            if len(within) == 1
            else f"components {within[0]} to {within[-1]}"
        )
        click.secho(
            f"             {which}: {values_name} within the bound of 0, so the noise "
            f"alone could give {'them' if len(within) > 1 else 'it'}",
            fg="yellow",
        )


def clip_note(query: Any) -> str | None:
    """A line saying how far rows were clipped, when ``--clip-norm`` is below the
    longest row the public bounds allow (√M once scaled onto [-1, 1]^M). The default of
    1 clipped 98.7 % of the rows of an 8-feature table near its bounds and nothing said
    so (a new user's walkthrough). None without bounds (raw units: no longest row)."""
    if not query.feature_lower:
        return None
    longest = math.sqrt(query.n_features)
    if query.clip_norm >= longest:
        return None
    return (
        f"rows:        clipped to L2 norm {query.clip_norm:g} after scaling by the bounds, "
        f"where a row can reach {longest:.3g} (sqrt M): rows longer than that are "
        "shortened (choosing --clip-norm: docs/operations.md)"
    )


def print_release_summary(estimator: Any, files: Any) -> None:
    """The summary of a PCA or DCA release and the files written for it."""
    from fedpca.analyst.estimators import FederatedPCA
    from fedpca.formatting import exact
    from fedpca.query import QueryKind

    click.echo(f"query:       {estimator.query_id_}")
    query = estimator.release_.query
    if isinstance(estimator, FederatedPCA) and query.kind is not QueryKind.PCA:
        classes = ", ".join(exact(c) for c in query.class_labels)
        click.echo(
            f"pca of:      the records of classes {classes} (the {query.kind.value} release)"
        )
    if query.feature_columns:
        listed = ", ".join(str(c) for c in query.feature_columns)
        click.echo(f"columns:     {listed} (the owners' file columns, 0-based)")
    print_owners(estimator)
    click.echo(
        records_line(
            estimator.n_samples_, estimator.release_.n_samples_noise_sd, estimator.not_private_
        )
    )
    if (note := clip_note(query)) is not None:
        click.echo(note)
    if isinstance(estimator, FederatedPCA):
        ratios = ", ".join(f"{r:.4f}" for r in estimator.explained_variance_ratio_)
        click.echo(f"explained variance ratio: {ratios}")
        if clipped := estimator.n_eigenvalues_clipped_:
            click.secho(
                f"             {clipped} of the {estimator.n_features_in_} noisy eigenvalues "
                "were negative (the noise outweighs the variance in their directions) and "
                "were set to 0: the ratios are over the others",
                fg="yellow",
            )
        click.echo(f"explained variance: {_numbers(estimator.explained_variance_)}")
        _print_component_noise(estimator, estimator.explained_variance_, "explained variance")
    else:
        click.echo(f"generalized eigenvalues: {_numbers(estimator.eigenvalues_)}")
        _print_component_noise(estimator, estimator.eigenvalues_, "eigenvalue")
    if estimator.not_private_:
        click.secho("release: NOT PRIVATE (epsilon = inf)", fg="red", bold=True)
    else:
        click.echo(f"release: ({estimator.epsilon_:g}, {estimator.delta_:g})-DP")
    timings = ", ".join(f"{k} {v:.2f} s" for k, v in estimator.timings_.items())
    click.echo(f"timings: {timings}")
    for plot in (files.scree, files.projection):
        if plot is not None:
            click.echo(f"plot: {plot}")
    click.echo(str(files.json))
