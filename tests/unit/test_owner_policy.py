"""An owner's decision to take part, from public facts only: signature, pinned keys,
the deployment's relation, per-query caps, quorum, task rate and the table's schema."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedpca.codec import generate_keypair, key_fingerprint
from fedpca.dp.accounting import compose_epsilon
from fedpca.errors import ConfigError, UntrustedKeyError
from fedpca.messages import DeclineReason, Task
from fedpca.owner.config import (
    DataConfig,
    OwnerConfig,
    PrivacyConfig,
)
from fedpca.owner.local_table import LocalTable
from fedpca.owner.policy import Refusal, TaskAccepted, check_resumed_task, check_task
from fedpca.protocol import ReleasePlan
from fedpca.query import Neighbouring, ProtocolMode, QueryKind, QuerySpec, spec_digest
from fedpca.signing import generate_signing_key, sign_query, signer_id
from helpers import TEST_SIGNER, TEST_SIGNING_KEY, owner_policy_config, query_builder

_spec = query_builder(epsilon=1.0, quorum=2)


def _config(public_key: Any, **policy: Any) -> OwnerConfig:
    return owner_policy_config(public_key, **policy)


def _task(spec: QuerySpec, key: Any = TEST_SIGNING_KEY) -> Task:
    return Task(
        query=spec,
        upload_deadline=datetime.now(UTC) + timedelta(minutes=5),
        query_signature=sign_query(spec, key),
        query_signer=signer_id(key),
        task_id=f"alice/{spec.query_id}",
    )


def _table(label_column: int | None = 0) -> LocalTable:
    rng = np.random.default_rng(0)
    labels = rng.choice([-1.0, 1.0, 7.0], size=20)  # 7 is in no query's class list
    columns = np.column_stack([labels, rng.normal(size=(20, 3))])
    return LocalTable(columns, label_column, "test")


def _refusal(result: TaskAccepted | Refusal, reason: DeclineReason, match: str) -> None:
    assert isinstance(result, Refusal), result
    assert result.reason is reason
    assert match in result.detail, result.detail


def _dca(public_key: Any, **overrides: Any) -> QuerySpec:
    fields: dict[str, Any] = {
        "kind": QueryKind.DCA,
        "n_components": 1,
        "label_column": 0,
        "class_labels": (-1.0, 1.0),
    }
    fields.update(overrides)
    return _spec(public_key, **fields)


def test_good_task_passes(test_only_keypair_512: tuple[Any, Any]) -> None:
    public_key, _ = test_only_keypair_512
    config = _config(public_key)
    accepted = check_task(_task(_spec(public_key)), config, _table())
    assert isinstance(accepted, TaskAccepted)
    assert (accepted.table.n_records, accepted.table.n_features) == (20, 3)
    assert accepted.table.label_column is None
    # Labels outside the query's classes are not a reason to decline: the owner
    # leaves those records out of its statistics.
    accepted = check_task(_task(_dca(public_key)), config, _table())
    assert isinstance(accepted, TaskAccepted)


def test_only_queries_signed_by_a_pinned_analyst(test_only_keypair_512: tuple[Any, Any]) -> None:
    public_key, _ = test_only_keypair_512
    config = _config(public_key)
    spec = _spec(public_key)
    unsigned = replace(_task(spec), query_signature=b"", query_signer="")
    _refusal(check_task(unsigned, config, _table()), DeclineReason.UNSIGNED_QUERY, "not signed")
    stranger = generate_signing_key()
    _refusal(
        check_task(_task(spec, stranger), config, _table()),
        DeclineReason.UNSIGNED_QUERY,
        signer_id(stranger),
    )
    # A proxy that changes anything in a signed query breaks the signature.
    invented = replace(_task(spec), query=replace(spec, epsilon=1.4))
    _refusal(
        check_task(invented, config, _table()), DeclineReason.UNSIGNED_QUERY, "does not verify"
    )


def test_key_not_pinned_and_substituted_modulus(test_only_keypair_512: tuple[Any, Any]) -> None:
    public_key, _ = test_only_keypair_512
    config = _config(public_key)
    other, _ = generate_keypair(512, allow_insecure_test_key=True)
    _refusal(
        check_task(_task(_spec(other)), config, _table()),
        DeclineReason.KEY_NOT_PINNED,
        "not in policy.accepted_analyst_keys",
    )
    # A proxy forwarding the pinned fingerprint with its own modulus gets a refusal
    # (signed by the analyst here, to show the two checks are independent).
    forged = _spec(
        public_key,
        analyst_public_key_n=other.n,
        analyst_key_fingerprint=key_fingerprint(public_key),
    )
    _refusal(
        check_task(_task(forged), config, _table()), DeclineReason.KEY_NOT_PINNED, "substituted"
    )


def test_epsilon_is_measured_at_the_owner_budget_delta(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    public_key, _ = test_only_keypair_512
    config = _config(public_key)
    _refusal(
        check_task(_task(_spec(public_key, epsilon=3.0)), config, _table()),
        DeclineReason.POLICY_REFUSAL,
        "max_epsilon_per_query",
    )
    # delta = 0.99 would make sigma tiny for "epsilon = 1": refused by the delta cap,
    # and even under a generous cap the epsilon it costs at the budget's delta is huge.
    big_delta = _spec(public_key, epsilon=1.0, delta=0.99)
    _refusal(
        check_task(_task(big_delta), config, _table()), DeclineReason.POLICY_REFUSAL, "cap 1e-05"
    )
    generous = _config(public_key, max_delta_per_query=0.999)
    _refusal(
        check_task(_task(big_delta), generous, _table()),
        DeclineReason.POLICY_REFUSAL,
        "at this owner's budget delta 1e-05",
    )


def test_a_decline_prints_two_different_values_differently(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    # Printed with 4 significant digits, a release costing a hair over the cap read
    # "epsilon = 1 ... above policy.max_epsilon_per_query = 1".
    public_key, _ = test_only_keypair_512
    spec = _spec(public_key, epsilon=1.0, delta=1e-5)
    plan = ReleasePlan.for_query(spec, spec.analyst_public_key_n.bit_length())
    cost = compose_epsilon([plan.privacy_event("alice")], 1e-5)
    cap = cost * (1 - 1e-9)
    assert f"{cost:.6g}" == f"{cap:.6g}"
    result = check_task(_task(spec), _config(public_key, max_epsilon_per_query=cap), _table())
    assert isinstance(result, Refusal), result
    shown = re.fullmatch(
        r"the release costs epsilon = (\S+) at this owner's budget delta 1e-05, above "
        r"policy.max_epsilon_per_query = (\S+)",
        result.detail,
    )
    assert shown is not None, result.detail
    assert float(shown[1]) > float(shown[2])
    # The per-query delta cap likewise.
    above = _spec(public_key, delta=1.0000001e-5)
    _refusal(
        check_task(_task(above), _config(public_key), _table()),
        DeclineReason.POLICY_REFUSAL,
        "the query's delta 1.0000001e-05 is above this owner's per-query cap 1e-05",
    )


def test_not_private_masked_relation_kind_and_quorum(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    public_key, _ = test_only_keypair_512
    config = _config(public_key)
    table = _table()
    not_private = _task(_spec(public_key, epsilon=math.inf))
    _refusal(check_task(not_private, config, table), DeclineReason.POLICY_REFUSAL, "allow_not")
    assert isinstance(
        check_task(not_private, _config(public_key, allow_not_private=True), table), TaskAccepted
    )
    masked = _task(
        _spec(public_key, mode=ProtocolMode.MASKED, neighbouring=Neighbouring.REPLACE_ONE)
    )
    _refusal(check_task(masked, config, table), DeclineReason.POLICY_REFUSAL, "replace-one")
    replace_one = replace(config, privacy=PrivacyConfig(neighbouring=Neighbouring.REPLACE_ONE))
    _refusal(check_task(masked, replace_one, table), DeclineReason.POLICY_REFUSAL, "masked")
    opted_in = replace(replace_one, policy=replace(config.policy, allow_masked_mode=True))
    assert isinstance(check_task(masked, opted_in, table), TaskAccepted)
    pca_only = _config(public_key, allowed_kinds=(QueryKind.PCA,))
    _refusal(
        check_task(_task(_dca(public_key)), pca_only, table), DeclineReason.POLICY_REFUSAL, "dca"
    )
    lonely = _task(_spec(public_key, quorum=1))
    _refusal(
        check_task(lonely, _config(public_key, min_quorum=2), table),
        DeclineReason.POLICY_REFUSAL,
        "min_quorum",
    )


def test_task_rate_cap(test_only_keypair_512: tuple[Any, Any]) -> None:
    public_key, _ = test_only_keypair_512
    config = _config(public_key, max_tasks_per_day=3)
    task = _task(_spec(public_key))
    assert isinstance(check_task(task, config, _table(), tasks_last_day=lambda: 2), TaskAccepted)
    _refusal(
        check_task(task, config, _table(), tasks_last_day=lambda: 3),
        DeclineReason.POLICY_REFUSAL,
        "max_tasks_per_day",
    )
    # The count covers every analyst's tasks (another analyst's activity): only the
    # owner's own limit is stated.
    refused = check_task(task, config, _table(), tasks_last_day=lambda: 7)
    assert isinstance(refused, Refusal)
    assert "max_tasks_per_day = 3," in refused.detail and "7" not in refused.detail


def test_the_schema_must_fit(test_only_keypair_512: tuple[Any, Any]) -> None:
    public_key, _ = test_only_keypair_512
    config = _config(public_key)
    _refusal(
        check_task(_task(_spec(public_key, n_features=4)), config, _table()),
        DeclineReason.POLICY_REFUSAL,
        "4 features; this owner's data has 3",
    )
    # Without a configured label column all four columns are features.
    wide = _task(_spec(public_key, n_features=4))
    assert isinstance(check_task(wide, config, _table(label_column=None)), TaskAccepted)
    _refusal(
        check_task(_task(_dca(public_key, label_column=7)), config, _table()),
        DeclineReason.POLICY_REFUSAL,
        "column 7",
    )
    _refusal(
        check_task(_task(_dca(public_key, label_column=1)), config, _table()),
        DeclineReason.POLICY_REFUSAL,
        "labels are in column 0",
    )
    # An owner without a configured label column follows the query's.
    assert isinstance(
        check_task(_task(_dca(public_key)), config, _table(label_column=None)), TaskAccepted
    )


def test_configured_label_column_must_exist() -> None:
    with pytest.raises(ConfigError, match="label_column = 9"):
        LocalTable(np.zeros((2, 3)), 9, "test")
    assert LocalTable(np.zeros((2, 3)), -1, "test").label_column == 2


def test_bounded_owner_tables_need_an_enforced_capacity_within_the_cap(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    """From public facts only: the owner's enforcement flag and its capacity."""
    public_key, _ = test_only_keypair_512
    config = _config(public_key)  # max_records = 100, not enforced
    bounded = _spec(public_key, bounded_owner_tables=True, max_records_per_owner=100)
    _refusal(
        check_task(_task(bounded), config, _table()),
        DeclineReason.POLICY_REFUSAL,
        "does not enforce its max_records",
    )
    enforced = replace(
        config, data=DataConfig(Path("data.csv"), max_records=100, enforce_max_records=True)
    )
    assert isinstance(check_task(_task(bounded), enforced, _table()), TaskAccepted)
    # A cap below the capacity could make the owner sample: declined, whatever it holds
    # (the table here has 20 records, fewer than either bound).
    below = _spec(public_key, bounded_owner_tables=True, max_records_per_owner=99)
    _refusal(
        check_task(_task(below), enforced, _table()),
        DeclineReason.POLICY_REFUSAL,
        "below this owner's public max_records 100",
    )
    # Queries that cover a capped owner's swap are answered either way.
    assert isinstance(check_task(_task(_spec(public_key)), enforced, _table()), TaskAccepted)


def test_a_key_is_answered_only_for_the_signers_pinned_to_it(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    """Found by review: signers and keys were pinned separately, so analyst B could
    sign a query naming analyst A's key: the owner charged A's budget share and its
    decline told B how much of that share A had used. With analyst_key_signers a key is
    answered only for its own signers, whatever the proxy delivers."""
    public_key, _ = test_only_keypair_512
    key = key_fingerprint(public_key)
    other = generate_signing_key()
    both = (TEST_SIGNER, signer_id(other))
    spec = _spec(public_key)
    unpaired = _config(public_key, accepted_query_signers=both)
    paired = _config(
        public_key,
        accepted_query_signers=both,
        analyst_key_signers={key: (TEST_SIGNER,)},
    )

    # The pairing is checked before the daily count reads the key's releases.
    def counted() -> int:
        raise AssertionError("the named key's releases were read")

    _refusal(
        check_task(_task(spec, other), paired, _table(), tasks_last_day=counted),
        DeclineReason.KEY_NOT_PINNED,
        "pins to other signers",
    )
    # Without the table any pinned signer may name any pinned key (as before).
    assert isinstance(check_task(_task(spec, other), unpaired, _table()), TaskAccepted)
    # With it, the other pinned signer is declined for this key, before any budget.
    _refusal(
        check_task(_task(spec, other), paired, _table()),
        DeclineReason.KEY_NOT_PINNED,
        "pins to other signers",
    )
    assert isinstance(check_task(_task(spec), paired, _table()), TaskAccepted)
    # An upload in flight is not resumed for a task the other signer sends again.
    digest = spec_digest(spec)
    with pytest.raises(UntrustedKeyError, match="pins to other signers"):
        check_resumed_task(_task(spec, other), paired.policy, digest)
    check_resumed_task(_task(spec), paired.policy, digest)
