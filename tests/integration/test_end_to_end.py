"""End to end over gRPC: real proxy and owner processes, mutual TLS, 2048-bit keys.

Every test starts ``fedpca proxy serve`` and ``fedpca owner serve`` as separate OS
processes on loopback (through :class:`fedpca.app.cluster.LocalCluster`) and runs the
analyst against them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn.decomposition import PCA

from fedpca.analyst.estimators import FederatedDCA, FederatedPCA
from fedpca.analyst.solvers import dca_from_statistics
from fedpca.app.cluster import LocalCluster, split_rows
from fedpca.query import QueryKind
from fedpca.stats import StatisticsSpec
from helpers import dataset_table, reference_statistics

pytestmark = pytest.mark.slow


def _dataset(name: str) -> np.ndarray:
    return dataset_table(name.removesuffix(".csv"))


def _unit_rows(table: np.ndarray) -> np.ndarray:
    """Rows scaled into the unit ball so that clipping changes nothing."""
    labels, rows = table[:, :1], table[:, 1:]
    norms = np.linalg.norm(rows, axis=1).max()
    return np.column_stack([labels, rows / norms])


def _cluster(tmp_path: Path, table: np.ndarray, owners: int, **kwargs: object) -> LocalCluster:
    parts = split_rows(len(table), owners, seed=1)
    return LocalCluster(
        workdir=tmp_path / "work",
        owner_tables=[table[p] for p in parts],
        **kwargs,  # type: ignore[arg-type]
    )


def _estimator_kwargs(cluster: LocalCluster) -> dict[str, object]:
    return {
        **cluster.analyst_connection(),
        "quorum": len(cluster.owner_tables),
        "deadline_seconds": 300.0,
    }


def _same_up_to_sign(a: np.ndarray, b: np.ndarray, atol: float) -> None:
    for row_a, row_b in zip(a, b, strict=True):
        sign = np.sign(row_a @ row_b) or 1.0
        np.testing.assert_allclose(row_a, sign * row_b, atol=atol)


@pytest.mark.parametrize("mode", ["stats", "masked"])
def test_no_noise_pca_equals_sklearn(tmp_path: Path, mode: str) -> None:
    table = _unit_rows(_dataset("ionosphere.csv"))
    rows = table[:, 1:]
    with _cluster(tmp_path, table, owners=3, allow_not_private=True) as cluster:
        cluster.prepare()
        cluster.start()
        model = FederatedPCA(
            n_components=3, epsilon=math.inf, delta=1e-5, mode=mode, **_estimator_kwargs(cluster)
        ).fit(n_features=rows.shape[1])
    reference = PCA(n_components=3, svd_solver="covariance_eigh").fit(rows)
    assert model.n_owners_ == 3
    _same_up_to_sign(model.components_, reference.components_, atol=1e-6)
    np.testing.assert_allclose(
        model.explained_variance_ratio_, reference.explained_variance_ratio_, rtol=1e-6
    )
    np.testing.assert_allclose(model.explained_variance_, reference.explained_variance_, rtol=1e-6)
    if mode == "stats":
        np.testing.assert_allclose(model.mean_, reference.mean_, atol=1e-9)
        assert model.n_samples_ == pytest.approx(len(rows), abs=1e-6)


def test_no_noise_dca_equals_reference_formulation(tmp_path: Path) -> None:
    table = _unit_rows(_dataset("ionosphere.csv"))
    rows, labels = table[:, 1:], table[:, 0]
    with _cluster(tmp_path, table, owners=2, allow_not_private=True) as cluster:
        cluster.prepare()
        cluster.start()
        model = FederatedDCA(
            n_components=1,
            epsilon=math.inf,
            delta=1e-5,
            label_column=0,
            classes=(-1.0, 1.0),
            **_estimator_kwargs(cluster),
        ).fit(n_features=rows.shape[1])
    spec = StatisticsSpec(QueryKind.DCA, rows.shape[1], 1.0, (-1.0, 1.0))
    reference = dca_from_statistics(reference_statistics(rows, labels, spec), n_components=1)
    _same_up_to_sign(model.components_, reference.components, atol=1e-6)


def test_noise_differs_from_exact_by_the_calibrated_scale(tmp_path: Path) -> None:
    table = _unit_rows(_dataset("ionosphere.csv"))
    rows = table[:, 1:]
    with _cluster(tmp_path, table, owners=2) as cluster:
        cluster.prepare()
        cluster.start()
        model = FederatedPCA(
            n_components=2, epsilon=1.0, delta=1e-5, **_estimator_kwargs(cluster)
        ).fit(n_features=rows.shape[1])
    noisy = model.release_.statistics
    assert noisy is not None
    exact = rows.T @ rows
    upper = np.triu_indices(rows.shape[1])
    errors = (noisy.scatter - exact)[upper]
    sigma = model.noise_sigmas_["scatter"]
    # 595 i.i.d. draws: the sample sd is within ~3 % of sigma; 15 % leaves room.
    assert np.std(errors) == pytest.approx(sigma, rel=0.15)
    assert abs(np.mean(errors)) < 4 * sigma / math.sqrt(len(errors))
    assert not np.allclose(noisy.scatter, exact)


def test_demo_command_writes_exact_result(tmp_path: Path) -> None:
    """The README's main command, run as a user would, with --epsilon inf."""
    table = _unit_rows(_dataset("ionosphere.csv"))
    dataset = tmp_path / "unit.csv"
    np.savetxt(dataset, table, delimiter=",", fmt="%.17g")
    out = tmp_path / "out"
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedpca.app.cli",
            "demo",
            "--owners",
            "2",
            "--dataset",
            str(dataset),
            "--epsilon",
            "inf",
            "--bounds",
            "none",
            "--components",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "NOT PRIVATE" in completed.stdout
    result = json.loads((out / "result.json").read_text())
    reference = PCA(n_components=2, svd_solver="covariance_eigh").fit(table[:, 1:])
    _same_up_to_sign(np.array(result["components"]), reference.components_, atol=1e-6)
    assert result["n_owners"] == 2
    pngs = sorted(out.glob("*.png"))
    assert pngs and all(p.stat().st_size > 1000 for p in pngs)
