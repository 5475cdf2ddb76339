"""What ``pca`` and ``dca`` print after a release: rows clipped below the longest row
the bounds allow, and eigenvalues that noise made negative (a new user's walkthrough:
the default --clip-norm 1 clipped 98.7 % of an 8-feature table's rows, and a noisy
spectrum printed ratios summing to 1 over two of eight eigenvalues, without a word)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import click
import numpy as np
import pytest
from click.testing import CliRunner

from fedpca.analyst.component_noise import ComponentNoise
from fedpca.analyst.estimators import FederatedPCA
from fedpca.analyst.release_summary import (
    _print_component_noise,
    clip_note,
    print_release_summary,
    records_line,
)
from fedpca.analyst.solvers import pca_from_statistics
from fedpca.query import QueryKind


def _query(n_features: int, clip_norm: float, bounded: bool = True) -> Any:
    bounds = (-1.0,) * n_features if bounded else ()
    return SimpleNamespace(
        kind=QueryKind.PCA,
        n_features=n_features,
        clip_norm=clip_norm,
        feature_lower=bounds,
        feature_columns=(),
    )


def test_a_clip_below_the_longest_row_the_bounds_allow_is_said() -> None:
    note = clip_note(_query(8, 1.0))
    assert note is not None and "clipped to L2 norm 1 " in note and "reach 2.83" in note
    assert clip_note(_query(8, 2.9)) is None  # at least sqrt(8): nothing is clipped
    assert clip_note(_query(8, 1.0, bounded=False)) is None  # raw units: no longest row


def test_negative_eigenvalues_are_counted_and_said() -> None:
    # A noisy scatter with two negative eigenvalues (of four).
    rng = np.random.default_rng(1)
    basis, _ = np.linalg.qr(rng.normal(size=(4, 4)))
    scatter = (basis * np.array([50.0, 20.0, -3.0, -1.0])) @ basis.T
    result = pca_from_statistics(scatter, np.zeros(4), 100.0, 2)
    assert result.n_eigenvalues_clipped == 2
    assert float(result.explained_variance_ratio.sum()) == pytest.approx(1.0)  # the other two

    estimator = FederatedPCA.__new__(FederatedPCA)
    fitted = {
        "query_id_": "q",
        "n_owners_": 2,
        "n_owners_registered_": 2,
        "quorum_": 2,
        "n_samples_is_noisy_": True,
        "not_private_": False,
        "n_samples_": 100.0,
        "release_": SimpleNamespace(query=_query(4, 2.0), n_samples_noise_sd=3.0),
        "explained_variance_ratio_": result.explained_variance_ratio,
        "explained_variance_": result.explained_variance,
        "n_eigenvalues_clipped_": result.n_eigenvalues_clipped,
        "n_features_in_": 4,
        "epsilon_": 1.0,
        "delta_": 1e-6,
        "timings_": {},
    }
    estimator.__dict__.update(fitted)
    files = SimpleNamespace(scree=None, projection=None, json="result.json")

    @click.command()
    def show() -> None:
        print_release_summary(estimator, files)

    printed = CliRunner().invoke(show).output
    assert "2 of the 4 noisy eigenvalues were negative" in printed
    assert "clipped to L2 norm" not in printed  # 2 >= sqrt(4)
    estimator.n_eigenvalues_clipped_ = 0
    assert "noisy eigenvalues" not in CliRunner().invoke(show).output


@pytest.mark.parametrize(
    ("values", "said"),
    [
        ([0.5, 0.3], None),
        ([0.5, 0.1, 0.04], "component 3: explained variance within the bound of 0"),
        ([0.5, 0.05, 0.01], "components 2 to 3: explained variance within the bound of 0"),
        ([0.5, 0.05, 0.01, 0.0], "components 2 to 4: explained variance within the bound of 0"),
    ],
)
def test_the_noise_bound_names_the_components_the_noise_alone_could_give(
    values: list[float], said: str | None
) -> None:
    estimator = FederatedPCA.__new__(FederatedPCA)
    estimator.__dict__["component_noise_"] = ComponentNoise(
        np.full(len(values), 0.01), np.full(len(values), 5.0), 40, values_bound=0.05
    )

    @click.command()
    def show() -> None:
        _print_component_noise(estimator, np.array(values), "explained variance")

    printed = CliRunner().invoke(show).output
    assert "noise bound: +/- 0.05 on every explained variance at once" in printed
    assert "the bound below covers both" in printed
    if said is None:
        assert "within the bound of 0" not in printed
    else:
        assert said in printed
    estimator.__dict__["component_noise_"] = ComponentNoise(
        np.full(len(values), 0.01), np.full(len(values), 5.0), 40
    )
    without = CliRunner().invoke(show).output  # DCA: no bound
    assert "noise bound" not in without and "the bound below" not in without


def test_the_records_line_prints_an_exact_count_whole_and_says_why_it_is_exact() -> None:
    assert records_line(351.0, 0.0, True) == "records N:   351 (exact: NOT PRIVATE)"
    assert records_line(351.0, 0.0, False) == ("records N:   351 (exact: public under replace-one)")
    assert records_line(350.62, 4.25, False) == "records N:   350.6 (noisy, noise sd 4.25)"
