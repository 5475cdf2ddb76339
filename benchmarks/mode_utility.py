"""Utility of the two protocol modes (and the historical baseline) at equal (epsilon, delta).

Measures the captured-variance ratio of the private top-k subspace (variance it
captures on the pooled preprocessed rows / variance the exact top-k subspace
captures; 1 = as good as non-private PCA) for

* ``stats``  — noisy R, v, N with the per-section sigmas of ``ReleasePlan``;
* ``masked`` — the corrected Wang & Chang release S + E with sigma = z * Delta_S(N),
  stated for replace-one adjacency (the only relation under which it has a finite
  epsilon; ``stats`` is stated for add/remove, the stronger guarantee);
* PrivateLocalPCA — the historical baseline (Wishart noise, sequential merge; not DP
  as published, shown only because the seed paper compared against it).

Encryption is exact (packed Paillier adds integers exactly), so the released values
are simulated in plaintext with the very noise scales the protocol uses; this isolates
utility from cryptography. The noise is drawn from numpy here (a benchmark, not a
release). Usage::

    python benchmarks/mode_utility.py [--trials 20] [--components 5]

The last line reads ``stats_better_everywhere=<bool> mean_gain=<float>``.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from fedpca.analyst.baseline import private_local_pca_baseline
from fedpca.analyst.solvers import pca_from_centred_scatter, pca_from_statistics
from fedpca.app.demo import captured_variance_ratio
from fedpca.data import load_dataset
from fedpca.preprocess import FeatureBounds, preprocess
from fedpca.protocol import ReleasePlan, masked_sigma
from fedpca.query import Neighbouring, ProtocolMode, QueryKind, QuerySpec
from fedpca.stats import SufficientStatistics

# Public bounds documented with the datasets (none: raw values, rows clipped).
SCHEMAS: dict[str, tuple[float, float] | None] = {
    "ionosphere": (-1.0, 1.0),
    "madelon": (0.0, 999.0),
    "german": None,
    "australian": None,
}


def symmetric_noise(m: int, sigma: float, rng: np.random.Generator) -> np.ndarray:
    upper = np.triu(rng.normal(0.0, sigma, (m, m)))
    return upper + np.triu(upper, 1).T


def spec_for(m: int, epsilon: float, delta: float, k: int, mode: ProtocolMode) -> QuerySpec:
    return QuerySpec(
        query_id="bench",
        kind=QueryKind.PCA,
        n_features=m,
        epsilon=epsilon,
        delta=delta,
        n_components=k,
        analyst_public_key_n=3,
        analyst_key_fingerprint="sha256:benchmark",
        mode=mode,
        neighbouring=(
            Neighbouring.REPLACE_ONE if mode is ProtocolMode.MASKED else Neighbouring.ADD_REMOVE
        ),
    )


def run(trials: int, k: int, owners: int, epsilons: list[float], delta: float) -> bool:
    rng = np.random.default_rng(2026)
    gains: list[float] = []
    stats_better = True
    header = f"{'dataset':<16}{'epsilon':>8}{'stats':>10}{'masked':>10}{'PrivLocal':>11}"
    print(header)
    print("-" * len(header))
    for name, schema in SCHEMAS.items():
        raw, _ = load_dataset(name)
        m = raw.shape[1]
        bounds = None
        if schema is not None:
            bounds = FeatureBounds.from_arrays(np.full(m, schema[0]), np.full(m, schema[1]))
        rows = preprocess(raw, bounds, 1.0)
        n = len(rows)
        exact_r, exact_v = rows.T @ rows, rows.sum(axis=0)
        parts = np.array_split(rng.permutation(n), owners)
        for epsilon in epsilons:
            stats_plan = ReleasePlan.for_query(
                spec_for(m, epsilon, delta, k, ProtocolMode.STATS), 2048
            )
            masked_plan = ReleasePlan.for_query(
                spec_for(m, epsilon, delta, k, ProtocolMode.MASKED), 2048
            )
            sigma = {s.name: s.sigma for s in stats_plan.sections}
            sigma_s, _ = masked_sigma(masked_plan, n)
            scores: dict[str, list[float]] = {"stats": [], "masked": [], "baseline": []}
            for _ in range(trials):
                noisy = SufficientStatistics(
                    exact_r + symmetric_noise(m, sigma["scatter"], rng),
                    exact_v + rng.normal(0.0, sigma["sum"], m),
                    n + rng.normal(0.0, sigma["count"]),
                )
                scores["stats"].append(
                    captured_variance_ratio(
                        rows, pca_from_statistics(noisy, n_components=k).components
                    )
                )
                centred = exact_r - np.outer(exact_v, exact_v) / n
                released = centred + symmetric_noise(m, sigma_s, rng)
                scores["masked"].append(
                    captured_variance_ratio(
                        rows, pca_from_centred_scatter(released, n, n_components=k).components
                    )
                )
                baseline = private_local_pca_baseline([rows[p] for p in parts], k, epsilon, rng)
                scores["baseline"].append(captured_variance_ratio(rows, baseline.components))
            mean = {key: float(np.mean(v)) for key, v in scores.items()}
            print(
                f"{name:<16}{epsilon:>8g}{mean['stats']:>10.4f}{mean['masked']:>10.4f}"
                f"{mean['baseline']:>11.4f}"
            )
            gains.append(mean["stats"] - mean["masked"])
            stats_better = stats_better and mean["stats"] >= mean["masked"]
    print(
        f"\ncaptured-variance ratio, mean of {trials} trials, k={k}, delta={delta:g}, "
        f"{owners} owners for the baseline (per-owner epsilon)"
    )
    print(f"stats_better_everywhere={stats_better} mean_gain={float(np.mean(gains)):.4f}")
    return stats_better


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--components", type=int, default=5)
    parser.add_argument("--owners", type=int, default=10)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument(
        "--epsilons", type=lambda s: [float(x) for x in s.split(",")], default=[0.1, 0.3, 1.0, 3.0]
    )
    args = parser.parse_args()
    if not all(math.isfinite(e) and e > 0 for e in args.epsilons):
        raise SystemExit("--epsilons must be positive and finite")
    run(args.trials, args.components, args.owners, args.epsilons, args.delta)


if __name__ == "__main__":
    main()
