"""``fedpca proxy|owner|analyst init`` write node folders that the real loaders accept,
``owner serve`` flags override the file, and ``owner probe`` checks a folder end to end."""

from __future__ import annotations

import logging
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from fedpca.analyst.config import load_config as load_analyst_config
from fedpca.analyst.init import init_command as analyst_init
from fedpca.codec import CryptoPool, key_fingerprint
from fedpca.dp.mechanisms import PrivacyEvent
from fedpca.errors import ConfigError
from fedpca.owner.cli import owner_group
from fedpca.owner.config import load_config as load_owner_config
from fedpca.owner.init import write_owner_folder
from fedpca.owner.ledger import BudgetLedger, owner_ledger
from fedpca.proxy.cli import proxy_group
from fedpca.proxy.config import BudgetConfig
from fedpca.proxy.config import load_config as load_proxy_config
from fedpca.proxy.store import ProxyStore
from fedpca.proxy.store_database import use_database
from fedpca.query import RELEASE_KINDS, Neighbouring
from fedpca.transport.certs import TlsMaterial, init_certificates
from helpers import TEST_SIGNER
from inprocess import deployment, labelled

OWNERS = ["hospital-a", "hospital-b"]


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    init_certificates(tmp_path / "certs", OWNERS, ["alice"], proxy_hosts=("proxy.test",))
    return tmp_path / "certs"


def _table(path: Path, rows: int = 351, features: int = 4) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = np.random.default_rng(0).uniform(-1, 1, size=(rows, features))
    np.savetxt(path, labelled(data), delimiter=",")
    return path


def test_proxy_init_writes_a_folder_the_proxy_loads(certs: Path, tmp_path: Path) -> None:
    out = tmp_path / "proxy"
    args = ["init", "--out", str(out), "--owners", ",".join(OWNERS), "--certs", str(certs)]
    extra = ["--analyst-budget", "alice=1:1e-6", "--monitoring-listen", "0.0.0.0:9464"]
    result = CliRunner().invoke(proxy_group, [*args, *extra])
    assert result.exit_code == 0, result.output
    config = load_proxy_config(out / "proxy.toml")
    assert config.owners.allowed == frozenset(OWNERS)
    assert config.proxy.listen == "0.0.0.0:50051"
    assert config.proxy.database == out / "state" / "proxy.sqlite3"
    assert config.tls.files().private_key == out / "tls" / "key.pem"
    assert config.budget.analysts["alice"].epsilon == 1.0
    # The default budget init writes is the one a configuration without [budget] gets.
    assert config.budget.default == BudgetConfig().default
    assert config.monitoring.listen == "0.0.0.0:9464"
    assert config.privacy.neighbouring is Neighbouring.ADD_REMOVE
    # Paths are relative in the file: the folder can move or be mounted anywhere.
    text = (out / "proxy.toml").read_text()
    assert str(tmp_path) not in text and 'ca = "tls/ca.pem"' in text
    assert stat.S_IMODE((out / "tls" / "key.pem").stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "tls" / "ca.pem").stat().st_mode) == 0o644
    assert TlsMaterial.load(config.tls.files()).identity.node_id == "proxy"
    # The database is made with the folder (`proxy serve` refuses one that is missing).
    assert config.proxy.database.is_file()
    assert f"database        {config.proxy.database}" in result.output
    inode = config.proxy.database.stat().st_ino
    # Not twice without --force; the CA key never leaves the certificates directory.
    again = CliRunner().invoke(proxy_group, args)
    assert again.exit_code == 1 and "already exists" in again.output
    assert not list(out.rglob("ca-key.pem"))
    # --force without the flags that wrote a setting refuses to drop it (it dropped
    # budget overrides, revoked serials and monitoring: an operator's review), names
    # each change and leaves the folder as it was.
    text = (out / "proxy.toml").read_text()
    dropped = CliRunner().invoke(proxy_group, [*args, "--force"])
    assert dropped.exit_code == 1
    assert "budget.analysts.alice.epsilon: 1.0 dropped" in dropped.output
    assert "monitoring.listen: '0.0.0.0:9464' dropped" in dropped.output
    assert "--replace-settings" in dropped.output
    assert (out / "proxy.toml").read_text() == text
    # With --force the folder is written again around the same database.
    forced = CliRunner().invoke(proxy_group, [*args, *extra, "--force"])
    assert forced.exit_code == 0, forced.output
    assert config.proxy.database.stat().st_ino == inode
    assert "run: fedpca proxy serve" in forced.output
    # Beside a running proxy (it holds the database's lock) the new settings wait for
    # its restart, which init now says (it said "run: fedpca proxy serve", which the
    # lock refused: a new user's walkthrough).
    with use_database(config.proxy.database):
        serving = CliRunner().invoke(proxy_group, [*args, *extra, "--force"])
    assert serving.exit_code == 0, serving.output
    assert "a proxy still serves this folder with its old settings" in serving.output
    assert "in use by process" in serving.output and "restart it" in serving.output
    assert "run: fedpca proxy serve" not in serving.output
    # A proxy ran on it (its lock file is left) and the database is gone: --force
    # does not make a new one in its place (found by review).
    (out / "state" / "proxy.sqlite3.lock").touch()
    for suffix in ("", "-wal", "-shm"):
        (out / "state" / f"proxy.sqlite3{suffix}").unlink(missing_ok=True)
    refused = CliRunner().invoke(proxy_group, [*args, *extra, "--force"])
    assert refused.exit_code == 1 and "a proxy ran on this database" in refused.output
    assert not config.proxy.database.exists()


def test_init_force_accepts_the_changes_its_flags_ask_for(
    certs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A new user's ``proxy init --force --owners a,b`` was refused for changing the
    owners, the change asked for, until --replace-settings was added. Changes by
    flags given are accepted; changes by defaults (a dropped setting) are not."""
    out = tmp_path / "proxy"
    base = ["init", "--out", str(out), "--certs", str(certs), "--force"]
    budget = ["--analyst-budget", "alice=1:1e-6"]
    first = CliRunner().invoke(proxy_group, [*base, "--owners", OWNERS[0], *budget])
    assert first.exit_code == 0, first.output
    wider = [*base, "--owners", ",".join(OWNERS), "--budget-epsilon", "2"]
    # The analyst's budget, not given again, would be dropped: refused, by name only.
    refused = CliRunner().invoke(proxy_group, wider)
    assert refused.exit_code == 1
    assert "budget.analysts.alice.epsilon: 1.0 dropped" in refused.output
    assert "owners.allowed" not in refused.output and "budget.epsilon" not in refused.output
    # --analyst-budget writes it: not named as a setting no flag writes (review, stop 42).
    assert "No flag" not in refused.output
    assert load_proxy_config(out / "proxy.toml").owners.allowed == {OWNERS[0]}
    with caplog.at_level(logging.WARNING, logger="fedpca.transport.bundle"):
        changed = CliRunner().invoke(proxy_group, [*wider, "--analyst-budget", "alice=3:1e-6"])
    assert changed.exit_code == 0, changed.output
    # Each change is said, the asked ones too: --owners is required, so a re-run with
    # fewer owners would otherwise drop some without a word (review).
    assert "proxy.toml: owners.allowed: ['hospital-a'] -> ['hospital-a', 'hospital-b']" in (
        caplog.text
    )
    assert "proxy.toml: budget.epsilon: 3.0 -> 2.0" in caplog.text
    config = load_proxy_config(out / "proxy.toml")
    assert config.owners.allowed == frozenset(OWNERS)
    assert config.budget.default.epsilon == 2.0
    assert config.budget.analysts["alice"].epsilon == 3.0
    # Revocations are kept whatever the flags: no flag writes them, and an operator
    # re-adding an owner could keep them only by editing the file or dropping them
    # with --replace-settings (an operator's walkthrough).
    path = out / "proxy.toml"
    path.write_text(path.read_text().replace("revoked_serials = []", 'revoked_serials = ["1a2b"]'))
    again = [*wider, "--analyst-budget", "alice=3:1e-6"]
    for extra in ([], ["--replace-settings"]):
        kept = CliRunner().invoke(proxy_group, [*again, *extra])
        assert kept.exit_code == 0, kept.output
        assert "revoked         1 certificate serial(s), kept" in kept.output
        assert load_proxy_config(path).tls.revoked_serials == frozenset({0x1A2B})
    # An owner folder alike: a new --max-records and one more analyst key are asked for;
    # the monitoring address, not given again, is not.
    data = _table(tmp_path / "table.csv")
    owner = tmp_path / "hospital-a"
    args = [
        *("init", "--out", str(owner), "--id", "hospital-a", "--proxy", "proxy.test:50051"),
        *("--certs", str(certs), "--data", str(data), "--analyst-signer", TEST_SIGNER),
        *("--analyst-key", "sha256:" + "a" * 64, "--force"),
    ]
    monitoring = ["--monitoring-listen", "127.0.0.1:9464"]
    made = CliRunner().invoke(owner_group, [*args, "--max-records", "400", *monitoring])
    assert made.exit_code == 0, made.output
    more = [*args, "--analyst-key", "sha256:" + "b" * 64, "--max-records", "500"]
    refused = CliRunner().invoke(owner_group, more)
    assert refused.exit_code == 1 and "monitoring.listen: '127.0.0.1:9464' dropped" in (
        refused.output
    )
    assert "max_records" not in refused.output and "accepted_analyst_keys" not in refused.output
    changed = CliRunner().invoke(owner_group, [*more, *monitoring])
    assert changed.exit_code == 0, changed.output
    loaded = load_owner_config(owner / "owner.toml")
    assert loaded.data.max_records == 500 and len(loaded.policy.accepted_analyst_keys) == 2


def test_init_force_refuses_what_would_lose_or_weaken_a_setting_unseen(
    certs: Path, tmp_path: Path
) -> None:
    """Review: over a proxy.toml that did not parse, `init --force` wrote a new one from
    the flags alone (revocations and a database elsewhere gone, exit 0); a file without
    `listen` (loopback when loaded) got 0.0.0.0 without a refusal; a revoked serial
    written as a TOML number was kept as another serial; `--analysts ""` (an unset
    variable) turned the analyst allow-list off."""
    out = tmp_path / "proxy"
    path = out / "proxy.toml"
    args = ["init", "--out", str(out), "--owners", OWNERS[0], "--certs", str(certs)]
    assert CliRunner().invoke(proxy_group, args).exit_code == 0
    good = path.read_text()
    path.write_text(good.replace("revoked_serials = []", 'revoked_serials = ["1a2b]'))
    broken = path.read_text()
    for extra in ([], ["--replace-settings"]):
        refused = CliRunner().invoke(proxy_group, [*args, "--force", *extra])
        assert refused.exit_code == 1, refused.output
        assert "exists and cannot be read" in refused.output and "fix it first" in refused.output
        assert path.read_text() == broken
    path.write_text(good.replace("revoked_serials = []", "revoked_serials = [0x1a2b]"))
    refused = CliRunner().invoke(proxy_group, [*args, "--force", "--replace-settings"])
    assert refused.exit_code == 1 and "hex serials in quotes" in refused.output
    path.write_text("\n".join(line for line in good.splitlines() if "listen" not in line))
    added = CliRunner().invoke(proxy_group, [*args, "--force"])
    assert added.exit_code == 1 and "proxy.listen: '0.0.0.0:50051' added" in added.output
    chosen = CliRunner().invoke(proxy_group, [*args, "--force", "--listen", "127.0.0.1:50051"])
    assert chosen.exit_code == 0, chosen.output
    empty = CliRunner().invoke(proxy_group, [*args, "--force", "--analysts", " "])
    assert empty.exit_code == 1 and "--analysts names no analyst" in empty.output


def test_proxy_init_keeps_the_relation_its_releases_were_recorded_under(
    certs: Path, tmp_path: Path
) -> None:
    """As ``owner init`` for an owner's ledger (review): a proxy whose database holds
    releases under one relation, configured for the other, refuses every analyst
    with a release; init says so before writing."""
    out = tmp_path / "proxy"
    args = ["init", "--out", str(out), "--owners", OWNERS[0], "--certs", str(certs)]
    assert CliRunner().invoke(proxy_group, args).exit_code == 0
    config = load_proxy_config(out / "proxy.toml")
    store = ProxyStore(config.proxy.database)
    event = PrivacyEvent("alice/q1", "alice", 5.0, 0.5, 1e-6).to_strict_dict()
    with store.transaction() as conn:
        store.record_release(conn, "alice", "alice/q1", event)
    store.close()
    before = (out / "proxy.toml").read_text()
    other = [*args, "--force", "--neighbouring", "replace-one"]
    refused = CliRunner().invoke(proxy_group, other)
    assert refused.exit_code == 1
    assert "holds releases recorded under add-remove adjacency" in refused.output
    assert (out / "proxy.toml").read_text() == before


def test_proxy_init_can_list_the_analysts_it_serves(certs: Path, tmp_path: Path) -> None:
    out = tmp_path / "proxy"
    args = ["init", "--out", str(out), "--owners", OWNERS[0], "--certs", str(certs)]
    anyone = CliRunner().invoke(proxy_group, args)
    assert anyone.exit_code == 0, anyone.output
    assert "analysts        any the CA certified (--analysts A,B to list them)" in anyone.output
    assert load_proxy_config(out / "proxy.toml").analysts.allowed is None
    listed = CliRunner().invoke(proxy_group, [*args, "--force", "--analysts", "alice, bob"])
    assert listed.exit_code == 0, listed.output
    assert "analysts        alice, bob" in listed.output
    assert load_proxy_config(out / "proxy.toml").analysts.allowed == {"alice", "bob"}
    # Not dropped by a re-run that does not give it (a default, not a request).
    again = CliRunner().invoke(proxy_group, [*args, "--force"])
    assert again.exit_code == 1 and "analysts.allowed: ['alice', 'bob'] dropped" in again.output


def test_proxy_init_refusals_name_the_problem(certs: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    base = ["init", "--out", str(tmp_path / "p"), "--owners", OWNERS[0], "--certs", str(certs)]
    wrong_id = runner.invoke(proxy_group, [*base, "--id", "other"])
    assert wrong_id.exit_code == 1 and "fedpca certs issue" in wrong_id.output
    budget = runner.invoke(proxy_group, [*base, "--analyst-budget", "alice=1"])
    assert budget.exit_code == 1 and "ID=EPSILON:DELTA" in budget.output
    no_tls = runner.invoke(proxy_group, ["init", "--out", str(tmp_path / "q"), "--owners", "a"])
    assert no_tls.exit_code == 1 and "--certs" in no_tls.output
    # A folder that is no `fedpca certs init` output is named as such (it used to be
    # told to issue a proxy certificate, which cannot create the missing CA).
    stray = tmp_path / "stray"
    stray.mkdir()
    not_certs = runner.invoke(
        proxy_group, ["init", "--out", str(tmp_path / "r"), "--owners", "a", "--certs", str(stray)]
    )
    assert not_certs.exit_code == 1 and "is not a certificates directory" in not_certs.output
    assert "fedpca certs init" in not_certs.output and "certs issue" not in not_certs.output


def test_init_budget_flags_refuse_nan_and_a_cap_above_the_budget(
    certs: Path, tmp_path: Path
) -> None:
    """Found by review: ``nan`` for any budget flag of ``proxy init`` or ``owner init``
    ended in a TypeError traceback from the configuration writer, and the proxy took a
    per-query delta cap above its budget's delta that an owner refuses."""
    runner = CliRunner()
    base = ["init", "--out", str(tmp_path / "p"), "--owners", OWNERS[0], "--certs", str(certs)]
    for flag in ("--budget-epsilon", "--budget-delta", "--max-delta-per-query"):
        refused = runner.invoke(proxy_group, [*base, flag, "nan"])
        assert refused.exit_code == 2, refused.output
        assert f"Invalid value for '{flag}': must be a number, got nan" in refused.output
        assert refused.exception is None or isinstance(refused.exception, SystemExit)
    for text in ("alice=nan:1e-6", "alice=1:nan"):
        refused = runner.invoke(proxy_group, [*base, "--analyst-budget", text])
        assert refused.exit_code == 1 and "ID=EPSILON:DELTA" in refused.output
    over = runner.invoke(proxy_group, [*base, "--max-delta-per-query", "0.5"])
    assert over.exit_code == 1
    assert "privacy.max_delta_per_query = 0.5 exceeds budget.delta = 1e-05" in over.output
    assert not (tmp_path / "p").exists()
    data = _table(tmp_path / "hospital-a" / "data" / "table.csv")
    owner = [
        *("init", "--out", str(tmp_path / "hospital-a"), "--id", "hospital-a"),
        *("--proxy", "proxy.test:50051", "--certs", str(certs), "--data", str(data)),
        *("--label-column", "0", "--max-records", "400", "--analyst-key", "sha256:" + "a" * 64),
        *("--analyst-signer", TEST_SIGNER),
    ]
    for flag in ("--budget-epsilon", "--budget-delta", "--max-epsilon-per-query"):
        refused = runner.invoke(owner_group, [*owner, flag, "nan"])
        assert refused.exit_code == 2, refused.output
        assert "must be a number, got nan" in refused.output
    assert not (tmp_path / "hospital-a" / "owner.toml").exists()


def test_proxy_init_refuses_an_owner_without_a_certificate_before_writing(
    certs: Path, tmp_path: Path
) -> None:
    """A new operator's review: ``--owners`` took an id no certificate was issued
    for, so that owner could never connect and nothing said so."""
    out = tmp_path / "proxy"
    runner = CliRunner()

    def init(owners: str) -> Any:
        return runner.invoke(
            proxy_group, ["init", "--out", str(out), "--owners", owners, "--certs", str(certs)]
        )

    missing = init(f"{OWNERS[0]},hospital-c")
    assert missing.exit_code == 1
    assert "owner 'hospital-c' has no certificate" in missing.output
    assert f"fedpca certs issue --dir {certs} --role owner --node-id hospital-c" in missing.output
    assert not out.exists()
    # A certificate under the owner's name must be that owner's, from this CA.
    stolen = certs / "owner" / "hospital-c"
    stolen.mkdir()
    (stolen / "cert.pem").write_bytes((certs / "owner" / OWNERS[1] / "cert.pem").read_bytes())
    other = tmp_path / "other-ca"
    init_certificates(other, ["hospital-d"], [])
    foreign = certs / "owner" / "hospital-d"
    foreign.mkdir()
    (foreign / "cert.pem").write_bytes((other / "owner" / "hospital-d" / "cert.pem").read_bytes())
    for owner in ("hospital-c", "hospital-d"):
        refused = init(f"{OWNERS[0]},{owner}")
        assert refused.exit_code == 1, refused.output
        assert f"owner '{owner}': " in refused.output
        assert "is not a certificate of" in refused.output
        assert not out.exists()
    twice = init(f"{OWNERS[0]},{OWNERS[0]}")
    assert twice.exit_code == 1 and f"lists owner '{OWNERS[0]}' twice" in twice.output
    assert init(",".join(OWNERS)).exit_code == 0


def test_proxy_init_summary_shows_analyst_budgets_and_monitoring(
    certs: Path, tmp_path: Path
) -> None:
    base = ["init", "--owners", ",".join(OWNERS), "--certs", str(certs)]
    extra = ["--analyst-budget", "alice=2:1e-6", "--monitoring-listen", "0.0.0.0:9464"]
    result = CliRunner().invoke(proxy_group, [*base, "--out", str(tmp_path / "a"), *extra])
    assert result.exit_code == 0, result.output
    assert "  budget          epsilon 3.0 at delta 1e-05 per analyst" in result.output
    assert "                  alice: epsilon 2.0 at delta 1e-06" in result.output
    assert "  monitoring      0.0.0.0:9464 (HTTP /metrics, /healthz, /readyz)" in result.output
    plain = CliRunner().invoke(proxy_group, [*base, "--out", str(tmp_path / "b")])
    assert plain.exit_code == 0, plain.output
    assert "alice" not in plain.output and "  monitoring      off" in plain.output


@pytest.mark.parametrize(
    ("role", "flag", "value"),
    [
        ("analyst", "--proxy", "localhost"),
        ("owner", "--proxy", "proxy.test"),
        ("owner", "--monitoring-listen", "::1:9464"),
        ("proxy", "--listen", "0.0.0.0"),
        ("proxy", "--monitoring-listen", "localhost:99999"),
    ],
)
def test_init_refuses_an_address_that_is_not_host_port_before_writing(
    role: str, flag: str, value: str, certs: Path, tmp_path: Path
) -> None:
    """A new operator's review: ``fedpca analyst init --proxy localhost`` succeeded,
    and the address failed only at the first query."""
    out = tmp_path / role
    data = _table(tmp_path / "table.csv")
    common = ["--out", str(out), "--certs", str(certs)]
    group, args = {
        "analyst": (analyst_init, [*common, "--id", "alice", "--key-dir", str(tmp_path)]),
        "owner": (
            owner_group,
            [
                *("init", *common, "--id", OWNERS[0], "--data", str(data)),
                *("--max-records", "400", "--analyst-key", "sha256:" + "a" * 64),
                *("--analyst-signer", TEST_SIGNER),
            ],
        ),
        "proxy": (proxy_group, ["init", *common, "--owners", ",".join(OWNERS)]),
    }[role]
    if flag != "--proxy" and role != "proxy":
        args += ["--proxy", "proxy.test:50051"]
    elif role != "proxy":
        args += ["--proxy", value]
    if flag != "--proxy":
        args += [flag, value]
    result = CliRunner().invoke(group, args)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{flag}': must be 'host:port'" in result.output
    assert not out.exists()


def test_the_force_hint_names_what_the_folder_holds(certs: Path, tmp_path: Path) -> None:
    """A new operator's review: a second ``fedpca analyst init`` said that --force
    keeps the folder's state/, which an analyst's folder does not have."""
    keys = tmp_path / "keys"
    analyst = ["--out", str(tmp_path / "alice"), "--id", "alice", "--proxy", "proxy.test:1"]
    analyst += ["--key-dir", str(keys), "--certs", str(certs)]
    proxy = ["init", "--out", str(tmp_path / "proxy"), "--owners", OWNERS[0]]
    proxy += ["--certs", str(certs)]
    for group, args, config in ((analyst_init, analyst, "analyst"), (proxy_group, proxy, "proxy")):
        assert CliRunner().invoke(group, args).exit_code == 0
        again = CliRunner().invoke(group, args)
        assert again.exit_code == 1
        assert f"pass --force to write {config}.toml and tls/ again" in again.output
        assert ("state/" in again.output) is (config == "proxy"), again.output


def test_owner_init_needs_max_records_and_suggests_one(certs: Path, tmp_path: Path) -> None:
    data = _table(tmp_path / "hospital-a" / "data" / "table.csv")
    out = tmp_path / "hospital-a"
    args = [
        "init",
        "--out",
        str(out),
        "--id",
        "hospital-a",
        "--proxy",
        "proxy.test:50051",
        "--certs",
        str(certs),
        "--data",
        str(data),
        "--label-column",
        "0",
        "--analyst-key",
        "sha256:" + "a" * 64,
        "--analyst-signer",
        TEST_SIGNER,
    ]
    refused = CliRunner().invoke(owner_group, args)
    assert refused.exit_code == 1
    assert "PUBLIC" in refused.output and "351 records" in refused.output
    # No value derived from the count is suggested (a rounded count published as the
    # capacity still tells neighbouring tables apart; review).
    assert "--max-records 4" not in refused.output and "400" not in refused.output
    assert not (out / "owner.toml").exists()

    result = CliRunner().invoke(owner_group, [*args, "--max-records", "400"])
    assert result.exit_code == 0, result.output
    assert "351 records, 5 columns: 4 features and the label in column 0 (0-based)" in (
        result.output
    )
    config = load_owner_config(out / "owner.toml")
    assert config.owner.id == "hospital-a" and config.owner.proxy == "proxy.test:50051"
    assert config.data.path == data and config.data.label_column == 0
    assert config.data.max_records == 400
    assert config.policy.accepted_analyst_keys == ("sha256:" + "a" * 64,)
    assert config.policy.accepted_query_signers == (TEST_SIGNER,)
    assert config.policy.allowed_kinds == RELEASE_KINDS
    assert config.owner.state_dir == out / "state" and config.owner.state_dir.is_dir()
    # The ledger is made with the folder (`owner serve` refuses one that is missing).
    assert config.ledger_path.is_file()
    assert f"budget ledger   {config.ledger_path}" in result.output
    text = (out / "owner.toml").read_text()
    assert 'path = "data/table.csv"' in text and str(tmp_path) not in text
    assert stat.S_IMODE((out / "tls" / "key.pem").stat().st_mode) == 0o600


def test_init_refuses_a_folder_of_fedpcas_own_sources(certs: Path, tmp_path: Path) -> None:
    """A new user's walkthrough ran `proxy init --out proxy` in a clone of fedpca: the
    proxy's keys, configuration and database went into proxy/, the proxy's sources."""
    sources = tmp_path / "proxy" / "fedpca" / "proxy"
    sources.mkdir(parents=True)
    (sources / "server.py").write_text("")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    args = ["init", "--out", str(tmp_path / "proxy"), "--owners", OWNERS[0], "--certs", str(certs)]
    refused = CliRunner().invoke(proxy_group, [*args, "--force"])
    assert refused.exit_code == 1, refused.output
    assert "looks like a folder of fedpca's own repository" in refused.output
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    # A folder that merely has a fedpca/ subfolder without sources is a folder like any.
    (sources / "server.py").unlink()
    assert CliRunner().invoke(proxy_group, args).exit_code == 0


@pytest.mark.parametrize(
    ("labels", "said"),
    [
        ([1.0, -1.0, 0.1, 1.0], "-1, 0.1, 1"),
        (list(range(12)), "0, 1, 2, 3, 4, 5, 6, 7, 8, 9 and 2 more"),
        ([0.30000000000000004, 1.0], "0.30000000000000004, 1"),
        ([-0.0, 0.0, 1.0], "0, 1"),  # one class: -0.0 == 0.0
    ],
)
def test_owner_probe_names_the_label_values_to_the_owner_alone(
    certs: Path, tmp_path: Path, labels: list[float], said: str
) -> None:
    """A walkthrough of stop 45: a DCA query names its classes exactly as the owners'
    tables hold them (one naming values a table lacks is charged for noise), and the
    probe said nothing of the labels, so an owner could not tell the analyst -1,1 from
    0,1. Every digit is shown: a class must equal a label exactly."""
    rows = np.resize(np.asarray(labels, dtype=np.float64), 24)
    data = tmp_path / "hospital-a" / "data" / "table.csv"
    data.parent.mkdir(parents=True)
    np.savetxt(data, np.column_stack([rows, np.zeros((24, 4))]), delimiter=",", fmt="%.17g")
    out = tmp_path / "hospital-a"
    args = [
        *("init", "--out", str(out), "--id", "hospital-a", "--proxy", "proxy.test:50051"),
        *("--certs", str(certs), "--data", str(data), "--label-column", "0"),
        *("--max-records", "1000", "--analyst-key", "sha256:" + "a" * 64),
        *("--analyst-signer", TEST_SIGNER),
    ]
    runner = CliRunner()
    initialised = runner.invoke(owner_group, args)
    assert initialised.exit_code == 0, initialised.output
    probe = runner.invoke(owner_group, ["probe", "--config", str(out / "owner.toml"), "--local"])
    assert probe.exit_code == 0, probe.output
    assert f"; label values (shown here only, not sent to the proxy): {said}\n" in probe.output


def test_owner_init_and_probe_refuse_a_relation_other_than_the_ledgers(
    certs: Path, tmp_path: Path
) -> None:
    """Found by review: ``owner init --force --neighbouring replace-one`` on a ledger
    with add-remove releases succeeded and ``owner probe`` said ok, then the node
    declined every query ("this deployment accounts under replace-one")."""
    from fedpca.dp.mechanisms import PrivacyEvent, PrivacyParams
    from fedpca.owner.ledger import owner_ledger

    data = _table(tmp_path / "hospital-a" / "data" / "table.csv")
    out = tmp_path / "hospital-a"
    args = [
        *("init", "--out", str(out), "--id", "hospital-a", "--proxy", "proxy.test:50051"),
        *("--certs", str(certs), "--data", str(data), "--label-column", "0"),
        *("--max-records", "400", "--analyst-key", "sha256:" + "a" * 64),
        *("--analyst-signer", TEST_SIGNER),
    ]
    runner = CliRunner()
    assert runner.invoke(owner_group, args).exit_code == 0
    config = load_owner_config(out / "owner.toml")
    event = PrivacyEvent("alice/q1", "sha256:" + "a" * 64, 5.0, 0.5, 1e-6)
    owner_ledger(config).reserve(event, PrivacyParams(3.0, 1e-5), spec_digest="d1")
    before = (out / "owner.toml").read_text()
    other = [*args, "--force", "--replace-settings", "--neighbouring", "replace-one"]
    refused = runner.invoke(owner_group, other)
    assert refused.exit_code == 1, refused.output
    assert "holds releases recorded under add-remove adjacency" in refused.output
    assert (out / "owner.toml").read_text() == before  # the folder as it was
    # A configuration edited by hand to the other relation: the probe says so.
    edited = before.replace('neighbouring = "add-remove"', 'neighbouring = "replace-one"')
    assert edited != before
    (out / "owner.toml").write_text(edited)
    probe = runner.invoke(owner_group, ["probe", "--config", str(out / "owner.toml"), "--local"])
    assert probe.exit_code != 0
    assert "but this configuration accounts under replace-one" in probe.output
    # The probe wrote nothing in the state folder (a read-only connection left the
    # write-ahead log's files behind: review).
    assert sorted(p.name for p in config.ledger_path.parent.iterdir() if "sqlite3-" in p.name) == []


@pytest.mark.parametrize("max_records", [100, 351])
def test_a_table_beyond_its_capacity_is_said_locally(
    certs: Path,
    tmp_path: Path,
    pool: CryptoPool,
    max_records: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A new user's walkthrough: a table of 256 rows under max_records = 100 lost 156
    rows from every query, and after init nothing said so. The probe and the node's
    start-up now say it, in the owner's own terminal and log, without the count."""
    from fedpca.owner.node import OwnerNode

    data = _table(tmp_path / "hospital-a" / "data" / "table.csv")  # 351 rows
    out = tmp_path / "hospital-a"
    args = [
        *("init", "--out", str(out), "--id", "hospital-a", "--proxy", "proxy.test:50051"),
        *("--certs", str(certs), "--data", str(data), "--label-column", "0"),
        *("--max-records", str(max_records), "--analyst-key", "sha256:" + "a" * 64),
        *("--analyst-signer", TEST_SIGNER),
    ]
    runner = CliRunner()
    assert runner.invoke(owner_group, args).exit_code == 0
    path = out / "owner.toml"
    probe = runner.invoke(owner_group, ["probe", "--config", str(path), "--local"])
    said = f"queries use a uniform sample of {max_records} (raise data.max_records"
    assert (said in probe.output) is (max_records < 351), probe.output
    with caplog.at_level(logging.WARNING, logger="fedpca.owner"):
        OwnerNode(load_owner_config(path), pool=pool)
    warned = [r.getMessage() for r in caplog.records if "uniform sample" in r.getMessage()]
    assert len(warned) == (max_records < 351)
    assert not any("351" in message for message in warned)  # the count stays unsaid


def test_allowed_columns_the_table_does_not_have_are_refused(
    certs: Path, tmp_path: Path, pool: CryptoPool
) -> None:
    """Found by review: ``policy.allowed_columns = [1, 99]`` on a 5-column table passed
    the configuration and ``owner probe``; queries reading column 99 could never come."""
    from fedpca.owner.node import OwnerNode

    data = _table(tmp_path / "hospital-a" / "data" / "table.csv")
    out = tmp_path / "hospital-a"
    args = [
        *("init", "--out", str(out), "--id", "hospital-a", "--proxy", "proxy.test:50051"),
        *("--certs", str(certs), "--data", str(data), "--label-column", "0"),
        *("--max-records", "400", "--analyst-key", "sha256:" + "a" * 64),
        *("--analyst-signer", TEST_SIGNER),
    ]
    runner = CliRunner()
    assert runner.invoke(owner_group, args).exit_code == 0
    path = out / "owner.toml"
    text = path.read_text()
    assert "\n[policy]\n" in text
    path.write_text(text.replace("\n[policy]\n", "\n[policy]\nallowed_columns = [1, 99]\n"))
    probe = runner.invoke(owner_group, ["probe", "--config", str(path), "--local"])
    assert probe.exit_code != 0
    assert "policy.allowed_columns names column 99 (0-based), but" in probe.output
    with pytest.raises(ConfigError, match=r"has 5 columns \(0 to 4\)"):
        OwnerNode(load_owner_config(path), pool=pool)


def test_owner_init_writes_the_columns_queries_may_read(certs: Path, tmp_path: Path) -> None:
    """An operator could restrict the columns only by editing owner.toml by hand."""
    data = _table(tmp_path / "table.csv")
    out = tmp_path / "hospital-a"
    args = [
        *("init", "--out", str(out), "--id", "hospital-a", "--proxy", "proxy.test:50051"),
        *("--certs", str(certs), "--data", str(data), "--label-column", "0"),
        *("--max-records", "400", "--analyst-key", "sha256:" + "a" * 64),
        *("--analyst-signer", TEST_SIGNER, "--allowed-columns"),
    ]
    runner = CliRunner()
    for value, message in [
        ("1,,2", "'1,,2' is not a comma-separated list of columns"),
        ("1,2,1", "column 1 is given twice"),
        ("-1", "columns are 0-based indices >= 0"),
    ]:
        usage = runner.invoke(owner_group, [*args, value])
        assert usage.exit_code == 2 and message in usage.output, usage.output
    outside = runner.invoke(owner_group, [*args, "1,5"])
    assert outside.exit_code == 1
    assert "--allowed-columns names column 5, but" in outside.output
    assert "has 5 columns (0 to 4, the label included)" in outside.output
    assert not out.exists()
    result = runner.invoke(owner_group, [*args, "0,2,4"])
    assert result.exit_code == 0, result.output
    assert "queries may read only columns 0, 2, 4" in result.output
    assert load_owner_config(out / "owner.toml").policy.allowed_columns == (0, 2, 4)


def test_init_force_names_the_settings_no_flag_keeps(certs: Path, tmp_path: Path) -> None:
    """An operator's walkthrough (stop 42): over an owner.toml edited by hand
    (``[crypto] processes = 1``), `init --force` said "give the flags that keep them",
    and `owner init` has no such flag."""
    data = _table(tmp_path / "table.csv")
    out = tmp_path / "hospital-a"
    args = [
        *("init", "--out", str(out), "--id", "hospital-a", "--proxy", "proxy.test:50051"),
        *("--certs", str(certs), "--data", str(data), "--label-column", "0"),
        *("--max-records", "400", "--analyst-key", "sha256:" + "a" * 64),
        *("--analyst-signer", TEST_SIGNER),
    ]
    runner = CliRunner()
    assert runner.invoke(owner_group, args).exit_code == 0
    path = out / "owner.toml"
    edited = (
        path.read_text()
        .replace("processes = 0", "processes = 1")
        .replace("epsilon = 3.0", "epsilon = 2.0")
    )
    path.write_text(edited)
    refused = runner.invoke(owner_group, [*args, "--force"])
    assert refused.exit_code == 1
    message = " ".join(refused.output.split())
    assert "crypto.processes: 1 -> 0" in message and "budget.epsilon: 2.0 -> 3.0" in message
    # The budget has a flag (--budget-epsilon); the number of processes none.
    assert "No flag of `init` writes crypto.processes: keep it by editing owner.toml" in (message)
    assert path.read_text() == edited


def test_owner_backup_copies_the_ledger_and_the_kept_shares(certs: Path, tmp_path: Path) -> None:
    """An operator's walkthrough (stop 42): owners had no backup command, only a Python
    one-liner in the docs whose copy landed beside the ledger."""
    data = _table(tmp_path / "table.csv")
    out = tmp_path / "hospital-a"
    args = [
        *("init", "--out", str(out), "--id", "hospital-a", "--proxy", "proxy.test:50051"),
        *("--certs", str(certs), "--data", str(data), "--label-column", "0"),
        *("--max-records", "400", "--analyst-key", "sha256:" + "a" * 64),
        *("--analyst-signer", TEST_SIGNER),
    ]
    runner = CliRunner()
    assert runner.invoke(owner_group, args).exit_code == 0
    config = load_owner_config(out / "owner.toml")
    owner_ledger(config).reserve(
        PrivacyEvent("alice/q1", "alice", 2.0, 1.0, 1e-6), config.budget, spec_digest="d1"
    )
    shares = config.owner.state_dir / "shares"
    shares.mkdir(mode=0o700)
    (shares / ("0" * 32 + ".npz")).write_bytes(b"share")
    # Neither a share being written nor anything else there is a kept share (review).
    (shares / ".1234.npz.tmp").write_bytes(b"half")
    (shares / "stray").mkdir()
    copy = tmp_path / "backups" / "today"  # backups/ made too, as in the docs' example
    command = ["backup", "--config", str(out / "owner.toml"), "--out", str(copy)]
    result = runner.invoke(owner_group, command)
    assert result.exit_code == 0, result.output
    assert "(1 releases) and 1 kept share(s)" in result.output
    restored = BudgetLedger(copy / "ledger.sqlite3", read_only=True)
    assert [entry.event.query_id for entry in restored.events()] == ["alice/q1"]
    assert [p.name for p in (copy / "shares").iterdir()] == ["0" * 32 + ".npz"]
    assert (copy / "shares" / ("0" * 32 + ".npz")).read_bytes() == b"share"
    assert stat.S_IMODE(copy.stat().st_mode) == 0o700
    assert stat.S_IMODE((copy / "ledger.sqlite3").stat().st_mode) == 0o600
    again = runner.invoke(owner_group, command)
    assert again.exit_code == 1 and "exists: give a new folder" in again.output
    (config.owner.state_dir / "ledger.sqlite3").unlink()
    missing = runner.invoke(owner_group, [*command[:-1], str(tmp_path / "other")])
    assert missing.exit_code == 1 and "no budget ledger at" in missing.output
    assert not (tmp_path / "other").exists()


def test_owner_init_can_give_each_analyst_an_equal_share(certs: Path, tmp_path: Path) -> None:
    data = _table(tmp_path / "table.csv")
    keys = ["sha256:" + c * 64 for c in "abc"]
    signers = ["ed25519:" + c * 64 for c in "def"]
    out = tmp_path / "hospital-a"
    base = ["init", "--out", str(out), "--id", "hospital-a", "--proxy", "proxy.test:50051"]
    base += ["--certs", str(certs), "--data", str(data), "--max-records", "400"]
    pin_signers = [arg for signer in signers for arg in ("--analyst-signer", signer)]
    args = [*base, *[arg for key in keys for arg in ("--analyst-key", key)], *pin_signers]
    result = CliRunner().invoke(owner_group, [*args, "--equal-analyst-shares"])
    assert result.exit_code == 0, result.output
    config = load_owner_config(out / "owner.toml")
    assert config.analyst_shares == dict.fromkeys(keys, 1 / 3)
    # Each key is answered for the signer given in the same place only.
    assert config.policy.analyst_key_signers == {
        k: (s,) for k, s in zip(keys, signers, strict=True)
    }
    assert f"share           0.333333 of it for analyst {keys[2]}" in result.output
    assert f"analyst key     {keys[1]} for signer {signers[1]}" in result.output
    # Without the flag: one budget for every analyst, as before (still paired).
    again = CliRunner().invoke(owner_group, [*args, "--force"])
    assert again.exit_code == 1 and "budget.analyst_shares." in again.output  # named
    again = CliRunner().invoke(owner_group, [*args, "--force", "--replace-settings"])
    assert again.exit_code == 0, again.output
    config = load_owner_config(out / "owner.toml")
    assert config.analyst_shares == {} and len(config.policy.analyst_key_signers) == 3
    # Shares need one signer per key: which analyst a share is for must be known.
    unpaired = [*args[:-2], "--equal-analyst-shares", "--force"]
    refused = CliRunner().invoke(owner_group, unpaired)
    assert refused.exit_code != 0 and "got 3 keys and 2 signers" in refused.output
    # With a team's signers for one key, nothing is paired and no shares can be asked.
    # A key given twice is refused by name, not by the TOML parser on a rolled-back file.
    twice = [*base, "--analyst-key", keys[0], "--analyst-key", keys[0], *pin_signers[:4]]
    refused = CliRunner().invoke(owner_group, [*twice, "--equal-analyst-shares", "--force"])
    assert refused.exit_code != 0 and f"--analyst-key {keys[0]} is given twice" in refused.output
    team = [*base, "--analyst-key", keys[0], *pin_signers, "--force", "--replace-settings"]
    unpaired_run = CliRunner().invoke(owner_group, team)
    assert unpaired_run.exit_code == 0, unpaired_run.output
    assert "not paired with keys" in unpaired_run.output
    assert load_owner_config(out / "owner.toml").policy.analyst_key_signers == {}
    # A node ran on the folder (its lock file is left) and its ledger is gone (here: an
    # empty file): init --force does not make a new one in its place (found by review).
    ledger = config.ledger_path
    (ledger.parent / "node.lock").touch()
    for suffix in ("-wal", "-shm"):
        ledger.with_name(ledger.name + suffix).unlink(missing_ok=True)
    ledger.write_bytes(b"")
    refused = CliRunner().invoke(owner_group, [*args, "--force", "--replace-settings"])
    assert refused.exit_code != 0 and "holds node.lock but no ledger" in refused.output
    assert ledger.stat().st_size == 0


def test_owner_init_without_readable_data_and_without_pins(certs: Path, tmp_path: Path) -> None:
    common: dict[str, Any] = {
        "owner_id": "hospital-b",
        "proxy": "proxy.test:50051",
        "data": Path("/srv/fedpca/data/table.csv"),
        "certs": certs,
    }
    with pytest.raises(ConfigError, match="--max-records is required") as info:
        write_owner_folder(
            tmp_path / "b", max_records=None, analyst_keys=["x"], signers=["y"], **common
        )
    assert "suggest" not in str(info.value) and "PUBLIC" in str(info.value)
    with pytest.raises(ConfigError, match="--analyst-signer"):
        write_owner_folder(tmp_path / "b", max_records=100, analyst_keys=[], signers=[], **common)
    config, facts = write_owner_folder(
        tmp_path / "b",
        max_records=100,
        analyst_keys=["sha256:" + "b" * 64],
        signers=[TEST_SIGNER],
        **common,
    )
    assert facts is None  # the data lives where the node will run; checked there
    assert config.data.path == Path("/srv/fedpca/data/table.csv")


def test_analyst_init(certs: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    out = tmp_path / "analyst"
    args = ["--out", str(out), "--id", "alice", "--proxy", "proxy.test:50051"]
    result = CliRunner().invoke(
        analyst_init, [*args, "--key-dir", str(keys), "--certs", str(certs)]
    )
    assert result.exit_code == 0, result.output
    config = load_analyst_config(out / "analyst.toml")
    assert config.proxy == "proxy.test:50051" and config.key_dir == keys
    assert config.tls is not None and config.tls.certificate == out / "tls" / "cert.pem"
    assert TlsMaterial.load(config.tls).identity.node_id == "alice"
    # The key folder is empty: said at init, not first at the first query.
    assert "holds no analyst key yet" in result.output and "analyst keygen" in result.output


def test_owner_serve_flags_override_the_file(certs: Path, tmp_path: Path) -> None:
    data = _table(tmp_path / "o" / "data" / "t.csv", rows=20)
    config, _ = write_owner_folder(
        tmp_path / "o",
        owner_id="hospital-a",
        proxy="proxy.test:50051",
        data=data,
        max_records=20,
        analyst_keys=["sha256:" + "a" * 64],
        signers=[TEST_SIGNER],
        certs=certs,
    )
    overridden = config.with_overrides(
        proxy="other.test:1", data=tmp_path / "x.csv", state_dir=tmp_path / "s", insecure=True
    )
    assert overridden.owner.proxy == "other.test:1" and overridden.data.path == tmp_path / "x.csv"
    assert overridden.owner.state_dir == tmp_path / "s" and overridden.tls.insecure
    monitored = config.with_overrides(monitoring_listen="127.0.0.1:9464")
    assert monitored.monitoring.listen == "127.0.0.1:9464"
    assert monitored.with_overrides(monitoring_listen="off").monitoring.listen is None
    runner = CliRunner()
    serve = ["serve", "--config", str(tmp_path / "o" / "owner.toml")]
    # The node refuses to start with what the flags name, before connecting anywhere.
    missing = runner.invoke(owner_group, [*serve, "--data", str(tmp_path / "nowhere.csv")])
    assert missing.exit_code == 1 and "nowhere.csv" in missing.output
    bad = runner.invoke(owner_group, [*serve, "--proxy", "no-port"])
    assert bad.exit_code == 1 and "owner.proxy must be 'host:port'" in bad.output


def test_owner_probe_against_a_running_proxy(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> None:
    public_key, _ = test_only_keypair_512
    tables = {owner: labelled(np.zeros((5, 3))) for owner in ("owner-1", "owner-2")}
    with deployment(
        workdir=tmp_path / "run",
        tables=tables,
        pool=pool,
        public_key=public_key,
        allowed=("owner-1",),
        running=(),
    ) as running:
        assert running.proxy is not None
        data = _table(tmp_path / "data.csv", rows=5, features=3)
        folders = {}
        for owner in ("owner-1", "owner-2"):
            write_owner_folder(
                tmp_path / owner,
                owner_id=owner,
                proxy=running.proxy.address,
                data=data,
                label_column=0,
                max_records=10,
                analyst_keys=[key_fingerprint(public_key)],
                signers=[TEST_SIGNER],
                certs=running.workdir / "certs",
            )
            folders[owner] = tmp_path / owner / "owner.toml"
        ok = CliRunner().invoke(owner_group, ["probe", "--config", str(folders["owner-1"])])
        assert ok.exit_code == 0, ok.output
        names = [line.split()[:2] for line in ok.stdout.strip().splitlines()]
        assert names == [
            ["ok", "config"],
            ["ok", "data"],
            ["ok", "tls"],
            ["ok", "state"],
            ["ok", "proxy"],
            ["ok", "enrolled"],
        ]
        assert "4 columns: 3 features and the label in column 0 (0-based);" in ok.output
        # owner-2 has a valid certificate but is not on the proxy's allow-list.
        refused = CliRunner().invoke(owner_group, ["probe", "--config", str(folders["owner-2"])])
        assert refused.exit_code == 1
        assert "FAIL  enrolled  PERMISSION_DENIED" in refused.output
        assert "not in this proxy's [owners] allowed list" in refused.output
        # Served anyway, it logs a refusal, not an outage.
        assert "refused this owner (PERMISSION_DENIED" in _first_session_log(folders["owner-2"])
        address = running.proxy.address
    # The proxy is gone: the probe says which address refused.
    down = CliRunner().invoke(owner_group, ["probe", "--config", str(folders["owner-1"])])
    assert down.exit_code == 1
    assert f"FAIL  proxy     {address} unreachable" in down.output
    assert "skip  enrolled" in down.output
    # --local (a container's startup probe) checks the node's own setup only.
    local = CliRunner().invoke(
        owner_group, ["probe", "--local", "--config", str(folders["owner-1"])]
    )
    assert local.exit_code == 0, local.output
    assert "skip  proxy     not checked (--local)" in local.output
    assert "FAIL" not in local.output and "warning" not in local.output
    # A key every user may read still works, with a warning on its line.
    key = tmp_path / "owner-1" / "tls" / "key.pem"
    key.chmod(0o644)
    exposed = CliRunner().invoke(
        owner_group, ["probe", "--local", "--config", str(folders["owner-1"])]
    )
    assert exposed.exit_code == 0, exposed.output
    tls_line = next(line for line in exposed.stdout.splitlines() if line.startswith("ok    tls"))
    assert f"(warning: {key} is readable by every user" in tls_line
    # Without its ledger the node would not start (a wrong state_dir): the probe says so.
    ledger = tmp_path / "owner-1" / "state" / "ledger.sqlite3"
    ledger.unlink()
    unledgered = CliRunner().invoke(
        owner_group, ["probe", "--local", "--config", str(folders["owner-1"])]
    )
    assert unledgered.exit_code == 1
    assert f"FAIL  state     {ledger} does not exist" in unledgered.output


def _first_session_log(config: Path) -> str:
    """``fedpca owner serve``'s log up to its first failed session (then SIGTERM)."""
    process = subprocess.Popen(
        [
            *(sys.executable, "-c", "from fedpca.owner.cli import owner_group; owner_group()"),
            *("serve", "--config", str(config)),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    watchdog = threading.Timer(60.0, process.kill)  # a node that never logs it fails
    watchdog.start()
    try:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            if "proxy" in line and ("refused" in line or "unreachable" in line):
                break
    finally:
        watchdog.cancel()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return "".join(lines)
