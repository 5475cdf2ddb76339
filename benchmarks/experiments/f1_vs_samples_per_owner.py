"""Figure 2 of the published evaluation: classification F1 against samples per owner.

The training rows of a dataset are split over owners holding ``s`` rows each (s =
samples per owner; fewer rows per owner means more owners). Each protocol computes k
principal components from the owners' rows; training and held-out rows are projected
onto them (after the query's public preprocessing: bounds, clip to ‖x‖ <= 1), an SVM
with an RBF kernel (scikit-learn ``SVC``, defaults) is trained on the projected
training rows, and its macro-averaged F1 on the held-out rows is reported.

Protocols: non-private PCA (scikit-learn on the pooled preprocessed rows; the upper
reference), PrivateLocalPCA (``fedpca.analyst.baseline``, the historical baseline with
a per-owner epsilon; NOT differentially private as published), fedpca ``stats``
(add/remove adjacency) and fedpca ``masked`` (replace-one adjacency), and a random
k-dimensional subspace (data-independent; what components that carry no information
achieve). fedpca's releases are computed with :mod:`fedpca.app.plaintext_release`: the
owners', proxy's and analyst's own code minus transport and Paillier, which are exact on
the fixed-point grid (a test shows the same numbers as a real deployment).

For each (dataset, samples per owner) the owners' split is fixed (seeded); each of the
``--runs`` runs draws the mechanisms' randomness afresh (fedpca's discrete Gaussian noise
from the production exact sampler and its mask, PrivateLocalPCA's Wishart noise, the
random subspace). Non-private PCA is deterministic: one value per dataset.

Datasets: stand-ins with the published shapes (1,080 × 857 with 9 classes, 7,797 × 617
with 26 classes; see ``reproduction.spiked_classes``), and the bundled madelon (2,000 ×
500, two classes, public bounds 0..999). 80 % of the rows train, 20 % are held out
(stratified, seeded). Usage::

    python benchmarks/experiments/f1_vs_samples_per_owner.py [--runs 10] [--epsilons 0.5]
        [--quick] [--out docs/figures]

Writes ``f1_vs_samples_per_owner.{csv,json,png}``; the last line printed reads
``fedpca_spread=<float> baseline_drop=<float>``: the largest difference between fedpca
stats' mean F1 at two sample sizes (same dataset and epsilon), and the largest drop of
PrivateLocalPCA's mean F1 from the largest to the smallest sample size.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from reproduction import (
    FIGURES,
    PLAN_KEY_BITS,
    FloatArray,
    mean_and_std,
    plot_series,
    positive_floats,
    positive_ints,
    print_table,
    provenance,
    spiked_classes,
    write_results,
)
from sklearn.decomposition import PCA
from sklearn.metrics import f1_score
from sklearn.model_selection import train_test_split
from sklearn.svm import SVC

from fedpca.analyst.baseline import private_local_pca_baseline
from fedpca.app.cluster import split_rows
from fedpca.app.plaintext_release import (
    fold_owner_shares,
    plaintext_pca_query,
    release_from_folded,
)
from fedpca.data import load_dataset
from fedpca.preprocess import FeatureBounds, preprocess
from fedpca.query import ProtocolMode
from fedpca.tables import OwnerTable

STEM = "f1_vs_samples_per_owner"
METHODS = ("non-private PCA", "PrivateLocalPCA", "fedpca stats", "fedpca masked", "random subspace")


@dataclass(frozen=True)
class Dataset:
    name: str
    load: Callable[[], tuple[FloatArray, np.ndarray]]
    bounds: tuple[float, float] | None
    samples_per_owner: tuple[int, ...]
    note: str


def _stand_in(rows: int, features: int, classes: int, seed: int) -> Callable[[], Any]:
    return lambda: spiked_classes(rows, features, classes, signal_dims=10, seed=seed)


def _bundled(name: str) -> Callable[[], Any]:
    def load() -> tuple[FloatArray, np.ndarray]:
        table = load_dataset(name)
        assert table.labels is not None
        return table.features, table.labels

    return load


DATASETS = (
    Dataset(
        "stand-in 1080x857 (9 classes)",
        _stand_in(1080, 857, 9, seed=857),
        None,
        (10, 20, 50, 100, 200, 432),
        "synthetic stand-in with the shape of the published text dataset",
    ),
    Dataset(
        "stand-in 7797x617 (26 classes)",
        _stand_in(7797, 617, 26, seed=617),
        None,
        (20, 50, 100, 200, 500, 1000),
        "synthetic stand-in with the shape of the published image/speech dataset",
    ),
    Dataset(
        "madelon 2000x500 (bundled)",
        _bundled("madelon"),
        (0.0, 999.0),
        (10, 20, 50, 100, 200, 400, 800),
        "bundled real dataset (fedpca.data), public bounds 0..999",
    ),
)
QUICK = (
    Dataset(
        "stand-in 400x40 (4 classes, --quick)",
        _stand_in(400, 40, 4, seed=40),
        None,
        (20, 80),
        "small synthetic stand-in for the CI smoke run",
    ),
)


def _f1(
    components: FloatArray,
    train: FloatArray,
    y_train: np.ndarray,
    test: FloatArray,
    y_test: np.ndarray,
) -> float:
    # The RBF kernel and gamma="scale" are translation invariant, so projecting
    # uncentred rows (masked mode and PrivateLocalPCA release no mean) loses nothing.
    model = SVC(kernel="rbf").fit(train @ components.T, y_train)
    return float(f1_score(y_test, model.predict(test @ components.T), average="macro"))


def run_dataset(
    dataset: Dataset, epsilons: list[float], delta: float, k: int, runs: int, seed: int
) -> list[dict[str, Any]]:
    features, labels = dataset.load()
    x_train, x_test, y_train, y_test = train_test_split(
        features, labels, test_size=0.2, stratify=labels, random_state=seed
    )
    m = features.shape[1]
    bounds = None
    if dataset.bounds is not None:
        bounds = FeatureBounds.from_arrays(
            np.full(m, dataset.bounds[0]), np.full(m, dataset.bounds[1])
        )
    train = preprocess(x_train, bounds, 1.0)
    test = preprocess(x_test, bounds, 1.0)
    n_train = len(train)

    def row(
        epsilon: float, spo: int, owners: int, method: str, scores: list[float]
    ) -> dict[str, Any]:
        mean, std = mean_and_std(scores)
        return {
            "dataset": dataset.name,
            "epsilon": epsilon,
            "samples_per_owner": spo,
            "owners": owners,
            "method": method,
            "f1_mean": mean,
            "f1_std": std,
            "runs": len(scores),
        }

    exact = PCA(n_components=k, svd_solver="covariance_eigh").fit(train).components_
    reference = _f1(exact, train, y_train, test, y_test)
    rng = np.random.default_rng(seed)
    random_scores = [
        _f1(np.linalg.qr(rng.normal(size=(m, k)))[0].T, train, y_train, test, y_test)
        for _ in range(runs)
    ]
    rows: list[dict[str, Any]] = []
    for epsilon in epsilons:
        for spo in dataset.samples_per_owner:
            owners = n_train // spo
            if owners < 2:
                continue
            started = time.perf_counter()
            parts = split_rows(n_train, owners, seed=seed + spo)
            folded = {
                mode: fold_owner_shares(
                    plaintext_pca_query(
                        m,
                        epsilon,
                        delta,
                        k,
                        mode,
                        bounds=dataset.bounds,
                        max_owners=max(256, owners),
                    ),
                    [OwnerTable(x_train[p], None) for p in parts],
                    key_bits=PLAN_KEY_BITS,
                )
                for mode in (ProtocolMode.STATS, ProtocolMode.MASKED)
            }
            scores: dict[str, list[float]] = {
                "PrivateLocalPCA": [],
                "fedpca stats": [],
                "fedpca masked": [],
            }
            for run in range(runs):
                baseline_rng = np.random.default_rng([seed, spo, run])
                baseline = private_local_pca_baseline(
                    [train[p] for p in parts], k, epsilon, baseline_rng
                )
                scores["PrivateLocalPCA"].append(
                    _f1(baseline.components, train, y_train, test, y_test)
                )
                for mode, method in (
                    (ProtocolMode.STATS, "fedpca stats"),
                    (ProtocolMode.MASKED, "fedpca masked"),
                ):
                    release = release_from_folded(folded[mode])
                    scores[method].append(
                        _f1(release.pca(k).components, train, y_train, test, y_test)
                    )
            rows.append(row(epsilon, spo, owners, "non-private PCA", [reference]))
            rows.extend(
                row(epsilon, spo, owners, method, values) for method, values in scores.items()
            )
            rows.append(row(epsilon, spo, owners, "random subspace", random_scores))
            print(
                f"  {dataset.name}: epsilon={epsilon:g} samples/owner={spo} owners={owners} "
                f"({time.perf_counter() - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return rows


def plot(
    rows: list[dict[str, Any]], path: Path, datasets: list[str], epsilons: list[float]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(epsilons),
        len(datasets),
        figsize=(4.6 * len(datasets), 3.6 * len(epsilons)),
        squeeze=False,
    )
    styles = {
        "non-private PCA": ("black", "-", "o"),
        "PrivateLocalPCA": ("tab:red", "-", "s"),
        "fedpca stats": ("tab:blue", "-", "^"),
        "fedpca masked": ("tab:green", "--", "v"),
        "random subspace": ("grey", ":", None),
    }
    for i, epsilon in enumerate(epsilons):
        for j, name in enumerate(datasets):
            ax = axes[i][j]
            for method in METHODS:
                points = [
                    r
                    for r in rows
                    if r["dataset"] == name and r["epsilon"] == epsilon and r["method"] == method
                ]
                if not points:
                    continue
                plot_series(
                    ax, points, "samples_per_owner", "f1_mean", "f1_std", styles[method], method
                )
            ax.set_xscale("log")
            ax.set_ylim(0.0, 1.02)
            ax.set_title(f"{name}\nε = {epsilon:g}", fontsize=9)
            ax.set_xlabel("samples per owner")
            ax.set_ylabel("macro F1 (RBF-SVM, held out)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _means(rows: list[dict[str, Any]], dataset: str, epsilon: float, method: str) -> list[float]:
    """Mean F1 of ``method`` at every sample size, in grid order."""
    return [
        r["f1_mean"]
        for r in rows
        if r["dataset"] == dataset and r["epsilon"] == epsilon and r["method"] == method
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--epsilons", type=positive_floats, default=[0.5])
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--components", type=int, default=10)
    parser.add_argument("--seed", type=int, default=2018)
    parser.add_argument(
        "--samples-per-owner",
        type=positive_ints,
        default=None,
        help="override every dataset's grid",
    )
    parser.add_argument("--datasets", default=None, help="comma-separated indices (0, 1, 2) to run")
    parser.add_argument("--quick", action="store_true", help="one small stand-in, two runs (CI)")
    parser.add_argument("--out", type=Path, default=FIGURES)
    args = parser.parse_args()
    if args.runs < 1:
        raise SystemExit("--runs must be >= 1")
    datasets = list(QUICK if args.quick else DATASETS)
    if args.datasets is not None:
        datasets = [datasets[int(i)] for i in args.datasets.split(",")]
    if args.samples_per_owner is not None:
        datasets = [
            Dataset(d.name, d.load, d.bounds, tuple(args.samples_per_owner), d.note)
            for d in datasets
        ]
    runs = 2 if args.quick else args.runs
    k = min(args.components, 4) if args.quick else args.components
    meta = provenance(
        {
            "runs": runs,
            "epsilons": args.epsilons,
            "delta": args.delta,
            "n_components": k,
            "seed": args.seed,
            "key_bits_of_the_plan": PLAN_KEY_BITS,
            "datasets": {d.name: d.note for d in datasets},
            "quick": args.quick,
        }
    )
    rows: list[dict[str, Any]] = []
    for dataset in datasets:
        rows.extend(run_dataset(dataset, args.epsilons, args.delta, k, runs, args.seed))
    print_table(
        rows, ["dataset", "epsilon", "samples_per_owner", "owners", "method", "f1_mean", "f1_std"]
    )
    written = write_results(args.out, STEM, rows, meta)
    png = args.out / f"{STEM}.png"
    plot(rows, png, [d.name for d in datasets], args.epsilons)
    print("wrote " + ", ".join(str(p) for p in [*written, png]))
    spread, drop = 0.0, 0.0
    for dataset in datasets:
        for epsilon in args.epsilons:
            stats = _means(rows, dataset.name, epsilon, "fedpca stats")
            baseline = _means(rows, dataset.name, epsilon, "PrivateLocalPCA")
            if stats:
                spread = max(spread, max(stats) - min(stats))
                drop = max(drop, baseline[-1] - baseline[0])
    print(f"fedpca_spread={spread:.4f} baseline_drop={drop:.4f}")


if __name__ == "__main__":
    main()
