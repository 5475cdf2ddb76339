"""Utility of the aggregate queries: federated against centralised DP at equal (epsilon, delta).

For epsilon in {0.1, 0.3, 1, 3} (delta = 1e-5, zCDP calibration) and three settings
(replace-one; add/remove, where owners at their public cap sample, so the noise covers a
swapped record; add/remove over bounded owner tables, whose owners enforce their capacity
and never sample), each query is answered

* ``fed`` — federated: the rows split over four owners, each owner's exact integer
  statistics computed by the owner code (``fedpca.owner.compute.encode_share``: public
  bounds, clipping, the 2^-16 grid, padding), summed, and noised with the plan's discrete
  Gaussian noise (``ReleasePlan.noise_values``, the production exact sampler), then decoded and
  post-processed by the analyst code (``FederatedStatistics.from_result`` …).
  Encryption is left out: packed Paillier adds these integers exactly (the codec tests
  and the slow tier check it), so it cannot change utility;
* ``central`` — a trusted curator with all rows: the same statistics in floating point,
  continuous Gaussian noise from the same allocation (``fedpca.dp.allocation``) with the
  same noise multiplier and budget split, but only the changes a curator without a
  record cap must cover: an added record under add/remove (owners at their public cap
  must also cover a swapped one, unless their tables are bounded), a replaced record
  under replace-one (where the count is public: released exactly, its share of the
  budget given to the other sections);
* ``diffprivlib`` (regression only, if installed: ``pip install -e .[bench]``) — its
  LinearRegression at (epsilon, 0), a pure-epsilon central baseline.

Queries: means and covariance (relative error in Frobenius/L2 norm against the pooled
data) and histograms (L1 error of the clamped counts against the true counts) on
ionosphere (public bounds [-1, 1]) and madelon (public bounds [0, 999]); a linear
regression on the Pima diabetes data (target: plasma glucose in [0, 200], the other
eight columns as features with public domain bounds, written out below and not taken
from the data), scored by R² on a held-out 30 %.

Usage::

    python benchmarks/aggregation_utility.py [--trials 20] [--regression-trials 100] \\
        [--plot docs/aggregation_utility.png]

Prints three tables (errors: mean over trials ± its standard error; R²: median and
quartiles, because a noisy model's R² has outliers of any size) and, last, the summary
``fed_over_central_replace_one=… fed_over_central_add_remove=…
fed_over_central_add_remove_bounded=… r2_fed=… r2_fed_bounded=… r2_central=…
r2_diffprivlib=… r2_nonprivate=…``: error ratios are means over every (query, epsilon);
the R² values are medians at epsilon = 3 under add/remove.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from sklearn.linear_model import LinearRegression
from sklearn.model_selection import train_test_split

from fedpca.aggregates import histogram_cells, part_sections, split_parts
from fedpca.analyst.aggregate_estimators import aggregate_query
from fedpca.analyst.decode import DecodedRelease
from fedpca.analyst.regression import FederatedLinearRegression
from fedpca.analyst.statistics import FederatedHistogram, FederatedStatistics
from fedpca.app.cluster import split_rows
from fedpca.data import dataset_path
from fedpca.dp.allocation import allocate_noise, normalise_weights
from fedpca.dp.noise import DiscreteGaussianSampler
from fedpca.owner.compute import encode_share
from fedpca.owner.local_table import LocalTable
from fedpca.protocol import ReleasePlan
from fedpca.query import Aggregate, AggregateKind, Neighbouring, QuerySpec

EPSILONS = (0.1, 0.3, 1.0, 3.0)
DELTA = 1e-5
OWNERS = 4


@dataclass(frozen=True)
class Setting:
    """A neighbouring relation, and whether the owners' tables are bounded by their cap."""

    label: str
    relation: Neighbouring
    bounded: bool = False


SETTINGS = (
    Setting("replace-one", Neighbouring.REPLACE_ONE),
    Setting("add-remove", Neighbouring.ADD_REMOVE),
    Setting("bounded", Neighbouring.ADD_REMOVE, bounded=True),
)

# Pima diabetes (file columns): 0 outcome, 1 pregnancies, 2 glucose, 3 blood pressure,
# 4 skin thickness, 5 insulin, 6 BMI, 7 pedigree, 8 age. Public domain bounds.
REGRESSION = Aggregate.linear_regression(
    (0, 1, 3, 4, 5, 6, 7, 8),
    (-1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 20.0),
    (1.0, 20.0, 130.0, 100.0, 900.0, 70.0, 2.5, 90.0),
    2,
    0.0,
    200.0,
)


class _Key:
    """The plan only needs the key size; every figure here is for a 2048-bit key."""

    n = (1 << 2047) + 1


def _table(name: str) -> np.ndarray:
    return np.loadtxt(dataset_path(name), delimiter=",")


@dataclass
class Query:
    """One aggregate over one dataset, and how to score a fitted estimator."""

    dataset: str
    label: str
    estimator: Any
    score: Callable[[Any], float]


def _spec(part: Aggregate, epsilon: float, setting: Setting) -> QuerySpec:
    return aggregate_query(
        [part],
        _Key(),
        epsilon=epsilon,
        delta=DELTA,
        neighbouring=setting.relation.value,
        bounded_owner_tables=setting.bounded,
        max_records_per_owner=4096,
        max_owners=16,
        query_id="bench",
    )


def _release(spec: QuerySpec, sections: dict[str, np.ndarray], sigmas: dict[str, float]) -> Any:
    plan = ReleasePlan.for_query(spec, 2048)
    return DecodedRelease(
        query=spec,
        plan=plan,
        n_owners=OWNERS,
        key_fingerprint="sha256:benchmark",
        values=None,
        centred_scatter=None,
        public_count=None,
        sigmas=sigmas,
        aggregates=tuple(split_parts(spec.aggregates, sections)),
    )


def float_sections(part: Aggregate, rows: np.ndarray) -> dict[str, np.ndarray]:
    """A curator's exact statistics in floating point (no grid), by released name."""
    names = [f"0.{s.name}" for s in part_sections(part)]
    if part.kind is AggregateKind.HISTOGRAM:
        group = None if part.group_column is None else rows[:, part.group_column]
        cells = histogram_cells(part, rows[:, list(part.columns)], group)
        counts = np.bincount(cells[cells >= 0], minlength=part.n_cells).astype(float)
        return {names[0]: counts}
    lo, hi = np.array(part.lower), np.array(part.upper)
    u = 2 * (np.clip(rows[:, list(part.columns)], lo, hi) - lo) / (hi - lo) - 1
    count = np.array([float(len(rows))])
    if part.kind is AggregateKind.STATS:
        upper = np.triu_indices(u.shape[1])
        return dict(zip(names, [count, u.sum(axis=0), (u.T @ u)[upper]], strict=True))
    assert part.target_column is not None and part.target_lower is not None
    assert part.target_upper is not None
    target = np.clip(rows[:, part.target_column], part.target_lower, part.target_upper)
    v = 2 * (target - part.target_lower) / (part.target_upper - part.target_lower) - 1
    d = u.shape[1]
    values = [count, u.sum(axis=0), np.array([v.sum()]), (u.T @ u)[np.triu_indices(d)], u.T @ v]
    return dict(zip(names, values, strict=True))


class Runner:
    """Answers one query both ways, trial after trial."""

    def __init__(self, part: Aggregate, rows: np.ndarray, rng: np.random.Generator) -> None:
        self.part = part
        self.rng = rng
        self.sampler = DiscreteGaussianSampler()
        parts = split_rows(len(rows), OWNERS, seed=7)
        self.owner_rows = [rows[p] for p in parts]
        self.exact = float_sections(part, rows)
        self._integers: dict[Neighbouring, np.ndarray] = {}

    def federated(self, spec: QuerySpec) -> Any:
        plan = ReleasePlan.for_query(spec, 2048)
        if spec.neighbouring not in self._integers:
            # The owners' shares do not depend on epsilon: encode them once per layout.
            self._integers[spec.neighbouring] = sum(
                encode_share(
                    spec, LocalTable(r, None, "bench").table_for(spec), plan, capacity=4096
                )["shares"]
                for r in self.owner_rows
            )
        noisy = self._integers[spec.neighbouring] + plan.noise_values(self.sampler)
        sigmas = {s.name: s.sigma for s in plan.sections}
        return _release(spec, plan.section_values(noisy), sigmas)

    def central(self, spec: QuerySpec) -> Any:
        plan = ReleasePlan.for_query(spec, 2048)
        sections = plan.statistics.sections
        omegas = normalise_weights(list(spec.noise_weights) or [1.0] * len(sections))
        if spec.neighbouring is Neighbouring.ADD_REMOVE:
            changes = [s.l2_sensitivity for s in sections]
        else:
            changes = [s.swap_sensitivity or 0.0 for s in sections]
        # A section no change can move (a count under replace-one) is released exactly
        # and its share goes to the others.
        shares = [w if c > 0 else 0.0 for w, c in zip(omegas, changes, strict=True)]
        sigmas = allocate_noise(changes, shares, plan.noise_multiplier)
        noisy = {
            s.name: self.exact[s.name] + self.rng.normal(0.0, sigma, s.length)
            for s, sigma in zip(sections, sigmas, strict=True)
        }
        return _release(spec, noisy, dict(zip([s.name for s in sections], sigmas, strict=True)))


def _plotted(setting: Setting) -> tuple[tuple[str, str], ...]:
    """The curves a setting adds to the plot: a bounded setting's central curve would
    repeat the add/remove one (the same curator, the same noise)."""
    if setting.bounded:
        return (("f", "fed"),)
    return (("f", "fed"), ("c", "central"))


def _mean_se(values: Sequence[float]) -> tuple[float, float]:
    array = np.asarray(values, dtype=np.float64)
    return float(array.mean()), float(array.std(ddof=1) / math.sqrt(len(array)))


def _cell(values: Sequence[float]) -> str:
    mean, se = _mean_se(values)
    return f"{mean:.4g} ± {se:.2g}"


def _quartiles(values: Sequence[float]) -> str:
    """Median [25 %, 75 %]: R² of a noisy model has outliers of any size."""
    low, median, high = np.percentile(np.asarray(values, dtype=np.float64), [25, 50, 75])
    return f"{median:.3f} [{low:.3g}, {high:.3g}]"


def descriptive_queries() -> list[tuple[str, Aggregate, np.ndarray]]:
    ionosphere = _table("ionosphere")
    madelon = _table("madelon")
    return [
        ("ionosphere", Aggregate.statistics(range(3, 11), (-1.0,) * 8, (1.0,) * 8), ionosphere),
        ("madelon", Aggregate.statistics(range(1, 11), (0.0,) * 10, (999.0,) * 10), madelon),
    ]


def histogram_queries() -> list[tuple[str, Aggregate, np.ndarray]]:
    ionosphere = _table("ionosphere")
    madelon = _table("madelon")
    return [
        (
            "ionosphere",
            Aggregate.histogram((5,), (tuple(np.linspace(-1, 1, 21)),), 0, (-1.0, 1.0)),
            ionosphere,
        ),
        (
            "madelon",
            Aggregate.histogram(
                (1, 2), (tuple(np.linspace(0, 999, 11)), tuple(np.linspace(0, 999, 11)))
            ),
            madelon,
        ),
    ]


def _relative(estimate: np.ndarray, truth: np.ndarray) -> float:
    return float(np.linalg.norm(estimate - truth) / np.linalg.norm(truth))


def run(trials: int, regression_trials: int, plot: str | None) -> None:
    rng = np.random.default_rng(2026)
    ratios: dict[str, list[float]] = {s.label: [] for s in SETTINGS}
    curves: dict[str, dict[str, list[float]]] = {}

    def record(key: str, series: str, value: float) -> None:
        curves.setdefault(key, {}).setdefault(series, []).append(value)

    print("Means and covariance: relative error (L2 of the means, Frobenius of the covariance)")
    header = f"{'dataset':<11}{'setting':<13}{'epsilon':>8}"
    header += f"{'mean fed':>20}{'mean central':>20}{'cov fed':>20}{'cov central':>20}"
    print(header)
    for name, part, rows in descriptive_queries():
        x = rows[:, list(part.columns)]
        truth_mean, truth_cov = x.mean(axis=0), np.cov(x, rowvar=False, ddof=0)
        runner = Runner(part, rows, rng)
        for setting in SETTINGS:
            for epsilon in EPSILONS:
                spec = _spec(part, epsilon, setting)
                errors: dict[str, list[float]] = {k: [] for k in ("mf", "mc", "cf", "cc")}
                for _ in range(trials):
                    for way, release in (
                        ("f", runner.federated(spec)),
                        ("c", runner.central(spec)),
                    ):
                        fitted = FederatedStatistics.from_result(release)
                        errors["m" + way].append(_relative(fitted.mean_, truth_mean))
                        errors["c" + way].append(_relative(fitted.covariance_, truth_cov))
                print(
                    f"{name:<11}{setting.label:<13}{epsilon:>8g}{_cell(errors['mf']):>20}"
                    f"{_cell(errors['mc']):>20}{_cell(errors['cf']):>20}{_cell(errors['cc']):>20}"
                )
                ratios[setting.label] += [
                    float(np.mean(errors["mf"]) / np.mean(errors["mc"])),
                    float(np.mean(errors["cf"]) / np.mean(errors["cc"])),
                ]
                for way, series in _plotted(setting):
                    label = f"{series}, {setting.label}"
                    record(f"means, {name}", label, float(np.mean(errors["m" + way])))
                    record(f"covariance, {name}", label, float(np.mean(errors["c" + way])))

    print("\nHistograms: L1 error of the counts (clamped at 0) against the true counts")
    print(f"{'dataset':<11}{'setting':<13}{'epsilon':>8}{'cells':>7}{'fed':>20}{'central':>20}")
    for name, part, rows in histogram_queries():
        runner = Runner(part, rows, rng)
        truth = runner.exact["0.counts"]
        for setting in SETTINGS:
            for epsilon in EPSILONS:
                spec = _spec(part, epsilon, setting)
                fed, central = [], []
                for _ in range(trials):
                    for out, release in (
                        (fed, runner.federated(spec)),
                        (central, runner.central(spec)),
                    ):
                        counts = FederatedHistogram.from_result(release).counts_.reshape(-1)
                        out.append(float(np.abs(counts - truth).sum()))
                print(
                    f"{name:<11}{setting.label:<13}{epsilon:>8g}{part.n_cells:>7}"
                    f"{_cell(fed):>20}{_cell(central):>20}"
                )
                ratios[setting.label].append(float(np.mean(fed) / np.mean(central)))
                errors_by_way = {"f": fed, "c": central}
                for way, series in _plotted(setting):
                    label = f"{series}, {setting.label}"
                    record(f"histogram L1, {name}", label, float(np.mean(errors_by_way[way])))

    r2 = regression(regression_trials, rng, record)
    if plot is not None:
        _plot(curves, plot)
        print(f"\nplot: {plot}")
    summary = {
        "fed_over_central_replace_one": float(np.mean(ratios["replace-one"])),
        "fed_over_central_add_remove": float(np.mean(ratios["add-remove"])),
        "fed_over_central_add_remove_bounded": float(np.mean(ratios["bounded"])),
        **r2,
    }
    print(
        f"\nerrors: mean of {trials} trials ± standard error; R²: median of "
        f"{regression_trials} trials; delta={DELTA:g}, zcdp, {OWNERS} owners; ratios: mean "
        "federated error / mean central error over every query and epsilon"
    )
    print(" ".join(f"{k}={v:.4f}" for k, v in summary.items()))


def regression(
    trials: int, rng: np.random.Generator, record: Callable[[str, str, float], None]
) -> dict[str, float]:
    table = _table("diabetes")
    train, test = train_test_split(table, test_size=0.3, random_state=0)
    features, target = list(REGRESSION.columns), REGRESSION.target_column
    x_test, y_test = test[:, features], test[:, target]
    nonprivate = LinearRegression().fit(train[:, features], train[:, target]).score(x_test, y_test)
    try:
        from diffprivlib.models import LinearRegression as DiffprivlibLinearRegression
    except ImportError as exc:  # the bench extra is not installed, or does not import
        print(f"\n(diffprivlib unavailable: {exc}; its column is n/a)")
        DiffprivlibLinearRegression = None
    runner = Runner(REGRESSION, train, rng)
    print(
        f"\nLinear regression, diabetes (glucose ~ 8 features): held-out R², median "
        "[quartiles] "
        f"({len(train)} training rows over {OWNERS} owners, {len(test)} held out); "
        f"non-private LinearRegression: {nonprivate:.4f}"
    )
    print(
        f"{'setting':<13}{'epsilon':>8}{'fed':>26}{'central':>26}{'diffprivlib':>34}"
        f"{'alpha fed':>11}"
    )
    at_three: dict[str, float] = {}
    for setting in SETTINGS:
        for epsilon in EPSILONS:
            spec = _spec(REGRESSION, epsilon, setting)
            fed, central, dpl, alphas = [], [], [], []
            for _ in range(trials):
                model = FederatedLinearRegression.from_result(runner.federated(spec))
                fed.append(model.score(x_test, y_test))
                alphas.append(model.alpha_)
                model = FederatedLinearRegression.from_result(runner.central(spec))
                central.append(model.score(x_test, y_test))
                if DiffprivlibLinearRegression is not None and not setting.bounded:
                    baseline = DiffprivlibLinearRegression(
                        epsilon=epsilon,
                        bounds_X=(list(REGRESSION.lower), list(REGRESSION.upper)),
                        bounds_y=(REGRESSION.target_lower, REGRESSION.target_upper),
                        random_state=int(rng.integers(1 << 31)),
                    ).fit(train[:, features], train[:, target])
                    dpl.append(float(baseline.score(x_test, y_test)))
            print(
                f"{setting.label:<13}{epsilon:>8g}{_quartiles(fed):>26}{_quartiles(central):>26}"
                f"{(_quartiles(dpl) if dpl else 'n/a'):>34}{float(np.median(alphas)):>11.4g}"
            )
            title = "regression R² (median)"
            medians = {"f": float(np.median(fed)), "c": float(np.median(central))}
            for way, series in _plotted(setting):
                record(title, f"{series}, {setting.label}", medians[way])
            if setting.bounded and epsilon == 3.0:
                at_three["r2_fed_bounded"] = float(np.median(fed))
            if setting.label == "add-remove":
                record(title, "non-private", float(nonprivate))
                if dpl:
                    record(title, "diffprivlib", float(np.median(dpl)))
                if epsilon == 3.0:
                    at_three |= {
                        "r2_fed": float(np.median(fed)),
                        "r2_central": float(np.median(central)),
                        "r2_diffprivlib": float(np.median(dpl)) if dpl else math.nan,
                    }
    return {**at_three, "r2_nonprivate": float(nonprivate)}


def _plot(curves: dict[str, dict[str, list[float]]], path: str) -> None:
    # matplotlib's object API on its Agg canvas: no display, no pyplot state.
    columns = 4
    rows = -(-len(curves) // columns)
    figure = Figure(figsize=(4.0 * columns, 3.4 * rows), layout="constrained")
    axes = figure.subplots(rows, columns).reshape(-1)
    colours = {"fed": "tab:blue", "central": "tab:orange"}
    for axis, (title, series) in zip(axes, curves.items(), strict=False):
        regression = title.startswith("regression")
        for name, values in series.items():
            if name == "non-private":
                axis.axhline(values[0], color="black", linewidth=0.8, label=name)
                continue
            if name == "diffprivlib":
                # Far below -1 at every epsilon here: drawn on the lower edge.
                axis.plot(
                    EPSILONS,
                    np.maximum(values, -0.95),
                    "v:",
                    color="tab:green",
                    label="diffprivlib (below -1)",
                )
                continue
            way, label = name.split(", ")
            style = {"add-remove": "-", "bounded": ":", "replace-one": "--"}[label]
            axis.plot(
                EPSILONS,
                values,
                ("s" if label == "bounded" else "o") + style,
                color="tab:purple" if label == "bounded" else colours[way],
                label=name,
                markersize=4,
                alpha=0.7 if label == "replace-one" else 1.0,
            )
        axis.set_xscale("log")
        if regression:
            axis.set_ylim(-1.0, 0.4)
        else:
            axis.set_yscale("log")
        axis.set_xlabel("epsilon")
        axis.set_title(title, fontsize=10)
        axis.legend(fontsize=7)
    for axis in axes[len(curves) :]:
        axis.set_visible(False)
    figure.suptitle(
        f"federated vs central DP at equal (epsilon, delta = {DELTA:g}): errors are means, "
        "R² medians; solid: add/remove, dotted: add/remove over bounded owner tables "
        "(its central curve is the add/remove one), dashed: replace-one",
        fontsize=10,
    )
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument(
        "--regression-trials",
        type=int,
        default=100,
        help="trials of the regression (its R² is heavy-tailed: medians need more)",
    )
    parser.add_argument("--plot", default="aggregation_utility.png", help="PNG to write")
    args = parser.parse_args()
    if min(args.trials, args.regression_trials) < 2:
        raise SystemExit("--trials and --regression-trials must be at least 2")
    run(args.trials, args.regression_trials, args.plot)


if __name__ == "__main__":
    main()
