"""How long an owner's work before its upload header takes, against its record count N.

The proxy's clock sees when an owner's upload header arrives, so the work an owner does
for a task before it (choosing the records, computing the padded statistics) should not
depend on N. docs/privacy.md ("Work padded to a public size") quotes this script for
two cases:

* DCA at cap K = 1,000, M = 5, two classes, N from 1,000 to 2 million, each table
  padded to a capacity of 2 million as a node keeps it: the records are chosen with
  work of the capacity's size (:func:`fedpca.owner.compute.chosen_rows`);
* PCA at cap K, M = 10, at N = K and N = K + 1 (capacity 2 K): where the owner
  sampled (and copied the K records drawn) only above the cap, until stop 41;
* histograms at cap K_H = 100,000: 1,000 bins of a column whose values are spread or all
  in one bin, and 2 bins in each of 50 listed categories with K_H records or none (the
  bins and categories were looked up with steps that depend on the values); then the
  same spread-or-one-bin pair at 65,536 and at ``--most-bins`` bins (2^20, the most a
  histogram may have), where the bins no longer fit in the processor's caches;
* three residuals a review of owners' observables measured (docs/privacy.md): the mean
  of 3 columns of a 200-column file at K_H, with no record against K_H records (real
  rows are read from the file, padding rows only written); PCA without public bounds,
  K = N = 20,000, M = 10, on values of order 1 against subnormal ones (1e-310); and
  PCA at K = 10,000, M = 10 for N from K to 100 K, capacity 100 K (the sample drawn
  past the cap grew with N until stop 41).

Times are wall-clock medians of repeated calls in this one process (no network, no
encryption); read them as the size of a step, not as what a deployment's clock shows.

Usage: python benchmarks/owner_task_timing.py [--repeats 15] [--largest 2000000]

The last line reads ``dca_ratio_largest_over_smallest=<x> pca_boundary_us=<a>,<b>
histogram_ratio_spread_over_one_bin=<y> grouped_ratio_full_over_empty=<z>
large_histogram_ratios=<r1>,<r2> wide_file_ratio=<w> subnormal_ratio=<s>
sampling_ratios=<p1>,<p2>,<p3>`` (each the second case over the first, or over N = K).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np

from fedpca.aggregates import fixed_point_aggregates
from fedpca.owner.compute import share_statistics
from fedpca.owner.local_table import LocalTable
from fedpca.query import Aggregate, QueryKind, QuerySpec

CAP = 1_000
PUBLIC_KEY_N = (1 << 2047) + 1  # only its size matters here: nothing is encrypted


def _spec(kind: QueryKind, m: int) -> QuerySpec:
    extra = {"class_labels": (0.0, 1.0), "label_column": m} if kind is QueryKind.DCA else {}
    return QuerySpec(
        query_id="timing",
        kind=kind,
        n_features=m,
        epsilon=1.0,
        delta=1e-6,
        n_components=1,
        analyst_public_key_n=PUBLIC_KEY_N,
        analyst_key_fingerprint="sha256:timing",
        max_records_per_owner=CAP,
        max_owners=4,
        feature_lower=(-1.0,) * m,
        feature_upper=(1.0,) * m,
        **extra,
    )


def _task_seconds(table: LocalTable, spec: QuerySpec, repeats: int) -> float:
    """Median seconds of what a task does before its header: choose, then sum (the
    cap is the query's: the table's capacity, if it has one, is at least that)."""
    times = []
    for _ in range(repeats):
        columns = table.table_for(spec)
        started = time.perf_counter()
        share_statistics(spec, columns, capacity=spec.max_records_per_owner)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _paired_seconds(
    first: LocalTable, second: LocalTable, spec: QuerySpec, repeats: int
) -> tuple[float, float]:
    """Median seconds of the task on each table, the two calls alternated (the one
    measured first would otherwise pay for warming the caches)."""
    tables = (first.table_for(spec), second.table_for(spec))
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for table, out in zip(tables, times, strict=True):
            started = time.perf_counter()
            share_statistics(spec, table, capacity=spec.max_records_per_owner)
            out.append(time.perf_counter() - started)
    return statistics.median(times[0]), statistics.median(times[1])


def _residuals(
    rng: np.random.Generator, repeats: int, scale: int
) -> tuple[float, float, list[float]]:
    """The three residuals of docs/privacy.md measured here; ``scale`` divides the sizes
    (1 for the documented run, larger for the smoke test)."""
    k = HISTOGRAM_CAP // scale
    mean = Aggregate.statistics((0, 1, 2), (-1.0,) * 3, (1.0,) * 3)
    wide = _aggregate_spec(mean, k)
    source = rng.uniform(-1, 1, (k, 200))
    # As a node keeps it: padded with zero rows up to its declared capacity, here K.
    empty, full = _paired_seconds(
        LocalTable(source[:0], None, "benchmark", k),
        LocalTable(source, None, "benchmark", k),
        wide,
        repeats,
    )
    print(
        f"mean of 3 of 200 columns, K = {k:,}: no record {empty * 1e3:.2f} ms, "
        f"K records {full * 1e3:.2f} ms ({full / empty:.3f}x)"
    )
    n, m = 20_000 // scale, 10
    unbounded = replace(_spec(QueryKind.PCA, m), feature_lower=(), feature_upper=())
    unbounded = replace(unbounded, max_records_per_owner=n)
    usual = rng.uniform(-1, 1, (n, m))
    plain, tiny = _paired_seconds(
        LocalTable(usual, None, "benchmark"),
        LocalTable(usual * 1e-310, None, "benchmark"),
        unbounded,
        repeats,
    )
    print(
        f"PCA without bounds, K = N = {n:,}: values of order 1 {plain * 1e3:.2f} ms, "
        f"subnormal values {tiny * 1e3:.2f} ms ({tiny / plain:.3f}x)"
    )
    cap = 10_000 // scale
    sampled = replace(_spec(QueryKind.PCA, m), max_records_per_owner=cap)
    times = []
    for count in (cap, cap + 1, 10 * cap, 100 * cap):
        table = LocalTable(rng.uniform(-1, 1, (count, m)), None, "benchmark", 100 * cap)
        times.append(_task_seconds(table, sampled, repeats))
        print(f"PCA, K = {cap:,}, M = {m}, N = {count:>9,}: {times[-1] * 1e3:.2f} ms")
    return full / empty, tiny / plain, [t / times[0] for t in times[1:]]


HISTOGRAM_CAP = 100_000


def _aggregate_spec(part: Aggregate, cap: int) -> QuerySpec:
    """An aggregate query of ``part`` alone, at cap ``cap``."""
    return QuerySpec(
        query_id="timing",
        kind=QueryKind.AGGREGATE,
        n_features=len(part.read_columns),
        epsilon=1.0,
        delta=1e-6,
        n_components=1,
        analyst_public_key_n=PUBLIC_KEY_N,
        analyst_key_fingerprint="sha256:timing",
        aggregates=(part,),
        max_records_per_owner=cap,
        max_owners=4,
    )


def _histogram_ms(part: Aggregate, rows: np.ndarray, repeats: int) -> float:
    """Median milliseconds of an owner's padded histogram of ``rows``."""
    spec = _aggregate_spec(part, HISTOGRAM_CAP)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fixed_point_aggregates(rows, spec, pad_to=HISTOGRAM_CAP)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="calls per point (median)")
    parser.add_argument("--largest", type=int, default=2_000_000, help="largest DCA table")
    parser.add_argument(
        "--most-bins", type=int, default=1 << 20, help="bins of the largest histogram"
    )
    parser.add_argument(
        "--residual-scale", type=int, default=1, help="divide the residuals' sizes by this"
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)

    m = 5
    dca = _spec(QueryKind.DCA, m)
    sizes = sorted({CAP, 10 * CAP, 100 * CAP, args.largest})
    dca_ms = []
    print(f"DCA, K = {CAP}, M = {m}, classes 0 and 1 (labels 0, 1, 2 uniformly)")
    for n in sizes:
        source = np.column_stack([rng.uniform(-1, 1, (n, m)), rng.integers(0, 3, n)])
        loading = time.perf_counter()
        # As a node keeps it: padded to its declared capacity (here the largest N).
        table = LocalTable(source.astype(np.float64), m, "benchmark", args.largest)
        loaded = time.perf_counter() - loading
        dca_ms.append(_task_seconds(table, dca, args.repeats) * 1e3)
        print(
            f"  N = {n:>9,}   task {dca_ms[-1]:7.3f} ms   (loading, index included: "
            f"{loaded * 1e3:.0f} ms)"
        )

    m = 10
    pca = _spec(QueryKind.PCA, m)
    boundary_us = []
    print(f"PCA, K = {CAP}, M = {m}")
    for n in (CAP, CAP + 1):
        table = LocalTable(rng.uniform(-1, 1, (n, m)), None, "benchmark", 2 * CAP)
        boundary_us.append(_task_seconds(table, pca, max(args.repeats, 200)) * 1e6)
        print(f"  N = {n:>9,}   task {boundary_us[-1]:7.1f} µs")
    k = HISTOGRAM_CAP
    bins = Aggregate.histogram((0,), (tuple(np.linspace(0.0, 1.0, 1001)),))
    print(f"histogram, K = {k:,}, 1,000 bins")
    one_bin = _histogram_ms(bins, np.full((k, 1), 0.5), args.repeats)
    spread = _histogram_ms(bins, rng.uniform(0.0, 1.0, (k, 1)), args.repeats)
    print(
        f"  values all in one bin   {one_bin:7.3f} ms\n  values spread           {spread:7.3f} ms"
    )
    grouped = Aggregate.histogram(
        (1,), ((0.0, 0.5, 1.0),), group_column=0, categories=tuple(range(1, 51))
    )
    listed = np.column_stack([rng.integers(1, 51, k), rng.uniform(0, 1, k)]).astype(float)
    print(f"histogram, K = {k:,}, 2 bins in each of 50 categories")
    empty = _histogram_ms(grouped, listed[:0], args.repeats)
    full = _histogram_ms(grouped, listed, args.repeats)
    print(f"  no records              {empty:7.3f} ms\n  K records, all listed   {full:7.3f} ms")
    large = []
    for n_bins in (min(1 << 16, args.most_bins), args.most_bins):
        part = Aggregate.histogram((0,), (tuple(np.linspace(0.0, 1.0, n_bins + 1)),))
        repeats = max(3, args.repeats // 3)
        at_one = _histogram_ms(part, np.full((k, 1), 0.5), repeats)
        at_spread = _histogram_ms(part, rng.uniform(0.0, 1.0, (k, 1)), repeats)
        large.append(at_spread / at_one)
        print(
            f"histogram, K = {k:,}, {n_bins:,} bins: one bin {at_one:8.1f} ms, "
            f"spread {at_spread:8.1f} ms ({large[-1]:.3f}x)"
        )
    wide, subnormal, sampling = _residuals(rng, args.repeats, args.residual_scale)
    print(
        f"dca_ratio_largest_over_smallest={dca_ms[-1] / dca_ms[0]:.3f} "
        f"pca_boundary_us={boundary_us[0]:.1f},{boundary_us[1]:.1f} "
        f"histogram_ratio_spread_over_one_bin={spread / one_bin:.3f} "
        f"grouped_ratio_full_over_empty={full / empty:.3f} "
        f"large_histogram_ratios={large[0]:.3f},{large[1]:.3f} "
        f"wide_file_ratio={wide:.3f} subnormal_ratio={subnormal:.3f} "
        f"sampling_ratios={','.join(f'{r:.3f}' for r in sampling)}"
    )


if __name__ == "__main__":
    main()
