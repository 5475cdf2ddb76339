"""The printed summary of a histogram per category: a category the owners may not hold.

Found by a new analyst's walkthrough (stop 43): ``--categories 0,1`` on a label of
-1/+1 printed category 0 with counts of pure noise and no word, where DCA warns of such
a class. The summary now says when a category's noisy counts sum to within 3 sigma of
zero (the sum of k cells of noise sigma s has sigma s·√k).
"""

from __future__ import annotations

import numpy as np

from fedpca.aggregates import COUNTS
from fedpca.analyst.aggregate_summary import summary_lines
from fedpca.analyst.statistics import FederatedHistogram, FederatedStatistics


def _fitted(raw: np.ndarray, sigma: float, *, not_private: bool = False) -> FederatedHistogram:
    histogram = FederatedHistogram(6, bins=[0.0, 1.0, 2.0, 3.0], groupby=0, categories=[0, 1])
    histogram.columns_ = (6,)
    histogram.bin_edges_ = [np.array([0.0, 1.0, 2.0, 3.0])]
    histogram.categories_ = np.array([0.0, 1.0])
    histogram.raw_counts_ = raw
    histogram.counts_ = np.maximum(raw, 0.0)
    histogram.clamped_ = True
    histogram.noise_sigmas_ = {COUNTS: sigma}
    histogram.not_private_ = not_private
    return histogram


def _warnings(histogram: FederatedHistogram) -> list[str]:
    return [line for line, colour in summary_lines(histogram) if "within 3 sigma" in line]


def test_a_category_whose_counts_sum_to_noise_is_named() -> None:
    # Category 0: three cells summing to 4 with sigma 2 each: 3·2·√3 = 10.4 > 4.
    # Category 1: 300 records, far from zero.
    raw = np.array([[3.0, -1.0, 2.0], [100.0, 120.0, 80.0]])
    (warning,) = _warnings(_fitted(raw, 2.0))
    assert warning.startswith("  its counts sum to 4, within 3 sigma (10.4) of zero")
    lines = [line for line, _ in summary_lines(_fitted(raw, 2.0))]
    # Said under the category it concerns.
    assert lines[lines.index(warning) - 1] == "category 0 of col 0:"


def test_no_warning_beyond_3_sigma_or_without_noise() -> None:
    raw = np.array([[4.0, 4.0, 3.0], [100.0, 120.0, 80.0]])  # 11 > 10.4
    assert _warnings(_fitted(raw, 2.0)) == []
    empty = np.array([[0.0, 0.0, 0.0], [100.0, 120.0, 80.0]])
    assert _warnings(_fitted(empty, 0.0, not_private=True)) == []


def test_the_outer_bins_are_labelled_with_the_values_they_count() -> None:
    """A new user's walkthrough: bins 30,40,50 printed '[30, 40) 538', a count that held
    every age below 40 (values beyond the outer edges count in the outer bins)."""
    raw = np.array([[4.0, 4.0, 3.0], [100.0, 120.0, 80.0]])
    lines = [line for line, _ in summary_lines(_fitted(raw, 2.0))]
    labels = [line.split()[0] + " " + line.split()[1] for line in lines if line.startswith("  (")]
    labels += [line.split()[0] + " " + line.split()[1] for line in lines if line.startswith("  [")]
    assert sorted(set(labels)) == ["(-inf, 1)", "[1, 2)", "[2, inf)"]
    assert "edges:       0 to 3; values beyond them count in the outer bins" in lines


def test_the_widest_numbers_stay_apart() -> None:
    """A walkthrough read '0.504076-0.000947619' as one number: a %.6g value of 12
    characters filled its 12-character column."""
    stats = FederatedStatistics([1, 2], bounds="0:1")
    stats.columns_ = (1, 2)
    stats.not_private_ = False
    stats.n_samples_, stats.n_samples_noise_sd_ = 700.0, 6.4
    stats.mean_ = np.array([0.504076, -0.000947619])
    stats.mean_noise_sd_ = np.array([-1.23456e-05, 0.5])
    stats.variance_ = stats.covariance_ = None
    stats.clip_moved_ = ()
    lines = [line for line, _ in summary_lines(stats)]
    assert lines[2].split() == ["mean", "0.504076", "-0.000947619"]
    assert lines[3].split() == ["noise", "sd", "-1.23e-05", "0.5"]
    assert lines[1].split() == ["column", "col", "1", "col", "2"]
    # The columns line up under their headers.
    assert len(lines[1]) == len(lines[2]) == len(lines[3])
