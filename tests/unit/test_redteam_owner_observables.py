"""Red-team findings: owner behaviour an analyst or proxy can observe that depends on data.

Each test states a property docs/privacy.md claims and checks it on two neighbouring
inputs (one record apart, or the same records with different values). They fail on
the code they were written against; REDTEAM.md describes each finding and a fix.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpca.aggregates import fixed_point_aggregates
from fedpca.errors import FedpcaError
from fedpca.exact_statistics import fixed_point_statistics
from fedpca.owner.compute import share_statistics
from fedpca.owner.config import DataConfig
from fedpca.owner.local_table import LocalTable
from fedpca.preprocess import clip_rows
from fedpca.query import Aggregate, QueryKind
from helpers import make_query

# ------------------------------------------------------------ whether a node starts


def _start_outcome(config: DataConfig) -> str:
    """What anyone watching which owners connect sees: the node starts, or it does not."""
    try:
        LocalTable.load(config)  # the first thing OwnerNode.__init__ does
    except FedpcaError as exc:
        return f"refuses to start ({type(exc).__name__})"
    return "starts"


def _write_csv(path: Path, rows: np.ndarray) -> Path:
    header = "label,a,b,c"
    np.savetxt(path, rows, delimiter=",", header=header, comments="")
    return path


def _write_npy(path: Path, rows: np.ndarray) -> Path:
    np.save(path, rows)
    return path


@pytest.mark.parametrize("enforce", [False, True], ids=["default", "bounded-owner-tables"])
@pytest.mark.parametrize(
    "write", [_write_csv, _write_npy], ids=["csv-with-header", "npy-of-known-width"]
)
def test_an_owners_last_record_does_not_decide_whether_its_node_starts(
    tmp_path: Path, enforce: bool, write: Callable[[Path, np.ndarray], Path]
) -> None:
    """Under add/remove, D and D' differ by one owner's only record.

    docs/privacy.md: add/remove "protects the *presence* of a record, including the fact
    that an organisation holds it", and over bounded owner tables "every record of every
    dataset in 𝒟 is protected: removing it gives a dataset in 𝒟" (|D_l| = 0 is in 𝒟).
    The schema is known in both cases (a header, an array of known width). Yet the node
    of the owner without records refuses to start, before it connects, so the proxy and
    the analyst (owners connected, contributing) see whether the owner holds a record.
    """
    one = np.array([[1.0, 0.1, -0.2, 0.3]])
    empty = one[:0]
    suffix = ".csv" if write is _write_csv else ".npy"
    header: Any = True if write is _write_csv else "auto"
    outcomes = []
    for name, rows in (("d", one), ("d-prime", empty)):
        path = write(tmp_path / f"{name}{suffix}", rows)
        config = DataConfig(
            path,
            header=header,
            label_column=0,
            max_records=5,
            enforce_max_records=enforce,
            n_columns=4,
        )
        outcomes.append(_start_outcome(config))
    assert outcomes[0] == "starts"
    assert outcomes[1] == outcomes[0], (
        f"with its record the node {outcomes[0]}; without it, it {outcomes[1]}"
    )


# ------------------------------------------------------------ timing of the padded work


def _fastest_of(runs: int, calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """The fastest of ``runs`` interleaved timings of each call (seconds)."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(runs):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def _settled_timings(
    runs: int,
    calls: dict[str, Callable[[], object]],
    ratio: Callable[[dict[str, float]], float],
    below: float,
    attempts: int = 4,
) -> tuple[float, dict[str, float]]:
    """The ratio of :func:`_fastest_of` timings, and the timings, of the first of up to
    ``attempts`` measurements whose ratio is below ``below``, else of the one with the
    smallest ratio. On a shared machine a burst of other work can slow one case through
    all of one measurement's runs (CI once measured 1.107x between two cases that take
    the same work, whose ratio over 10 measurements here spread from 0.94 to 1.04); a
    real difference in work shows in every measurement, so the test still fails on it."""
    smallest: tuple[float, dict[str, float]] = (float("inf"), {})
    for _ in range(attempts):
        best = _fastest_of(runs, calls)
        smallest = min(smallest, (ratio(best), best), key=lambda measured: measured[0])
        if smallest[0] < below:
            break
    return smallest


def _spread(best: dict[str, float]) -> float:
    """The slowest case's time over the fastest's."""
    return max(best.values()) / min(best.values())


@pytest.mark.slow  # wall-clock ratios: with the other timing checks, off the fast tier
def test_dca_statistics_take_the_same_time_whatever_the_number_of_records_below_the_cap(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    """fixed_point_statistics promises: with ``pad_to`` "the work done (and the time taken)
    depends on max(N, pad_to) only, not on N"; docs/privacy.md lists the only steps of an
    owner's time that grow with N (copying the query's columns, drawing a sample when
    N > K). For DCA the label of every *real* record is looked up in a Python dict, one
    interpreted iteration per record (about 70 ns each), which padding rows skip: at
    M = 2, K = 100,000 per class an owner holding 2K records takes about 1.5x as long
    as one holding one record, with no sample drawn in either case. Two ciphertexts are
    encrypted at this size, so the statistics dominate the owner's time to upload.
    """
    public_key, _ = test_only_keypair_512
    m, per_class = 2, 100_000
    spec = make_query(
        public_key,
        kind=QueryKind.DCA,
        n_features=m,
        n_components=1,
        label_column=0,
        class_labels=(0.0, 1.0),
        max_records_per_owner=per_class,
        feature_lower=(-1.0,) * m,
        feature_upper=(1.0,) * m,
        epsilon=1.0,
        delta=1e-6,
    )
    padded = 2 * per_class  # padded_rows: the cap times the number of classes
    rng = np.random.default_rng(0)
    features = rng.uniform(-0.5, 0.5, size=(padded, m))  # within the clip norm
    labels = np.repeat([0.0, 1.0], per_class)  # every class exactly at its cap

    def statistics(n: int) -> Callable[[], object]:
        return lambda: fixed_point_statistics(features[:n], labels[:n], spec, pad_to=padded)

    ratio, best = _settled_timings(
        7,
        {"one record": statistics(1), "at the cap": statistics(padded)},
        lambda best: best["at the cap"] / best["one record"],
        below=1.25,
    )
    assert ratio < 1.25, (
        f"{best['at the cap'] * 1e3:.1f} ms at the cap against "
        f"{best['one record'] * 1e3:.1f} ms for one record ({ratio:.2f}x), same padding"
    )


@pytest.mark.slow  # wall-clock ratios: with the other timing checks, off the fast tier
@pytest.mark.parametrize("grouped", [False, True], ids=["1000 bins", "50 categories"])
def test_a_histogram_takes_the_same_time_whatever_the_rows_hold(
    grouped: bool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """An owner's histogram took time that showed its data to the proxy's clock (review,
    K = 100,000): numpy's binary search branched on the values, so a 1,000-bin histogram
    of a spread column took 7.9 ms against 2.7 ms for a constant one, and the category
    lookup wrote only the matching rows, so 50 listed categories took 10.6 ms with K
    records against 6.9 ms with none."""
    k = 100_000
    if grouped:
        part = Aggregate.histogram(
            (1,), ((0.0, 0.5, 1.0),), group_column=0, categories=tuple(range(1, 51))
        )
    else:
        part = Aggregate.histogram((0,), (tuple(np.linspace(0.0, 1.0, 1001)),))
    spec = make_query(
        test_only_keypair_512[0],
        kind=QueryKind.AGGREGATE,
        n_features=len(part.read_columns),
        epsilon=1.0,
        n_components=1,
        aggregates=(part,),
        max_records_per_owner=k,
        max_owners=4,
    )
    rng = np.random.default_rng(1)
    if grouped:  # every record in a listed category, or none at all
        spread = np.column_stack([rng.integers(1, 51, k), rng.uniform(0, 1, k)]).astype(float)
        other = spread[:0]
    else:  # every value in its own place, or all in one bin
        spread = rng.uniform(0.0, 1.0, (k, 1))
        other = np.full((k, 1), 0.5)

    def histogram(rows: np.ndarray) -> Callable[[], object]:
        return lambda: fixed_point_aggregates(rows, spec, pad_to=k)

    # 25 interleaved runs (9 failed once in CI at 1.40x while the machine was busy;
    # 5 ms each, so a burst of other work spans only some runs of each case).
    ratio, best = _settled_timings(
        25, {"spread": histogram(spread), "other": histogram(other)}, _spread, below=1.15
    )
    assert ratio < 1.15, (
        f"spread records: {best['spread'] * 1e3:.2f} ms; "
        f"{'no records' if grouped else 'one value'}: {best['other'] * 1e3:.2f} ms "
        f"({ratio:.2f}x)"
    )


@pytest.mark.slow  # wall-clock ratios: with the other timing checks, off the fast tier
def test_a_wide_file_is_read_alike_whatever_the_number_of_records_below_the_cap(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    """Real rows were read from the owner's table, as wide as its file, and padding rows
    only written: the mean of 3 columns of a 200-column file took 1.3 to 2.1 times as
    long with K records as with none (review). A table kept padded to the owner's
    capacity gives its K rows alike, records or zeros."""
    k = 100_000
    spec = make_query(
        test_only_keypair_512[0],
        kind=QueryKind.AGGREGATE,
        n_features=3,
        epsilon=1.0,
        n_components=1,
        aggregates=(Aggregate.statistics((0, 1, 2), (-1.0,) * 3, (1.0,) * 3),),
        max_records_per_owner=k,
        max_owners=4,
    )
    source = np.random.default_rng(0).uniform(-1, 1, (k, 200))

    def statistics(n: int) -> Callable[[], object]:
        table = LocalTable(source[:n], None, "test", k).table_for(spec)
        return lambda: share_statistics(spec, table, capacity=k)

    ratio, best = _settled_timings(
        9, {"none": statistics(0), "at the cap": statistics(k)}, _spread, below=1.15
    )
    assert ratio < 1.15, (
        f"{best['at the cap'] * 1e3:.2f} ms with K records against "
        f"{best['none'] * 1e3:.2f} ms with none ({ratio:.2f}x)"
    )


@pytest.mark.slow  # wall-clock ratios: with the other timing checks, off the fast tier
def test_clipping_costs_the_same_whatever_the_rows_hold() -> None:
    """docs/privacy.md ("Work padded to a public size"): "Clipping scales every row, by 1
    when it lies within the norm, so it costs the same whatever the rows hold." It does
    not: after scaling, rows beyond the norm that rounding left a hair above it are
    shaved in a loop whose passes (each a norm of the whole block) run only while such a
    row exists, so a block of rows beyond the clip norm costs about 1.2x a block of rows
    within it. The owner clips every padded block of 4,096 rows this way (at M = 2 the
    difference is about 15 % of its statistics' time), so the time to upload shows how
    many of its rows lie beyond the clip norm.
    """
    block, m = 4096, 2  # fixed_point_statistics' block at M = 2
    rng = np.random.default_rng(0)
    within = rng.uniform(-0.5, 0.5, size=(block, m))
    beyond = rng.uniform(-1.0, 1.0, size=(block, m))
    beyond[:, 0] = 1.0  # every row has norm > 1

    def clip_many(rows: np.ndarray) -> Callable[[], object]:
        return lambda: [clip_rows(rows, 1.0) for _ in range(20)]

    ratio, best = _settled_timings(
        9,
        {"within": clip_many(within), "beyond": clip_many(beyond)},
        lambda best: best["beyond"] / best["within"],
        below=1.1,
    )
    assert ratio < 1.1, (
        f"rows beyond the clip norm: {best['beyond'] * 1e3:.2f} ms; within: "
        f"{best['within'] * 1e3:.2f} ms ({ratio:.2f}x)"
    )


@pytest.mark.slow  # wall-clock ratios: with the other timing checks, off the fast tier
@pytest.mark.parametrize("kind", [QueryKind.PCA, QueryKind.DCA])
def test_a_table_one_record_above_the_cap_takes_the_time_of_one_at_the_cap(
    test_only_keypair_512: tuple[Any, Any], kind: QueryKind
) -> None:
    """An outside attack timed the owner's upload header against its query: the owner
    sampled and copied its records only when N exceeded the analyst's cap K, which took
    14.0 ms at N = K and 16.8 ms at N = K + 1 (PCA, K = 50,000, M = 4; a DCA class the
    same), so bisecting K timed N (or a class's size) exactly. The rows are now chosen
    with work of the capacity's size whatever N."""
    k, capacity = 50_000, 100_000
    extra: dict[str, Any] = {}
    if kind is QueryKind.DCA:
        extra = {"label_column": 4, "class_labels": (1.0, 2.0), "n_components": 1}
    spec = make_query(
        test_only_keypair_512[0],
        kind=kind,
        n_features=4,
        epsilon=1.0,
        feature_lower=(-1.0,) * 4,
        feature_upper=(1.0,) * 4,
        max_records_per_owner=k,
        max_owners=4,
        **extra,
    )
    rng = np.random.default_rng(0)
    # n records; for DCA n of class 1.0 and one more of class 2.0.
    source = np.column_stack([rng.uniform(-1, 1, (k + 2, 4)), np.ones(k + 2)])
    source[-1, 4] = 2.0

    def statistics(n: int) -> Callable[[], object]:
        rows = np.vstack([source[:n], source[-1:]]) if kind is QueryKind.DCA else source[:n]
        table = LocalTable(rows, 4, "test", capacity).table_for(spec)
        return lambda: share_statistics(spec, table, capacity=capacity)

    ratio, best = _settled_timings(
        15, {"at the cap": statistics(k), "one above": statistics(k + 1)}, _spread, below=1.1
    )
    assert ratio < 1.1, (
        f"{best['one above'] * 1e3:.2f} ms one record above the cap against "
        f"{best['at the cap'] * 1e3:.2f} ms at it ({ratio:.3f}x)"
    )
