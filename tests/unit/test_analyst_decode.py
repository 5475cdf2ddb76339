"""Analyst decryption and decoding: stats and masked mode, and refusals.

Results are built in the tests the way owners and the proxy build them: owners'
local statistics of real rows, fixed-point encoded, packed and encrypted under a
TEST-ONLY 512-bit analyst key, summed homomorphically; masked-mode results by
hand from known R, v, b.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from fedpca.analyst.decode import (
    DecodedRelease,
    decrypt_result,
    decrypt_stream,
    noise_description,
    result_from_packed,
    unmask_scatter,
)
from fedpca.analyst.estimators import FederatedDCA, FederatedPCA
from fedpca.analyst.solvers import (
    dca_from_statistics,
    pca_from_centred_scatter,
    pca_from_statistics,
)
from fedpca.codec import (
    CryptoPool,
    PackedCiphertexts,
    PackingBounds,
    add_packed,
    generate_keypair,
    key_fingerprint,
    owner_value_bound,
)
from fedpca.data import dataset_path
from fedpca.dp.noise import TestOnlySeededSampler
from fedpca.errors import (
    EncodingOverflowError,
    LayoutError,
    ProtocolError,
    UntrustedKeyError,
)
from fedpca.exact_statistics import FixedPointStatistics, fixed_point_statistics
from fedpca.masked_release import mask_width, row_aligned_positions
from fedpca.messages import (
    CiphertextPayload,
    QueryResult,
)
from fedpca.preprocess import preprocess_for_query
from fedpca.protocol import (
    MASKED_SUM,
    SCATTER_ROWS,
    SHARES,
    ReleasePlan,
)
from fedpca.query import Neighbouring, ProtocolMode, QueryKind, QuerySpec
from fedpca.stats import SufficientStatistics
from fedpca.tables import load_table
from helpers import query_builder

IONOSPHERE = dataset_path("ionosphere")
N_OWNERS = 3


@pytest.fixture(scope="module")
def ionosphere() -> tuple[np.ndarray, np.ndarray]:
    rows, labels = load_table(IONOSPHERE, label_column=0)
    assert labels is not None
    return rows, labels


make_spec = query_builder(
    query_id="q-test",
    n_features=34,
    delta=1e-6,
    n_components=3,
    # (-2, 2) halves every feature, so the bounds scaling is not the identity.
    feature_lower=(-2.0,) * 34,
    feature_upper=(2.0,) * 34,
    max_records_per_owner=256,
    max_owners=4,
)


def owner_statistics(
    spec: QuerySpec, rows: np.ndarray, labels: np.ndarray
) -> list[FixedPointStatistics]:
    """The exact statistics each of N_OWNERS owners releases for ``spec``."""
    parts = np.array_split(np.arange(len(rows)), N_OWNERS)
    return [
        fixed_point_statistics(
            rows[index], labels[index] if spec.kind is QueryKind.DCA else None, spec
        )
        for index in parts
    ]


def pooled_statistics(spec: QuerySpec, shares: list[FixedPointStatistics]) -> SufficientStatistics:
    """The noiseless sum of the owners' statistics, in real units."""
    plan = ReleasePlan.for_query(spec, spec.analyst_public_key_n.bit_length())
    total = sum(share.to_vector(plan.statistics).astype(object) for share in shares)
    return plan.statistics_from_integers(total)


def encrypted_stats_result(
    spec: QuerySpec,
    shares: list[FixedPointStatistics],
    public_key: Any,
    pool: CryptoPool,
    noise: np.ndarray | None = None,
) -> QueryResult:
    """What owners upload and the proxy folds (plus optional noise), as a result."""
    plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    block = plan.owner_block(SHARES)
    total: PackedCiphertexts | None = None
    for share in shares:
        values = plan.owner_integers(share)[SHARES]
        packed = pool.encrypt_packed(public_key, values, block.layout, block.bound)
        total = packed if total is None else add_packed(total, packed)
    assert total is not None
    if noise is not None:
        headroom = plan.bounds.noise_headroom
        total = add_packed(total, pool.encrypt_packed(public_key, noise, block.layout, headroom))
    return result_from_packed(spec, len(shares), {SHARES: total})


# ------------------------------------------------------------------ stats mode
def test_stats_pca_without_noise_equals_sklearn_on_pooled_rows(
    test_only_keypair_512: Any, pool: CryptoPool, ionosphere: tuple[np.ndarray, np.ndarray]
) -> None:
    from sklearn.decomposition import PCA

    public_key, private_key = test_only_keypair_512
    rows, labels = ionosphere
    spec = make_spec(public_key)
    shares = owner_statistics(spec, rows, labels)
    result = encrypted_stats_result(spec, shares, public_key, pool)

    progress: list[int] = []
    release = decrypt_result(
        result, private_key, expected_query=spec, pool=pool, progress=progress.append
    )
    # Progress moves as batches are decrypted (one call at the end before: `fetch`
    # showed nothing for 12 s at madelon's width).
    total = result.payload.total_ciphertexts
    assert total > 32 and len(progress) > 1
    assert progress == sorted(progress) and progress[-1] == total
    estimator = FederatedPCA.from_result(release)
    # Without noise the decoded statistics are exactly the owners' summed integers.
    assert release.statistics is not None
    exact = pooled_statistics(spec, shares)
    np.testing.assert_array_equal(release.statistics.scatter, exact.scatter)
    np.testing.assert_array_equal(release.statistics.sums, exact.sums)

    # ... and the components are sklearn's on the pooled rows, to within the owners'
    # quantisation of each row coordinate to 2^-16.
    pooled = preprocess_for_query(rows, spec)
    reference = PCA(n_components=3, svd_solver="covariance_eigh").fit(pooled)
    signs = np.sign(np.sum(estimator.components_ * reference.components_, axis=1))
    np.testing.assert_allclose(
        estimator.components_ * signs[:, None], reference.components_, atol=1e-4
    )
    np.testing.assert_allclose(
        estimator.explained_variance_, reference.explained_variance_, rtol=1e-4
    )
    np.testing.assert_allclose(
        estimator.explained_variance_ratio_, reference.explained_variance_ratio_, rtol=1e-4
    )
    assert estimator.mean_ is not None
    np.testing.assert_allclose(estimator.mean_, reference.mean_, atol=2.0**-15)
    # The count is encoded exactly in fixed point and no noise was added.
    assert estimator.n_samples_ == len(rows)
    assert estimator.not_private_ and not estimator.n_samples_is_noisy_
    assert estimator.n_owners_ == N_OWNERS
    # preprocess applies the query's public bounds and clip; transform projects like sklearn.
    np.testing.assert_array_equal(estimator.preprocess(rows[:20]), pooled[:20])
    scores = estimator.transform(pooled[:20])
    assert scores.shape == (20, 3)
    np.testing.assert_allclose(scores * signs, reference.transform(pooled[:20]), atol=1e-4)


def test_stats_dca_without_noise_equals_solver_on_pooled_statistics(
    test_only_keypair_512: Any, pool: CryptoPool, ionosphere: tuple[np.ndarray, np.ndarray]
) -> None:
    public_key, private_key = test_only_keypair_512
    rows, labels = ionosphere
    spec = make_spec(
        public_key,
        kind=QueryKind.DCA,
        n_components=1,
        label_column=0,
        class_labels=(-1.0, 1.0),
    )
    shares = owner_statistics(spec, rows, labels)
    result = encrypted_stats_result(spec, shares, public_key, pool)

    estimator = FederatedDCA.from_result(decrypt_result(result, private_key, pool=pool))
    reference = dca_from_statistics(pooled_statistics(spec, shares), 1)

    np.testing.assert_allclose(estimator.components_, reference.components, atol=1e-7)
    np.testing.assert_allclose(estimator.eigenvalues_, reference.eigenvalues, rtol=1e-7)
    np.testing.assert_array_equal(estimator.classes_, [-1.0, 1.0])
    np.testing.assert_allclose(estimator.class_counts_, [np.sum(labels == -1), np.sum(labels == 1)])
    assert estimator.transform(estimator.preprocess(rows[:5])).shape == (5, 1)


def test_noisy_stats_release_decodes_to_truth_plus_the_added_noise(
    test_only_keypair_512: Any, pool: CryptoPool, ionosphere: tuple[np.ndarray, np.ndarray]
) -> None:
    public_key, private_key = test_only_keypair_512
    rows, labels = ionosphere
    spec = make_spec(public_key, epsilon=1.0, n_features=34)
    plan = ReleasePlan.for_query(spec, 512)
    noise = plan.noise_values(TestOnlySeededSampler(3))
    assert (noise < 0).any()  # negative slots must survive packing and decoding
    shares = owner_statistics(spec, rows, labels)
    result = encrypted_stats_result(spec, shares, public_key, pool, noise=noise)

    release = decrypt_result(result, private_key, expected_query=spec, pool=pool)

    assert release.private and release.n_samples_is_noisy
    assert release.statistics is not None
    decoded = release.statistics.to_vector(plan.statistics)
    # The release keeps the vector; the matrix form and the PCA are made from it.
    assert release.values is not None and not release.values.flags.writeable
    np.testing.assert_array_equal(release.values, decoded)
    assert release.n_samples == release.statistics.count
    np.testing.assert_array_equal(
        release.pca(3).components,
        pca_from_statistics(release.statistics, n_components=3).components,
    )
    truth = pooled_statistics(spec, shares).to_vector(plan.statistics)
    # Exactly the owners' integers plus the noise (clip norm 1: clip units are real units).
    np.testing.assert_allclose(
        decoded - truth, np.ldexp(noise.astype(float), -spec.frac_bits), atol=1e-9
    )
    assert release.sigmas == {s.name: s.sigma for s in plan.sections}
    estimator = FederatedPCA.from_result(release)
    assert estimator.epsilon_ == 1.0 and estimator.delta_ == 1e-6
    assert not estimator.not_private_
    assert estimator.n_samples_ != len(rows)


def test_pages_are_unpacked_as_they_are_decrypted_and_counted(
    test_only_keypair_512: Any, pool: CryptoPool, ionosphere: tuple[np.ndarray, np.ndarray]
) -> None:
    # Pages of any size (here 7 ciphertexts, across slot and section boundaries) decode
    # to the release of the whole result; a result longer or shorter than the plan
    # is refused.
    public_key, private_key = test_only_keypair_512
    rows, labels = ionosphere
    spec = make_spec(public_key, epsilon=1.0, n_features=34)
    plan = ReleasePlan.for_query(spec, 512)
    noise = plan.noise_values(TestOnlySeededSampler(3))
    result = encrypted_stats_result(
        spec, owner_statistics(spec, rows, labels), public_key, pool, noise=noise
    )
    whole = decrypt_result(result, private_key, expected_query=spec, pool=pool)
    ciphertexts = list(result.payload.in_wire_order())
    assert len(ciphertexts) > 14
    pages = [ciphertexts[i : i + 7] for i in range(0, len(ciphertexts), 7)]
    paged = decrypt_stream(result, pages, private_key, expected_query=spec, pool=pool)
    assert whole.statistics is not None and paged.statistics is not None
    assert np.array_equal(paged.statistics.scatter, whole.statistics.scatter)
    assert np.array_equal(paged.statistics.sums, whole.statistics.sums)
    assert paged.statistics.count == whole.statistics.count
    with pytest.raises(ProtocolError, match=f"more than {len(ciphertexts)} ciphertexts"):
        decrypt_stream(result, [*pages, ciphertexts[:1]], private_key, pool=pool)
    with pytest.raises(ProtocolError, match=f"{len(ciphertexts) - 7} ciphertexts, the plan"):
        decrypt_stream(result, pages[1:], private_key, pool=pool)


# ----------------------------------------------------------------- masked mode
def masked_spec(public_key: Any, m: int = 4) -> QuerySpec:
    return make_spec(
        public_key,
        n_features=m,
        n_components=2,
        feature_lower=(),
        feature_upper=(),
        mode=ProtocolMode.MASKED,
        neighbouring=Neighbouring.REPLACE_ONE,
        frac_bits=16,
        max_records_per_owner=64,
    )


def masked_result_by_hand(
    spec: QuerySpec, public_key: Any, pool: CryptoPool, seed: int
) -> tuple[QueryResult, int, np.ndarray]:
    """T and v' computed in plaintext from known R, v, b, E; returns (result, N, S + E)."""
    rng = random.Random(seed)
    m, f = spec.n_features, spec.frac_bits
    n_records = 37
    plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    scale = 1 << f
    # Integer R, v in 2^f units as the owners' sums would be (|x| <= 1 per entry).
    r = [[0] * m for _ in range(m)]
    for i in range(m):
        for j in range(i, m):
            r[i][j] = r[j][i] = rng.randint(-n_records * scale, n_records * scale)
    v = [rng.randint(-n_records * scale, n_records * scale) for _ in range(m)]
    e = [[0] * m for _ in range(m)]
    for i in range(m):
        for j in range(i, m):
            e[i][j] = e[j][i] = rng.randint(-50 * scale, 50 * scale)
    v_bound = spec.max_owners * owner_value_bound(
        PackingBounds(1.0, spec.max_records_per_owner, 1, f, 0)  # clip units
    )
    b = [rng.randrange(mask_width(v_bound)) for _ in range(m)]

    rows_block = plan.result_block(SCATTER_ROWS)
    k = rows_block.layout.slots_per_ciphertext
    t_values = []
    for position in row_aligned_positions(m, k):
        if position is None:
            t_values.append(0)
            continue
        i, j = position
        t_values.append(
            n_records * scale * r[i][j]
            + v[i] * b[j]
            + b[i] * v[j]
            + b[i] * b[j]
            + n_records * scale * e[i][j]
        )
    masked_sums = [v[i] + b[i] for i in range(m)]
    sums_block = plan.result_block(MASKED_SUM)
    packed = {
        SCATTER_ROWS: pool.encrypt_packed(
            public_key, t_values, rows_block.layout, rows_block.bound
        ),
        MASKED_SUM: pool.encrypt_packed(
            public_key, masked_sums, sums_block.layout, sums_block.bound
        ),
    }
    expected = np.array(
        [
            [
                float(
                    Fraction(
                        n_records * scale * (r[i][j] + e[i][j]) - v[i] * v[j],
                        n_records * scale * scale,
                    )
                )
                for j in range(m)
            ]
            for i in range(m)
        ]
    )
    result = result_from_packed(spec, 2, packed, public_count=n_records)
    return result, n_records, expected


def test_masked_mode_unmasks_the_scatter_exactly(
    test_only_keypair_512: Any, pool: CryptoPool
) -> None:
    public_key, private_key = test_only_keypair_512
    spec = masked_spec(public_key)
    result, n_records, expected = masked_result_by_hand(spec, public_key, pool, seed=11)

    assert result.public_record_count == n_records
    release = decrypt_result(result, private_key, expected_query=spec, pool=pool)

    assert release.centred_scatter is not None and release.statistics is None
    np.testing.assert_array_equal(release.centred_scatter, expected)
    assert release.n_samples == n_records and not release.n_samples_is_noisy
    estimator = FederatedPCA.from_result(release)
    reference = pca_from_centred_scatter(expected, n_records, 2)
    np.testing.assert_array_equal(estimator.components_, reference.components)
    assert estimator.mean_ is None  # masked mode never releases the mean
    assert estimator.transform(np.ones((3, 4)) / 4).shape == (3, 2)


def test_masked_mode_needs_the_public_count(test_only_keypair_512: Any, pool: CryptoPool) -> None:
    public_key, private_key = test_only_keypair_512
    spec = masked_spec(public_key)
    result, n_records, _ = masked_result_by_hand(spec, public_key, pool, seed=12)
    # N is part of a masked-mode result, so a result without it cannot even be built.
    with pytest.raises(LayoutError, match="masked mode needs public_record_count"):
        dataclasses.replace(result, public_record_count=None)
    with pytest.raises(ProtocolError, match="impossible"):
        decrypt_result(
            dataclasses.replace(result, public_record_count=10**6), private_key, pool=pool
        )
    # The count the result carries is the one the scatter is unmasked with.
    right = decrypt_result(result, private_key, pool=pool)
    wrong = decrypt_result(
        dataclasses.replace(result, public_record_count=n_records + 1), private_key, pool=pool
    )
    assert right.public_count == n_records and wrong.public_count == n_records + 1
    assert right.centred_scatter is not None and wrong.centred_scatter is not None
    assert not np.allclose(right.centred_scatter, wrong.centred_scatter)


def test_unmask_scatter_is_the_exact_rational() -> None:
    rng = random.Random(5)
    m, k, f, n = 3, 2, 20, 9
    positions = row_aligned_positions(m, k)
    t_values = [rng.randrange(-(2**150), 2**150) if p else 0 for p in positions]
    sums = [rng.randrange(-(2**70), 2**70) for _ in range(m)]
    scatter = unmask_scatter(t_values, sums, m, k, n, f)
    checked = set()
    for value, position in zip(t_values, positions, strict=True):
        if position is not None:
            i, j = position
            exact = float(Fraction(value - sums[i] * sums[j], n << (2 * f)))
            assert scatter[i, j] == exact == scatter[j, i]
            checked.add((i, j))
    # Every entry of the upper triangle was compared (the padding slots hold none).
    assert checked == {(i, j) for i in range(m) for j in range(i, m)}


# ------------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def small_stats_result(
    test_only_keypair_512: Any, pool: CryptoPool
) -> tuple[QuerySpec, QueryResult]:
    public_key, _ = test_only_keypair_512
    spec = make_spec(public_key, n_features=3, feature_lower=(), feature_upper=(), n_components=1)
    rows = np.array([[0.1, 0.2, 0.3], [0.5, -0.1, 0.0], [-0.3, 0.3, 0.2]])
    shares = [
        fixed_point_statistics(rows, None, spec),
        fixed_point_statistics(rows[:2], None, spec),
    ]
    return spec, encrypted_stats_result(spec, shares, public_key, pool)


def test_result_under_a_foreign_key_is_refused(
    test_only_keypair_512: Any, pool: CryptoPool
) -> None:
    _, private_key = test_only_keypair_512
    foreign_public, _ = generate_keypair(512, allow_insecure_test_key=True)
    spec = make_spec(
        foreign_public, n_features=2, feature_lower=(), feature_upper=(), n_components=1
    )
    share = fixed_point_statistics(np.array([[0.1, 0.2], [0.3, 0.1]]), None, spec)
    result = encrypted_stats_result(spec, [share], foreign_public, pool)
    with pytest.raises(UntrustedKeyError, match="not your key"):
        decrypt_result(result, private_key, pool=pool)


def test_fingerprint_that_does_not_match_the_key_is_refused(
    test_only_keypair_512: Any, small_stats_result: tuple[QuerySpec, QueryResult]
) -> None:
    _, private_key = test_only_keypair_512
    spec, result = small_stats_result
    forged = dataclasses.replace(
        result, query=dataclasses.replace(spec, analyst_key_fingerprint="sha256:00")
    )
    with pytest.raises(UntrustedKeyError, match="fingerprint"):
        decrypt_result(forged, private_key)


def test_layout_other_than_the_plan_is_refused(
    test_only_keypair_512: Any, small_stats_result: tuple[QuerySpec, QueryResult]
) -> None:
    _, private_key = test_only_keypair_512
    _, result = small_stats_result
    (block,) = result.payload.blocks
    # Same ciphertexts, but declared with narrower slots than the plan derives.
    narrower = dataclasses.replace(block, slot_bits=block.slot_bits - 1)
    payload = CiphertextPayload((narrower,), {block.name: result.payload[block.name]})
    with pytest.raises(LayoutError, match="plan derived from the query"):
        decrypt_result(dataclasses.replace(result, payload=payload), private_key)


def test_result_for_another_query_is_refused(
    test_only_keypair_512: Any, small_stats_result: tuple[QuerySpec, QueryResult]
) -> None:
    _, private_key = test_only_keypair_512
    spec, result = small_stats_result
    submitted = dataclasses.replace(spec, epsilon=0.5)
    with pytest.raises(ProtocolError, match="epsilon"):
        decrypt_result(result, private_key, expected_query=submitted)


def test_more_owners_than_the_slots_hold_is_refused(
    test_only_keypair_512: Any, small_stats_result: tuple[QuerySpec, QueryResult]
) -> None:
    _, private_key = test_only_keypair_512
    spec, result = small_stats_result
    with pytest.raises(EncodingOverflowError, match="max_owners"):
        decrypt_result(dataclasses.replace(result, n_owners=spec.max_owners + 1), private_key)


def test_noise_for_other_parameters_is_refused(
    test_only_keypair_512: Any, small_stats_result: tuple[QuerySpec, QueryResult]
) -> None:
    _, private_key = test_only_keypair_512
    spec, result = small_stats_result
    plan = ReleasePlan.for_query(dataclasses.replace(spec, epsilon=2.0), 512)
    wrong = noise_description(plan)
    with pytest.raises(ProtocolError, match="noise for other parameters"):
        decrypt_result(dataclasses.replace(result, noise=wrong), private_key)


def test_slot_beyond_the_declared_bound_is_refused(
    test_only_keypair_512: Any, pool: CryptoPool
) -> None:
    """A share that breaks its bound decodes outside n_owners x bound: refused, not used."""
    public_key, private_key = test_only_keypair_512
    spec = make_spec(public_key, n_features=2, feature_lower=(), feature_upper=(), n_components=1)
    plan = ReleasePlan.for_query(spec, 512)
    block = plan.owner_block(SHARES)
    values = [0] * block.layout.value_count
    values[0] = block.layout.slot_capacity  # fits the slot, not the declared sum bound
    packed = pool.encrypt_packed(public_key, values, block.layout, block.layout.slot_capacity)
    result = result_from_packed(spec, 1, {SHARES: packed})
    with pytest.raises(EncodingOverflowError, match="outside the declared bound"):
        decrypt_result(result, private_key, pool=pool)


def test_a_page_that_fails_to_decode_is_reported_only_after_the_last(
    test_only_keypair_512: Any, pool: CryptoPool
) -> None:
    """Found by review: decryption stopped at the first page that did not decode, so a
    proxy saw where the analyst hung up, and learnt which page held the first value
    beyond the bound: built from an owner's ciphertext and thresholds, a decryption
    oracle for its share without noise. Every page is now read and decrypted, the
    error raised after the last; and it does not carry the decrypted value."""
    public_key, private_key = test_only_keypair_512
    spec = make_spec(public_key, n_features=6, feature_lower=(), feature_upper=(), n_components=1)
    plan = ReleasePlan.for_query(spec, 512)
    block = plan.owner_block(SHARES)
    values = [0] * block.layout.value_count
    values[0] = block.layout.slot_capacity  # beyond the declared sum bound, in page 0
    packed = pool.encrypt_packed(public_key, values, block.layout, block.layout.slot_capacity)
    result = result_from_packed(spec, 1, {SHARES: packed})
    ciphertexts = list(result.payload.in_wire_order())
    assert len(ciphertexts) >= 3
    pulled: list[int] = []

    def pages() -> Iterator[list[int]]:
        for index, ciphertext in enumerate(ciphertexts):
            if index:
                time.sleep(0.2)  # pages trickle in: the one before is decrypted meanwhile
            pulled.append(index)
            yield [ciphertext]

    with pytest.raises(EncodingOverflowError, match="outside the declared bound") as raised:
        decrypt_stream(result, pages(), private_key, pool=pool)
    assert pulled == list(range(len(ciphertexts)))  # was: [0]
    assert str(block.layout.slot_capacity) not in str(raised.value)


def test_decoded_release_reports_what_it_is(
    test_only_keypair_512: Any,
    small_stats_result: tuple[QuerySpec, QueryResult],
    pool: CryptoPool,
) -> None:
    public_key, private_key = test_only_keypair_512
    spec, result = small_stats_result
    release = decrypt_result(result, private_key, expected_query=spec, pool=pool)
    assert isinstance(release, DecodedRelease)
    assert release.key_fingerprint == key_fingerprint(public_key)
    assert release.n_owners == 2 and release.n_samples == 5.0
    assert release.mode is ProtocolMode.STATS and not release.private
