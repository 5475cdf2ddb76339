"""proxy.toml: the documented format, relative paths, errors that name the key."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fedpca.dp.accounting import Accountant
from fedpca.dp.mechanisms import PrivacyParams
from fedpca.errors import ConfigError
from fedpca.proxy.config import ProxyConfig, load_config
from fedpca.query import Neighbouring

OWNERS = '[owners]\nallowed = ["o1"]\n'

EXAMPLE = """\
[proxy]
id = "proxy"
listen = "127.0.0.1:50051"
database = "proxy.sqlite3"
heartbeat_seconds = 5.0
[tls]
ca = "certs/ca.pem"
cert = "certs/proxy.pem"
key = "certs/proxy.key"
insecure = false
revoked_serials = ["1f:2e", "AB"]
[owners]
allowed = ["hospital-a", "hospital-b"]
[privacy]
neighbouring = "replace-one"
accountant = "pld-continuous"
max_delta_per_query = 1e-7
[budget]
epsilon = 10.0
delta = 1e-5
[budget.analysts.alice]
epsilon = 2.0
delta = 1e-6
[crypto]
processes = 0
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "conf" / "proxy.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def test_the_documented_example_loads_with_paths_relative_to_the_file(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, EXAMPLE))
    base = (tmp_path / "conf").resolve()
    assert config.proxy.id == "proxy" and config.proxy.listen == "127.0.0.1:50051"
    assert config.proxy.database == base / "proxy.sqlite3"
    assert config.proxy.heartbeat_seconds == 5.0
    assert config.proxy.max_upload_mib == 256.0  # the default
    assert config.tls.files().certificate == base / "certs" / "proxy.pem"
    assert config.tls.ca == base / "certs" / "ca.pem" and not config.tls.insecure
    assert config.budget.for_analyst("alice") == PrivacyParams(2.0, 1e-6)
    assert config.budget.for_analyst("bob") == PrivacyParams(10.0, 1e-5)
    assert config.crypto.pool_processes is None  # 0 = all cores
    assert not config.crypto.allow_insecure_test_keys
    assert config.tls.revoked_serials == frozenset({0x1F2E, 0xAB})
    assert config.owners.allowed == frozenset({"hospital-a", "hospital-b"})
    assert config.privacy.neighbouring is Neighbouring.REPLACE_ONE
    assert config.privacy.accountant is Accountant.PLD_CONTINUOUS
    assert config.privacy.delta_cap(config.budget.default) == 1e-7


def test_defaults_and_unlimited_budget(tmp_path: Path) -> None:
    text = "[tls]\ninsecure = true\n[budget]\nepsilon = inf\n" + OWNERS
    config = load_config(write(tmp_path, text))
    assert config.tls.insecure and config.proxy.listen == "127.0.0.1:50051"
    assert math.isinf(config.budget.default.epsilon) and config.budget.default.delta == 1e-5
    assert config.privacy.neighbouring is Neighbouring.ADD_REMOVE
    assert config.privacy.accountant is Accountant.ZCDP
    assert config.privacy.delta_cap(config.budget.default) == 1e-5


def test_without_a_budget_section_every_analyst_gets_what_init_writes(tmp_path: Path) -> None:
    """A configuration without [budget] gave every analyst epsilon 10, said nowhere;
    `proxy init` writes 3 by default (review). The two are now the same value."""
    config = load_config(write(tmp_path, "[tls]\ninsecure = true\n" + OWNERS))
    assert config.budget.default == PrivacyParams(3.0, 1e-5)  # init's: test_node_folders.py


def test_the_owner_allow_list_is_required(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"owners\.allowed is required"):
        load_config(write(tmp_path, "[tls]\ninsecure = true\n"))


def test_the_analyst_allow_list_is_optional_and_checked(tmp_path: Path) -> None:
    base = '[tls]\nca = "ca.pem"\ncert = "c.pem"\nkey = "k.pem"\n' + OWNERS
    assert load_config(write(tmp_path, base)).analysts.allowed is None  # any certified one
    listed = base + '[analysts]\nallowed = ["alice", "bob"]\n[budget.analysts.bob]\nepsilon = 1\n'
    assert load_config(write(tmp_path, listed)).analysts.allowed == frozenset({"alice", "bob"})
    refusals = {
        "[analysts]\n": r"analysts\.allowed is required in \[analysts\]",
        "[analysts]\nallowed = []\n": r"analysts\.allowed is empty: this proxy would accept no",
        "[analysts]\nallowed = ['a', 'a']\n": r"analysts\.allowed lists an analyst twice",
        "[analysts]\nallowed = ['a b']\n": r"analysts\.allowed\[0\]",
        "[analysts]\nallowd = ['a']\n": r"allowd",
        # A budget for an analyst the list leaves out is a typo or a forgotten entry.
        "[analysts]\nallowed = ['alice']\n[budget.analysts.bob]\nepsilon = 1\n": (
            r"\[budget\.analysts\.bob\] names an analyst that analysts\.allowed does not list"
        ),
    }
    for text, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            load_config(write(tmp_path, base + text))
    # Without certificates a caller names itself: a list would only look like a guard.
    insecure = "[tls]\ninsecure = true\n" + OWNERS + "[analysts]\nallowed = ['alice']\n"
    with pytest.raises(ConfigError, match=r"means nothing with tls\.insecure"):
        load_config(write(tmp_path, insecure))


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[proxy]\nlisten = 5\n[tls]\ninsecure = true\n", "proxy.listen"),
        ("[proxy]\nlisten = 'nohost'\n[tls]\ninsecure = true\n", "proxy.listen"),
        ("[proxy]\nheartbeat_seconds = 0\n[tls]\ninsecure = true\n", "proxy.heartbeat_seconds"),
        ("[proxy]\nmax_upload_mib = -1\n[tls]\ninsecure = true\n", "proxy.max_upload_mib"),
        ("[proxy]\nid = 'bad id'\n[tls]\ninsecure = true\n", "proxy.id"),
        ("[proxy]\nport = 1\n[tls]\ninsecure = true\n", "proxy.port"),
        ("[tls]\nca = 'ca.pem'\ncert = 'c.pem'\n", "tls.key"),
        ("[tls]\ninsecure = 'yes'\n", "tls.insecure"),
        ("[tls]\ninsecure = true\n[budget]\nepsilion = 1.0\n", "budget.epsilion"),
        ("[tls]\ninsecure = true\n[budget]\ndelta = 0\n", "budget.delta"),
        ("[tls]\ninsecure = true\n[budget.analysts.bob]\nepsilon = -1\n", "budget.analysts.bob"),
        ("[tls]\ninsecure = true\n[crypto]\nprocesses = -2\n", "crypto.processes"),
        ("[tls]\ninsecure = true\n[cryto]\nprocesses = 1\n", "cryto"),
        ("[tls]\ninsecure = true\nrevoked_serials = ['xyz']\n", "tls.revoked_serials"),
        ("[tls]\ninsecure = true\n[owners]\nallowed = ['a b']\n", "owners.allowed"),
        ("[tls]\ninsecure = true\n[owners]\nallowed = ['a', 'a']\n", "twice"),
        ("[tls]\ninsecure = true\n[privacy]\nneighbouring = 'x'\n", "privacy"),
        ("[tls]\ninsecure = true\n[privacy]\nmax_delta_per_query = 2\n", "max_delta"),
    ],
)
def test_bad_values_name_their_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(write(tmp_path, text + ("" if "[owners]" in text else OWNERS)))


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "[proxy\n"))


def test_flags_override_the_file() -> None:
    config = ProxyConfig().with_overrides(listen="0.0.0.0:0", insecure=True)
    assert config.proxy.listen == "0.0.0.0:0" and config.tls.insecure
    with pytest.raises(ConfigError, match="listen"):
        ProxyConfig().with_overrides(listen="nope")
    # "off" turns a configured monitoring port off (a new user's walkthrough: no value
    # of the flag could, and the error suggested "off:50051").
    monitored = ProxyConfig().with_overrides(monitoring_listen="127.0.0.1:9464")
    assert monitored.monitoring.listen == "127.0.0.1:9464"
    assert monitored.with_overrides(monitoring_listen="off").monitoring.listen is None


def test_max_concurrent_rpcs_must_leave_room_for_the_allowed_owners(tmp_path: Path) -> None:
    """Found by review: any value >= 1 was accepted, though every allowed owner keeps a
    task stream open against it (and may upload beside it)."""
    # Two owners, each a stream and 2 uploads, and one analyst's 16 calls: 22.
    for value, fits in ((21, False), (22, True)):
        text = EXAMPLE + f"[limits]\nmax_concurrent_rpcs = {value}\n"
        if fits:
            assert load_config(write(tmp_path, text)).limits.max_concurrent_rpcs == value
        else:
            with pytest.raises(ConfigError, match="at least 22 are needed"):
                load_config(write(tmp_path, text))


def test_keep_results_days(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, EXAMPLE)).proxy.keep_results_days == 30.0
    text = EXAMPLE.replace(
        "heartbeat_seconds = 5.0", "heartbeat_seconds = 5.0\nkeep_results_days = 0"
    )
    assert load_config(write(tmp_path, text)).proxy.keep_results_days == 0.0
    for bad in ("-1", "inf", '"a month"'):
        text = EXAMPLE.replace(
            "heartbeat_seconds = 5.0", f"heartbeat_seconds = 5.0\nkeep_results_days = {bad}"
        )
        with pytest.raises(ConfigError, match="keep_results_days"):
            load_config(write(tmp_path, text))


def test_the_per_query_delta_cap_is_checked_against_the_default_budget_only(
    tmp_path: Path,
) -> None:
    """As an owner's cap against its budget: above the default budget's delta it is
    refused; an analyst given a smaller delta than the cap is not an error (found by
    review: checking every analyst's budget refused configurations that worked)."""
    text = "max_delta_per_query = {cap}\n[budget]\ndelta = 1e-5\n[budget.analysts.student]\n"
    base = f"[tls]\ninsecure = true\n{OWNERS}[privacy]\n"
    with pytest.raises(ConfigError, match=r"max_delta_per_query = 0\.5 exceeds budget\.delta"):
        load_config(write(tmp_path, base + text.format(cap=0.5) + "delta = 1e-7\n"))
    config = load_config(write(tmp_path, base + text.format(cap=1e-6) + "delta = 1e-7\n"))
    assert config.privacy.max_delta_per_query == 1e-6
