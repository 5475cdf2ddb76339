"""Figure 1 of the published evaluation: running time against the number of owners.

fedpca: for each number of owners L, the bundled madelon (2,000 × 500, public bounds
0..999) is split over L owner processes (``fedpca owner serve``, one crypto worker
each) and one proxy process (``fedpca proxy serve``) on loopback with mutual TLS, a
2048-bit analyst key, stats mode, ε = 0.3 (as published), δ = 10⁻⁵, k = 5
(:class:`fedpca.app.cluster.LocalCluster`, as ``benchmarks/end_to_end.py`` uses it).
The analyst (``FederatedPCA.fit``, here) runs ``--runs`` queries one after another on
the same processes; each is timed from submission to decrypted components.

Every process runs on this one machine, so the owners' encryptions, which a real
deployment runs on L machines at once, share its cores here. To separate what grows
with L from what a deployment parallelises, each query also records

* the owners' encryption window (first start to last end of any owner's encryption,
  from the owners' logs) and one owner's own encryption time;
* the proxy process's CPU seconds for the query (receiving, checking and folding the L
  uploads, finishing; the noise is drawn by its worker process while owners encrypt);
* the analyst's phases (submit, wait, fetch, decrypt, solve).

From these the script derives an *estimate* for one machine per owner: the measured
end-to-end time with the owners' encryption window replaced by one owner's encryption
time at the smallest L of the run, plus the proxy's CPU seconds as if none of them
overlapped the encryption. It is a model built from measured parts, not a measurement;
docs/experiments.md states its assumptions.

PrivateLocalPCA (``fedpca.analyst.baseline``): the same split, each owner's local PCA
(Wishart noise at per-owner ε, eigendecomposition) and the sequential merge, timed in
this process without any network (which favours it: a deployment adds L sequential
transfers of a 500 × 5 matrix).

Usage::

    python benchmarks/experiments/runtime_vs_owners.py [--owners 2,5,10,20,30,40,50]
        [--runs 10] [--key-bits 2048] [--quick] [--out docs/figures]

Writes ``runtime_vs_owners.{csv,json,png}``; the last line printed reads
``fedpca_seconds_per_owner=<float> estimate_seconds_per_owner=<float>
baseline_seconds_per_owner=<float>``: least-squares slopes of the mean times against L.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from reproduction import (
    FIGURES,
    mean_and_std,
    plot_series,
    positive_ints,
    print_table,
    provenance,
    write_results,
)

from fedpca.analyst.baseline import private_local_pca_baseline
from fedpca.analyst.estimators import FederatedPCA
from fedpca.app.cluster import LocalCluster, split_rows
from fedpca.data import load_dataset
from fedpca.preprocess import FeatureBounds, preprocess

STEM = "runtime_vs_owners"
BOUNDS = (0.0, 999.0)
COMPONENTS = 5
LOG_LINE = re.compile(
    r"^(?P<stamp>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) \S+ (?P<logger>\S+): (?P<text>.*)$"
)
# The owner reserves budget, then computes, packs and encrypts its share (fedpca.owner.node);
# the log's one-decimal duration is too coarse, so both lines' timestamps are used.
RESERVED = re.compile(r"query (?P<task>\S+): budget reserved")
ENCRYPTED = re.compile(r"query (?P<task>\S+): share encrypted ")


def _stamp(text: str) -> float:
    return dt.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _owner_encryptions(logs: Sequence[str], query_id: str) -> list[tuple[float, float]]:
    """(start, seconds) of every owner's share computation and encryption of ``query_id``."""
    found = []
    for text in logs:
        start = end = None
        for line in text.splitlines():
            parsed = LOG_LINE.match(line)
            if parsed is None:
                continue
            for pattern in (RESERVED, ENCRYPTED):
                event = pattern.match(parsed["text"])
                # Owners log the proxy's task id, "<analyst>/<query id>".
                if event is not None and event["task"].rsplit("/", 1)[-1] == query_id:
                    if pattern is RESERVED:
                        start = _stamp(parsed["stamp"])
                    else:
                        end = _stamp(parsed["stamp"])
        if start is not None and end is not None:
            found.append((start, end - start))
    if len(found) != len(logs):
        raise SystemExit(
            f"query {query_id}: encryption records in {len(found)} of {len(logs)} owner logs"
        )
    return found


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_fedpca(
    table: np.ndarray, owners: int, runs: int, key_bits: int, epsilon: float, seed: int
) -> list[dict[str, float]]:
    parts = split_rows(len(table), owners, seed=seed)
    workdir = Path(tempfile.mkdtemp(prefix="fedpca-runtime-"))
    cluster = LocalCluster(
        workdir=workdir,
        owner_tables=[table[p] for p in parts],
        key_bits=key_bits,
        epsilon_budget=1000.0,
        delta_budget=1e-2,
        processes_per_node=1,
    )
    measurements = []
    try:
        cluster.prepare()
        with cluster:
            cluster.start()
            assert cluster.proxy is not None
            proxy_pid = cluster.proxy.process.pid
            for _ in range(runs):
                model = FederatedPCA(
                    n_components=COMPONENTS,
                    epsilon=epsilon,
                    delta=1e-5,
                    bounds=BOUNDS,
                    quorum=owners,
                    deadline_seconds=3600.0,
                    max_owners=max(256, owners),
                    **cluster.analyst_connection(),
                )
                proxy_cpu = _cpu_seconds(proxy_pid)
                started = time.time()
                model.fit(n_features=table.shape[1] - 1)
                finished = time.time()
                proxy_cpu = _cpu_seconds(proxy_pid) - proxy_cpu
                logs = [process.log_text() for process in cluster.owners]
                encryptions = _owner_encryptions(logs, model.query_id_)
                first_start = min(start for start, _ in encryptions)
                last_end = max(start + seconds for start, seconds in encryptions)
                measurements.append(
                    {
                        "end_to_end": finished - started,
                        "submit_to_first_encryption": first_start - started,
                        "encryption_window": last_end - first_start,
                        "owner_encryption_median": float(np.median([s for _, s in encryptions])),
                        "last_encryption_to_end": finished - last_end,
                        "proxy_cpu": proxy_cpu,
                        "decrypt": model.timings_["decrypt"],
                    }
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return measurements


def measure_baseline(
    rows: np.ndarray, owners: int, runs: int, epsilon: float, seed: int
) -> list[float]:
    parts = split_rows(len(rows), owners, seed=seed)
    tables = [rows[p] for p in parts]
    seconds = []
    for run in range(runs):
        rng = np.random.default_rng([seed, owners, run])
        started = time.perf_counter()
        private_local_pca_baseline(tables, COMPONENTS, epsilon, rng)
        seconds.append(time.perf_counter() - started)
    return seconds


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    return float(np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)[0])


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = {
        "fedpca, measured (all processes on 2 shared cores)": ("tab:blue", "-", "o"),
        "fedpca, estimate for one machine per owner": ("tab:blue", "--", None),
        "PrivateLocalPCA (in process, no network)": ("tab:red", "-", "s"),
    }
    for series, style in styles.items():
        points = [r for r in rows if r["series"] == series]
        plot_series(ax, points, "owners", "seconds_mean", "seconds_std", style, series)
    ax.set_xlabel("number of owners L")
    ax.set_ylabel("seconds")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--owners", type=positive_ints, default=[2, 5, 10, 20, 30, 40, 50])
    parser.add_argument("--runs", type=int, default=10, help="queries per number of owners")
    parser.add_argument("--key-bits", type=int, default=2048)
    parser.add_argument("--epsilon", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=2018)
    parser.add_argument("--quick", action="store_true", help="2 and 3 owners, one run each (CI)")
    parser.add_argument("--out", type=Path, default=FIGURES)
    args = parser.parse_args()
    if args.runs < 1:
        raise SystemExit("--runs must be >= 1")
    if args.key_bits < 2048:
        raise SystemExit("--key-bits must be >= 2048 (smaller keys are for tests only)")
    owner_counts = [2, 3] if args.quick else sorted(args.owners)
    if owner_counts[0] < 2:
        raise SystemExit("--owners must all be >= 2")
    runs = 1 if args.quick else args.runs
    features, labels = load_dataset("madelon")
    assert labels is not None
    table = np.column_stack([labels, features])
    m = features.shape[1]
    rows_pre = preprocess(
        features, FeatureBounds.from_arrays(np.full(m, BOUNDS[0]), np.full(m, BOUNDS[1]))
    )
    meta = provenance(
        {
            "dataset": "madelon 2000x500 (bundled), public bounds 0..999",
            "owners": owner_counts,
            "runs": runs,
            "key_bits": args.key_bits,
            "epsilon": args.epsilon,
            "delta": 1e-5,
            "mode": "stats",
            "n_components": COMPONENTS,
            "processes_per_owner": 1,
            "seed": args.seed,
            "quick": args.quick,
        }
    )
    # Untimed warm-up: the first call pays one-off costs (imports, BLAS start-up).
    measure_baseline(rows_pre, 2, 1, args.epsilon, args.seed)
    per_owner_count: dict[int, list[dict[str, float]]] = {}
    baselines: dict[int, list[float]] = {}
    for owners in owner_counts:
        started = time.perf_counter()
        per_owner_count[owners] = measure_fedpca(
            table, owners, runs, args.key_bits, args.epsilon, args.seed
        )
        baselines[owners] = measure_baseline(rows_pre, owners, runs, args.epsilon, args.seed)
        print(
            f"  {owners} owners: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True
        )
    # One owner's encryption with the machine to itself (as near as this machine gets):
    # the median at the smallest number of owners of this run.
    alone = float(
        np.median([m["owner_encryption_median"] for m in per_owner_count[owner_counts[0]]])
    )
    rows: list[dict[str, Any]] = []
    for owners in owner_counts:
        measured = per_owner_count[owners]
        estimate = [
            m["end_to_end"] - m["encryption_window"] + alone + m["proxy_cpu"] for m in measured
        ]
        phases = {
            key: mean_and_std([m[key] for m in measured])[0]
            for key in (
                "submit_to_first_encryption",
                "encryption_window",
                "owner_encryption_median",
                "last_encryption_to_end",
                "proxy_cpu",
                "decrypt",
            )
        }
        for series, values in (
            (
                "fedpca, measured (all processes on 2 shared cores)",
                [m["end_to_end"] for m in measured],
            ),
            ("fedpca, estimate for one machine per owner", estimate),
            ("PrivateLocalPCA (in process, no network)", baselines[owners]),
        ):
            mean, std = mean_and_std(values)
            rows.append(
                {
                    "owners": owners,
                    "series": series,
                    "seconds_mean": mean,
                    "seconds_std": std,
                    "runs": len(values),
                    **(
                        {f"{k}_mean": v for k, v in phases.items()}
                        if series.startswith("fedpca, m")
                        else {}
                    ),
                }
            )
    columns = ["owners", "series", "seconds_mean", "seconds_std", "runs"]
    print_table(rows, columns)
    print("fedpca phases (means, seconds):")
    print_table(
        [r for r in rows if r["series"].startswith("fedpca, m")],
        [
            "owners",
            "submit_to_first_encryption_mean",
            "encryption_window_mean",
            "owner_encryption_median_mean",
            "last_encryption_to_end_mean",
            "proxy_cpu_mean",
            "decrypt_mean",
        ],
    )
    # Every row carries the same columns in the CSV (phases empty where they do not apply).
    keys = sorted({key for r in rows for key in r}, key=lambda k: (k not in columns, k))
    written = write_results(args.out, STEM, [{k: r.get(k, "") for k in keys} for r in rows], meta)
    png = args.out / f"{STEM}.png"
    plot(
        rows,
        png,
        f"madelon 2000x500, ε = {args.epsilon:g}, {args.key_bits}-bit key, "
        f"mean ± sd of {runs} runs",
    )
    print("wrote " + ", ".join(str(p) for p in [*written, png]))
    slopes = {
        series: _slope(
            [r["owners"] for r in rows if r["series"] == series],
            [r["seconds_mean"] for r in rows if r["series"] == series],
        )
        for series in {r["series"] for r in rows}
    }
    print(
        "fedpca_seconds_per_owner={:.4f} estimate_seconds_per_owner={:.4f} "
        "baseline_seconds_per_owner={:.4f}".format(
            slopes["fedpca, measured (all processes on 2 shared cores)"],
            slopes["fedpca, estimate for one machine per owner"],
            slopes["PrivateLocalPCA (in process, no network)"],
        )
    )


if __name__ == "__main__":
    main()
