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

The releases are computed with :mod:`fedpca.app.plaintext_release`: the owners',
proxy's and analyst's own code (exact fixed-point statistics, the plan's noise from the
production discrete Gaussian sampler, the mean mask, the analyst's decoding and solver)
minus the transport and Paillier, which are exact on the fixed-point grid; this isolates
utility from cryptography. Usage::

    python benchmarks/mode_utility.py [--trials 20] [--components 5] [--owners 10]
                                      [--delta 1e-5] [--epsilons 0.1,0.3,1,3]

The last line reads ``stats_better_everywhere=<bool> mean_gain=<float>
min_gain=<float> settings=<int>`` (gain = stats minus masked, per dataset and epsilon).
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from fedpca.analyst.baseline import private_local_pca_baseline
from fedpca.app.demo import captured_variance_ratio
from fedpca.app.plaintext_release import (
    fold_owner_shares,
    plaintext_pca_query,
    release_from_folded,
)
from fedpca.data import load_dataset
from fedpca.preprocess import FeatureBounds, preprocess
from fedpca.query import ProtocolMode
from fedpca.tables import OwnerTable

# Public bounds documented with the datasets (none: raw values, rows clipped).
SCHEMAS: dict[str, tuple[float, float] | None] = {
    "ionosphere": (-1.0, 1.0),
    "madelon": (0.0, 999.0),
    "german": None,
    "australian": None,
}


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
        parts = np.array_split(rng.permutation(n), owners)
        tables = [OwnerTable(raw[p], None) for p in parts]
        for epsilon in epsilons:
            folded = {
                mode: fold_owner_shares(
                    plaintext_pca_query(m, epsilon, delta, k, mode, bounds=schema), tables
                )
                for mode in (ProtocolMode.STATS, ProtocolMode.MASKED)
            }
            scores: dict[str, list[float]] = {"stats": [], "masked": [], "baseline": []}
            for _ in range(trials):
                for mode in (ProtocolMode.STATS, ProtocolMode.MASKED):
                    release = release_from_folded(folded[mode])
                    scores[mode.value].append(
                        captured_variance_ratio(rows, release.pca(k).components)
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
        f"rows split over {owners} owners (the baseline spends epsilon per owner)"
    )
    print(
        f"stats_better_everywhere={stats_better} mean_gain={float(np.mean(gains)):.4f} "
        f"min_gain={min(gains):.4f} settings={len(gains)}"
    )
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
