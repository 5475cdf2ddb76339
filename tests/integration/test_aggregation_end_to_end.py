"""Aggregate queries end to end: real proxy and owner processes, mutual TLS, 2048-bit keys.

The bundled Pima diabetes table (column 0 the outcome -1/1, then pregnancies, glucose,
blood pressure, skin thickness, insulin, BMI, pedigree, age) is split over three owner
processes started with ``fedpca owner serve``; the analyst runs the estimators and the
``fedpca analyst stats|histogram|linreg`` commands against ``fedpca proxy serve``.

With epsilon = inf (NOT PRIVATE) every kind equals numpy / scikit-learn on the pooled
rows: histograms and counts exactly, everything else to within the 2^-16 quantisation
of scaled values (and exactly, to float rounding, on the values the owners sum). With a
finite epsilon the histogram's noise has the plan's standard deviation.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sklearn.linear_model import LinearRegression

from fedpca.analyst import (
    FederatedHistogram,
    FederatedLinearRegression,
    FederatedQuery,
    FederatedStatistics,
)
from fedpca.app.cluster import LocalCluster, split_rows
from helpers import dataset_table, quantisation_step

pytestmark = pytest.mark.slow

STEP = quantisation_step(32)
OWNERS = 3
STATS_COLUMNS, STATS_BOUNDS = [1, 2, 6, 8], [(0.0, 17.0), (0.0, 200.0), (0.0, 70.0), (20.0, 90.0)]
FEATURES = [0, 1, 3, 4, 5, 6, 7, 8]
FEATURE_BOUNDS = [
    (-1.0, 1.0),
    (0.0, 17.0),
    (0.0, 130.0),
    (0.0, 100.0),
    (0.0, 900.0),
    (0.0, 70.0),
    (0.0, 2.5),
    (20.0, 90.0),
]
TARGET, TARGET_BOUNDS = 2, (0.0, 200.0)
AGE_EDGES = [20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 90.0]
BMI_EDGES, GLUCOSE_EDGES = [0.0, 20.0, 30.0, 40.0, 70.0], [0.0, 100.0, 140.0, 200.0]


def _cluster(tmp_path: Path, table: np.ndarray, **kwargs: Any) -> LocalCluster:
    parts = split_rows(len(table), OWNERS, seed=1)
    return LocalCluster(workdir=tmp_path / "work", owner_tables=[table[p] for p in parts], **kwargs)


def _connection(cluster: LocalCluster) -> dict[str, Any]:
    return {**cluster.analyst_connection(), "quorum": OWNERS, "deadline_seconds": 300.0}


def _quantised(values: np.ndarray, bounds: list[tuple[float, float]]) -> np.ndarray:
    lo = np.array([b[0] for b in bounds])
    hi = np.array([b[1] for b in bounds])
    u = np.clip(2 * (np.clip(values, lo, hi) - lo) / (hi - lo) - 1, -1, 1)
    return (hi + lo) / 2 + (hi - lo) / 2 * np.trunc(u / STEP) * STEP


def _within(actual: Any, expected: Any, atol: Any) -> None:
    error = np.abs(np.asarray(actual) - np.asarray(expected))
    assert np.all(error <= atol), f"largest error / tolerance: {np.max(error / atol):.3g}"


def test_not_private_aggregates_equal_numpy_and_sklearn(tmp_path: Path) -> None:
    table = dataset_table("diabetes")
    stats = FederatedStatistics(STATS_COLUMNS, bounds=STATS_BOUNDS, ddof=1)
    ages = FederatedHistogram(8, bins=AGE_EDGES)
    joint = FederatedHistogram(
        [6, 2], bins=[BMI_EDGES, GLUCOSE_EDGES], groupby=0, categories=[-1.0, 1.0]
    )
    regression = FederatedLinearRegression(
        FEATURES, bounds=FEATURE_BOUNDS, target=TARGET, target_bounds=TARGET_BOUNDS
    )
    with _cluster(tmp_path, table, allow_not_private=True) as cluster:
        cluster.prepare()
        cluster.start()
        query = FederatedQuery(
            [stats, ages, joint, regression],
            epsilon=math.inf,
            delta=1e-5,
            **_connection(cluster),
        ).fit()
    assert query.not_private_ and query.n_owners_ == OWNERS
    assert query.release_.plan.key_bits == 2048

    x = table[:, STATS_COLUMNS]
    scale = np.array([(hi - lo) / 2 for lo, hi in STATS_BOUNDS])
    assert stats.n_samples_ == len(table)
    _within(stats.mean_, x.mean(axis=0), scale * STEP)
    _within(stats.covariance_, np.cov(x, rowvar=False), 8 * np.outer(scale, scale) * STEP)
    q = _quantised(x, STATS_BOUNDS)
    np.testing.assert_allclose(stats.mean_, q.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(stats.covariance_, np.cov(q, rowvar=False), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(stats.correlation_, np.corrcoef(q, rowvar=False), atol=1e-9)

    np.testing.assert_array_equal(ages.counts_, np.histogram(table[:, 8], bins=AGE_EDGES)[0])
    for c, label in enumerate([-1.0, 1.0]):
        rows = table[table[:, 0] == label]
        cells, _, _ = np.histogram2d(rows[:, 6], rows[:, 2], bins=[BMI_EDGES, GLUCOSE_EDGES])
        np.testing.assert_array_equal(joint.counts_[c], cells)

    features, target = table[:, FEATURES], table[:, TARGET]
    exact = LinearRegression().fit(
        _quantised(features, FEATURE_BOUNDS), _quantised(target[:, None], [TARGET_BOUNDS])[:, 0]
    )
    np.testing.assert_allclose(regression.coef_, exact.coef_, rtol=1e-8, atol=1e-10)
    assert regression.intercept_ == pytest.approx(exact.intercept_, rel=1e-8)
    reference = LinearRegression().fit(features, target)
    assert regression.score(features, target) == pytest.approx(
        reference.score(features, target), abs=1e-5
    )


def test_cli_commands_and_histogram_noise_over_real_processes(tmp_path: Path) -> None:
    table = dataset_table("diabetes")
    # The deployment allows verification runs (an unlimited analyst budget at the
    # proxy); owners record a NOT PRIVATE release over their finite budget, which it
    # exhausts, so the private run comes first.
    with _cluster(tmp_path, table, allow_not_private=True) as cluster:
        cluster.prepare()
        cluster.start()
        tls = cluster.analyst_tls()
        common = [
            *("--proxy", cluster.proxy_address, "--ca", str(tls.ca_certificate)),
            *("--cert", str(tls.certificate), "--key", str(tls.private_key)),
            *("--key-dir", str(cluster.key_dir), "--quorum", str(OWNERS)),
        ]

        def run(*args: str, epsilon: str = "inf") -> dict[str, Any]:
            out = tmp_path / f"{args[0]}-{epsilon}.json"
            completed = subprocess.run(
                [
                    *(sys.executable, "-m", "fedpca.app.cli", "analyst", *args, *common),
                    *("--epsilon", epsilon, "--delta", "1e-6", "--out", str(out)),
                ],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            assert completed.returncode == 0, completed.stdout + completed.stderr
            assert completed.stdout.strip().splitlines()[-1] == str(out)
            document: dict[str, Any] = json.loads(out.read_text())
            return document

        # 200 cells of a private 2-D histogram.
        glucose, bmi = np.linspace(0, 200, 21), np.linspace(0, 70, 11)
        bins = ("--bins", ",".join(map(str, glucose)), "--bins", ",".join(map(str, bmi)))
        noisy = run("histogram", "--columns", "2,6", *bins, "--no-clamp", epsilon="1")

        stats = run("stats", "--columns", "1,6", "--bounds", "0:17,0:70", "--moments", "mean")
        assert stats["not_private"] is True and stats["n_samples"] == len(table)
        _within(stats["mean"], table[:, [1, 6]].mean(axis=0), np.array([8.5, 35.0]) * STEP)

        model = run(
            *("linreg", "--columns", "6,8", "--bounds", "0:70,20:90"),
            *("--target", "2", "--target-bounds", "0:200"),
        )
        reference = LinearRegression().fit(
            _quantised(table[:, [6, 8]], [(0.0, 70.0), (20.0, 90.0)]),
            _quantised(table[:, [2]], [TARGET_BOUNDS])[:, 0],
        )
        np.testing.assert_allclose(model["coef"], reference.coef_, rtol=1e-8)
    assert noisy["not_private"] is False and noisy["postprocessing"] == "none"
    exact, _, _ = np.histogram2d(table[:, 2], table[:, 6], bins=[glucose, bmi])
    errors = np.array(noisy["raw_counts"]) - exact
    assert np.all(errors == np.round(errors))  # integer noise on integer counts
    sigma = noisy["noise_sigma"]["counts"]
    # Calibrated for a capped owner's swap (one cell down, another up): sqrt(2) z.
    assert sigma == pytest.approx(math.sqrt(2) * noisy["noise_multiplier"], rel=1e-12)
    # 200 i.i.d. draws: the sample sd is within ~5 % of sigma; 20 % leaves room.
    assert np.std(errors) == pytest.approx(sigma, rel=0.2)
    assert abs(np.mean(errors)) < 4 * sigma / math.sqrt(errors.size)


def test_bounded_owner_tables_release_a_central_curators_noise(tmp_path: Path) -> None:
    """Owners that enforce their capacity answer a bounded query with add-only noise.

    Before bounded owner tables existed, every add/remove query covered a capped
    owner's swap: a histogram's counts had sqrt(2) z noise where a central curator
    adds z. Here the three owners enforce ``data.max_records`` (their table sizes),
    the CLI asks for ``--bounded-owner-tables`` and the counts get z: the central
    noise. A query whose cap is below an owner's capacity is declined by every owner
    (it could make them sample), with the public reason.
    """
    table = dataset_table("diabetes")
    enforce = {"data": {"enforce_max_records": True}}
    owners = {f"owner-{i + 1}": enforce for i in range(OWNERS)}
    with _cluster(tmp_path, table, owner_settings=owners) as cluster:
        cluster.prepare()
        cluster.start()
        tls = cluster.analyst_tls()
        glucose, bmi = np.linspace(0, 200, 21), np.linspace(0, 70, 11)
        command = [
            *(sys.executable, "-m", "fedpca.app.cli", "analyst", "histogram"),
            *("--proxy", cluster.proxy_address, "--ca", str(tls.ca_certificate)),
            *("--cert", str(tls.certificate), "--key", str(tls.private_key)),
            *("--key-dir", str(cluster.key_dir), "--quorum", str(OWNERS)),
            *("--columns", "2,6", "--bins", ",".join(map(str, glucose))),
            *("--bins", ",".join(map(str, bmi)), "--no-clamp", "--bounded-owner-tables"),
            *("--epsilon", "1", "--delta", "1e-6", "--deadline", "30"),
        ]
        out = tmp_path / "bounded.json"
        completed = subprocess.run(
            [*command, "--out", str(out)], capture_output=True, text=True, timeout=600
        )
        assert completed.returncode == 0, completed.stdout + completed.stderr
        noisy = json.loads(out.read_text())
        # A cap of 100 is below every owner's capacity (256 of the 768 rows each).
        refused = subprocess.run(
            [*command, "--max-records-per-owner", "100", "--out", str(tmp_path / "no.json")],
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert noisy["not_private"] is False and noisy["bounded_owner_tables"] is True
    exact, _, _ = np.histogram2d(table[:, 2], table[:, 6], bins=[glucose, bmi])
    errors = np.array(noisy["raw_counts"]) - exact
    sigma = noisy["noise_sigma"]["counts"]
    # One added record moves one cell by 1: the noise is z itself, not sqrt(2) z.
    assert sigma == pytest.approx(noisy["noise_multiplier"], rel=1e-12)
    assert np.std(errors) == pytest.approx(sigma, rel=0.2)
    assert refused.returncode != 0
    assert "below this owner's public max_records" in refused.stdout + refused.stderr
