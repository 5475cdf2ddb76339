"""Owner share computation: decrypting the encrypted share gives the local statistics.

Uses real rows of ionosphere.csv (column 0 is the class label) and a TEST-ONLY
512-bit key.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedpca.codec import CryptoPool, decode_fixed_point
from fedpca.data import dataset_path
from fedpca.errors import DataError, EncodingOverflowError
from fedpca.owner.compute import LocalTable, encrypt_share
from fedpca.owner.config import DataConfig
from fedpca.owner.statistics import local_statistics
from fedpca.preprocess import preprocess_for_query
from fedpca.protocol import SHARES, SUM_SINGLE, SUM_WINDOWS, ReleasePlan
from fedpca.query import ProtocolMode, QueryKind, QuerySpec, spec_digest
from fedpca.stats import SufficientStatistics
from helpers import query_builder

IONOSPHERE = dataset_path("ionosphere")
FRAC_BITS = 32


@pytest.fixture(scope="module")
def ionosphere() -> LocalTable:
    return LocalTable.load(DataConfig(IONOSPHERE, header=False, label_column=0))


_spec = query_builder(
    n_features=34,
    epsilon=1.0,
    feature_lower=(-1.0,) * 34,
    feature_upper=(1.0,) * 34,
    max_records_per_owner=1000,
    max_owners=8,
    frac_bits=FRAC_BITS,
)


def _decrypt(pool: CryptoPool, private_key: Any, packed: Any) -> np.ndarray:
    return decode_fixed_point(pool.decrypt_packed(private_key, packed), FRAC_BITS)


@pytest.mark.parametrize("kind", [QueryKind.PCA, QueryKind.DCA])
def test_decrypted_share_is_the_local_statistics(
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
    assert table.features.shape == (351, 34)
    progress: list[tuple[int, int]] = []
    shares = encrypt_share(spec, table, pool, progress=lambda d, t: progress.append((d, t)))

    plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    assert list(shares) == [SHARES]
    n_ciphertexts = plan.owner_block(SHARES).layout.n_ciphertexts
    assert len(shares[SHARES].ciphertexts) == n_ciphertexts
    assert progress[-1] == (n_ciphertexts, n_ciphertexts)
    decoded = _decrypt(pool, private_key, shares[SHARES])
    received = plan.statistics_from_values(decoded)

    rows = preprocess_for_query(table.features, spec)
    expected = local_statistics(rows, table.labels, spec)
    tolerance = 2.0**-FRAC_BITS  # one stochastic rounding per value
    np.testing.assert_allclose(received.scatter, expected.scatter, rtol=0, atol=tolerance)
    # DCA derives v from C separately rounded class sums.
    sums_tolerance = tolerance * max(1, len(spec.class_labels))
    np.testing.assert_allclose(received.sums, expected.sums, rtol=0, atol=sums_tolerance)
    assert received.count == 351.0
    if kind is QueryKind.DCA:
        assert received.class_counts is not None and expected.class_sums is not None
        np.testing.assert_array_equal(received.class_counts, expected.class_counts)
        assert received.class_sums is not None
        np.testing.assert_allclose(received.class_sums, expected.class_sums, atol=tolerance)
        assert received.class_counts.sum() == 351.0
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
        n_features=m,
        feature_lower=(-1.0,) * m,
        feature_upper=(1.0,) * m,
        frac_bits=16,
        max_owners=2,
    )
    narrow = LocalTable(ionosphere.columns[:, : m + 1], 0, "ionosphere[:, :4]")
    table = narrow.table_for(spec)
    plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    shares = encrypt_share(spec, table, pool, plan=plan)
    assert list(shares) == [block.name for block in plan.owner_blocks]
    rows = preprocess_for_query(table.features, spec)
    expected = plan.owner_values(local_statistics(rows, None, spec))
    integers = {name: pool.decrypt_packed(private_key, packed) for name, packed in shares.items()}
    for name, values in integers.items():
        decoded = decode_fixed_point(values, 16)
        np.testing.assert_allclose(decoded, expected[name], rtol=0, atol=2.0**-16)
    # The mask terms only cancel if every copy of v is the very same integer.
    k = plan.owner_block(SUM_WINDOWS).layout.slots_per_ciphertext
    single = integers[SUM_SINGLE]
    windows = integers[SUM_WINDOWS]
    for t in range(m):
        window = windows[t * k : (t + 1) * k]
        assert window[: m - t] == single[t : t + k][: m - t]


class _RecordingPool:
    """Stands in for CryptoPool: any encryption call is a test failure."""

    def __init__(self) -> None:
        self.calls = 0

    def encrypt_packed(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise AssertionError("nothing may be encrypted")


def test_more_rows_than_declared_is_refused_before_encryption(
    test_only_keypair_512: tuple[Any, Any], ionosphere: LocalTable
) -> None:
    public_key, _ = test_only_keypair_512
    spec = _spec(public_key, max_records_per_owner=100)
    recording = _RecordingPool()
    with pytest.raises(EncodingOverflowError, match="max_records_per_owner=100"):
        encrypt_share(spec, ionosphere.table_for(spec), recording)  # type: ignore[arg-type]
    assert recording.calls == 0


def test_out_of_bounds_refuse_raises_before_encryption(
    test_only_keypair_512: tuple[Any, Any], ionosphere: LocalTable
) -> None:
    public_key, _ = test_only_keypair_512
    m = 34
    spec = _spec(public_key, feature_lower=(0.0,) * m, feature_upper=(0.5,) * m)
    recording = _RecordingPool()
    with pytest.raises(DataError, match="outside the declared public bounds"):
        encrypt_share(
            spec,
            ionosphere.table_for(spec),
            recording,  # type: ignore[arg-type]
            out_of_bounds="refuse",
        )
    assert recording.calls == 0


def test_pca_drops_the_configured_label_column(
    test_only_keypair_512: tuple[Any, Any], ionosphere: LocalTable
) -> None:
    public_key, _ = test_only_keypair_512
    table = ionosphere.table_for(_spec(public_key))
    np.testing.assert_array_equal(table.features, ionosphere.columns[:, 1:])
    assert table.labels is None


def test_spec_digest_binds_every_public_parameter(test_only_keypair_512: tuple[Any, Any]) -> None:
    public_key, _ = test_only_keypair_512
    base = _spec(public_key)
    assert spec_digest(base) == spec_digest(_spec(public_key))
    assert spec_digest(base) != spec_digest(_spec(public_key, epsilon=0.5))
    assert spec_digest(base) != spec_digest(_spec(public_key, clip_norm=0.5))


def test_statistics_vector_roundtrip_sanity() -> None:
    # Guards the test's own decoding path: the plan's vector layout is invertible.
    spec = QuerySpec("q", QueryKind.PCA, 2, 1.0, 1e-5, 1, 77, "f")
    stats = SufficientStatistics(np.eye(2), np.ones(2), 3.0)
    plan_statistics = ReleasePlan.for_query(spec, 512).statistics
    vector = stats.to_vector(plan_statistics)
    back = SufficientStatistics.from_vector(plan_statistics, vector)
    np.testing.assert_array_equal(back.scatter, stats.scatter)
