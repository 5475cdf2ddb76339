"""End to end over gRPC: real proxy and owner processes, mutual TLS, 2048-bit keys.

Every test starts ``fedpca proxy serve`` and ``fedpca owner serve`` as separate OS
processes on loopback (through :class:`fedpca.app.cluster.LocalCluster`) and runs the
analyst against them.

Owners release exact integer statistics of their rows quantised to 2^-16 per
coordinate: a noiseless result equals, to float precision, the same solver applied to
those exact statistics (helpers.exact_statistics), and sklearn on the float rows to
within the quantisation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn.decomposition import PCA

from fedpca.analyst.estimators import FederatedDCA, FederatedPCA
from fedpca.analyst.solvers import dca_from_statistics, pca_from_statistics
from fedpca.app.cluster import LocalCluster, split_rows
from fedpca.app.plaintext_release import plaintext_release
from fedpca.query import Neighbouring, ProtocolMode, QueryKind
from fedpca.stats import StatisticsSpec
from fedpca.tables import OwnerTable
from helpers import QUANTISATION_STEP, dataset_table, exact_statistics, reference_statistics

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
        np.testing.assert_allclose(row_a, sign * row_b, rtol=0, atol=atol)


@pytest.mark.parametrize("mode", ["stats", "masked"])
def test_no_noise_pca_equals_sklearn(tmp_path: Path, mode: str) -> None:
    table = _unit_rows(_dataset("ionosphere.csv"))
    rows = table[:, 1:]
    masked = mode == "masked"
    # Masked mode publishes N: it needs a replace-one deployment whose owners opted in.
    relation = {"neighbouring": "replace-one", "allow_masked_mode": True} if masked else {}
    with _cluster(tmp_path, table, owners=3, allow_not_private=True, **relation) as cluster:
        cluster.prepare()
        cluster.start()
        # The estimator states masked queries for replace-one by default.
        model = FederatedPCA(
            n_components=3, epsilon=math.inf, delta=1e-5, mode=mode, **_estimator_kwargs(cluster)
        ).fit(n_features=rows.shape[1])
    spec = model.release_.query
    assert model.n_owners_ == 3
    assert spec.neighbouring is (Neighbouring.REPLACE_ONE if masked else Neighbouring.ADD_REMOVE)
    # Exactly the PCA of the owners' exact statistics ...
    exact = pca_from_statistics(
        exact_statistics(rows, None, dataclasses.replace(spec, mode=ProtocolMode.STATS)),
        n_components=3,
    )
    _same_up_to_sign(model.components_, exact.components, atol=1e-9)
    np.testing.assert_allclose(model.explained_variance_, exact.explained_variance, rtol=1e-9)
    # ... which is sklearn's on the float rows to within the rows' quantisation (2^-16
    # per coordinate; measured: 5e-5 on the components, 1.3e-4 relative on the variances).
    reference = PCA(n_components=3, svd_solver="covariance_eigh").fit(rows)
    _same_up_to_sign(model.components_, reference.components_, atol=5e-4)
    np.testing.assert_allclose(
        model.explained_variance_ratio_, reference.explained_variance_ratio_, rtol=1e-3
    )
    np.testing.assert_allclose(model.explained_variance_, reference.explained_variance_, rtol=1e-3)
    if masked:
        assert model.mean_ is None and model.n_samples_ == len(rows)  # N is public
    else:
        np.testing.assert_allclose(model.mean_, exact.mean, rtol=0, atol=1e-12)
        np.testing.assert_allclose(model.mean_, reference.mean_, rtol=0, atol=QUANTISATION_STEP)
        assert model.n_samples_ == len(rows)  # the count is exact
    # The utility benchmarks' plaintext path (no transport, no Paillier) releases the
    # very same numbers as these processes did.
    parts = split_rows(len(table), 3, seed=1)
    plaintext = plaintext_release(spec, [OwnerTable(rows[p], None) for p in parts])
    released = model.release_
    if masked:
        np.testing.assert_array_equal(plaintext.centred_scatter, released.centred_scatter)
    else:
        assert plaintext.statistics is not None and released.statistics is not None
        np.testing.assert_array_equal(plaintext.statistics.scatter, released.statistics.scatter)
        np.testing.assert_array_equal(plaintext.statistics.sums, released.statistics.sums)
        assert plaintext.statistics.count == released.statistics.count


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
    exact = dca_from_statistics(
        exact_statistics(rows, labels, model.release_.query), n_components=1
    )
    _same_up_to_sign(model.components_, exact.components, atol=1e-9)
    # The float formulation, to within the rows' quantisation (measured: 1.7e-5).
    spec = StatisticsSpec(QueryKind.DCA, rows.shape[1], 1.0, (-1.0, 1.0))
    reference = dca_from_statistics(reference_statistics(rows, labels, spec), n_components=1)
    _same_up_to_sign(model.components_, reference.components, atol=2e-4)


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
    # The owners' exact statistics: what is left of the difference is the noise alone.
    exact = exact_statistics(rows, None, model.release_.query).scatter
    upper = np.triu_indices(rows.shape[1])
    errors = (noisy.scatter - exact)[upper]
    sigma = model.noise_sigmas_["scatter"]
    # Calibrated for a capped owner's swap under add/remove: z * sqrt(4.5) at clip norm 1.
    plan = model.release_.plan
    assert sigma == pytest.approx(plan.noise_multiplier * math.sqrt(4.5))
    # 595 i.i.d. draws: the sample sd is within ~3 % of sigma; 15 % leaves room.
    assert np.std(errors) == pytest.approx(sigma, rel=0.15)
    assert abs(np.mean(errors)) < 4 * sigma / math.sqrt(len(errors))
    assert not np.allclose(noisy.scatter, exact)


@pytest.mark.parametrize("mode", ["stats", "masked"])
def test_demo_command_writes_exact_result(tmp_path: Path, mode: str) -> None:
    """The README's main command, run as a user would, with --epsilon inf, in both modes
    (the README lists --mode masked; its deployment once refused every masked query)."""
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
            "--mode",
            mode,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "NOT PRIVATE" in completed.stdout and "records (exact)" in completed.stdout
    result = json.loads((out / "result.json").read_text())
    assert result["mode"] == mode
    reference = PCA(n_components=2, svd_solver="covariance_eigh").fit(table[:, 1:])
    # Exact statistics of rows quantised to 2^-16 per coordinate: sklearn's components
    # to within the quantisation.
    _same_up_to_sign(np.array(result["components"]), reference.components_, atol=5e-4)
    assert result["n_owners"] == 2
    pngs = sorted(out.glob("*.png"))
    assert pngs and all(p.stat().st_size > 1000 for p in pngs)


def test_pca_of_named_columns_is_the_pca_of_those_columns(tmp_path: Path) -> None:
    """A query naming its feature columns (one owner allows only those: before, its
    policy made it decline every PCA) releases exactly the PCA of those file columns."""
    table = _unit_rows(_dataset("ionosphere.csv"))
    columns = (12, 3, 7, 20)  # file columns (column 0 is the label), in this order
    allowed = {"owner-1": {"policy": {"allowed_columns": sorted(columns)}}}
    with _cluster(
        tmp_path, table, owners=2, allow_not_private=True, owner_settings=allowed
    ) as cluster:
        cluster.prepare()
        cluster.start()
        model = FederatedPCA(
            n_components=2,
            epsilon=math.inf,
            delta=1e-5,
            columns=columns,
            **_estimator_kwargs(cluster),
        ).fit()
    assert model.n_owners_ == 2 and model.release_.query.feature_columns == columns
    rows = table[:, list(columns)]
    exact = pca_from_statistics(exact_statistics(rows, None, model.release_.query), n_components=2)
    _same_up_to_sign(model.components_, exact.components, atol=1e-9)
    np.testing.assert_allclose(model.explained_variance_, exact.explained_variance, rtol=1e-9)
    reference = PCA(n_components=2, svd_solver="covariance_eigh").fit(rows)
    np.testing.assert_allclose(model.explained_variance_, reference.explained_variance_, rtol=1e-3)
