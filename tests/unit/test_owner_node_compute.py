"""Owner share computation: what an owner encrypts for a query, whatever its rows hold.

Decrypting the share gives the exact fixed-point statistics of the owner's rows
(sampled to the public cap, labels outside the query's classes left out, values
clipped to the public bounds); nothing about the rows is ever a reason to refuse.
Uses real rows of ionosphere (column 0 is the class label) and a TEST-ONLY 512-bit key.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from fedpca.codec import CryptoPool, ciphertext_byte_length, ciphertexts_from_bytes, pack_slots
from fedpca.codec.paillier import stream_task_ciphertexts
from fedpca.data import dataset_path
from fedpca.errors import ConfigError, LayoutError
from fedpca.exact_statistics import ChosenRows, fixed_point_statistics
from fedpca.owner import compute
from fedpca.owner.compute import (
    chosen_rows,
    encode_share,
    encrypt_share,
    padded_rows,
    record_cap,
)
from fedpca.owner.config import DataConfig
from fedpca.owner.local_table import LocalTable, QueryColumns
from fedpca.owner.upload import OutgoingUpload
from fedpca.preprocess import preprocess_for_query
from fedpca.protocol import SHARES, SUM_SINGLE, SUM_WINDOWS, ReleasePlan
from fedpca.query import Aggregate, Moments, Neighbouring, ProtocolMode, QueryKind, spec_digest
from fedpca.tables import OwnerTable
from helpers import query_builder, reference_statistics

IONOSPHERE = dataset_path("ionosphere")
FRAC_BITS = 32
CAPACITY = 1000


def _records(table: QueryColumns) -> OwnerTable:
    """Every record of the query's columns, as a plain reading of the table gives them."""
    features = np.array(table.source[:, list(table.feature_columns)])
    label = table.label_column
    return OwnerTable(features, None if label is None else np.array(table.source[:, label]))


def _picked(chosen: ChosenRows) -> OwnerTable:
    """The records among the chosen rows (the rest fill the cap and count for nothing)."""
    records = chosen.positions[: chosen.n_real]
    return OwnerTable(chosen.table[np.ix_(records, chosen.columns)], chosen.labels)


def _contributed(
    table: QueryColumns, spec: Any, cap: int, rng: np.random.Generator | None = None
) -> OwnerTable:
    return _picked(chosen_rows(table, spec, cap, rng))


@pytest.fixture(scope="module")
def ionosphere() -> LocalTable:
    return LocalTable.load(DataConfig(IONOSPHERE, header=False, label_column=0, n_columns=35))


_spec = query_builder(
    n_features=34,
    epsilon=1.0,
    feature_lower=(-1.0,) * 34,
    feature_upper=(1.0,) * 34,
    max_records_per_owner=1000,
    max_owners=8,
    frac_bits=FRAC_BITS,
)


@pytest.mark.parametrize("kind", [QueryKind.PCA, QueryKind.DCA])
def test_decrypted_share_is_the_exact_statistics_of_the_rows(
    test_only_keypair_512: tuple[Any, Any],
    pool: CryptoPool,
    ionosphere: LocalTable,
    kind: QueryKind,
) -> None:
    public_key, private_key = test_only_keypair_512
    extra: dict[str, Any] = {}
    if kind is QueryKind.DCA:
        extra = {"kind": kind, "label_column": 0, "class_labels": (-1.0, 1.0)}
    spec = _spec(public_key, **extra)
    table = ionosphere.table_for(spec)
    assert _records(table).features.shape == (351, 34)
    progress: list[tuple[int, int]] = []
    shares = encrypt_share(
        spec, table, pool, capacity=CAPACITY, progress=lambda d, t: progress.append((d, t))
    )

    plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    assert list(shares) == [SHARES]
    n_ciphertexts = plan.owner_block(SHARES).layout.n_ciphertexts
    assert len(shares[SHARES].ciphertexts) == n_ciphertexts
    assert progress[-1] == (n_ciphertexts, n_ciphertexts)
    integers = pool.decrypt_packed(private_key, shares[SHARES])
    exact = fixed_point_statistics(
        _records(table).features, _records(table).labels, spec
    ).to_vector(plan.statistics)
    assert integers == exact.tolist()
    # ... which are the float statistics to within the rows' quantisation (2^-16 per
    # coordinate, 351 rows).
    received = plan.statistics_from_integers(integers)
    expected = reference_statistics(
        preprocess_for_query(_records(table).features, spec), _records(table).labels, spec
    )
    tolerance = 351 * 2 * 2.0**-16
    np.testing.assert_allclose(received.scatter, expected.scatter, rtol=0, atol=tolerance)
    np.testing.assert_allclose(received.sums, expected.sums, rtol=0, atol=tolerance)
    assert received.count == 351.0
    if kind is QueryKind.DCA:
        assert received.class_counts is not None and expected.class_counts is not None
        np.testing.assert_array_equal(received.class_counts, expected.class_counts)
        assert received.class_counts[0] == np.sum(ionosphere.columns[:, 0] == -1.0)
    # The share really is this owner's data, not e.g. zeros.
    assert np.abs(expected.scatter).max() > 1.0


def test_masked_mode_blocks_decrypt_to_the_planned_values(
    test_only_keypair_512: tuple[Any, Any], pool: CryptoPool, ionosphere: LocalTable
) -> None:
    public_key, private_key = test_only_keypair_512
    m = 3
    # Few features and small bounds keep the masked slots inside a 512-bit key.
    spec = _spec(
        public_key,
        mode=ProtocolMode.MASKED,
        neighbouring=Neighbouring.REPLACE_ONE,
        n_features=m,
        feature_lower=(-1.0,) * m,
        feature_upper=(1.0,) * m,
        frac_bits=16,
        max_owners=2,
    )
    narrow = LocalTable(ionosphere.columns[:, : m + 1], 0, "ionosphere[:, :4]")
    table = narrow.table_for(spec)
    plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    shares = encrypt_share(spec, table, pool, capacity=CAPACITY, plan=plan)
    assert list(shares) == [block.name for block in plan.owner_blocks]
    expected = plan.owner_integers(fixed_point_statistics(_records(table).features, None, spec))
    integers = {name: pool.decrypt_packed(private_key, packed) for name, packed in shares.items()}
    for name, values in integers.items():
        assert values == expected[name].tolist()
    # The mask terms only cancel if every copy of v is the very same integer.
    k = plan.owner_block(SUM_WINDOWS).layout.slots_per_ciphertext
    single = integers[SUM_SINGLE]
    windows = integers[SUM_WINDOWS]
    for t in range(m):
        window = windows[t * k : (t + 1) * k]
        assert window[: m - t] == single[t : t + k][: m - t]


def test_an_upload_packed_as_it_encrypts_replays_the_very_same_messages(
    test_only_keypair_512: tuple[Any, Any], pool: CryptoPool
) -> None:
    # The plaintexts are packed batch by batch while the pool encrypts (no list of
    # the whole share); the upload keeps its chunk messages, so a retry sends exactly
    # the first attempt's bytes, and they decrypt to the packed share, in order.
    public_key, private_key = test_only_keypair_512
    m = 60
    spec = _spec(public_key, n_features=m, feature_lower=(-1.0,) * m, feature_upper=(1.0,) * m)
    plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    block = plan.owner_block(SHARES)
    task = stream_task_ciphertexts(block.layout.n_ciphertexts, pool.processes)
    assert block.layout.n_ciphertexts > 2 * task  # several batches
    rows = np.random.default_rng(0).uniform(-1, 1, size=(80, m))
    table = LocalTable(rows, None, "uniform rows").table_for(spec)
    encoded = encode_share(spec, table, plan, capacity=CAPACITY, rng=np.random.default_rng(0))
    width = ciphertext_byte_length(public_key.n.bit_length())
    per_chunk = 50  # chunks straddle the encryption batches
    upload = OutgoingUpload(
        "u1",
        "header",
        compute.encrypt_share_stream(spec, encoded, plan, pool),
        width,
        per_chunk,
        lambda chunk: (chunk.index, chunk.ciphertexts, chunk.sha256),
    ).start()
    first = list(upload.messages())
    assert upload.wait(30.0) and upload.error is None
    assert list(upload.messages()) == first  # a retry
    assert first[0] == "header" and [m[0] for m in first[1:]] == list(range(len(first) - 1))
    data = b"".join(m[1] for m in first[1:])
    ciphertexts = ciphertexts_from_bytes(data, public_key, block.layout.n_ciphertexts)
    n = public_key.n
    expected = [p % n for p in pack_slots(encoded[SHARES], block.layout, block.bound)]
    assert pool.decrypt(private_key, ciphertexts) == expected


def test_the_encryption_stream_lets_go_of_the_share(
    test_only_keypair_512: tuple[Any, Any], pool: CryptoPool
) -> None:
    """Once begun, the stream holds per-task copies (each dropped once packed) instead
    of the share, so the share's memory goes with its last outside reference (the
    owner's, until the share is kept on disk) rather than staying beside all of its
    ciphertexts."""
    public_key, _ = test_only_keypair_512
    m = 60
    spec = _spec(public_key, n_features=m, feature_lower=(-1.0,) * m, feature_upper=(1.0,) * m)
    plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    total = plan.owner_block(SHARES).layout.n_ciphertexts
    assert total > 2 * stream_task_ciphertexts(total, pool.processes)  # several pieces
    rows = np.random.default_rng(0).uniform(-1, 1, size=(80, m))
    table = LocalTable(rows, None, "uniform rows").table_for(spec)
    encoded = encode_share(spec, table, plan, capacity=CAPACITY, rng=np.random.default_rng(0))
    share = weakref.ref(encoded[SHARES])
    stream = compute.encrypt_share_stream(spec, encoded, plan, pool)
    first = next(stream)
    del encoded
    assert share() is None, "the stream still holds the whole share"
    assert len(first) + sum(len(batch) for batch in stream) == total


def _count(spec: Any, table: QueryColumns, capacity: int) -> float:
    plan = ReleasePlan.for_query(spec, spec.analyst_public_key_n.bit_length())
    values = encode_share(spec, table, plan, capacity=capacity, rng=np.random.default_rng(1))
    statistics = plan.statistics_from_integers(values[SHARES])
    return statistics.count


def test_more_rows_than_the_cap_contribute_a_sample_of_exactly_the_cap(
    test_only_keypair_512: tuple[Any, Any], ionosphere: LocalTable
) -> None:
    """fedpca 0.1 refused (a decline an analyst could binary-search); now it samples."""
    public_key, _ = test_only_keypair_512
    table = ionosphere.table_for(_spec(public_key))
    assert _count(_spec(public_key, max_records_per_owner=100), table, CAPACITY) == 100.0
    # The owner's declared capacity caps it the same way.
    assert _count(_spec(public_key), table, capacity=50) == 50.0
    assert _count(_spec(public_key), table, capacity=CAPACITY) == 351.0
    rows = _contributed(table, _spec(public_key), 100, np.random.default_rng(3))
    assert rows.features.shape == (100, 34)
    # A uniform sample without replacement: distinct rows of the table.
    assert len({row.tobytes() for row in rows.features}) == 100


def test_the_chosen_rows_are_read_from_the_table_not_copied(
    test_only_keypair_512: tuple[Any, Any], ionosphere: LocalTable
) -> None:
    """Copying the query's columns of every record cost time linear in N on each task
    (visible to the proxy), and a copy of the records kept sat beside the statistics:
    the rows are chosen by position in the table kept padded to the capacity, which
    the statistics read block by block."""
    public_key, _ = test_only_keypair_512
    dca = _spec(
        public_key, kind=QueryKind.DCA, label_column=0, class_labels=(-1.0, 1.0), n_components=1
    )
    for spec in (_spec(public_key), dca):
        table = ionosphere.table_for(spec)
        assert table.source is ionosphere.columns and table.padding is ionosphere.padded
        chosen = chosen_rows(table, spec, 40, np.random.default_rng(1))
        assert chosen.table is ionosphere.padded and not chosen.table.flags.writeable
        per_class = 2 if spec.kind is QueryKind.DCA else 1
        assert chosen.total == chosen.n_real == 40 * per_class
        assert len(set(chosen.positions.tolist())) == chosen.total  # without replacement
        rows = _picked(chosen)
        source = {row.tobytes() for row in ionosphere.columns[:, 1:]}
        assert all(row.tobytes() in source for row in rows.features)
        if spec.kind is QueryKind.DCA:
            assert rows.labels is not None and np.sum(rows.labels == 1.0) == 40
            np.testing.assert_array_equal(rows.labels, ionosphere.columns[chosen.positions, 0])
        else:
            assert rows.labels is None


@pytest.mark.parametrize("suffix", [".csv", ".npy", ".parquet"])
def test_an_owner_without_records_contributes_a_zero_share(
    test_only_keypair_512: tuple[Any, Any], tmp_path: Path, suffix: str
) -> None:
    """Found by review: a node refused to start without records, so whether an owner
    held its last record showed (add/remove makes the two tables neighbours). A table
    of known width and no records now loads, and every kind of query gets a share of
    the agreed layout holding zeros: the same as the padding of any other owner."""
    public_key, _ = test_only_keypair_512
    width = 35  # label + 34 features, as ionosphere
    path = tmp_path / f"empty{suffix}"
    if suffix == ".csv":
        path.write_text(",".join(f"c{j}" for j in range(width)) + "\n")
    elif suffix == ".npy":
        np.save(path, np.zeros((0, width)))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({f"c{j}": pa.array([], pa.float64()) for j in range(width)}), path)
    empty = LocalTable.load(
        DataConfig(path, header=True, label_column=0, max_records=50, n_columns=width)
    )
    assert empty.n_records == 0 and empty.n_features == 34
    specs = [
        _spec(public_key),
        _spec(public_key, kind=QueryKind.DCA, label_column=0, class_labels=(-1.0, 1.0)),
        _spec(
            public_key,
            kind=QueryKind.AGGREGATE,
            n_features=2,
            n_components=1,
            aggregates=(Aggregate.statistics((1, 2), (0.0, 0.0), (1.0, 1.0)),),
            feature_lower=(),
            feature_upper=(),
        ),
    ]
    for spec in specs:
        plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
        encoded = encode_share(spec, empty.table_for(spec), plan, capacity=50)
        assert [name for name in encoded] == [block.name for block in plan.owner_blocks]
        for block in plan.owner_blocks:
            values = encoded[block.name]
            assert values.shape == (block.layout.value_count,) and not values.any()


def test_bounded_owner_tables_never_sample(
    test_only_keypair_512: tuple[Any, Any], ionosphere: LocalTable, tmp_path: Path
) -> None:
    """A node that enforces its capacity refuses to load a larger table, and a query
    for bounded owner tables cannot make an owner sample (it would be a bug)."""
    public_key, _ = test_only_keypair_512
    path = tmp_path / "rows.npy"
    np.save(path, ionosphere.columns)
    with pytest.raises(ConfigError, match=r"more records than data\.max_records = 350"):
        LocalTable.load(DataConfig(path, max_records=350, enforce_max_records=True, n_columns=35))
    loaded = LocalTable.load(
        DataConfig(path, max_records=351, enforce_max_records=True, n_columns=35)
    )
    assert loaded.n_records == 351
    # Without enforcement the same file loads, and queries use a sample.
    assert LocalTable.load(DataConfig(path, max_records=350, n_columns=35)).n_records == 351
    bounded = _spec(public_key, bounded_owner_tables=True)
    table = ionosphere.table_for(bounded)
    assert _contributed(table, bounded, 351).features.shape[0] == 351
    with pytest.raises(LayoutError, match="bounded owner tables reached an owner that samples"):
        _contributed(table, bounded, 350)


def test_dca_caps_each_class_and_leaves_unknown_labels_out(
    test_only_keypair_512: tuple[Any, Any], ionosphere: LocalTable
) -> None:
    public_key, _ = test_only_keypair_512
    spec = _spec(
        public_key, kind=QueryKind.DCA, label_column=0, class_labels=(1.0, 5.0), n_components=1
    )
    table = ionosphere.table_for(spec)  # labels -1 and 1; -1 is not a class of this query
    rows = _contributed(table, spec, 60, np.random.default_rng(0))
    assert rows.labels is not None and set(np.unique(rows.labels)) == {1.0}
    assert rows.features.shape[0] == 60
    assert record_cap(spec, 40) == 40 and padded_rows(spec, 40) == 80  # per class


def test_dca_takes_each_class_up_to_the_cap_and_nothing_else(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    """Each class gives all its records below the cap and a sample of exactly the cap
    above it; a label outside the query's classes, and the padding, never count."""
    public_key, _ = test_only_keypair_512
    rng = np.random.default_rng(5)
    n = 3_000
    labels = rng.choice([-0.0, 0.0, 1.0, 2.5, 7.0], n)  # 7 is no class; -0 == 0
    source = np.column_stack([rng.uniform(-1, 1, (n, 3)), labels])
    spec = query_builder(n_features=3, epsilon=1.0, max_records_per_owner=400)(
        public_key, kind=QueryKind.DCA, label_column=3, class_labels=(2.5, 0.0, 1.0, 4.0)
    )
    table = LocalTable(source, 3, "test", 4_000).table_for(spec)
    for cap in (400, 5_000):  # sampled classes, then every record of each class
        chosen = chosen_rows(table, spec, cap, np.random.default_rng(11))
        assert chosen.total == 4 * cap
        records = chosen.positions[: chosen.n_real]
        assert len(set(records.tolist())) == records.size and records.max() < n
        assert chosen.labels is not None
        np.testing.assert_array_equal(chosen.labels, labels[records])
        for label in spec.class_labels:
            members = set(np.flatnonzero(labels == label).tolist())
            taken = set(records[chosen.labels == label].tolist())
            assert taken <= members and len(taken) == min(len(members), cap)
        assert not np.isin(labels[records], [7.0]).any()
    empty = LocalTable(np.zeros((0, 4)), 3, "empty", 50).table_for(spec)
    assert _contributed(empty, spec, 50).features.shape == (0, 3)
    in_memory = QueryColumns(np.zeros((0, 4)), (0, 1, 2), 3)  # no padding, no records
    assert chosen_rows(in_memory, spec, 50).n_real == 0


def test_dca_keeping_every_record_gives_the_row_by_row_statistics(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    """The class lookup compares every row with every class; the class sums are those
    of a row-by-row reading."""
    public_key, _ = test_only_keypair_512
    rng = np.random.default_rng(6)
    n = 2_000
    labels = rng.choice([0.0, 1.0], n)
    source = np.column_stack([rng.uniform(-1, 1, (n, 3)), labels])
    spec = query_builder(n_features=3, epsilon=1.0, max_records_per_owner=5_000)(
        public_key, kind=QueryKind.DCA, label_column=3, class_labels=(1.0, 0.0)
    )
    table = LocalTable(source, 3, "test").table_for(spec)
    rows = _contributed(table, spec, 5_000)
    order = np.lexsort(rows.features.T[::-1])
    expected_order = np.lexsort(source[:, :3].T[::-1])
    np.testing.assert_array_equal(rows.features[order], source[expected_order, :3])
    assert rows.labels is not None
    np.testing.assert_array_equal(rows.labels[order], labels[expected_order])
    # The statistics' lookup: the same class sums as a row-by-row reading.
    stats = fixed_point_statistics(chosen_rows(table, spec, 5_000), None, spec)
    ones = labels == 1.0
    expected = fixed_point_statistics(source[ones, :3], labels[ones], spec)
    zeros = fixed_point_statistics(source[~ones, :3], labels[~ones], spec)
    assert stats.class_sums is not None and expected.class_sums is not None
    assert zeros.class_sums is not None
    np.testing.assert_array_equal(
        stats.class_sums, expected.class_sums * [[1], [0]] + zeros.class_sums
    )
    np.testing.assert_array_equal(stats.scatter, expected.scatter + zeros.scatter)
    with pytest.raises(LayoutError, match="one of the query's class labels"):
        fixed_point_statistics(rows.features[:3], np.array([0.0, 1.0, 0.5]), spec)


def test_values_outside_the_bounds_are_clipped_not_refused(
    test_only_keypair_512: tuple[Any, Any], pool: CryptoPool, ionosphere: LocalTable
) -> None:
    public_key, private_key = test_only_keypair_512
    m = 34
    spec = _spec(public_key, feature_lower=(0.0,) * m, feature_upper=(0.5,) * m)
    table = ionosphere.table_for(spec)
    shares = encrypt_share(spec, table, pool, capacity=CAPACITY)
    clipped = np.clip(_records(table).features, 0.0, 0.5)
    expected = fixed_point_statistics(clipped, None, spec)
    plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    assert (
        pool.decrypt_packed(private_key, shares[SHARES])
        == expected.to_vector(plan.statistics).tolist()
    )


def test_the_work_is_padded_to_the_public_cap(
    test_only_keypair_512: tuple[Any, Any], ionosphere: LocalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The statistics always process the cap's number of rows, however many are real."""
    public_key, _ = test_only_keypair_512
    spec = _spec(public_key)
    plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    seen: list[tuple[int, int]] = []
    real = compute.fixed_point_statistics

    def recording(rows: ChosenRows, labels: Any, query: Any) -> Any:
        seen.append((rows.total, rows.n_real))
        return real(rows, labels, query)

    monkeypatch.setattr(compute, "fixed_point_statistics", recording)
    every = _records(ionosphere.table_for(spec)).features
    for n in (10, 351):
        small = LocalTable(every[:n], None, "first rows").table_for(spec)
        encode_share(spec, small, plan, capacity=CAPACITY)
        padded = LocalTable(every[:n], None, "first rows", CAPACITY).table_for(spec)
        encode_share(spec, padded, plan, capacity=CAPACITY)
    assert seen == [(1000, 10), (1000, 10), (1000, 351), (1000, 351)]


def test_a_table_padded_to_its_capacity_gives_the_same_share(
    test_only_keypair_512: tuple[Any, Any], ionosphere: LocalTable
) -> None:
    """Reading the padding from the table (review: real rows were read, padding rows
    only written, so N showed in the time for a file wider than the query) changes no
    value: PCA, an aggregate of consecutive columns and one of scattered columns."""
    public_key, _ = test_only_keypair_512
    source = ionosphere.columns[:200]
    specs = [
        _spec(public_key),
        query_builder(n_features=3, n_components=1, epsilon=1.0, max_records_per_owner=CAPACITY)(
            public_key,
            kind=QueryKind.AGGREGATE,
            aggregates=(Aggregate.statistics((4, 5, 6), (-1.0,) * 3, (1.0,) * 3),),
        ),
        query_builder(n_features=4, n_components=1, epsilon=1.0, max_records_per_owner=CAPACITY)(
            public_key,
            kind=QueryKind.AGGREGATE,
            aggregates=(
                Aggregate.statistics((2, 9, 30), (-1.0,) * 3, (1.0,) * 3, Moments.COVARIANCE),
                Aggregate.histogram((7,), ((-1.0, 0.0, 1.0),)),
            ),
        ),
    ]
    for spec in specs:
        plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
        label = ionosphere.label_column
        plain = LocalTable(source, label, "plain").table_for(spec)
        padded = LocalTable(source, label, "padded", CAPACITY).table_for(spec)
        assert padded.padding is not None and padded.padding.shape[0] == CAPACITY
        expected = encode_share(spec, plain, plan, capacity=CAPACITY)
        got = encode_share(spec, padded, plan, capacity=CAPACITY)
        assert expected.keys() == got.keys()
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name])


def _blas_threads() -> int:
    return max(pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas")


@pytest.mark.parametrize("small", [True, False])
def test_statistics_of_a_small_table_run_on_one_blas_thread(
    test_only_keypair_512: tuple[Any, Any],
    ionosphere: LocalTable,
    monkeypatch: pytest.MonkeyPatch,
    small: bool,
) -> None:
    """Below SINGLE_THREAD_BLAS_WORK the Gram matrix is computed on one BLAS thread (no
    spinning pool threads afterwards); above it BLAS keeps its threads; either way the
    process's limit is restored."""
    public_key, _ = test_only_keypair_512
    spec = _spec(public_key)
    work = CAPACITY * 34**2
    assert work < compute.SINGLE_THREAD_BLAS_WORK
    if not small:
        monkeypatch.setattr(compute, "SINGLE_THREAD_BLAS_WORK", work)
    plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    before = _blas_threads()
    with threadpool_limits(limits=2, user_api="blas"):
        if _blas_threads() < 2:
            pytest.skip("this BLAS cannot run two threads here")
        seen: list[int] = []
        real = compute.fixed_point_statistics

        def recording(features: Any, labels: Any, query: Any, **padding: Any) -> Any:
            seen.append(_blas_threads())
            return real(features, labels, query, **padding)

        monkeypatch.setattr(compute, "fixed_point_statistics", recording)
        table = ionosphere.table_for(spec)
        encode_share(spec, table, plan, capacity=CAPACITY)
        assert seen == [1 if small else 2]
        assert _blas_threads() == 2
    assert _blas_threads() == before


def test_pca_drops_the_configured_label_column(
    test_only_keypair_512: tuple[Any, Any], ionosphere: LocalTable
) -> None:
    public_key, _ = test_only_keypair_512
    table = ionosphere.table_for(_spec(public_key))
    np.testing.assert_array_equal(_records(table).features, ionosphere.columns[:, 1:])
    assert _records(table).labels is None


def test_spec_digest_binds_every_public_parameter(test_only_keypair_512: tuple[Any, Any]) -> None:
    public_key, _ = test_only_keypair_512
    base = _spec(public_key)
    assert spec_digest(base) == spec_digest(_spec(public_key))
    assert spec_digest(base) != spec_digest(_spec(public_key, epsilon=0.5))
    assert spec_digest(base) != spec_digest(_spec(public_key, clip_norm=0.5))
    assert spec_digest(base) != spec_digest(_spec(public_key, query_id="other"))


@pytest.mark.parametrize("kind", [QueryKind.PCA, QueryKind.DCA])
def test_choosing_the_rows_does_the_same_work_whatever_n(
    test_only_keypair_512: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, kind: QueryKind
) -> None:
    """The owner sampled (and copied) only when N exceeded the analyst's cap K, and the
    sample's cost grew with N: the time to its upload header timed N exactly by
    bisecting K (an outside attack). Every step of the choice now has the same sizes
    whatever N is, below, at or above K: one random ordering and one sort of all U rows
    of the padded table, the cap's number of positions per class. (A re-attack of the
    fix: the sort returned at once when all its keys were alike, N = 0 or N = U.)"""
    public_key, _ = test_only_keypair_512
    cap, capacity = 50, 400
    extra: dict[str, Any] = {}
    if kind is QueryKind.DCA:
        extra = {"kind": kind, "label_column": 3, "class_labels": (1.0, 2.0)}
    spec = query_builder(n_features=3, epsilon=1.0, max_records_per_owner=cap)(public_key, **extra)
    calls: list[tuple[str, tuple[int, ...], str]] = []
    real_argsort, real_permutation = np.argsort, np.random.Generator.permutation

    def argsort(values: Any, *args: Any, **kwargs: Any) -> Any:
        # Whether every key is alike too: numpy's radix sort then returns at once.
        alike = bool(np.all(np.asarray(values) == np.asarray(values).flat[0]))
        calls.append(("argsort", np.shape(values), f"{np.asarray(values).dtype} {alike}"))
        return real_argsort(values, *args, **kwargs)

    class Recording:
        def permutation(self, size: int) -> Any:
            calls.append(("permutation", (size,), "int"))
            return real_permutation(np.random.default_rng(0), size)

    monkeypatch.setattr(compute.np, "argsort", argsort)
    work = {}
    for n in (0, cap - 1, cap, cap + 1, 3 * cap, capacity):
        rng = np.random.default_rng(n)
        source = np.column_stack([rng.uniform(-1, 1, (n, 3)), rng.choice([1.0, 2.0], n)])
        table = LocalTable(source, 3, "test", capacity).table_for(spec)
        calls.clear()
        chosen = chosen_rows(table, spec, cap, Recording())  # type: ignore[arg-type]
        blocks = [(start, rows.shape) for start, rows, _ in chosen.blocks(64)]
        work[n] = (tuple(calls), chosen.total, chosen.table.shape, tuple(blocks))
        assert chosen.n_real <= chosen.total
    assert len(set(work.values())) == 1, work


def test_rows_past_a_class_are_random_rows_not_one_row_read_again(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    """A re-attack of the choice: the slots past the last row read row 0 again and
    again, which stayed in cache, so the classes after a large first class were read
    faster, by its size. They read random rows now."""
    public_key, _ = test_only_keypair_512
    capacity = cap = 400
    spec = query_builder(n_features=3, epsilon=1.0, max_records_per_owner=cap)(
        public_key, kind=QueryKind.DCA, label_column=3, class_labels=(1.0, 2.0)
    )
    rng = np.random.default_rng(2)
    source = np.column_stack([rng.uniform(-1, 1, (capacity, 3)), np.ones(capacity)])
    table = LocalTable(source, 3, "test", capacity).table_for(spec)
    chosen = chosen_rows(table, spec, cap, np.random.default_rng(3))
    assert chosen.n_real == cap  # every record, all of class 1.0
    fillers = chosen.positions[chosen.n_real :]  # class 2.0's slots, all past the rows
    assert fillers.size == cap and len(set(fillers.tolist())) > cap // 2


def test_a_clip_norm_whose_squares_would_be_subnormal_is_refused(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    """A re-attack of the choice: at clip_norm 1e-155 the squares of a row's entries are
    subnormal, and clipping shaved rows that hold records in up to 8 more passes than
    zero rows (the reviewer timed N = 1 against N = 0 by hand). Such a norm is refused
    with the query."""
    public_key, _ = test_only_keypair_512
    with pytest.raises(ConfigError, match="at least 1e-100"):
        _spec(public_key, clip_norm=1e-155)
    assert _spec(public_key, clip_norm=1e-100).clip_norm == 1e-100
