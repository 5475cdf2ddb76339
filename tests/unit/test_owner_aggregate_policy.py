"""Owners and aggregate queries: policy keys, kinds and columns, decided from public facts."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpca.errors import ConfigError
from fedpca.messages import DeclineReason, Task
from fedpca.owner.compute import encode_share
from fedpca.owner.config import (
    OwnerConfig,
    load_config,
)
from fedpca.owner.local_table import LocalTable
from fedpca.owner.policy import Refusal, TaskAccepted, check_task
from fedpca.protocol import ReleasePlan
from fedpca.query import RELEASE_KINDS, Aggregate, AggregateKind, QueryKind, QuerySpec
from helpers import make_query, owner_policy_config, signed_task

TOML = f"""
[owner]
id = "owner-1"
proxy = "127.0.0.1:50051"
[tls]
insecure = true
[data]
path = "data.csv"
max_records = 100
[policy]
accepted_analyst_keys = ["sha256:{"ab" * 32}"]
max_epsilon_per_query = 1.0
allowed_kinds = ["pca"]
[budget]
epsilon = 10.0
delta = 1e-5
"""

STATS = Aggregate.statistics((1, 2), (0.0, 0.0), (1.0, 1.0))
HISTOGRAM = Aggregate.histogram((3,), ((0.0, 0.5, 1.0),), group_column=0, categories=(1.0,))


def _aggregate_query(public_key: Any, *aggregates: Aggregate, **fields: Any) -> QuerySpec:
    columns = {c for a in aggregates for c in a.read_columns}
    return make_query(
        public_key,
        kind=QueryKind.AGGREGATE,
        n_features=len(columns),
        n_components=1,
        epsilon=1.0,
        delta=1e-6,
        quorum=2,
        aggregates=aggregates,
        **fields,
    )


def _config(public_key: Any, **policy: Any) -> OwnerConfig:
    return owner_policy_config(public_key, **policy)


def _task(spec: QuerySpec) -> Task:
    return signed_task(spec, datetime.now(UTC) + timedelta(minutes=5))


def _table() -> LocalTable:
    rng = np.random.default_rng(0)
    columns = np.column_stack([rng.choice([-1.0, 1.0], 30), rng.uniform(-1, 2, (30, 3))])
    return LocalTable(columns, 0, "test")


def _refusal(result: Any, match: str) -> None:
    assert isinstance(result, Refusal), result
    assert result.reason is DeclineReason.POLICY_REFUSAL
    assert match == result.detail


def test_policy_keys_parse(tmp_path: Path) -> None:
    text = TOML.replace(
        'allowed_kinds = ["pca"]',
        'allowed_kinds = ["pca", "stats", "linreg"]\nallowed_columns = [0, 2, 5]',
    )
    path = tmp_path / "owner.toml"
    path.write_text(text)
    policy = load_config(path).policy
    assert policy.allowed_kinds == (QueryKind.PCA, AggregateKind.STATS, AggregateKind.LINREG)
    assert policy.allowed_columns == (0, 2, 5)
    for bad, match in (
        ('allowed_kinds = ["aggregate"]', "unknown release kind 'aggregate'"),
        ('allowed_kinds = ["pca"]\nallowed_columns = [-1]', "policy.allowed_columns"),
        ('allowed_kinds = ["pca"]\nallowed_columns = "1,2"', "policy.allowed_columns"),
    ):
        path.write_text(TOML.replace('allowed_kinds = ["pca"]', bad))
        with pytest.raises(ConfigError, match=match):
            load_config(path)
    # Without the key every kind is allowed (as before, now including the aggregates).
    path.write_text(TOML.replace('allowed_kinds = ["pca"]\n', ""))
    assert load_config(path).policy.allowed_kinds == RELEASE_KINDS


def test_every_aggregate_kind_of_a_query_must_be_allowed(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    public_key, _ = test_only_keypair_512
    table = _table()
    both = _task(_aggregate_query(public_key, STATS, HISTOGRAM))
    assert isinstance(check_task(both, _config(public_key), table), TaskAccepted)
    stats_only = _config(public_key, allowed_kinds=(QueryKind.PCA, AggregateKind.STATS))
    _refusal(
        check_task(both, stats_only, table),
        "histogram queries are not in policy.allowed_kinds (pca, stats)",
    )
    assert isinstance(
        check_task(_task(_aggregate_query(public_key, STATS)), stats_only, table), TaskAccepted
    )


def test_columns_a_query_reads_must_be_allowed(test_only_keypair_512: tuple[Any, Any]) -> None:
    public_key, _ = test_only_keypair_512
    table = _table()
    config = _config(public_key, allowed_columns=(0, 1, 2))
    _refusal(
        check_task(_task(_aggregate_query(public_key, STATS, HISTOGRAM)), config, table),
        "the query reads column 3 (0-based), which is not in policy.allowed_columns (0, 1, 2)",
    )
    assert isinstance(
        check_task(_task(_aggregate_query(public_key, STATS)), config, table), TaskAccepted
    )
    # PCA reads every feature column (not the label), DCA every column.
    assert table.columns_read(make_query(public_key)) == (1, 2, 3)
    _refusal(
        check_task(_task(make_query(public_key, epsilon=1.0, quorum=2)), config, table),
        "the query reads column 3 (0-based), which is not in policy.allowed_columns (0, 1, 2)",
    )
    # A column the file lacks is a schema refusal.
    missing = Aggregate.statistics((7,), (0.0,), (1.0,))
    _refusal(
        check_task(_task(_aggregate_query(public_key, missing)), _config(public_key), table),
        "query 'q1' reads column 7 (0-based); this owner's data has 4 columns (0 to 3)",
    )


def test_a_pca_or_dca_naming_its_columns_reads_those_and_is_allowed_by_them(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    """An owner whose policy leaves a column out declined every PCA (PCA read every
    feature column); a query naming allowed feature columns is now answered, and reads
    exactly those columns, in the query's order."""
    public_key, _ = test_only_keypair_512
    table = _table()
    config = _config(public_key, allowed_columns=(0, 1, 2))
    named = make_query(public_key, n_features=2, feature_columns=(2, 1), epsilon=1.0, quorum=2)
    assert table.columns_read(named) == (1, 2)
    assert isinstance(check_task(_task(named), config, table), TaskAccepted)
    chosen = table.table_for(named)
    assert chosen.feature_columns == (2, 1) and chosen.label_column is None
    # Not the owner's label column as a feature: before columns were named, a PCA never
    # read it (an aggregate may, within policy.allowed_columns).
    with_label = make_query(public_key, n_features=2, feature_columns=(0, 3), epsilon=1.0, quorum=2)
    _refusal(
        check_task(_task(with_label), _config(public_key), table),
        "query 'q1' reads column 0, this owner's label column, as a feature",
    )
    _refusal(
        check_task(_task(dataclasses.replace(named, feature_columns=(3, 1))), config, table),
        "the query reads column 3 (0-based), which is not in policy.allowed_columns (0, 1, 2)",
    )
    beyond = make_query(public_key, n_features=2, feature_columns=(1, 9), epsilon=1.0, quorum=2)
    _refusal(
        check_task(_task(beyond), _config(public_key), table),
        "query 'q1' reads feature column 9 (0-based); this owner's data has 4 columns (0 to 3)",
    )
    # DCA reads its labels too: the label column must be allowed.
    dca = make_query(
        public_key,
        kind=QueryKind.DCA,
        n_features=2,
        n_components=1,
        feature_columns=(2, 1),
        label_column=0,
        class_labels=(-1.0, 1.0),
        epsilon=1.0,
        quorum=2,
    )
    assert table.columns_read(dca) == (0, 1, 2)
    assert table.table_for(dca).label_column == 0
    _refusal(
        check_task(_task(dca), _config(public_key, allowed_columns=(1, 2)), table),
        "the query reads column 0 (0-based), which is not in policy.allowed_columns (1, 2)",
    )


def test_owner_share_is_the_exact_sums_of_its_capped_sample(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    public_key, _ = test_only_keypair_512
    spec = _aggregate_query(public_key, STATS, HISTOGRAM, max_records_per_owner=10)
    plan = ReleasePlan.for_query(spec, public_key.n.bit_length())
    columns = _table().table_for(spec)
    # 30 records, a cap of 10: a sample of exactly 10 is summed (the count says so).
    encoded = encode_share(spec, columns, plan, capacity=100, rng=np.random.default_rng(1))[
        "shares"
    ]
    assert encoded[0] == 10
    assert encoded.shape == (plan.statistics.value_count,)
