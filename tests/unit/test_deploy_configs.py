"""The example configurations under deploy/ are read by the real loaders, so they stay
valid, and the README's example query fits them."""

from __future__ import annotations

import shlex
from pathlib import Path

from fedpca.analyst.config import load_config as load_analyst_config
from fedpca.dp.accounting import Accountant
from fedpca.owner.config import load_config as load_owner_config
from fedpca.proxy.config import load_config as load_proxy_config
from fedpca.query import Neighbouring

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "config"


def test_proxy_example_parses() -> None:
    config = load_proxy_config(CONFIG / "proxy.toml")
    assert config.proxy.listen == "0.0.0.0:50051"
    assert config.proxy.database == CONFIG / "state" / "proxy.sqlite3"
    assert config.owners.allowed == {"hospital-a", "hospital-b", "hospital-c"}
    assert config.tls.revoked_serials == frozenset()
    assert config.privacy.neighbouring is Neighbouring.ADD_REMOVE
    assert config.privacy.accountant is Accountant.ZCDP
    # Its metrics show every analyst's spend: on loopback in the example (an operator's
    # walkthrough, stop 42, found it on every address).
    assert config.monitoring.listen == "127.0.0.1:9464"
    # The per-query delta cap is within every analyst's budget delta.
    cap = config.privacy.delta_cap(config.budget.default)
    budgets = [config.budget.default, *config.budget.analysts.values()]
    assert all(cap <= budget.delta for budget in budgets)


def test_owner_example_parses() -> None:
    config = load_owner_config(CONFIG / "owner.toml")
    assert config.policy.max_epsilon_per_query == 1.0
    assert not config.policy.allow_not_private and not config.policy.allow_masked_mode
    assert config.data.max_records == 5000
    assert config.data.path == CONFIG / "data" / "patients.csv"
    assert config.tls.cert == CONFIG / "tls" / "cert.pem"
    assert config.policy.accepted_query_signers == ("ed25519:" + "0" * 64,)
    # The example owner and the example proxy are one deployment: the same relation.
    proxy = load_proxy_config(CONFIG / "proxy.toml")
    assert config.privacy.neighbouring is proxy.privacy.neighbouring
    assert config.owner.id in proxy.owners.allowed
    assert config.analyst_shares == {}


def test_owner_example_with_its_commented_shares_parses(tmp_path: Path) -> None:
    text = (CONFIG / "owner.toml").read_text().replace("# analyst_shares = ", "analyst_shares = ")
    (tmp_path / "owner.toml").write_text(text)
    config = load_owner_config(tmp_path / "owner.toml")
    assert config.analyst_shares == {config.policy.accepted_analyst_keys[0]: 1.0}
    assert config.policy.delta_cap(config.budget) <= config.budget.delta


def test_analyst_example_parses() -> None:
    config = load_analyst_config(CONFIG / "analyst.toml")
    assert config.proxy == "proxy.example.org:50051"
    assert config.tls is not None and config.tls.ca_certificate == CONFIG / "tls" / "ca.pem"


def _readme_query() -> dict[str, str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "fedpca analyst pca " in line)
    command = [lines[start]]
    while command[-1].endswith("\\"):
        command.append(lines[start + len(command)])
    words = shlex.split(" ".join(line.rstrip("\\") for line in command))
    return {words[i]: words[i + 1] for i in range(len(words) - 1) if words[i].startswith("--")}


def test_the_readme_query_fits_the_example_deployment() -> None:
    """The README's query used to state delta 1e-5 against the examples' cap of 1e-7."""
    query = _readme_query()
    epsilon, delta = float(query["--epsilon"]), float(query["--delta"])
    proxy = load_proxy_config(CONFIG / "proxy.toml")
    owner = load_owner_config(CONFIG / "owner.toml")
    for analyst in ("alice", "someone-else"):
        budget = proxy.budget.for_analyst(analyst)
        assert delta <= proxy.privacy.delta_cap(budget) and epsilon <= budget.epsilon
    assert delta <= owner.policy.delta_cap(owner.budget)
    assert epsilon <= owner.policy.max_epsilon_per_query <= owner.budget.epsilon


def test_the_readme_says_where_the_fedpca_command_comes_from() -> None:
    """A new operator's review: "Running the roles for real" gave bare `fedpca ...`
    commands without saying that `fedpca` lives in the install step's virtual
    environment, which a new shell has not activated."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Running the roles for real", 1)[1].split("\n## ", 1)[0]
    lines = [line.strip() for line in section.splitlines()]
    first_command = next(i for i, line in enumerate(lines) if line.startswith("fedpca "))
    activation = next(i for i, line in enumerate(lines) if line.startswith("source "))
    assert activation < first_command
    assert lines[activation].endswith("/.venv/bin/activate")
    assert "/.venv/bin/fedpca` instead of `fedpca`" in " ".join(section.split())


def _shown_keys(path: Path) -> set[str]:
    """Keys the example shows, set or commented out (``# name = ...``)."""
    keys = set()
    for line in path.read_text().splitlines():
        text = line.strip().removeprefix("#").strip()
        name, equals, _ = text.partition("=")
        if equals and name.strip().isidentifier():
            keys.add(name.strip())
    return keys


def test_the_examples_show_every_key_of_these_sections() -> None:
    """They say "every key, annotated": a key the loaders accept but the examples leave
    out (all of [limits] once) is one an operator cannot find."""
    from dataclasses import fields

    from fedpca.analyst.config import _CONFIG_KEYS
    from fedpca.owner.policy_config import PolicyConfig
    from fedpca.proxy.config import CryptoConfig as ProxyCrypto
    from fedpca.proxy.limits import PeerLimits

    proxy = _shown_keys(CONFIG / "proxy.toml")
    for section in (PeerLimits, ProxyCrypto):
        assert {f.name for f in fields(section)} <= proxy, section.__name__
    assert {f.name for f in fields(PolicyConfig)} <= _shown_keys(CONFIG / "owner.toml")
    assert set(_CONFIG_KEYS) - {"tls"} <= _shown_keys(CONFIG / "analyst.toml")
