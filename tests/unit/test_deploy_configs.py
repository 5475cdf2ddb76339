"""The example configurations under deploy/ are read by the real loaders, so they stay valid."""

from __future__ import annotations

from pathlib import Path

from fedpca.analyst.config import load_config as load_analyst_config
from fedpca.dp.accounting import Accountant
from fedpca.owner.config import load_config as load_owner_config
from fedpca.proxy.config import load_config as load_proxy_config
from fedpca.query import Neighbouring

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "config"


def test_proxy_example_parses() -> None:
    config = load_proxy_config(CONFIG / "proxy.toml")
    assert config.proxy.listen == "0.0.0.0:50051"
    assert config.owners.allowed == {"hospital-a", "hospital-b", "hospital-c"}
    assert config.tls.revoked_serials == frozenset()
    assert config.privacy.neighbouring is Neighbouring.ADD_REMOVE
    assert config.privacy.accountant is Accountant.ZCDP
    # The per-query delta cap is within every analyst's budget delta.
    cap = config.privacy.delta_cap(config.budget.default)
    budgets = [config.budget.default, *config.budget.analysts.values()]
    assert all(cap <= budget.delta for budget in budgets)


def test_owner_example_parses() -> None:
    config = load_owner_config(CONFIG / "owner.toml")
    assert config.policy.max_epsilon_per_query == 1.0
    assert not config.policy.allow_not_private and not config.policy.allow_masked_mode
    assert config.data.max_records == 5000
    assert config.policy.accepted_query_signers == ("ed25519:" + "0" * 64,)
    # The example owner and the example proxy are one deployment: the same relation.
    proxy = load_proxy_config(CONFIG / "proxy.toml")
    assert config.privacy.neighbouring is proxy.privacy.neighbouring
    assert config.owner.id in proxy.owners.allowed
    assert config.policy.delta_cap(config.budget) <= config.budget.delta


def test_analyst_example_parses() -> None:
    config = load_analyst_config(CONFIG / "analyst.toml")
    assert config.proxy == "proxy.example.org:50051"
