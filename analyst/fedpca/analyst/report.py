"""Reports of a fitted federated estimator: ``result.json`` and plots beside it.

Everything written here is post-processing of the DP release (plus, for the
projection plot, the analyst's *own* sample, which it may look at freely).

``result.json`` is strict JSON (no NaN/Infinity): an epsilon of infinity — the
NOT PRIVATE verification mode — is written as ``null`` with
``"not_private": true``.

Plots use matplotlib's object API on an Agg canvas, so writing a report neither
needs a display nor changes the process-wide pyplot backend.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from fedpca.analyst.estimators import FederatedDCA, FederatedPCA
from fedpca.errors import ConfigError, DataError
from fedpca.files import write_atomically
from fedpca.query import QueryKind
from fedpca.version import __version__

__all__ = [
    "REPORT_FORMAT",
    "ReportFiles",
    "owners_summary",
    "plot_projection",
    "plot_scree",
    "projection_figure",
    "result_document",
    "scree_figure",
    "write_plots",
    "write_report",
    "write_result",
]

logger = logging.getLogger(__name__)

REPORT_FORMAT = "fedpca-analyst-result"
REPORT_VERSION = 1

Estimator = FederatedPCA | FederatedDCA


@dataclass(frozen=True)
class ReportFiles:
    """What :func:`write_report` wrote."""

    json: Path
    scree: Path
    projection: Path | None = None


def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _list(array: npt.ArrayLike | None) -> Any:
    if array is None:
        return None
    return np.asarray(array, dtype=np.float64).tolist()


def result_document(estimator: Estimator) -> dict[str, Any]:
    """The JSON-ready description of a fitted estimator's release.

    Returns
    -------
    dict with at least: query_id, kind (pca or dca: what the components are),
    query_kind (the query's: a PCA taken from a DCA release says dca), mode,
    feature_columns (the owners' file columns of the features; null: all but the
    label), components (k × M),
    explained_variance / explained_variance_ratio (PCA) or eigenvalues (DCA),
    mean (None when not released), n_samples with n_samples_noisy, n_owners,
    owners (contributed, registered, quorum), epsilon (None for inf), delta,
    not_private, mechanism, calibration, neighbouring, bounded_owner_tables,
    noise_sigma, clip_norm, space (what the components and the mean are of: the rows as
    scaled by feature_bounds and clipped), n_samples_noise_sd, noise_sd_draws (0 when
    the noise spread was not measured), explained_variance_noise_sd or
    eigenvalues_noise_sd and components_noise_angle_degrees (null when not measured),
    for PCA explained_variance_noise_bound (null when not measured), noise_sd_failure
    (null unless a redraw failed), key_fingerprint, timings.
    """
    release = getattr(estimator, "release_", None)
    if release is None:
        raise ConfigError("the estimator is not fitted; nothing to report")
    query = release.query
    document: dict[str, Any] = {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "fedpca_version": __version__,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "query_id": query.query_id,
        # What the components are: a PCA may come from a DCA query's release
        # (`fetch ID --as-pca`), whose kind query_kind keeps.
        "kind": "pca" if isinstance(estimator, FederatedPCA) else "dca",
        "query_kind": query.kind.value,
        "mode": query.mode.value,
        "n_features": query.n_features,
        # The owners' file columns the features are (null: every column but the label).
        "feature_columns": list(query.feature_columns) or None,
        "n_components": int(estimator.components_.shape[0]),
        "components": _list(estimator.components_),
    }
    if isinstance(estimator, FederatedPCA):
        if query.kind is not QueryKind.PCA:  # a DCA release read as a PCA: of these classes
            document.update(classes=list(query.class_labels))
        document.update(
            explained_variance=_list(estimator.explained_variance_),
            explained_variance_ratio=_list(estimator.explained_variance_ratio_),
            singular_values=_list(estimator.singular_values_),
            noise_variance=float(estimator.noise_variance_),
        )
    else:
        document.update(
            eigenvalues=_list(estimator.eigenvalues_),
            classes=_list(estimator.classes_),
            class_counts=_list(estimator.class_counts_),
            class_counts_noisy=release.n_samples_is_noisy,
            rho=float(estimator.rho_),
            rho_prime=float(estimator.rho_prime_),
            n_discriminant=int(estimator.n_discriminant_),
        )
    document.update(
        mean=_list(estimator.mean_),
        mean_released=estimator.mean_ is not None,
        n_samples=float(estimator.n_samples_),
        n_samples_noisy=release.n_samples_is_noisy,
        n_samples_noise_sd=release.n_samples_noise_sd,
        n_owners=int(estimator.n_owners_),
        epsilon=_finite_or_none(estimator.epsilon_),
        delta=float(estimator.delta_),
        not_private=bool(estimator.not_private_),
        mechanism="none" if estimator.not_private_ else "gaussian",
        calibration=query.calibration.value,
        neighbouring=query.neighbouring.value,
        bounded_owner_tables=query.bounded_owner_tables,
        noise_multiplier=float(release.plan.noise_multiplier),
        noise_sigma={name: float(sigma) for name, sigma in estimator.noise_sigmas_.items()},
        clip_norm=query.clip_norm,
        # Said in the file (a new analyst's walkthrough read the mean as the data's).
        space=(
            "each feature scaled by feature_bounds onto [-1, 1], then each row clipped to "
            "L2 norm clip_norm: components, mean and variances are of the rows so scaled"
            if query.has_bounds
            else "raw units, each row clipped to L2 norm clip_norm: components, mean and "
            "variances are of the rows so clipped"
        ),
        feature_bounds=(
            {"lower": list(query.feature_lower), "upper": list(query.feature_upper)}
            if query.has_bounds
            else None
        ),
        **_component_noise(estimator),
        quorum=query.quorum,
        owners=owners_summary(estimator),
        key_fingerprint=estimator.key_fingerprint_,
        timings={phase: float(seconds) for phase, seconds in estimator.timings_.items()},
    )
    return document


def _component_noise(estimator: Estimator) -> dict[str, Any]:
    """The components' noise spread, when measured (``component_noise``): the sd of
    each value (explained variance or eigenvalue), the rms angle of each component,
    for PCA the explained variances' noise bound, the draws, and why a redraw failed
    (None when none did)."""
    spread = getattr(estimator, "component_noise_", None)
    pca = isinstance(estimator, FederatedPCA)
    values = "explained_variance" if pca else "eigenvalues"
    bound = {"explained_variance_noise_bound": None if spread is None else spread.values_bound}
    if spread is None:  # not measured: the same keys, null (a walkthrough's were missing)
        return {
            f"{values}_noise_sd": None,
            "components_noise_angle_degrees": None,
            **(bound if pca else {}),
            "noise_sd_draws": 0,
            "noise_sd_failure": None,
        }
    return {
        f"{values}_noise_sd": _list(spread.values_sd),
        "components_noise_angle_degrees": _list(spread.angles_degrees),
        **(bound if pca else {}),
        "noise_sd_draws": spread.draws,
        "noise_sd_failure": spread.failure,
    }


class CoversOwners(Protocol):
    """A fitted release's owner facts (PCA/DCA and aggregate estimators alike)."""

    n_owners_: int
    n_owners_registered_: int | None
    quorum_: int


def owners_summary(estimator: CoversOwners) -> dict[str, Any]:
    """Who the release covers: owners contributed, registered at the proxy, the quorum.

    ``all_registered`` is False when fewer owners contributed than the proxy accepts
    (None when the number registered is unknown, e.g. a release read back offline).
    """
    contributed = int(estimator.n_owners_)
    registered = getattr(estimator, "n_owners_registered_", None)
    return {
        "contributed": contributed,
        "registered": registered,
        "quorum": int(estimator.quorum_),
        "all_registered": None if registered is None else contributed >= registered,
        "summary": (
            f"{contributed} of {registered} registered"
            if registered is not None
            else f"{contributed} (registered unknown)"
        ),
    }


def _figure(width: float = 6.4, height: float = 4.2) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _private_tag(estimator: Estimator) -> str:
    if estimator.not_private_:
        return "NOT PRIVATE (epsilon = inf)"
    return f"epsilon = {estimator.epsilon_:g}, delta = {estimator.delta_:g}"


SCREE_MIN_BARS = 20
"""The scree plot shows at least this many eigenvalues (all M when fewer)."""


def _pca_spectrum(estimator: FederatedPCA) -> npt.NDArray[np.float64]:
    """Explained variance ratio of every eigenvalue the release determines (descending).

    The release carries the whole (noisy) covariance, so the spectrum beyond the k
    components asked for is post-processing of the same release, and shows where k
    sits in it.
    """
    release = estimator.release_
    try:
        return np.asarray(release.pca(release.query.n_features).explained_variance_ratio)
    except Exception:  # a degenerate release: fall back to what the fit computed
        return np.asarray(estimator.explained_variance_ratio_)


def scree_figure(estimator: Estimator) -> Any:
    """The scree plot as a matplotlib Figure (see :func:`plot_scree`)."""
    figure = _figure()
    axes = figure.add_subplot()
    k = estimator.components_.shape[0]
    if isinstance(estimator, FederatedPCA):
        spectrum = _pca_spectrum(estimator)
        shown = min(len(spectrum), max(SCREE_MIN_BARS, 2 * k))
        ratio = spectrum[:shown]
        index = np.arange(1, shown + 1)
        colours = ["tab:blue" if i <= k else "tab:gray" for i in index]
        axes.bar(index, ratio, color=colours)
        axes.plot(index, np.cumsum(ratio), "o-", color="tab:orange", markersize=3)
        axes.axvline(k + 0.5, color="black", linestyle="--", linewidth=1)
        axes.set_ylabel("explained variance ratio (noisy)")
        axes.set_ylim(0.0, max(1.0, float(np.cumsum(ratio)[-1]) * 1.05))
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        handles = [
            Patch(color="tab:blue", label=f"the {k} component{'s' if k > 1 else ''} computed"),
            Patch(color="tab:gray", label="further eigenvalues of the release"),
            Line2D([], [], color="tab:orange", marker="o", markersize=3, label="cumulative"),
        ]
        # Below the axes: a legend inside would cover bars or the cumulative curve.
        figure.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8)
        title = "Federated PCA"
        if shown < len(spectrum):
            axes.set_xlabel(f"component (first {shown} of {len(spectrum)})")
        else:
            axes.set_xlabel("component")
        axes.set_xticks(index if shown <= 40 else index[:: max(1, shown // 20)])
    else:
        index = np.arange(1, k + 1)
        axes.bar(index, np.asarray(estimator.eigenvalues_), color="tab:green")
        # λ of (S_B + S_W + (ρ + ρ′)I, S_W + ρI): about 1 + between / within, so a
        # component without class signal sits near 1, not 0 (an analyst's walkthrough).
        axes.set_ylabel("generalized eigenvalue λ (≈ 1 + between / within)")
        axes.set_xlabel("discriminant component")
        axes.set_xticks(index)
        title = "Federated DCA"
    axes.set_title(f"{title} ({estimator.mode_} mode), {_private_tag(estimator)}", fontsize=10)
    return figure


def plot_scree(estimator: Estimator, path: str | os.PathLike[str]) -> Path:
    """Scree plot, returns the PNG path.

    PCA: the explained variance ratio of the leading eigenvalues of the release (at
    least :data:`SCREE_MIN_BARS`, or all M), the k computed components highlighted,
    and the cumulative ratio. DCA: the generalized eigenvalues of the components.
    """
    out = Path(path)
    scree_figure(estimator).savefig(out, dpi=110)
    return out


def projection_figure(
    estimator: Estimator,
    sample: npt.ArrayLike,
    labels: npt.ArrayLike | None = None,
    title: str = "Own sample",
) -> Any:
    """The projection plot as a matplotlib Figure (see :func:`plot_projection`)."""
    scores = estimator.transform(sample)
    n = scores.shape[0]
    if n == 0:
        raise DataError("the sample to project is empty")
    label_array = None if labels is None else np.asarray(labels)
    if label_array is not None and label_array.shape != (n,):
        raise DataError(f"labels must have shape ({n},), got {label_array.shape}")
    figure = _figure(6.4, 5.0)
    axes = figure.add_subplot()
    x: npt.NDArray[np.float64] = scores[:, 0]
    y: npt.NDArray[np.float64]
    jitter = np.random.default_rng(0).uniform(-0.3, 0.3, size=(n,))
    values = None if label_array is None else np.unique(label_array)
    if scores.shape[1] >= 2:
        y = scores[:, 1]
        axes.set_ylabel("component 2")
    elif values is not None and label_array is not None:
        # One component: one row of points per label, spread vertically for visibility.
        position = {value: i for i, value in enumerate(values)}
        y = np.array([position[v] for v in label_array], dtype=np.float64) + jitter
        axes.set_yticks(range(len(values)), [f"{v:g}" for v in values])
        axes.set_ylabel("label (points spread vertically for visibility)")
    else:
        y = jitter
        axes.set_yticks([])
        axes.set_ylabel("random spread (for visibility only)")
    if label_array is None or values is None:
        axes.scatter(x, y, s=10, alpha=0.7)
    else:
        for value in values:
            chosen = label_array == value
            axes.scatter(x[chosen], y[chosen], s=10, alpha=0.7, label=f"{value:g}")
        # Outside the axes: inside, the legend hid points under it.
        figure.legend(title="label", loc="outside center right", fontsize=8)
    axes.set_xlabel("component 1")
    axes.set_title(f"{title} projected ({n} rows)\n{_private_tag(estimator)}", fontsize=10)
    return figure


def plot_projection(
    estimator: Estimator,
    sample: npt.ArrayLike,
    path: str | os.PathLike[str],
    labels: npt.ArrayLike | None = None,
    title: str = "Own sample",
) -> Path:
    """Scatter of rows on the first two components (one component: a strip per label).

    Parameters
    ----------
    estimator : fitted estimator.
    sample : (n, M) rows in the preprocessed space of the components
        (``estimator.preprocess(raw_rows)``); normally the analyst's own sample.
    path : PNG to write.
    labels : (n,) optional labels; points are coloured by label.
    title : what the rows are ("Own sample"; the demo plots the pooled rows).
    """
    out = Path(path)
    projection_figure(estimator, sample, labels, title).savefig(out, dpi=110)
    return out


def write_result(
    path: str | os.PathLike[str],
    estimator: Estimator,
    *,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write result.json (:func:`result_document`, updated with ``extra``).

    Parameters
    ----------
    path : the JSON file to write (parent folders are created).
    estimator : a fitted estimator.
    extra : more JSON-ready entries (e.g. measured utility); they replace
        entries of the same name.

    Returns
    -------
    The path written.
    """
    document = result_document(estimator)
    document.update(extra or {})
    return write_report_json(path, document)


def write_report_json(path: str | os.PathLike[str], document: Mapping[str, Any]) -> Path:
    """Write ``document`` to ``path`` as strict JSON (non-finite floats as null; parent
    folders created), replacing any earlier file only once the new one is on disk: a
    fetch killed while writing leaves the earlier result whole (found by review; the
    proxy deletes results after ``keep_results_days``, so a lost file may be the only
    copy of a release already paid for)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False: the report must be strict JSON for any consumer.
    try:
        text = json.dumps(_strict(document), indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cannot write {out} as JSON: {exc}") from None
    write_atomically(out, lambda handle: handle.write(text.encode("utf-8")), REPORT_FILE_MODE)
    logger.info("wrote %s", out)
    return out


REPORT_FILE_MODE = 0o644
"""A result file's permissions (what ``write_text`` gave it under the usual umask)."""


def _strict(value: Any) -> Any:
    """Replace non-finite floats (e.g. an infinite epsilon in ``extra``) by None."""
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(item) for item in value]
    if isinstance(value, np.ndarray):
        return _strict(value.tolist())
    if isinstance(value, np.integer):
        return int(value)
    return value


def write_plots(
    directory: str | os.PathLike[str],
    estimator: Estimator,
    *,
    sample: npt.ArrayLike | None = None,
    labels: npt.ArrayLike | None = None,
    prefix: str = "",
    sample_title: str = "Own sample",
) -> list[Path]:
    """Write ``<prefix>scree.png`` and, with a sample, ``<prefix>projection.png``.

    Parameters
    ----------
    directory : where the PNGs go (created if missing).
    estimator : a fitted estimator.
    sample : (n, M) the analyst's own rows in the preprocessed space
        (``estimator.preprocess(raw_rows)``).
    labels : (n,) labels of the sample (colours the projection).
    prefix : file-name prefix.
    sample_title : what the sample's rows are, for the projection's title.

    Returns
    -------
    The PNG paths written.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    written = [plot_scree(estimator, folder / f"{prefix}scree.png")]
    if sample is not None:
        written.append(
            plot_projection(
                estimator, sample, folder / f"{prefix}projection.png", labels, sample_title
            )
        )
    return written


def write_report(
    path: str | os.PathLike[str],
    estimator: Estimator,
    *,
    sample: npt.ArrayLike | None = None,
    labels: npt.ArrayLike | None = None,
    extra: Mapping[str, Any] | None = None,
) -> ReportFiles:
    """Write ``path`` (result.json) and the plots next to it.

    The plots are ``<stem>.scree.png`` and, when ``sample`` is given,
    ``<stem>.projection.png``; result.json lists their names under "plots".

    Returns
    -------
    ReportFiles

    Raises
    ------
    ConfigError
        ``estimator`` is an aggregate (statistics, histogram, regression, or a
        :class:`~fedpca.analyst.FederatedQuery`): its writer is
        :func:`~fedpca.analyst.write_aggregate_result` (an AttributeError about
        ``components_`` before, found by an analyst's walkthrough).
    """
    from fedpca.analyst.aggregate_estimators import AggregateEstimator, FederatedQuery

    if isinstance(estimator, AggregateEstimator | FederatedQuery):
        raise ConfigError(
            f"write_report writes PCA and DCA results; a {type(estimator).__name__} is "
            "written by fedpca.analyst.write_aggregate_result(path, estimator)"
        )
    out = Path(path)
    plots = write_plots(out.parent, estimator, sample=sample, labels=labels, prefix=f"{out.stem}.")
    names = {"scree": plots[0].name, "projection": plots[1].name if len(plots) > 1 else None}
    write_result(out, estimator, extra={"plots": names, **(extra or {})})
    return ReportFiles(out, plots[0], plots[1] if len(plots) > 1 else None)
