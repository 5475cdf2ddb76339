"""Aggregate queries through a real proxy and real owner nodes over mutual TLS (in process).

The estimators run as an analyst would run them (their own AnalystClient, signed
queries, decryption) against :mod:`inprocess`; only the Paillier key is TEST-ONLY
(512 bits). The bundled Pima diabetes table is split over three owners: column 0 is the
outcome (-1/1), columns 1-8 pregnancies, glucose, blood pressure, skin thickness,
insulin, BMI, pedigree and age.

* epsilon = inf (NOT PRIVATE): every kind equals numpy / scikit-learn on the pooled rows
  (exactly for counts; to within the 2^-16 quantisation of scaled values otherwise).
* budgets: a combined query is charged once, at the composed cost, by the proxy and by
  every owner; its noise multiplier meets the defining worst case.
* policy: owners decline kinds and columns their policy forbids, with a public reason.
* conventions shared with PCA: the quorum defaults to every registered owner, a result
  of fewer owners warns, each decline is logged once, and ``fetch`` reads a stored
  aggregate release back.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from sklearn.linear_model import LinearRegression

import fedpca.analyst.aggregate_estimators as aggregate_estimators_module
import fedpca.analyst.keys as keys_module
import fedpca.analyst.querying as querying
from fedpca.analyst import (
    FederatedHistogram,
    FederatedLinearRegression,
    FederatedQuery,
    FederatedStatistics,
)
from fedpca.analyst.aggregate_report import aggregate_document, write_aggregate_result
from fedpca.analyst.cli import analyst_group
from fedpca.analyst.keys import (
    AnalystKeyFiles,
    create_analyst_keys,
    load_analyst_private_key,
)
from fedpca.analyst.querying import MissingOwnersWarning
from fedpca.codec import CryptoPool
from fedpca.dp.calibration import zcdp_noise_multiplier
from fedpca.dp.mechanisms import PrivacyParams
from fedpca.errors import OwnersWouldDeclineError, QueryStateError
from fedpca.messages import DeclineReason
from fedpca.query import QueryKind
from fedpca.transport.certs import Role
from helpers import LINREG_AGGREGATE, dataset_table, quantisation_step
from inprocess import deployment

OWNERS = ("owner-1", "owner-2", "owner-3")
STEP = quantisation_step(32)

STATS_COLUMNS = [1, 2, 6, 8]
STATS_BOUNDS = [(0.0, 17.0), (0.0, 200.0), (0.0, 70.0), (20.0, 90.0)]
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


@pytest.fixture(scope="module")
def table() -> np.ndarray:
    return dataset_table("diabetes")


@pytest.fixture
def analyst_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AnalystKeyFiles:
    files = create_analyst_keys(tmp_path / "keys", 512, allow_insecure_test_key=True)

    def load(path: Any) -> Any:
        return load_analyst_private_key(path, allow_insecure_test_key=True)

    monkeypatch.setattr(aggregate_estimators_module, "load_analyst_private_key", load)
    return files


@pytest.fixture
def running(
    tmp_path: Path, pool: CryptoPool, table: np.ndarray, analyst_keys: AnalystKeyFiles, request: Any
) -> Iterator[Any]:
    options: dict[str, Any] = getattr(request, "param", {})
    public_key = load_analyst_private_key(
        analyst_keys.directory, allow_insecure_test_key=True
    ).public_key
    parts = np.array_split(np.random.default_rng(3).permutation(len(table)), len(OWNERS))
    not_private = options.get("not_private", False)
    with deployment(
        workdir=tmp_path / "deployment",
        tables={owner: table[np.sort(p)] for owner, p in zip(OWNERS, parts, strict=True)},
        pool=pool,
        public_key=public_key,
        analyst_budget=PrivacyParams(math.inf if not_private else 100.0, 1e-5),
        policy={
            "accepted_query_signers": (analyst_keys.signer,),
            "allow_not_private": not_private,
            **options.get("policy", {}),
        },
    ) as started:
        yield started


def _connection(running: Any, analyst_keys: AnalystKeyFiles) -> dict[str, Any]:
    files = running.tls(Role.ANALYST, "alice")
    return {
        "proxy": running.proxy.address,
        "ca": files.ca_certificate,
        "cert": files.certificate,
        "key": files.private_key,
        "private_key_path": analyst_keys.directory,
        "n_jobs": 1,
        "quorum": len(OWNERS),
        "deadline_seconds": 60.0,
        "max_records_per_owner": 1000,
        "max_owners": 4,
    }


def _estimators() -> tuple[Any, Any, Any, Any]:
    stats = FederatedStatistics(STATS_COLUMNS, bounds=STATS_BOUNDS, ddof=1)
    ages = FederatedHistogram(8, bins=AGE_EDGES)
    table = FederatedHistogram(
        [6, 2], bins=[BMI_EDGES, GLUCOSE_EDGES], groupby=0, categories=[-1.0, 1.0]
    )
    regression = FederatedLinearRegression(
        FEATURES, bounds=FEATURE_BOUNDS, target=TARGET, target_bounds=TARGET_BOUNDS
    )
    return stats, ages, table, regression


def _within(actual: np.ndarray, expected: np.ndarray, atol: np.ndarray) -> None:
    """|actual - expected| <= atol elementwise (atol an array, as assert_allclose cannot)."""
    error = np.abs(np.asarray(actual) - np.asarray(expected))
    assert np.all(error <= atol), f"largest error / tolerance: {np.max(error / atol):.3g}"


def _quantised(values: np.ndarray, bounds: list[tuple[float, float]]) -> np.ndarray:
    """The values owners sum: clipped, scaled onto [-1, 1], truncated to 2^-16, scaled back."""
    lo = np.array([b[0] for b in bounds])
    hi = np.array([b[1] for b in bounds])
    centre, scale = (hi + lo) / 2, (hi - lo) / 2
    u = np.clip(2 * (np.clip(values, lo, hi) - lo) / (hi - lo) - 1, -1, 1)
    return centre + scale * np.trunc(u / STEP) * STEP


@pytest.mark.parametrize("running", [{"not_private": True}], indirect=True)
def test_not_private_results_equal_numpy_and_sklearn(
    running: Any, analyst_keys: AnalystKeyFiles, table: np.ndarray
) -> None:
    stats, ages, joint, regression = _estimators()
    query = FederatedQuery(
        [stats, ages, joint, regression],
        epsilon=math.inf,
        delta=1e-5,
        **_connection(running, analyst_keys),
    ).fit()
    assert query.not_private_ and query.n_owners_ == len(OWNERS)
    assert query.release_.query.kind is QueryKind.AGGREGATE

    # Descriptive statistics: the count exactly, the rest to within the quantisation.
    x = table[:, STATS_COLUMNS]
    scale = np.array([(hi - lo) / 2 for lo, hi in STATS_BOUNDS])
    assert stats.n_samples_ == len(table)
    _within(stats.mean_, x.mean(axis=0), scale * STEP)
    # Products of two values each within one step: 4 steps of each scale, covariance 8.
    atol = 8 * np.outer(scale, scale) * STEP
    _within(stats.covariance_, np.cov(x, rowvar=False), atol)
    np.testing.assert_allclose(stats.correlation_, np.corrcoef(x, rowvar=False), atol=1e-4)
    # Exactly numpy's on the values owners sum (float rounding only).
    q = _quantised(x, STATS_BOUNDS)
    np.testing.assert_allclose(stats.mean_, q.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(stats.covariance_, np.cov(q, rowvar=False), rtol=1e-9, atol=1e-9)

    # Histograms are exact: binning uses the raw values.
    expected, _ = np.histogram(table[:, 8], bins=AGE_EDGES)
    np.testing.assert_array_equal(ages.counts_, expected)
    np.testing.assert_array_equal(ages.raw_counts_, expected)
    for c, label in enumerate([-1.0, 1.0]):
        rows = table[table[:, 0] == label]
        cells, _, _ = np.histogram2d(rows[:, 6], rows[:, 2], bins=[BMI_EDGES, GLUCOSE_EDGES])
        np.testing.assert_array_equal(joint.counts_[c], cells)

    # Regression: scikit-learn's on the values owners sum, to float precision ...
    features, target = table[:, FEATURES], table[:, TARGET]
    exact = LinearRegression().fit(
        _quantised(features, FEATURE_BOUNDS), _quantised(target[:, None], [TARGET_BOUNDS])[:, 0]
    )
    np.testing.assert_allclose(regression.coef_, exact.coef_, rtol=1e-8, atol=1e-10)
    assert regression.intercept_ == pytest.approx(exact.intercept_, rel=1e-8)
    assert regression.alpha_ == 0.0
    # ... and on the raw rows to within the quantisation (measured: R² to 4e-7).
    reference = LinearRegression().fit(features, target)
    assert regression.score(features, target) == pytest.approx(
        reference.score(features, target), abs=1e-5
    )
    np.testing.assert_allclose(regression.predict(features), reference.predict(features), atol=0.05)


@pytest.mark.parametrize("running", [{}], indirect=True)
def test_combined_query_is_charged_once_at_the_composed_cost(
    running: Any, analyst_keys: AnalystKeyFiles
) -> None:
    stats, ages, _, regression = _estimators()
    epsilon, delta = 1.0, 1e-6
    query = FederatedQuery(
        [stats, ages, regression],
        weights=[2.0, 1.0, 1.0],
        epsilon=epsilon,
        delta=delta,
        **_connection(running, analyst_keys),
    ).fit()
    release = query.release_
    plan = release.plan
    z = plan.noise_multiplier
    # The release is one Gaussian mechanism whose noise multiplier is the target's ...
    assert z == pytest.approx(zcdp_noise_multiplier(epsilon, delta), rel=1e-9)
    # ... and which covers the worst change of the relation (add/remove: the larger of
    # an added record and a capped owner's swap), section by section, as derived in
    # docs/privacy.md from the bounds of each statistic (d columns each):
    d_stats, d_reg = len(STATS_COLUMNS), len(FEATURES)
    bounds = {  # section -> (add, swap)
        "0.count": (1, 0),
        "0.sums": (math.sqrt(d_stats), 2 * math.sqrt(d_stats)),
        "0.products": (math.sqrt(d_stats * (d_stats + 1) / 2), math.sqrt(d_stats**2 + d_stats / 2)),
        "1.counts": (1, math.sqrt(2)),
        "2.count": (1, 0),
        "2.x_sums": (math.sqrt(d_reg), 2 * math.sqrt(d_reg)),
        "2.y_sum": (1, 2),
        "2.xtx": (math.sqrt(d_reg * (d_reg + 1) / 2), math.sqrt(d_reg**2 + d_reg / 2)),
        "2.xty": (math.sqrt(d_reg), 2 * math.sqrt(d_reg)),
    }
    sigmas = release.sigmas
    assert set(sigmas) == set(bounds)
    add = sum((a / sigmas[name]) ** 2 for name, (a, _) in bounds.items())
    swap = sum((b / sigmas[name]) ** 2 for name, (_, b) in bounds.items())
    assert 1 / math.sqrt(max(add, swap)) == pytest.approx(z, rel=1e-9)
    # The weights split the budget: the statistics got twice the histogram's share.
    share = {name: (max(bounds[name]) / sigmas[name]) ** 2 for name in bounds}
    stats_share = sum(v for k, v in share.items() if k.startswith("0."))
    assert stats_share == pytest.approx(2 * share["1.counts"], rel=1e-9)

    # One event of that cost in the proxy's ledger and in every owner's.
    key = f"alice/{query.query_id_}"
    proxy_events = running.proxy.coordinator.store.releases("alice")
    assert len(proxy_events) == 1
    assert proxy_events[0]["noise_multiplier"] == pytest.approx(z, rel=1e-12)
    for owner_id, node in running.nodes.items():
        entries = node.ledger.events()
        assert [e.event.query_id for e in entries] == [key], owner_id
        assert entries[0].event.noise_multiplier == pytest.approx(z, rel=1e-12)
        assert entries[0].event.epsilon == epsilon and entries[0].event.delta == delta
    # Every estimator was fitted from that one release.
    assert {e.query_id_ for e in (stats, ages, regression)} == {query.query_id_}
    assert ages.counts_.min() >= 0 and ages.clamped_
    # One strict-JSON document for the release, one entry per aggregate.
    document = json.loads(json.dumps(aggregate_document(query), allow_nan=False))
    assert [part["aggregate"] for part in document["aggregates"]] == [
        "stats",
        "histogram",
        "linreg",
    ]
    assert document["noise_multiplier"] == pytest.approx(z)
    assert document["epsilon"] == epsilon and document["not_private"] is False
    assert document["aggregates"][1]["postprocessing"] == "negative counts clamped to 0"
    # The analyst's listing names the aggregates (it said "aggregate" for every one).
    with running.analyst() as client:
        listed = {item.status.query_id: item for item in client.list_queries(10)}
    assert listed[query.query_id_].what == "aggregate:stats+histogram+linreg"


def test_cli_combined_runs_the_aggregates_of_a_file_in_one_release(
    running: Any, analyst_keys: AnalystKeyFiles, tmp_path: Path
) -> None:
    """From the command line, several aggregates cost one release (each of stats,
    histogram and linreg was a release of its own), split by the file's weights."""
    files = running.tls(Role.ANALYST, "alice")
    spec = tmp_path / "aggregates.toml"
    spec.write_text(
        """
[[aggregate]]
kind = "stats"
weight = 2
columns = [1, 2]
bounds = "0:17,0:200"
moments = "variance"

[[aggregate]]
kind = "histogram"
columns = [8]
bins = [[20, 30, 40, 50, 60, 70, 90]]
"""
        + LINREG_AGGREGATE
    )
    out = tmp_path / "combined.json"
    result = CliRunner().invoke(
        analyst_group,
        [
            *("combined", str(spec)),
            *("--proxy", running.proxy.address, "--ca", str(files.ca_certificate)),
            *("--cert", str(files.certificate), "--key", str(files.private_key)),
            *("--key-dir", str(analyst_keys.directory), "--epsilon", "1", "--delta", "1e-6"),
            *("--max-records-per-owner", "1000", "--max-owners", "4", "--workers", "1"),
            *("--out", str(out)),
        ],
    )
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    parts = document["aggregates"]
    assert [p["aggregate"] for p in parts] == ["stats", "histogram", "linreg"]
    assert parts[0]["columns"] == [1, 2] and parts[2]["target_column"] == 2
    # One charge: one event in the proxy's ledger and in every owner's.
    assert len(running.proxy.coordinator.store.releases("alice")) == 1
    for node in running.nodes.values():
        assert [e.event.query_id for e in node.ledger.events()] == [f"alice/{document['query_id']}"]
    # The weights split the budget: the statistics got twice the histogram's share.
    sigma = document["noise_sigma"]
    worst = {  # section -> the larger of its add and swap changes (2 columns)
        "0.count": 1.0,
        "0.sums": 2 * math.sqrt(2),
        "0.squares": math.sqrt(2),
        "1.counts": math.sqrt(2),
    }
    share = {name: (change / sigma[name]) ** 2 for name, change in worst.items()}
    stats_share = share["0.count"] + share["0.sums"] + share["0.squares"]
    assert stats_share == pytest.approx(2 * share["1.counts"], rel=1e-9)
    lines = result.stdout.splitlines()
    assert "aggregates:  stats, histogram, linreg" in lines
    assert "--- histogram of columns 8" in lines and "--- linreg of columns 6,8" in lines
    assert lines[-2:] == ["release: (1, 1e-06)-DP", str(out)]


@pytest.mark.parametrize(
    "running",
    [{"policy": {"allowed_kinds": (QueryKind.PCA, QueryKind.DCA), "max_epsilon_per_query": 10}}],
    indirect=True,
)
def test_owners_decline_forbidden_kinds_with_a_public_reason(
    running: Any,
    analyst_keys: AnalystKeyFiles,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    statuses: list[Any] = []
    # Quorum 1: the query fails only once every owner has declined, so all are seen.
    connection = {**_connection(running, analyst_keys), "quorum": 1}
    histogram = FederatedHistogram(
        8, bins=AGE_EDGES, on_status=statuses.append, epsilon=1.0, **connection
    )
    reason = "histogram queries are not in policy.allowed_kinds (pca, dca)"
    # The owners' stated terms refuse it before it is submitted, with their reason.
    with pytest.raises(OwnersWouldDeclineError, match="nothing was submitted"):
        histogram.fit()
    assert statuses == []
    for owner in OWNERS:
        assert f"owner {owner} states terms this query does not meet: {reason}" in caplog.text
    caplog.clear()
    # An analyst that does not judge the terms (a fedpca older than them, or a proxy
    # that misstated them): each owner declines the signed query itself, alike.
    monkeypatch.setattr(querying, "check_owner_terms", lambda *args: {})
    with pytest.raises(QueryStateError):
        histogram.fit()
    declines = statuses[-1].declines
    assert {d.owner_id for d in declines} == set(OWNERS)
    for decline in declines:
        assert decline.reason == DeclineReason.POLICY_REFUSAL
        assert decline.detail == reason
    # Without a progress display each decline is logged, once per owner.
    logged = [r.getMessage() for r in caplog.records if "owner declined" in r.getMessage()]
    assert sorted(logged) == sorted(
        f"query {statuses[-1].query_id}: owner declined: {d.line()}" for d in declines
    )
    # Nothing was spent anywhere.
    for node in running.nodes.values():
        assert node.ledger.events() == []


@pytest.mark.parametrize("running", [{"policy": {"allowed_columns": (0, 1, 2, 8)}}], indirect=True)
def test_owners_decline_columns_their_policy_does_not_allow(
    running: Any, analyst_keys: AnalystKeyFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    statuses: list[Any] = []
    connection = {**_connection(running, analyst_keys), "quorum": 1}
    stats = FederatedStatistics(
        [2, 6], bounds=[(0, 200), (0, 70)], on_status=statuses.append, epsilon=1.0, **connection
    )
    reason = (
        "the query reads column 6 (0-based), which is not in policy.allowed_columns (0, 1, 2, 8)"
    )
    with pytest.raises(OwnersWouldDeclineError, match="3 of the 3 connected owners"):
        stats.fit()  # by the terms they stated: nothing submitted
    assert statuses == []
    # Submitted without judging the terms, the owners decline it themselves, alike.
    monkeypatch.setattr(querying, "check_owner_terms", lambda *args: {})
    with pytest.raises(QueryStateError):
        stats.fit()
    details = {d.detail for d in statuses[-1].declines}
    assert details == {reason}
    # Allowed columns are served.
    allowed = FederatedStatistics(
        [2, 8],
        bounds=[(0, 200), (20, 90)],
        moments="mean",
        epsilon=1.0,
        **_connection(running, analyst_keys),
    ).fit()
    assert allowed.mean_.shape == (2,) and allowed.covariance_ is None


@pytest.mark.parametrize("running", [{"not_private": True}], indirect=True)
def test_a_result_of_fewer_owners_than_registered_warns(
    running: Any, analyst_keys: AnalystKeyFiles, tmp_path: Path
) -> None:
    running.stop_owner("owner-3")
    connection = {**_connection(running, analyst_keys), "quorum": 2}
    stats = FederatedStatistics([8], bounds=[(20, 90)], moments="mean", epsilon=math.inf)
    stats.set_params(**connection)
    with pytest.warns(MissingOwnersWarning, match="only 2 of 3 registered owners"):
        stats.fit()
    assert (stats.n_owners_, stats.n_owners_registered_, stats.quorum_) == (2, 3, 2)
    document = json.loads(write_aggregate_result(tmp_path / "stats.json", stats).read_text())
    assert document["quorum"] == 2
    assert document["owners"] == {
        "contributed": 2,
        "registered": 3,
        "quorum": 2,
        "all_registered": False,
        "summary": "2 of 3 registered",
    }


def test_cli_histogram_total_is_the_sum_of_the_noisy_counts_not_of_the_clamped_ones(
    running: Any, analyst_keys: AnalystKeyFiles, table: np.ndarray, tmp_path: Path
) -> None:
    """Many near-empty bins at a small epsilon: the clamped counts are mostly clamped
    noise (a reviewer's 768 records printed "total count: 3567392"); the total printed is
    the sum of the noisy counts as released, whose noise has mean 0, and says so."""
    files = running.tls(Role.ANALYST, "alice")
    out = tmp_path / "ages.json"
    edges = ",".join(str(edge) for edge in np.arange(20.0, 90.5, 0.5))  # 140 bins
    result = CliRunner().invoke(
        analyst_group,
        [
            *("histogram", "--columns", "8", "--bins", edges),
            *("--proxy", running.proxy.address, "--ca", str(files.ca_certificate)),
            *("--cert", str(files.certificate), "--key", str(files.private_key)),
            *("--key-dir", str(analyst_keys.directory), "--epsilon", "0.1", "--delta", "1e-6"),
            *("--max-records-per-owner", "1000", "--max-owners", "4", "--workers", "1"),
            *("--out", str(out)),
        ],
    )
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    raw, clamped = np.array(document["raw_counts"]), np.array(document["counts"])
    assert raw.size == 140 and clamped.sum() > raw.sum()  # clamping only ever adds
    sigma = document["noise_sigma"]["counts"] * math.sqrt(raw.size)
    assert (
        f"total count: {raw.sum():.0f} (noisy: the sum of the 140 counts, negative ones "
        f"included, noise sd {sigma:.3g})\n" in result.stdout
    )
    each = document["noise_sigma"]["counts"]
    assert f"noise sd:    {each:.3g} in each count (the privacy noise's)\n" in result.stdout
    assert abs(raw.sum() - len(table)) < 6 * sigma


def test_cli_prints_the_noise_sd_of_each_estimate(
    running: Any, analyst_keys: AnalystKeyFiles, table: np.ndarray, tmp_path: Path
) -> None:
    """A new analyst could not tell a noisy mean's digits from its noise: under each
    mean and variance is its noise sd, the first-order spread the release's own sigmas
    give it (recomputed here from the document's numbers), under each coefficient its
    bootstrap spread, and result.json has them."""
    files = running.tls(Role.ANALYST, "alice")
    out = tmp_path / "stats.json"
    common = [
        *("--proxy", running.proxy.address, "--ca", str(files.ca_certificate)),
        *("--cert", str(files.certificate), "--key", str(files.private_key)),
        *("--key-dir", str(analyst_keys.directory), "--epsilon", "1", "--delta", "1e-6"),
        *("--max-records-per-owner", "1000", "--max-owners", "4", "--workers", "1"),
    ]
    result = CliRunner().invoke(
        analyst_group,
        [
            *("stats", "--columns", "1,2", "--bounds", "0:17,0:200", "--moments", "variance"),
            *common,
            *("--out", str(out)),
        ],
    )
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    sigma = document["noise_sigma"]
    n, scale = document["n_samples"], np.array([8.5, 100.0])
    mean_u = (np.array(document["mean"]) - scale) / scale
    expected = scale * np.sqrt(sigma["sums"] ** 2 + mean_u**2 * sigma["count"] ** 2) / n
    np.testing.assert_allclose(document["mean_noise_sd"], expected, rtol=1e-9)
    assert document["n_samples_noise_sd"] == sigma["count"] > 0
    assert document["n_samples_noisy"] is True
    lines = result.stdout.splitlines()
    assert f"records N:   {n:.1f} (noisy, noise sd {sigma['count']:.3g})" in lines
    at = lines.index("mean          " + "".join(f"{v:>13.6g}" for v in document["mean"]))
    assert lines[at + 1] == "  noise sd    " + "".join(f"{v:>13.3g}" for v in expected)
    at = lines.index("variance      " + "".join(f"{v:>13.6g}" for v in document["variance"]))
    spread = document["variance_noise_sd"]
    assert lines[at + 1] == "  noise sd    " + "".join(f"{v:>13.3g}" for v in spread)
    # The exact means are within a few noise sds of the noisy ones.
    x = table[:, [1, 2]]
    assert np.all(np.abs(np.array(document["mean"]) - x.mean(axis=0)) < 6 * expected)

    # A regression's coefficients and intercept get theirs from simulated releases.
    result = CliRunner().invoke(
        analyst_group,
        [
            *("linreg", "--columns", "6,8", "--bounds", "0:70,20:90"),
            *("--target", "2", "--target-bounds", "0:200"),
            *common,
            *("--out", str(tmp_path / "model.json")),
        ],
    )
    assert result.exit_code == 0, result.output
    model = json.loads((tmp_path / "model.json").read_text())
    assert model["noise_sd_draws"] == 200 and np.all(np.array(model["coef_noise_sd"]) > 0)
    lines = result.stdout.splitlines()
    at = lines.index(" " * 14 + "".join(f"{v:>13.6g}" for v in model["coef"]))
    assert lines[at + 1] == "  noise sd    " + "".join(
        f"{v:>13.3g}" for v in model["coef_noise_sd"]
    )
    intercept = (
        f"intercept:   {model['intercept']:.6g} (noise sd {model['intercept_noise_sd']:.3g})"
    )
    assert intercept in lines
    assert any(line.startswith("noise sd:") and "200 simulated releases" in line for line in lines)
    # Its N too, with the count section's noise sd (printed nowhere before).
    assert model["n_samples_noise_sd"] == model["noise_sigma"]["count"] > 0
    assert model["n_samples_noisy"] is True
    n_sd = model["n_samples_noise_sd"]
    assert f"records N:   {model['n_samples']:.1f} (noisy, noise sd {n_sd:.3g})" in lines


@pytest.mark.parametrize("running", [{"not_private": True}], indirect=True)
def test_cli_commands_write_strict_json(
    running: Any,
    analyst_keys: AnalystKeyFiles,
    table: np.ndarray,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    files = running.tls(Role.ANALYST, "alice")
    common = [
        *("--proxy", running.proxy.address, "--ca", str(files.ca_certificate)),
        *("--cert", str(files.certificate), "--key", str(files.private_key)),
        *("--key-dir", str(analyst_keys.directory), "--epsilon", "inf"),
        *("--max-records-per-owner", "1000", "--max-owners", "4", "--workers", "1"),
    ]

    printed: dict[str, str] = {}

    def run(*args: str) -> dict[str, Any]:
        out = tmp_path / f"{args[0]}.json"
        result = CliRunner().invoke(analyst_group, [*args, *common, "--out", str(out)])
        assert result.exit_code == 0, result.output
        printed[args[0]] = result.stdout
        assert "NOT PRIVATE" in result.output
        if args[0] in ("stats", "linreg"):  # the count is exact here, and says so
            assert f"records N:   {len(table)} (exact: NOT PRIVATE)" in result.stdout
            assert "noise sd" not in result.stdout
        assert result.stdout.strip().splitlines()[-1] == str(out)
        document: dict[str, Any] = json.loads(out.read_text())
        assert document["epsilon"] is None and document["not_private"] is True
        assert document["kind"] == "aggregate" and document["n_owners"] == len(OWNERS)
        # No --quorum: the query waited for every registered owner and says so.
        assert f"quorum {len(OWNERS)} of {len(OWNERS)} registered owners" in result.stderr
        assert "owners:      3 of 3 registered (quorum 3)" in result.stdout
        assert document["quorum"] == len(OWNERS)
        assert document["owners"]["summary"] == "3 of 3 registered"
        return document

    stats = run("stats", "--columns", "1,2", "--bounds", "0:17,0:200", "--moments", "variance")
    x = table[:, [1, 2]]
    assert stats["aggregate"] == "stats" and stats["n_samples"] == len(table)
    _within(np.array(stats["mean"]), x.mean(axis=0), np.array([8.5, 100.0]) * STEP)
    _within(np.array(stats["variance"]), x.var(axis=0), 4 * np.array([8.5, 100.0]) ** 2 * STEP)
    assert stats["covariance"] is None and stats["postprocessing"].startswith("clipped")

    # The summary prints every number computed, labelled by column (an analyst's
    # walkthrough found only N, the means and the variances, unlabelled).
    lines = printed["stats"].splitlines()
    assert "column        " + f"{'col 1':>13}{'col 2':>13}" in lines
    for name, values in (("mean", stats["mean"]), ("variance", stats["variance"])):
        assert f"{name} ".ljust(14) + "".join(f"{v:>13.6g}" for v in values) in lines
    covariance = run("stats", "--columns", "1,2", "--bounds", "0:17,0:200", "--ddof", "1")
    for name in ("covariance", "correlation"):
        at = printed["stats"].splitlines().index(f"{name}:")
        rows = printed["stats"].splitlines()[at + 2 : at + 4]
        for row, label, values in zip(rows, ("col 1", "col 2"), covariance[name], strict=True):
            assert row == f"  {label}".ljust(14) + "".join(f"{v:>13.6g}" for v in values)
    _within(
        np.array(covariance["covariance"]),
        np.cov(x, rowvar=False),
        4 * np.outer([8.5, 100.0], [8.5, 100.0]) * STEP,
    )

    histogram = run("histogram", "--columns", "8", "--bins", ",".join(map(str, AGE_EDGES)))
    expected, _ = np.histogram(table[:, 8], bins=AGE_EDGES)
    assert histogram["counts"] == expected.tolist() == histogram["raw_counts"]
    labels = [f"[{lo:.6g}, {hi:.6g})" for lo, hi in itertools.pairwise(AGE_EDGES)]
    # The outer bins also count the values beyond the outer edges.
    labels[0], labels[-1] = f"(-inf, {AGE_EDGES[1]:g})", f"[{AGE_EDGES[-2]:g}, inf)"
    for label, count in zip(labels, expected, strict=True):
        assert f"  {label:<22}{count}" in printed["histogram"].splitlines()
    assert "clamped" not in printed["histogram"]  # nothing negative to clamp
    assert "noise sd" not in printed["histogram"]

    model = run(
        *("linreg", "--columns", "6,8", "--bounds", "0:70,20:90"),
        *("--target", "2", "--target-bounds", "0:200"),
    )
    reference = LinearRegression().fit(
        _quantised(table[:, [6, 8]], [(0.0, 70.0), (20.0, 90.0)]),
        _quantised(table[:, [2]], [TARGET_BOUNDS])[:, 0],
    )
    np.testing.assert_allclose(model["coef"], reference.coef_, rtol=1e-8)
    assert model["intercept"] == pytest.approx(reference.intercept_, rel=1e-8)
    assert model["alpha"] == 0.0 and model["alpha_rule"].startswith("auto")
    summary = printed["linreg"].splitlines()
    at = summary.index("coefficient   " + f"{'col 6':>13}{'col 8':>13}")
    assert summary[at + 1] == " " * 14 + "".join(f"{v:>13.6g}" for v in model["coef"])
    assert "target:      col 2" in summary
    assert "noise sd" not in printed["linreg"] and model["noise_sd_draws"] == 0

    # The stored release read back by id: the same document, bar timings and time.
    monkeypatch.setattr(
        keys_module,
        "load_analyst_private_key",
        lambda path: load_analyst_private_key(path, allow_insecure_test_key=True),
    )
    fetched_path = tmp_path / "fetched.json"
    fetched = CliRunner().invoke(
        analyst_group,
        [
            *("fetch", model["query_id"], *common[:8], *common[8:10]),
            *("--workers", "1", "--out", str(fetched_path)),
        ],
    )
    assert fetched.exit_code == 0, fetched.output
    assert "owners:      3 of 3 registered (quorum 3)" in fetched.stdout
    again = json.loads(fetched_path.read_text())
    volatile = {"created_at", "timings"}
    assert {k: v for k, v in again.items() if k not in volatile} == {
        k: v for k, v in model.items() if k not in volatile
    }
    assert "--- linreg of columns 6,8" in fetched.stdout
    assert summary[at + 1] in fetched.stdout.splitlines()

    # A fetch given the query's own post-processing options rebuilds its result (it
    # could not: the stats of a --ddof 1 query came back with ddof 0).
    refetched = CliRunner().invoke(
        analyst_group,
        [
            *("fetch", covariance["query_id"], *common[:8], *common[8:10]),
            *("--workers", "1", "--ddof", "1", "--out", str(fetched_path)),
        ],
    )
    assert refetched.exit_code == 0, refetched.output
    again = json.loads(fetched_path.read_text())
    assert {k: v for k, v in again.items() if k not in volatile} == {
        k: v for k, v in covariance.items() if k not in volatile
    }
    assert "--- stats of columns 1,2" in refetched.stdout
    assert "covariance:" in refetched.stdout
