"""``fedpca proxy serve`` as a real process (mTLS, SIGTERM) and ``fedpca proxy status``."""

from __future__ import annotations

import json
import logging
import queue
import resource
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedpca.errors import ConfigError
from fedpca.messages import QueryState
from fedpca.proxy.cli import proxy_group
from fedpca.proxy.coordinator import task_id
from fedpca.proxy.open_files import needed_open_files
from fedpca.proxy.store import ProxyStore
from fedpca.transport import channels, serde
from fedpca.transport.certs import NodeIdentity, Role, TlsFiles, TlsMaterial, init_certificates
from fedpca.v1 import analyst_service_pb2_grpc as analyst_grpc

ENTRY = "from fedpca.proxy.cli import proxy_group; proxy_group()"


def write_config(
    tmp_path: Path, *, insecure: bool = False
) -> tuple[Path, dict[NodeIdentity, TlsFiles]]:
    files = init_certificates(tmp_path / "certs", owner_ids=["owner-1"], analyst_ids=["alice"])
    proxy = files[NodeIdentity(Role.PROXY, "proxy")]
    config = tmp_path / "proxy.toml"
    config.write_text(
        f"""\
[proxy]
id = "proxy"
listen = "127.0.0.1:0"
database = "state/proxy.sqlite3"
heartbeat_seconds = 1.0
[tls]
ca = "{proxy.ca_certificate.relative_to(tmp_path)}"
cert = "{proxy.certificate.relative_to(tmp_path)}"
key = "{proxy.private_key.relative_to(tmp_path)}"
insecure = {str(insecure).lower()}
[owners]
allowed = ["owner-1"]
[budget]
epsilon = 3.0
delta = 1e-5
[crypto]
processes = 1
"""
    )
    return config, files


# Started like a service under a soft limit below what its owners need (one owner: 258
# files), the proxy raises its own limit. Set in the child itself: a preexec_fn is not
# safe in a test process that runs threads.
LOW_LIMIT_ENTRY = (
    "import resource; hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard)); " + ENTRY
)


def test_serve_prints_its_address_answers_over_mtls_and_stops_on_sigterm(tmp_path: Path) -> None:
    config, files = write_config(tmp_path)
    process = subprocess.Popen(
        [sys.executable, "-c", LOW_LIMIT_ENTRY, "serve", "--config", str(config), "--new-database"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        if not line:  # it ended before listening: say why
            process.wait(timeout=30)
            raise AssertionError(process.stderr.read() if process.stderr else "no stderr")
        assert line.startswith("proxy listening on 127.0.0.1:"), line
        address = line.rsplit(" ", 1)[1]
        assert not address.endswith(":0")
        alice = TlsMaterial.load(files[NodeIdentity(Role.ANALYST, "alice")])
        with channels.secure_channel(address, alice) as channel:
            budget = serde.budget_status_from_proto(
                analyst_grpc.AnalystServiceStub(channel).GetBudget(
                    serde.budget_request_to_proto(), timeout=30
                )
            )
        assert budget.analyst_id == "alice" and budget.epsilon_limit == 3.0
        assert budget.epsilon_spent == 0.0 and budget.n_releases == 0
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert (tmp_path / "state" / "proxy.sqlite3").is_file()
    stderr = process.stderr.read() if process.stderr else ""
    assert "received SIGTERM" in stderr and "INSECURE" not in stderr
    assert "created a new, empty proxy database" in stderr
    # To the hard limit, which is at least what one owner needs.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    raised = needed_open_files(1) if hard == resource.RLIM_INFINITY else hard
    assert f"open files limit raised from 200 to {raised}" in stderr


def test_insecure_serve_warns(tmp_path: Path) -> None:
    config, _ = write_config(tmp_path)
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            ENTRY,
            "serve",
            "--config",
            str(config),
            "--insecure",
            "--new-database",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("proxy listening on")
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "INSECURE proxy" in (process.stderr.read() if process.stderr else "")


def test_serve_refuses_a_database_that_does_not_exist(tmp_path: Path) -> None:
    """A wrong [proxy] database would start every analyst's budget again at zero: only
    `proxy init` or --new-database creates one."""
    config, _ = write_config(tmp_path)
    database = tmp_path / "state" / "proxy.sqlite3"
    typo = tmp_path / "state" / "proxy.sqlite"
    result = CliRunner().invoke(
        proxy_group, ["serve", "--config", str(config), "--database", str(typo)]
    )
    assert result.exit_code == 1, result.output
    assert f"the proxy database {typo} does not exist" in result.output
    assert "--new-database" in result.output
    assert not typo.exists() and not database.exists()


def test_new_database_creates_it_once_and_never_replaces_one(tmp_path: Path) -> None:
    config, _ = write_config(tmp_path)
    database = tmp_path / "state" / "proxy.sqlite3"
    created = CliRunner().invoke(proxy_group, ["new-database", "--config", str(config)])
    assert created.exit_code == 0, created.output
    assert f"created the proxy database {database}" in created.output
    with sqlite3.connect(database) as connection:
        connection.execute("CREATE TABLE marker (x)")
    again = CliRunner().invoke(proxy_group, ["new-database", "--config", str(config)])
    assert again.exit_code == 0 and "exists: left as it is" in again.output
    with sqlite3.connect(database) as connection:  # the same file, not a new one
        assert connection.execute("SELECT name FROM sqlite_master WHERE name = 'marker'").fetchone()
    # A proxy ran on it (its lock file is left) and the database is gone: refused.
    (database.parent / "proxy.sqlite3.lock").touch()
    for suffix in ("", "-wal", "-shm"):
        database.with_name(database.name + suffix).unlink(missing_ok=True)
    refused = CliRunner().invoke(proxy_group, ["new-database", "--config", str(config)])
    assert refused.exit_code == 1 and "a proxy ran on this database" in refused.output
    assert not database.exists()


def test_an_empty_database_file_is_a_missing_database(tmp_path: Path) -> None:
    """Found by review: a database file of zero bytes was taken for the proxy's
    database and `serve` started every analyst's budget at zero without a word; and
    `serve --new-database` made a new one where a proxy had run."""
    config, _ = write_config(tmp_path)
    database = tmp_path / "state" / "proxy.sqlite3"
    for suffix in ("", "-wal", "-shm"):
        database.with_name(database.name + suffix).unlink(missing_ok=True)
    database.parent.mkdir(parents=True, exist_ok=True)
    database.touch()
    export = tmp_path / "owner-releases.json"
    export.write_text('{"owner": "o", "releases": []}')
    for command in (["serve"], ["status"], ["import-releases", str(export)]):
        refused = CliRunner().invoke(proxy_group, [*command, "--config", str(config)])
        assert refused.exit_code == 1, (command, refused.output)
        assert f"{database} is empty (0 bytes" in refused.output
        assert database.stat().st_size == 0
    (database.parent / "proxy.sqlite3.lock").touch()
    for command in (["new-database"], ["serve", "--new-database"]):
        refused = CliRunner().invoke(proxy_group, [*command, "--config", str(config)])
        assert refused.exit_code == 1 and "a proxy ran on this database" in refused.output
        assert database.stat().st_size == 0


def test_new_database_names_a_folder_it_cannot_create(tmp_path: Path) -> None:
    config, _ = write_config(tmp_path)
    (tmp_path / "afile").write_text("")
    text = config.read_text()
    start = text.index("database = ")
    end = text.index("\n", start)
    config.write_text(text[:start] + 'database = "afile/proxy.sqlite3"' + text[end:])
    result = CliRunner().invoke(proxy_group, ["new-database", "--config", str(config)])
    assert result.exit_code == 1, result.output
    assert "cannot create the folder of the proxy database" in result.output
    assert "Traceback" not in result.output


def test_serve_refuses_a_bad_config(tmp_path: Path) -> None:
    config = tmp_path / "proxy.toml"
    config.write_text(
        '[tls]\ninsecure = true\n[owners]\nallowed = ["owner-1"]\n[budget]\nepsilion = 1\n'
    )
    result = CliRunner().invoke(proxy_group, ["serve", "--config", str(config)])
    assert result.exit_code == 1 and "budget.epsilion" in result.output
    # Without the owner allow-list the proxy does not start (any CA-signed owner
    # certificate would otherwise be accepted).
    config.write_text("[tls]\ninsecure = true\n")
    result = CliRunner().invoke(proxy_group, ["serve", "--config", str(config)])
    assert result.exit_code == 1 and "owners.allowed is required" in result.output
    # An empty list is refused too (it started, and analysts learnt it much later).
    config.write_text("[tls]\ninsecure = true\n[owners]\nallowed = []\n")
    result = CliRunner().invoke(proxy_group, ["serve", "--config", str(config)])
    assert result.exit_code == 1 and "owners.allowed is empty" in result.output


def test_status_lists_queries(tmp_path: Path) -> None:
    config, _ = write_config(tmp_path)
    runner = CliRunner()
    missing = runner.invoke(proxy_group, ["status", "--config", str(config)])
    assert missing.exit_code == 1 and "no proxy database" in missing.output

    # The proxy stores each query under its task id, analyst/query.
    store = ProxyStore(tmp_path / "state" / "proxy.sqlite3")
    ok, late = task_id("alice", "q-ok"), task_id("bob", "q-late")
    store.create_query(ok, "alice", {"quorum": 2}, {}, deadline_at=time.time() + 60)
    store.create_query(late, "bob", {"quorum": 3}, {}, deadline_at=time.time() + 60)
    store.set_state(
        late, QueryState.FAILED, failure_reason="deadline passed with 1 of 3 required owners"
    )
    store.close()
    result = runner.invoke(proxy_group, ["status", "--config", str(config)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["QUERY", "ANALYST", "STATE", "OWNERS", "CREATED", "(UTC)", "REASON"]
    created = time.strftime("%Y-%m-%dT%H:", time.gmtime(time.time()))  # within this hour
    assert lines[1].split()[:4] == ["alice/q-ok", "alice", "collecting", "0/2"]
    assert lines[1].split()[4].startswith(created[:11]) and lines[1].split()[4].endswith("Z")
    assert len(lines[1].split()) == 5
    assert lines[2].split()[:4] == ["bob/q-late", "bob", "failed", "0/3"]
    assert lines[2].endswith("deadline passed with 1 of 3 required owners")

    # Filtered by state or analyst; as JSON for scripts.
    def status(*flags: str) -> str:
        outcome = runner.invoke(proxy_group, ["status", "--config", str(config), *flags])
        assert outcome.exit_code == 0, outcome.output
        return outcome.output

    assert [line.split()[0] for line in status("--state", "failed").splitlines()[1:]] == [late]
    both = status("--state", "failed", "--state", "collecting").splitlines()[1:]
    assert [line.split()[0] for line in both] == [ok, late]
    assert [line.split()[0] for line in status("--analyst", "alice").splitlines()[1:]] == [ok]
    assert status("--analyst", "carol") == "no such queries\n"
    listed = json.loads(status("--json", "--state", "failed"))
    assert [(q["query"], q["analyst"], q["state"]) for q in listed] == [(late, "bob", "failed")]
    assert (listed[0]["owners_contributed"], listed[0]["quorum"]) == (0, 3)
    assert listed[0]["reason"] == "deadline passed with 1 of 3 required owners"
    deadline = datetime.fromisoformat(listed[0]["deadline"])
    assert abs(deadline.timestamp() - (time.time() + 60)) < 30 and deadline.tzinfo is not None
    assert json.loads(status("--json", "--analyst", "carol")) == []
    refused = runner.invoke(proxy_group, ["status", "--config", str(config), "--state", "x"])
    assert refused.exit_code == 2 and "collecting" in refused.output


def test_serve_help_lists_the_overriding_flags() -> None:
    result = CliRunner().invoke(proxy_group, ["serve", "--help"])
    assert result.exit_code == 0 and "--listen" in result.output and "--insecure" in result.output


def test_a_reload_never_stops_the_proxy_and_pending_sighups_coalesce(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A review's malformed owner id in the file made the reload's error stop the proxy
    (and systemd's restart failed on the same file). A reload that cannot read the file
    or fails otherwise is logged and the proxy serves on; SIGHUPs pending together
    make one reload; SIGTERM ends the loop."""
    from fedpca.proxy.cli import _serve_until_stopped
    from fedpca.proxy.config import ProxyConfig

    signals: queue.SimpleQueue[int] = queue.SimpleQueue()
    reloaded: list[ProxyConfig] = []

    class _Server:
        def reload(self, config: ProxyConfig) -> list[str]:
            reloaded.append(config)
            return ["owners.allowed added: c"]

    reads = 0

    def read_config() -> ProxyConfig:
        nonlocal reads
        reads += 1
        if reads == 1:
            signals.put(signal.SIGHUP)
            raise ConfigError("proxy.toml: owners.allowed[1]: bad id")
        if reads == 2:
            signals.put(signal.SIGHUP)
            signals.put(signal.SIGHUP)
            raise RuntimeError("a bug")
        signals.put(signal.SIGTERM)
        return ProxyConfig()

    signals.put(signal.SIGHUP)
    with caplog.at_level(logging.INFO, logger="fedpca.proxy.cli"):
        _serve_until_stopped(signals, _Server(), tmp_path / "proxy.toml", read_config)
    assert reads == 3 and len(reloaded) == 1  # the two pending SIGHUPs made one reload
    text = caplog.text
    assert "reload refused, still serving as before: proxy.toml: owners.allowed[1]" in text
    assert "reload failed, still serving as before" in text and "RuntimeError: a bug" in text
    assert "owners.allowed added: c" in text and "received SIGTERM, stopping" in text
