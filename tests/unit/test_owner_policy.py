"""Owner policy: pinned keys (including a substituted modulus), epsilon caps, fit to the data."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from fedpca.codec import generate_keypair, key_fingerprint
from fedpca.errors import ConfigError, PolicyError, UntrustedKeyError
from fedpca.owner.compute import LocalTable
from fedpca.owner.config import PolicyConfig
from fedpca.owner.policy import check_task
from fedpca.query import QueryKind, QuerySpec
from helpers import query_builder

_spec = query_builder(epsilon=1.0)


def _policy(public_key: Any, **overrides: Any) -> PolicyConfig:
    fields: dict[str, Any] = {
        "accepted_analyst_keys": (key_fingerprint(public_key),),
        "max_epsilon_per_query": 1.0,
        "allow_not_private": False,
    }
    fields.update(overrides)
    return PolicyConfig(**fields)


def _table(label_column: int | None = 0) -> LocalTable:
    rng = np.random.default_rng(0)
    labels = rng.choice([-1.0, 1.0], size=20)
    columns = np.column_stack([labels, rng.normal(size=(20, 3))])
    return LocalTable(columns, label_column, "test")


def test_good_task_passes(test_only_keypair_512: tuple[Any, Any]) -> None:
    public_key, _ = test_only_keypair_512
    check_task(_spec(public_key), _policy(public_key), _table())
    dca = _spec(
        public_key, kind=QueryKind.DCA, n_components=1, label_column=0, class_labels=(-1.0, 1.0)
    )
    check_task(dca, _policy(public_key), _table())


def test_key_not_pinned(test_only_keypair_512: tuple[Any, Any]) -> None:
    public_key, _ = test_only_keypair_512
    other, _ = generate_keypair(512, allow_insecure_test_key=True)
    with pytest.raises(UntrustedKeyError, match=r"not in policy\.accepted_analyst_keys"):
        check_task(_spec(other), _policy(public_key))


def test_substituted_modulus_behind_a_pinned_fingerprint(
    test_only_keypair_512: tuple[Any, Any],
) -> None:
    """A proxy forwarding the pinned fingerprint with its own key gets a refusal."""
    public_key, _ = test_only_keypair_512
    proxy_key, _ = generate_keypair(512, allow_insecure_test_key=True)
    forged = _spec(
        public_key,
        analyst_public_key_n=proxy_key.n,
        analyst_key_fingerprint=key_fingerprint(public_key),
    )
    with pytest.raises(UntrustedKeyError, match="substituted key"):
        check_task(forged, _policy(public_key), _table())


def test_epsilon_cap_and_not_private(test_only_keypair_512: tuple[Any, Any]) -> None:
    public_key, _ = test_only_keypair_512
    with pytest.raises(PolicyError, match="max_epsilon_per_query"):
        check_task(_spec(public_key, epsilon=1.5), _policy(public_key))
    not_private = _spec(public_key, epsilon=math.inf)
    with pytest.raises(PolicyError, match="allow_not_private"):
        check_task(not_private, _policy(public_key))
    check_task(not_private, _policy(public_key, allow_not_private=True))


def test_feature_count_must_match_the_data(test_only_keypair_512: tuple[Any, Any]) -> None:
    public_key, _ = test_only_keypair_512
    with pytest.raises(PolicyError, match="4 features; this owner's data has 3"):
        check_task(_spec(public_key, n_features=4), _policy(public_key), _table())
    # Without a configured label column all four columns are features.
    check_task(_spec(public_key, n_features=4), _policy(public_key), _table(label_column=None))


def test_dca_labels_must_fit_the_data(test_only_keypair_512: tuple[Any, Any]) -> None:
    public_key, _ = test_only_keypair_512
    policy = _policy(public_key)

    def dca(**overrides: Any) -> QuerySpec:
        fields: dict[str, Any] = {
            "kind": QueryKind.DCA,
            "n_components": 1,
            "label_column": 0,
            "class_labels": (-1.0, 1.0),
        }
        fields.update(overrides)
        return _spec(public_key, **fields)

    with pytest.raises(PolicyError, match="outside the query's 2 public class labels"):
        check_task(dca(class_labels=(1.0, 2.0)), policy, _table())
    with pytest.raises(PolicyError, match="column 7"):
        check_task(dca(label_column=7), policy, _table())
    with pytest.raises(PolicyError, match="labels are in column 0"):
        check_task(dca(label_column=1), policy, _table())
    # An owner without a configured label column follows the query's.
    check_task(dca(), policy, _table(label_column=None))


def test_configured_label_column_must_exist() -> None:
    with pytest.raises(ConfigError, match="label_column = 9"):
        LocalTable(np.zeros((2, 3)), 9, "test")
    assert LocalTable(np.zeros((2, 3)), -1, "test").label_column == 2
