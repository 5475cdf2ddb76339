"""The example configurations under deploy/ are read by the real loaders, so they stay valid."""

from __future__ import annotations

from pathlib import Path

from fedpca.analyst.config import load_config as load_analyst_config
from fedpca.owner.config import load_config as load_owner_config
from fedpca.proxy.config import load_config as load_proxy_config

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "config"


def test_proxy_example_parses() -> None:
    config = load_proxy_config(CONFIG / "proxy.toml")
    assert config.proxy.listen == "0.0.0.0:50051"


def test_owner_example_parses() -> None:
    config = load_owner_config(CONFIG / "owner.toml")
    assert config.policy.max_epsilon_per_query == 1.0
    assert not config.policy.allow_not_private


def test_analyst_example_parses() -> None:
    config = load_analyst_config(CONFIG / "analyst.toml")
    assert config.proxy == "proxy.example.org:50051"
