"""The attacks of the privacy audit, replayed: nothing the analyst observes depends on data.

An untrusted analyst recovered an owner's exact row count in 20 probes at epsilon
0.01 by binary search over ``max_records_per_owner``, because the owner declined when
its data crossed the query's threshold; unexpected DCA labels, values outside the
public bounds (with ``out_of_bounds = "refuse"``) and a fixed-point overflow detected
from the data were oracles of the same kind. Each test below runs the same signed query
on two neighbouring datasets, one record apart across the old threshold, through a real
proxy and real owner nodes (:mod:`inprocess`), and checks that the analyst's view —
state, counts of contributing and declining owners, decline reasons, failure reason,
errors, and the time to the result on a one-second grid — is the same. Only the noised
numbers may differ. On fedpca 0.1 every one of these runs ended differently: the owner
crossing the threshold declined.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpca.codec import CryptoPool
from fedpca.query import Aggregate, QueryKind
from helpers import TEST_SIGNER, query_builder
from inprocess import Outcome, deployment, labelled

M = 4
_spec = query_builder(
    n_features=M,
    n_components=2,
    epsilon=1.0,
    delta=1e-6,
    quorum=2,
    deadline_seconds=60.0,
    feature_lower=(-1.0,) * M,
    feature_upper=(1.0,) * M,
)


def _rows(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.9, 0.9, size=(n, M))


def _observe(
    tmp_path: Path, pool: CryptoPool, public_key: Any, tables: dict[str, np.ndarray], **spec: Any
) -> Outcome:
    with deployment(
        workdir=tmp_path,
        tables=tables,
        pool=pool,
        public_key=public_key,
        capacity=spec.pop("capacity", 1000),
    ) as running:
        return running.run(_spec(public_key, **spec))


def _same_view(first: Outcome, second: Outcome) -> None:
    assert first.without_timing() == second.without_timing()
    assert first.state == "done", first
    assert first.owners_declined == 0 and first.declines == ()
    # The time to the result moves by milliseconds, far below a one-second grid.
    assert abs(first.seconds - second.seconds) < 1.0


def _neighbours(
    tmp_path: Path,
    pool: CryptoPool,
    public_key: Any,
    base: np.ndarray,
    extra: np.ndarray,
    labels: Any = 1.0,
    extra_label: float = 1.0,
    **spec: Any,
) -> tuple[Outcome, Outcome]:
    other = labelled(_rows(99, 30))
    d = {"owner-1": labelled(base, labels), "owner-2": other}
    d_prime = {
        "owner-1": np.vstack([labelled(base, labels), labelled(extra[None, :], extra_label)]),
        "owner-2": other,
    }
    return (
        _observe(tmp_path / "d", pool, public_key, d, **spec),
        _observe(tmp_path / "d-prime", pool, public_key, d_prime, **spec),
    )


def test_the_row_count_is_no_oracle_at_the_query_cap(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    # 40 rows fit max_records_per_owner = 40; 41 used to be declined.
    public_key, _ = test_only_keypair_512
    first, second = _neighbours(
        tmp_path, pool, public_key, _rows(1, 40), _rows(2, 1)[0], max_records_per_owner=40
    )
    _same_view(first, second)


def test_the_row_count_is_no_oracle_at_the_declared_capacity(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    public_key, _ = test_only_keypair_512
    first, second = _neighbours(
        tmp_path, pool, public_key, _rows(1, 30), _rows(2, 1)[0], capacity=30
    )
    _same_view(first, second)


def test_an_unexpected_label_is_no_oracle(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    public_key, _ = test_only_keypair_512
    labels = np.where(np.arange(30) % 2 == 0, -1.0, 1.0)
    first, second = _neighbours(
        tmp_path,
        pool,
        public_key,
        _rows(1, 30),
        _rows(2, 1)[0],
        labels=labels,
        extra_label=7.0,  # in no class list of the query
        kind=QueryKind.DCA,
        n_components=1,
        label_column=0,
        class_labels=(-1.0, 1.0),
    )
    _same_view(first, second)


def test_a_value_outside_the_public_bounds_is_no_oracle(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    public_key, _ = test_only_keypair_512
    outlier = np.array([0.2, 5.0, -0.1, 0.3])  # feature 2 far outside [-1, 1]
    first, second = _neighbours(tmp_path, pool, public_key, _rows(1, 30), outlier)
    _same_view(first, second)


def test_extreme_raw_values_cannot_overflow_a_slot(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """Without bounds only the row clip applies; slots are sized from it, not from data."""
    public_key, _ = test_only_keypair_512
    huge = np.array([1e300, -1e300, 1e300, 3.0])
    first, second = _neighbours(
        tmp_path, pool, public_key, _rows(1, 30), huge, feature_lower=(), feature_upper=()
    )
    _same_view(first, second)


def test_owner_logs_carry_no_record_counts_or_values(
    tmp_path: Path,
    pool: CryptoPool,
    test_only_keypair_512: tuple[Any, Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    public_key, _ = test_only_keypair_512
    # 70001 cannot be mistaken for a port number in a log line.
    rows = _rows(3, 70_001)
    rows[17, 2] = 0.8765432
    tables = {"owner-1": labelled(rows), "owner-2": labelled(_rows(4, 30))}
    with caplog.at_level(logging.DEBUG, logger="fedpca.owner"):
        outcome = _observe(tmp_path, pool, public_key, tables, capacity=100_000)
    assert outcome.state == "done"
    owner_lines = [r.getMessage() for r in caplog.records if r.name.startswith("fedpca.owner")]
    assert any("budget reserved" in line for line in owner_lines)  # the logs were captured
    text = "\n".join(owner_lines)
    assert "70001" not in text and "70,001" not in text
    assert "8765432" not in text


def test_aggregate_queries_have_no_data_dependent_oracle(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    """One extra record crossing every threshold of an aggregate query at once: values
    far outside the public bounds, a category not in the public list, an owner at its
    record cap. Owners clip, leave out and sample; none declines."""
    public_key, _ = test_only_keypair_512
    aggregates = (
        Aggregate.statistics((1, 2), (-1.0, -1.0), (1.0, 1.0)),
        Aggregate.histogram((3,), ((-1.0, 0.0, 1.0),), group_column=0, categories=(1.0,)),
        Aggregate.linear_regression((1, 2), (-1.0, -1.0), (1.0, 1.0), 4, -1.0, 1.0),
    )
    first, second = _neighbours(
        tmp_path,
        pool,
        public_key,
        _rows(1, 30),
        np.array([1e300, -1e300, 0.3, 5.0]),
        extra_label=7.0,
        kind=QueryKind.AGGREGATE,
        n_features=5,
        n_components=1,
        feature_lower=(),
        feature_upper=(),
        aggregates=aggregates,
        max_records_per_owner=30,
    )
    _same_view(first, second)


def test_the_masked_release_leaves_no_exact_residue_of_the_sums(tmp_path: Path) -> None:
    """Masked mode's noise is a multiple of N 2^f; v vᵀ is not. Without the proxy's
    uniform residue the analyst read v_i v_j mod N 2^f off T − v′v′ᵀ exactly (review):
    it told replace-one neighbours apart with certainty."""
    from fedpca.analyst.decode import _decrypt_blocks
    from fedpca.analyst.result_checks import check_result
    from fedpca.codec import generate_keypair
    from fedpca.dp.mechanisms import PrivacyParams
    from fedpca.exact_statistics import fixed_point_statistics
    from fedpca.masked_release import row_aligned_positions
    from fedpca.protocol import (
        MASKED_SUM,
        SCATTER_ROWS,
    )
    from fedpca.query import Neighbouring, ProtocolMode
    from helpers import make_query

    m, frac_bits = 3, 16
    public_key, private_key = generate_keypair(512, allow_insecure_test_key=True)  # TEST-ONLY
    rng = np.random.default_rng(7)
    tables = [rng.uniform(-0.5, 0.5, size=(12, m)), rng.uniform(-0.5, 0.5, size=(9, m))]
    query = make_query(
        public_key,
        query_id="q-masked-residue",
        n_features=m,
        n_components=1,
        mode=ProtocolMode.MASKED,
        neighbouring=Neighbouring.REPLACE_ONE,
        epsilon=1.0,
        delta=1e-5,
        feature_lower=(-1.0,) * m,
        feature_upper=(1.0,) * m,
        quorum=2,
        max_owners=4,
        max_records_per_owner=100,
        frac_bits=frac_bits,
    )
    with (
        CryptoPool(processes=1) as pool,
        deployment(
            workdir=tmp_path,
            tables={"owner-a": labelled(tables[0]), "owner-b": labelled(tables[1])},
            pool=pool,
            public_key=public_key,
            neighbouring=Neighbouring.REPLACE_ONE,
            owner_budget=PrivacyParams(10.0, 1e-5),
            analyst_budget=PrivacyParams(10.0, 1e-5),
        ) as cluster,
    ):
        assert cluster.run(query).state == "done"
        with cluster.analyst() as client:
            result = client.fetch(query.query_id, public_key=public_key, signer=TEST_SIGNER).result
        plan = check_result(result, public_key)
        bounds = {b.name: b.bound for b in plan.result_blocks}
        values = _decrypt_blocks(
            [list(result.payload.in_wire_order())], private_key, plan, bounds, pool, None
        )
    sums = sum(fixed_point_statistics(t, None, query).sums.astype(object) for t in tables)
    modulus = result.public_record_count << frac_bits
    masked_sums = [int(x) for x in values[MASKED_SUM]]
    k = plan.result_block(SCATTER_ROWS).layout.slots_per_ciphertext
    exact = 0
    entries = 0
    for value, position in zip(values[SCATTER_ROWS], row_aligned_positions(m, k), strict=True):
        if position is None:
            continue
        i, j = position
        seen = (masked_sums[i] * masked_sums[j] - int(value)) % modulus
        exact += seen == (int(sums[i]) * int(sums[j])) % modulus
        entries += 1
    assert entries == 6
    # Each entry's residue is now uniform on N 2^16 >= 1.3 million values: a chance match
    # of even one entry has probability below 5e-6.
    assert exact == 0
