"""``fedpca demo``: the whole protocol on loopback in about a minute.

Starts one proxy and N owner nodes as separate processes talking gRPC over mutual
TLS (certificates and the analyst's Paillier key are generated into the working
folder), splits a real public dataset across the owners, runs the analyst, and
prints a summary. Because a demo may look at the pooled data, it also reports how
much variance the private components capture compared with non-private PCA.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
import numpy.typing as npt

from fedpca.app.cluster import LocalCluster, split_rows
from fedpca.data import dataset_path
from fedpca.errors import ConfigError, FedpcaError
from fedpca.query import DEFAULT_QUERY_DELTA

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]


def parse_bounds(text: str) -> tuple[float, float] | None:
    """``none`` or ``LO:HI`` (one public range applied to every feature)."""
    if text.strip().lower() == "none":
        return None
    try:
        low_text, high_text = text.split(":")
        low, high = float(low_text), float(high_text)
    except ValueError:
        raise ConfigError(f"--bounds must be 'none' or LO:HI, got {text!r}") from None
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ConfigError(f"--bounds needs finite LO < HI, got {text!r}")
    return low, high


def captured_variance_ratio(rows: FloatArray, components: FloatArray) -> float:
    """Variance the components capture over what the top-k exact components capture.

    Both are measured on the same (pooled, preprocessed) rows; 1.0 means the private
    subspace is as good as non-private PCA.
    """
    centred = rows - rows.mean(axis=0)
    covariance = centred.T @ centred / max(len(rows) - 1, 1)
    return captured_variance_ratio_of_covariance(covariance, components)


def captured_variance_ratio_of_covariance(covariance: FloatArray, components: FloatArray) -> float:
    """:func:`captured_variance_ratio` from the rows' (M, M) covariance matrix.

    For repeated measurements on the same rows: the covariance is computed once.
    """
    eigenvalues = np.linalg.eigvalsh(covariance)[::-1]
    k = components.shape[0]
    basis, _ = np.linalg.qr(components.T)
    captured = float(np.trace(basis.T @ covariance @ basis))
    best = float(eigenvalues[:k].sum())
    return captured / best if best > 0 else float("nan")


def unscaled_warning(rows: FloatArray, bounds: tuple[float, float] | None) -> str | None:
    """A warning when ``--bounds none`` is given rows that are not on the [-1, 1] scale.

    Public bounds map every feature onto [-1, 1] before rows are clipped to
    ``--clip-norm``; without bounds the raw values are used, so features measured in
    larger units swamp the others and the clip (an unscaled dataset gave a captured
    variance of 0.04 instead of 0.14 with bounds). The demo may look at its public
    dataset to say so; a real analyst states public bounds instead.
    """
    if bounds is not None:
        return None
    low, high = float(rows.min()), float(rows.max())
    if low >= -1.0 and high <= 1.0:
        return None
    return (
        f"--bounds none, but the features range over [{low:.4g}, {high:.4g}], not [-1, 1]: "
        "features in larger units dominate and the components say little. Give public "
        f"bounds, e.g. --bounds {low:.4g}:{high:.4g} here (read from this public dataset; "
        "with private data take them from the variables' definitions, never from the data)"
    )


@dataclass(frozen=True)
class DemoSettings:
    owners: int
    dataset: Path
    has_label: bool
    epsilon: float
    delta: float
    components: int
    mode: str
    bounds: tuple[float, float] | None
    clip_norm: float
    key_bits: int
    out: Path


def run_demo(settings: DemoSettings) -> dict[str, Any]:
    """Run the demo and return the summary it prints (also written to ``result.json``)."""
    from fedpca.analyst.estimators import FederatedPCA
    from fedpca.analyst.report import write_plots, write_result
    from fedpca.preprocess import FeatureBounds, preprocess
    from fedpca.tables import load_table

    total_started = time.perf_counter()
    label_column = 0 if settings.has_label else None
    table = load_table(settings.dataset, label_column=label_column, header="auto")
    rows, labels = table
    n_features = rows.shape[1]
    if not 1 <= settings.components <= n_features:
        raise ConfigError(f"--components must be in [1, {n_features}]")
    warning = unscaled_warning(rows, settings.bounds)
    if warning is not None:
        click.secho(f"warning: {warning}", fg="yellow", err=True)
    parts = split_rows(len(rows), settings.owners)
    full = np.column_stack([labels, rows]) if labels is not None else rows
    owner_tables = [full[index] for index in parts]

    workdir = settings.out / "work"
    try:  # before any process starts: an --out under a file, or where no folder can be
        if workdir.exists():
            shutil.rmtree(workdir)
        workdir.mkdir(parents=True)
    except OSError as exc:
        raise ConfigError(f"--out {settings.out}: cannot make a folder there ({exc})") from None
    private = math.isfinite(settings.epsilon)
    cluster = LocalCluster(
        workdir=workdir,
        owner_tables=owner_tables,
        key_bits=settings.key_bits,
        label_column=label_column,
        max_epsilon_per_query=settings.epsilon if private else 10.0,
        allow_not_private=not private,
        # Masked mode has a finite epsilon only under replace-one (docs/privacy.md), and
        # owners take part in it only when they opt in: the demo's owners do when asked.
        neighbouring="replace-one" if settings.mode == "masked" else "add-remove",
        allow_masked_mode=settings.mode == "masked",
    )
    click.echo(f"preparing {settings.owners} owners, {settings.key_bits}-bit analyst key ...")
    cluster.prepare()
    bounds = None
    if settings.bounds is not None:
        low, high = settings.bounds
        bounds = FeatureBounds.from_arrays(np.full(n_features, low), np.full(n_features, high))
    with cluster:
        click.echo(f"starting proxy on {cluster.proxy_address} and {settings.owners} owners ...")
        cluster.start()
        estimator = FederatedPCA(
            n_components=settings.components,
            epsilon=settings.epsilon,
            delta=settings.delta,
            mode=settings.mode,
            bounds=settings.bounds,
            clip_norm=settings.clip_norm,
            deadline_seconds=600.0,
            **cluster.analyst_connection(),
            verbose=True,
        )
        estimator.fit(n_features=n_features)

    pooled = preprocess(rows, bounds, settings.clip_norm)
    ratio = captured_variance_ratio(pooled, np.asarray(estimator.components_))
    timings = {**cluster.timings, **estimator.timings_}
    timings["total"] = time.perf_counter() - total_started
    settings.out.mkdir(parents=True, exist_ok=True)
    result_path = settings.out / "result.json"
    write_result(
        result_path, estimator, extra={"captured_variance_ratio": ratio, "timings": timings}
    )
    plots = write_plots(
        settings.out,
        estimator,
        sample=pooled,
        labels=labels,
        # The demo may look at every row (a public dataset); an analyst sees its own.
        sample_title="All demo rows (pooled)",
    )
    summary = json.loads(result_path.read_text())
    _print_summary(settings, estimator, ratio, timings, result_path, plots)
    return summary


def _print_summary(
    settings: DemoSettings,
    estimator: Any,
    ratio: float,
    timings: dict[str, float],
    result_path: Path,
    plots: list[Path],
) -> None:
    click.echo("")
    click.echo("fedpca demo summary")
    click.echo("===================")
    click.echo(f"dataset           {settings.dataset.name}: {estimator.n_features_in_} features")
    click.echo(
        f"owners            {estimator.n_owners_} of {estimator.n_owners_registered_} registered "
        f"(quorum {estimator.quorum_})"
    )
    click.echo(f"mode              {settings.mode}")
    if math.isfinite(settings.epsilon):
        click.echo(f"privacy spent     epsilon={settings.epsilon:g} delta={settings.delta:g}")
    else:
        click.secho("privacy           NOT PRIVATE (epsilon = inf, no noise added)", fg="red")
    counted = "(noisy)" if math.isfinite(settings.epsilon) else "(exact)"
    click.echo(f"records {counted:9} {float(estimator.n_samples_):.1f}")
    ratios = ", ".join(f"{r:.4f}" for r in estimator.explained_variance_ratio_)
    click.echo(f"explained var.    ratio per component: {ratios}")
    click.echo(f"captured variance {ratio:.4f} of non-private PCA on the pooled rows")
    click.echo("timings (s)")
    for phase, seconds in timings.items():
        click.echo(f"  {phase:<18}{seconds:8.2f}")
    click.echo(f"result            {result_path}")
    for plot in plots:
        click.echo(f"plot              {plot}")


@click.command("demo")
@click.option(
    "--owners",
    type=click.IntRange(1, 64),
    default=4,
    show_default=True,
    help="Owner processes; the dataset's rows are split among them.",
)
@click.option(
    "--dataset",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="CSV with the label in column 0 (unless --no-label). Default: bundled ionosphere.",
)
@click.option("--no-label", is_flag=True, help="The dataset has no label column.")
@click.option(
    "--epsilon",
    type=click.FloatRange(min=0.0, min_open=True),
    default=1.0,
    show_default=True,
    help="'inf': no noise.",
)
@click.option(
    "--delta",
    type=click.FloatRange(min=0.0, max=1.0, min_open=True, max_open=True),
    default=DEFAULT_QUERY_DELTA,
    show_default=True,
    help="The query's delta (the default is FederatedPCA's).",
)
@click.option(
    "--components",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Principal components to report.",
)
@click.option(
    "--mode",
    type=click.Choice(["stats", "masked"]),
    default="stats",
    show_default=True,
    help="What owners send: their statistics, or masked ones (publishes each N).",
)
@click.option(
    "--bounds",
    default="none",
    show_default=True,
    help="Public bounds LO:HI applied to every feature, or 'none' to keep raw values.",
)
@click.option(
    "--clip-norm",
    type=click.FloatRange(min=0.0, min_open=True),
    default=1.0,
    show_default=True,
    help="L2 norm each scaled row is clipped to (it bounds one record's effect).",
)
@click.option(
    "--key-bits",
    type=click.IntRange(min=2048, max=8192),
    default=2048,
    show_default=True,
    help="The analyst's Paillier modulus size.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("demo-out"),
    show_default=True,
    help="Folder for result.json and the plots.",
)
def demo_command(
    owners: int,
    dataset: Path | None,
    no_label: bool,
    epsilon: float,
    delta: float,
    components: int,
    mode: str,
    bounds: str,
    clip_norm: float,
    key_bits: int,
    out: Path,
) -> None:
    """Run one proxy, N owners and the analyst on loopback with mutual TLS."""
    try:
        settings = DemoSettings(
            owners=owners,
            dataset=dataset or dataset_path("ionosphere"),
            has_label=not no_label,
            epsilon=epsilon,
            delta=delta,
            components=components,
            mode=mode,
            bounds=parse_bounds(bounds),
            clip_norm=clip_norm,
            key_bits=key_bits,
            out=out,
        )
        run_demo(settings)
    except (FedpcaError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from exc
