"""``fedpca owner serve`` / ``fedpca owner budget``."""

from __future__ import annotations

import math
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from fedpca.dp.accounting import compose_epsilon
from fedpca.dp.calibration import calibrate_noise_multiplier
from fedpca.dp.mechanisms import PrivacyEvent
from fedpca.errors import BudgetExceededError
from fedpca.messages import (
    Heartbeat,
    ProxyInfo,
)
from fedpca.owner.cli import owner_group
from fedpca.owner.config import load_config
from fedpca.owner.ledger import owner_ledger
from fedpca.owner.ledger_records import TaskOutcome
from fedpca.query import Neighbouring
from fedpca.transport import certs, channels, serde
from fedpca.transport.certs import NodeIdentity, Role, TlsMaterial
from fedpca.v1 import owner_service_pb2 as owner_pb
from fedpca.v1 import owner_service_pb2_grpc as owner_grpc
from helpers import sync_test_server, wait_for_log

REPLACE_ONE = Neighbouring.REPLACE_ONE
FINGERPRINT = "sha256:" + "cd" * 32
SIGNER = "ed25519:" + "ef" * 32


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _write_config(tmp_path: Path, proxy: str = "127.0.0.1:9", tls: str = "insecure = true") -> Path:
    data = tmp_path / "data.csv"
    np.savetxt(data, np.random.default_rng(0).normal(size=(10, 3)), delimiter=",")
    config = tmp_path / "owner.toml"
    config.write_text(
        f"""
[owner]
id = "owner-1"
proxy = "{proxy}"
state_dir = "state"
[tls]
{tls}
[data]
path = "data.csv"
max_records = 100
n_columns = 3
[policy]
accepted_analyst_keys = ["{FINGERPRINT}"]
accepted_query_signers = ["{SIGNER}"]
max_epsilon_per_query = 1.0
[budget]
epsilon = 2.0
delta = 1e-5
[crypto]
processes = 1
"""
    )
    return config


def test_budget_without_ledger_is_refused(tmp_path: Path) -> None:
    """A mistyped state_dir must not read as a full budget (it did: rc 0, "spent 0")."""
    result = CliRunner().invoke(owner_group, ["budget", "--config", str(_write_config(tmp_path))])
    assert result.exit_code == 1, result.output
    ledger = tmp_path / "state" / "ledger.sqlite3"
    assert f"Error: the budget ledger {ledger} does not exist." in result.output
    assert "[owner] state_dir names the wrong folder" in result.output
    assert "spent" not in result.output and "next query" not in result.output
    assert not (tmp_path / "state").exists()  # a read-only command creates nothing


def test_budget_of_a_ledger_of_another_version_prints_only_the_refusal(tmp_path: Path) -> None:
    """An operator's walkthrough (stop 42): two header lines came before the refusal."""
    config = _with_new_ledger(_write_config(tmp_path))
    with sqlite3.connect(tmp_path / "state" / "ledger.sqlite3") as conn:
        conn.execute("UPDATE meta SET value = '6' WHERE key = 'schema_version'")
    conn.close()
    result = CliRunner().invoke(owner_group, ["budget", "--config", str(config)])
    assert result.exit_code == 1
    assert result.output.startswith("Error: ") and "ledger schema version 6" in result.output


def _with_new_ledger(config: Path) -> Path:
    """Create the config's empty ledger, as `owner init` does; return the config."""
    owner_ledger(load_config(config))
    return config


def test_budget_of_a_new_ledger(tmp_path: Path) -> None:
    config = _with_new_ledger(_write_config(tmp_path))
    result = CliRunner().invoke(owner_group, ["budget", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert "no release recorded" in result.output
    assert "spent        epsilon=0 at delta=1e-05" in result.output
    # A fresh budget of 2: the policy's cap of 1 per query binds first. The cap is
    # measured at the budget's delta, the epsilon shown at the query's: each figure is
    # printed with its delta, so 1.12922 above a cap of 1 does not read as a bug.
    assert (
        "next query   epsilon up to 1.12922 at delta 1e-06 (capped by "
        "policy.max_epsilon_per_query: epsilon 1 at the budget's delta 1e-05)\n"
    ) in result.output
    # Below the budget's epsilon of 2: no explanation of an epsilon above it.
    assert "more than the budget's epsilon" not in result.output


def _next_query_epsilon(output: str) -> float:
    line = next(line for line in output.splitlines() if line.startswith("next query"))
    match = re.fullmatch(r"next query   epsilon up to (\S+) at delta (\S+)( \(.*\))?", line)
    assert match is not None, line
    return float(match.group(1))


def _own_epsilon(epsilon: float) -> float:
    """A release's epsilon at the owner's budget delta, as its policy measures it."""
    return compose_epsilon([calibrate_noise_multiplier(epsilon, 1e-6)], 1e-5)


def test_new_ledger_creates_it_once_and_never_replaces_one(tmp_path: Path) -> None:
    path = _write_config(tmp_path)
    config = load_config(path)
    created = CliRunner().invoke(owner_group, ["new-ledger", "--config", str(path)])
    assert created.exit_code == 0, created.output
    assert f"created the budget ledger {config.ledger_path}" in created.output
    z = calibrate_noise_multiplier(0.5, 1e-5)
    owner_ledger(config).reserve(PrivacyEvent("alice/q", "sha256:a", z, 0.5, 1e-5), config.budget)
    again = CliRunner().invoke(owner_group, ["new-ledger", "--config", str(path)])
    assert again.exit_code == 0 and "exists: left as it is" in again.output
    assert [e.event.query_id for e in owner_ledger(config).events()] == ["alice/q"]
    # A folder a node ran on (its lock file is left) whose ledger is gone: refused.
    (config.owner.state_dir / "node.lock").touch()
    config.ledger_path.unlink()
    refused = CliRunner().invoke(owner_group, ["new-ledger", "--config", str(path)])
    assert refused.exit_code == 1 and "holds node.lock but no ledger" in refused.output
    assert not config.ledger_path.exists()


def test_an_empty_ledger_file_is_a_missing_ledger(tmp_path: Path) -> None:
    """Found by review: a ledger file of zero bytes (a failed restore, a full disk)
    was taken for a ledger, and the node started on it with its budget at zero. It is
    missing, and where a node ran, no new one is made in its place."""
    path = _write_config(tmp_path)
    config = load_config(path)
    config.owner.state_dir.mkdir(parents=True)
    config.ledger_path.touch()
    for command in (["serve"], ["budget"], ["budget", "--json"]):
        refused = CliRunner().invoke(owner_group, [*command, "--config", str(path)])
        assert refused.exit_code == 1, (command, refused.output)
        assert f"{config.ledger_path} is empty (0 bytes" in refused.output
    assert config.ledger_path.stat().st_size == 0
    # A node ran here (its lock file is left): neither way of making a ledger does.
    (config.owner.state_dir / "node.lock").touch()
    for command in (["new-ledger"], ["serve", "--new-ledger"]):
        refused = CliRunner().invoke(owner_group, [*command, "--config", str(path)])
        assert refused.exit_code == 1 and "holds node.lock but no ledger" in refused.output
        assert config.ledger_path.stat().st_size == 0
    # A first start (no node ran): new-ledger makes the ledger in the empty file.
    (config.owner.state_dir / "node.lock").unlink()
    created = CliRunner().invoke(owner_group, ["new-ledger", "--config", str(path)])
    assert created.exit_code == 0 and "created the budget ledger" in created.output
    assert owner_ledger(config).events() == []


def test_budget_lists_spent_next_query_and_queries(tmp_path: Path) -> None:
    path = _write_config(tmp_path)
    config = load_config(path)
    ledger = owner_ledger(config)
    z = calibrate_noise_multiplier(0.5, 1e-5)
    ledger.reserve(PrivacyEvent("alice/q-private", "sha256:a", z, 0.5, 1e-5), config.budget)
    ledger.record_task("alice/q-private", TaskOutcome.UPLOADED, "accepted", upload_id="u")
    result = CliRunner().invoke(owner_group, ["budget", "--config", str(path)])
    assert result.exit_code == 0, result.output
    assert "spent        epsilon=0.5 at delta=1e-05" in result.output
    # Not "remaining epsilon=1.5": composition is not additive.
    assert "remaining" not in result.output
    assert "(capped by policy.max_epsilon_per_query: epsilon 1 at the budget's" in result.output
    assert "not additive" in result.output
    capped = _next_query_epsilon(result.output)
    assert _own_epsilon(capped) <= 1.0 < _own_epsilon(capped * (1 + 1e-3))
    assert "1 private, 0 NOT PRIVATE" in result.output
    assert "alice/q-private" in result.output and "uploaded" in result.output

    # Releases of the cap's size until the budget, not the cap, binds: what is printed
    # is what the ledger admits, and a little more is refused.
    z_cap = calibrate_noise_multiplier(capped, 1e-6)
    for n in range(3):
        ledger.reserve(PrivacyEvent(f"alice/q{n}", "sha256:a", z_cap, capped, 1e-6), config.budget)
    result = CliRunner().invoke(owner_group, ["budget", "--config", str(path)])
    assert result.exit_code == 0, result.output
    assert "capped" not in result.output
    epsilon = _next_query_epsilon(result.output)
    assert 0 < epsilon < capped
    more = calibrate_noise_multiplier(epsilon * (1 + 1e-3), 1e-6)
    with pytest.raises(BudgetExceededError):
        ledger.reserve(PrivacyEvent("alice/more", "sha256:a", more, epsilon, 1e-6), config.budget)
    exact = calibrate_noise_multiplier(epsilon, 1e-6)
    ledger.reserve(PrivacyEvent("alice/last", "sha256:a", exact, epsilon, 1e-6), config.budget)

    # A NOT PRIVATE (epsilon = inf) release exhausts the finite budget.
    ledger.reserve(
        PrivacyEvent("alice/q-verify", "sha256:a", 0.0, math.inf, 0.0),
        config.budget,
        allow_not_private=True,
    )
    result = CliRunner().invoke(owner_group, ["budget", "--config", str(path)])
    assert result.exit_code == 0, result.output
    assert "spent        epsilon=inf at delta=1e-05" in result.output
    assert "next query   none: the budget is exhausted" in result.output
    # Nothing is admitted: no "(composition is not additive; this is what the
    # accountant admits now)" under it.
    assert "not additive" not in result.output
    assert "5 private, 1 NOT PRIVATE" in result.output
    assert "alice/q-verify" in result.output and "exhausts a finite budget" in result.output
    other = CliRunner().invoke(owner_group, ["budget", "--config", str(path), "--delta", "1e-3"])
    assert other.exit_code == 0
    assert "at delta=0.001" in other.output and "exhausted" in other.output


def test_budget_next_query_at_the_query_delta_asked_for(tmp_path: Path) -> None:
    path = _with_new_ledger(_write_config(tmp_path))
    runner = CliRunner()
    result = runner.invoke(owner_group, ["budget", "--config", str(path), "--query-delta", "1e-8"])
    assert result.exit_code == 0, result.output
    assert "at delta 1e-08 (capped by policy.max_epsilon_per_query: epsilon 1 at" in result.output
    # Less delta, more noise for the same epsilon: the cap allows a larger one.
    assert _next_query_epsilon(result.output) > 1.12922
    # Above the per-query delta cap (the budget's delta here) every query is refused.
    above = runner.invoke(owner_group, ["budget", "--config", str(path), "--query-delta", "1e-4"])
    assert above.exit_code == 1 and "above this owner's per-query delta cap 1e-05" in above.output


def test_budget_says_why_the_next_query_may_ask_for_more_than_the_budget(tmp_path: Path) -> None:
    # A budget of 1 at delta 1e-5 and a cap no lower: a fresh ledger admits a query of
    # epsilon 1.12922 at delta 1e-6, the same noise as epsilon 1 at 1e-5.
    path = _write_config(tmp_path)
    path.write_text(path.read_text().replace("epsilon = 2.0", "epsilon = 1.0"))
    _with_new_ledger(path)
    result = CliRunner().invoke(owner_group, ["budget", "--config", str(path)])
    assert result.exit_code == 0, result.output
    assert _next_query_epsilon(result.output) == 1.12922
    lines = result.output.splitlines()
    hint = lines[lines.index(next(line for line in lines if line.startswith("next query"))) + 1]
    assert hint == (
        "             (more than the budget's epsilon 1: it is at the query's delta 1e-06, "
        "the budget at delta 1e-05; the same noise costs more epsilon at a smaller delta)"
    )
    # At the budget's own delta it is not above the budget: no hint.
    same = CliRunner().invoke(
        owner_group, ["budget", "--config", str(path), "--query-delta", "1e-5"]
    )
    assert same.exit_code == 0, same.output
    assert _next_query_epsilon(same.output) <= 1.0
    assert "more than the budget's epsilon" not in same.output


def test_budget_reads_the_ledger_under_the_configured_relation(tmp_path: Path) -> None:
    path = _write_config(tmp_path)
    path.write_text(path.read_text() + '[privacy]\nneighbouring = "replace-one"\n')
    config = load_config(path)
    ledger = owner_ledger(config)
    z = calibrate_noise_multiplier(0.5, 1e-5)
    event = PrivacyEvent("alice/q", "sha256:a", z, 0.5, 1e-5, neighbouring=REPLACE_ONE)
    ledger.reserve(event, config.budget)
    result = CliRunner().invoke(owner_group, ["budget", "--config", str(path)])
    assert result.exit_code == 0, result.output
    assert "spent        epsilon=0.5 at delta=1e-05" in result.output


def test_serve_fails_fast_on_bad_config_and_bad_data(tmp_path: Path) -> None:
    path = _write_config(tmp_path)
    path.write_text(path.read_text().replace("max_epsilon_per_query", "max_eps"))
    result = CliRunner().invoke(owner_group, ["serve", "--config", str(path)])
    assert result.exit_code == 1
    assert "policy.max_eps" in result.output

    path = _write_config(tmp_path)
    (tmp_path / "data.csv").write_text("1,2\n3,oops\n")
    result = CliRunner().invoke(owner_group, ["serve", "--config", str(path), "--new-ledger"])
    assert result.exit_code == 1
    assert "'oops' is not a number" in result.output


def test_serve_refuses_a_ledger_that_does_not_exist(tmp_path: Path) -> None:
    """A wrong [owner] state_dir would start the owner's budget again at zero: only
    `owner init` or --new-ledger creates a ledger."""
    path = _write_config(tmp_path)
    typo = tmp_path / "stat"
    result = CliRunner().invoke(
        owner_group, ["serve", "--config", str(path), "--state-dir", str(typo)]
    )
    assert result.exit_code == 1, result.output
    assert f"the budget ledger {typo / 'ledger.sqlite3'} does not exist" in result.output
    assert "--new-ledger" in result.output
    assert not typo.exists()


class _HelloOnly(owner_grpc.OwnerServiceServicer):
    def Hello(self, request: owner_pb.OwnerHello, context: Any) -> owner_pb.ProxyInfo:
        identity = certs.require_role(context, Role.OWNER)
        info = ProxyInfo("proxy", "test", identity.node_id, 1.0, 1 << 20, datetime.now(UTC))
        return serde.proxy_info_to_proto(info)

    def StreamTasks(self, request: owner_pb.TaskStreamRequest, context: Any) -> Iterator[Any]:
        # Like the real proxy: a heartbeat at once says the stream is live.
        yield serde.task_event_to_proto(Heartbeat(datetime.now(UTC)))
        while context.is_active():
            time.sleep(0.05)


def _serve_until(path: Path, marker: str, log: Path, *extra: str) -> str:
    """Run ``owner serve`` in a subprocess until ``marker`` is logged, then SIGTERM it."""
    code = "from fedpca.owner.cli import owner_group; owner_group()"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", code, "serve", "--config", str(path), "--new-ledger", *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_log(process, log, marker)
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) == 0, log.read_text()
        finally:
            if process.poll() is None:
                process.kill()
    return log.read_text()


def test_a_second_serve_on_the_same_state_folder_stops_at_start(tmp_path: Path) -> None:
    """Two nodes on one state folder would share a ledger and take the task stream
    from each other: the second says which process holds the folder and exits 1."""
    tls = 'ca = "x.pem"\ncert = "y.pem"\nkey = "z.pem"'
    path = _write_config(tmp_path, f"127.0.0.1:{free_port()}", tls)
    log = tmp_path / "first.log"
    code = "from fedpca.owner.cli import owner_group; owner_group()"
    # Both on one monitoring port too: the second says why, not that the port is taken.
    monitoring = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-c", code, "serve", "--config", str(path), "--insecure"]
    command += ["--monitoring-listen", monitoring]
    with log.open("wb") as out:
        first = subprocess.Popen([*command, "--new-ledger"], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_log(first, log, "reconnecting in")
        second = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1, second.stdout + second.stderr
        assert (
            f"the owner's state folder {tmp_path / 'state'} is in use by process {first.pid}"
            in second.stderr
        )
        assert first.poll() is None  # the first node runs on
        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0, log.read_text()
        # Once it has stopped, the folder is free again.
        restarted = _serve_until(path, "reconnecting in", tmp_path / "again.log", "--insecure")
        assert "stopped" in restarted
    finally:
        if first.poll() is None:
            first.kill()


def test_serve_connects_over_mtls_and_stops_on_sigterm(tmp_path: Path) -> None:
    files = certs.init_certificates(tmp_path / "pki", ["owner-1"], [])
    server = sync_test_server(max_workers=4)
    owner_grpc.add_OwnerServiceServicer_to_server(_HelloOnly(), server)
    port = channels.add_secure_port(
        server, "127.0.0.1:0", TlsMaterial.load(files[NodeIdentity(Role.PROXY, "proxy")])
    )
    server.start()
    owner = files[NodeIdentity(Role.OWNER, "owner-1")]
    tls = (
        f'ca = "{owner.ca_certificate}"\ncert = "{owner.certificate}"\nkey = "{owner.private_key}"'
    )
    path = _write_config(tmp_path, f"127.0.0.1:{port}", tls)
    try:
        text = _serve_until(path, "connected to", tmp_path / "owner.log")
    finally:
        server.stop(grace=None)
    assert f"owner owner-1 connected to 127.0.0.1:{port}" in text
    assert "owner owner-1 stopped" in text


def test_serve_insecure_flag_skips_tls_files_and_warns(tmp_path: Path) -> None:
    tls = 'ca = "x.pem"\ncert = "y.pem"\nkey = "z.pem"'
    path = _write_config(tmp_path, f"127.0.0.1:{free_port()}", tls)
    # Without the flag the missing TLS files are an error at start-up ...
    result = CliRunner().invoke(owner_group, ["serve", "--config", str(path), "--new-ledger"])
    assert result.exit_code == 1 and "x.pem" in result.output
    # ... with it they are never read, and every start says so loudly.
    text = _serve_until(path, "reconnecting in", tmp_path / "owner.log", "--insecure")
    assert "WARNING" in text and "tls.insecure = true" in text
    assert "INSECURE channel" in text
