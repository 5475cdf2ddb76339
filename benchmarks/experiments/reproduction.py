"""What the three scripts reproducing the published DPDPCA evaluation share.

Queries for the plaintext path, the synthetic stand-ins for the published datasets,
summaries over repeated runs, provenance, and the CSV/JSON/PNG outputs. The scripts
(``runtime_vs_owners.py``, ``f1_vs_samples_per_owner.py``,
``captured_variance_vs_epsilon.py``) import it from their own folder; docs/experiments.md
says what each measures and how.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fedpca.version import __version__

FloatArray = npt.NDArray[np.float64]

REPOSITORY = Path(__file__).resolve().parents[2]
FIGURES = REPOSITORY / "docs" / "figures"

PLAN_KEY_BITS = 2048
"""The plaintext path lays the statistics out for a 2048-bit analyst key, as deployed."""

STAND_IN_MEAN_SQUARED_NORM = 0.5
"""Stand-ins are scaled (by a constant of the generator, not of the sample) so that rows
have E‖x‖² = 0.5: inside the unit ball the queries clip to, rarely clipped."""


# ------------------------------------------------------------------ stand-ins
def _orthonormal_basis(n_features: int, rng: np.random.Generator) -> FloatArray:
    q, r = np.linalg.qr(rng.normal(size=(n_features, n_features)))
    return np.asarray(q * np.sign(np.diag(r)), dtype=np.float64)


def spiked_rows(n_rows: int, n_features: int, *, n_spikes: int, seed: int) -> FloatArray:
    """Zero-mean Gaussian rows with a spiked covariance in a random (seeded) basis.

    Eigenvalues: ``n_spikes`` spikes falling linearly from 1 to 0.5, then a flat bulk
    of 0.05; the whole scaled to E‖x‖² = :data:`STAND_IN_MEAN_SQUARED_NORM`. The top
    ``n_spikes`` components are therefore well separated from the rest.
    """
    rng = np.random.default_rng(seed)
    spikes = np.linspace(1.0, 0.5, n_spikes)
    eigenvalues = np.concatenate([spikes, np.full(n_features - n_spikes, 0.05)])
    eigenvalues *= STAND_IN_MEAN_SQUARED_NORM / eigenvalues.sum()
    basis = _orthonormal_basis(n_features, rng)
    rows = np.empty((n_rows, n_features), dtype=np.float64)
    step = 50_000  # bounded memory for the 515,345-row stand-in
    for start in range(0, n_rows, step):
        size = min(step, n_rows - start)
        latent = rng.normal(size=(size, n_features)) * np.sqrt(eigenvalues)
        rows[start : start + size] = latent @ basis.T
    return rows


def spiked_classes(
    n_rows: int, n_features: int, n_classes: int, *, signal_dims: int, seed: int
) -> tuple[FloatArray, npt.NDArray[np.int64]]:
    """Labelled rows whose classes differ only inside a ``signal_dims``-dimensional subspace.

    In a random (seeded) subspace, class centres are normal with standard deviation
    2 and each row is its class centre plus unit normal within-class noise; isotropic
    normal noise in all ``n_features`` dimensions carries as much variance in total as
    the subspace; the whole is scaled to E‖x‖² = :data:`STAND_IN_MEAN_SQUARED_NORM`.
    Projecting onto the top principal components keeps the class structure (an RBF-SVM
    on the top 10 non-private components reaches a macro F1 of 0.93-0.97 on held-out
    rows at the published shapes); the other directions carry only noise. Classes are
    balanced.
    """
    rng = np.random.default_rng(seed)
    basis = _orthonormal_basis(n_features, rng)[:, :signal_dims]
    centres = rng.normal(0.0, 2.0, size=(n_classes, signal_dims))
    labels = rng.permutation(np.arange(n_rows) % n_classes).astype(np.int64)
    signal = centres[labels] + rng.normal(size=(n_rows, signal_dims))
    subspace_variance = 5.0 * signal_dims  # E‖centre + within-class noise‖²
    bulk_sd = math.sqrt(subspace_variance / n_features)
    rows = signal @ basis.T + rng.normal(0.0, bulk_sd, size=(n_rows, n_features))
    rows *= math.sqrt(STAND_IN_MEAN_SQUARED_NORM / (2.0 * subspace_variance))
    return rows, labels


# ------------------------------------------------------------------- summaries
def mean_and_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    array = np.asarray(values, dtype=np.float64)
    std = float(array.std(ddof=1)) if array.size > 1 else 0.0
    return float(array.mean()), std


def provenance(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """Command line, date, machine and code version of a run, for the JSON output."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    model = None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPOSITORY), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus_usable": len(cpus) if cpus is not None else os.cpu_count(),
            "cpu_model": model,
            "platform": platform.platform(),
            "python": platform.python_version(),
            # Measured, not claimed: other work on the machine shows here.
            "load_average_1min_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        },
        "fedpca_version": __version__,
        "git_commit": commit,
        "parameters": dict(parameters),
    }


def write_results(
    out_dir: Path, stem: str, rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]
) -> list[Path]:
    """Write ``stem.csv`` (one line per row) and ``stem.json`` (meta and rows)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / f"{stem}.csv"
    columns = list(rows[0]) if rows else []
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(
        json.dumps({**meta, "rows": list(rows)}, indent=2, default=_json_default) + "\n"
    )
    return [csv_path, json_path]


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def plot_series(
    ax: Any,
    points: Sequence[Mapping[str, Any]],
    x: str,
    mean: str,
    std: str,
    style: tuple[str, str, str | None],
    label: str,
) -> None:
    """One line of means with standard-deviation error bars on a matplotlib axis.

    ``style`` is (colour, line style, marker or None).
    """
    color, line, marker = style
    ax.errorbar(
        [p[x] for p in points],
        [p[mean] for p in points],
        yerr=[p[std] for p in points],
        color=color,
        linestyle=line,
        marker=marker,
        capsize=3,
        label=label,
    )


def print_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[str]) -> None:
    """Print ``rows`` as an aligned text table of ``columns``."""
    materialised = [[_cell(row[c]) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in materialised)]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for cells in materialised:
        print("  ".join(cell.rjust(w) for cell, w in zip(cells, widths, strict=True)))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def positive_floats(text: str) -> list[float]:
    """argparse type: a comma-separated list of positive finite numbers."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise SystemExit(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise SystemExit(f"expected positive finite numbers, got {text!r}")
    return values


def positive_ints(text: str) -> list[int]:
    """argparse type: a comma-separated list of positive integers."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise SystemExit(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"expected positive integers, got {text!r}")
    return values
