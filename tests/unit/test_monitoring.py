"""What operators watch: the gRPC health service, Prometheus metrics and health
endpoints of the proxy and the owner node, and JSON log lines."""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fedpca import logs
from fedpca.codec import CryptoPool
from fedpca.dp.mechanisms import PrivacyParams
from fedpca.monitoring import MonitoringServer
from fedpca.owner.metrics import OwnerMetrics
from fedpca.proxy.config import MonitoringSection
from fedpca.transport.certs import Role, TlsMaterial, read_certificate
from fedpca.transport.channels import secure_channel
from helpers import TEST_SIGNING_KEY, query_builder
from inprocess import InProcessDeployment, labelled

M = 3
_spec = query_builder(
    n_features=M,
    n_components=1,
    epsilon=0.5,
    delta=1e-6,
    feature_lower=(-1.0,) * M,
    feature_upper=(1.0,) * M,
)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _eventually(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.05)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


class _MonitoredDeployment(InProcessDeployment):
    """The in-process deployment with the proxy's monitoring port on."""

    def start(self) -> _MonitoredDeployment:
        from fedpca.proxy import server as server_module

        original = server_module.ProxyServer.__init__

        def with_monitoring(server: Any, config: Any, **kwargs: Any) -> None:
            # carol has a budget of her own and has not queried yet.
            analysts = {**config.budget.analysts, "carol": PrivacyParams(2.0, 1e-5)}
            config = replace(
                config,
                monitoring=MonitoringSection("127.0.0.1:0"),
                budget=replace(config.budget, analysts=analysts),
            )
            original(server, config, **kwargs)

        server_module.ProxyServer.__init__ = with_monitoring  # type: ignore[method-assign]
        try:
            super().start()
        finally:
            server_module.ProxyServer.__init__ = original  # type: ignore[method-assign]
        return self


@pytest.fixture
def running(
    tmp_path: Path, pool: CryptoPool, test_only_keypair_512: tuple[Any, Any]
) -> Iterator[_MonitoredDeployment]:
    public_key, _ = test_only_keypair_512
    rng = np.random.default_rng(2)
    tables = {o: labelled(rng.uniform(-0.5, 0.5, size=(10, M))) for o in ("owner-1", "owner-2")}
    deployment = _MonitoredDeployment(
        workdir=tmp_path, tables=tables, pool=pool, public_key=public_key
    )
    try:
        yield deployment.start()
    finally:
        deployment.stop()


def test_proxy_health_service_and_metrics(
    running: _MonitoredDeployment, test_only_keypair_512: tuple[Any, Any]
) -> None:
    public_key, _ = test_only_keypair_512
    proxy = running.proxy
    assert proxy is not None and proxy.monitoring_port is not None
    base = f"http://127.0.0.1:{proxy.monitoring_port}"
    owner_metrics = {owner: OwnerMetrics(node) for owner, node in running.nodes.items()}
    for owner, node in running.nodes.items():
        node.metrics = owner_metrics[owner]

    # The standard gRPC health service, on the proxy's mutual-TLS port.
    files = running.tls(Role.ANALYST, "alice")
    with secure_channel(proxy.address, TlsMaterial.load(files)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "fedpca.v1.OwnerService", "fedpca.v1.AnalystService"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as unknown:
            stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
        assert unknown.value.code() is grpc.StatusCode.NOT_FOUND

    assert _get(f"{base}/healthz") == (200, "ok: event loop answering\n")
    status, body = _get(f"{base}/readyz")
    assert status == 200 and "2 owners connected" in body
    assert _get(f"{base}/nothing")[0] == 404

    # An analyst with a budget of its own is listed before its first query.
    before = _samples(_get(f"{base}/metrics")[1])
    assert before[("fedpca_proxy_analyst_epsilon_spent", (("analyst", "carol"),))] == 0.0
    assert before[("fedpca_proxy_analyst_epsilon_limit", (("analyst", "carol"),))] == 2.0

    outcome = running.run(_spec(public_key, "m1", quorum=2))
    assert outcome.state == "done"
    # The last page can be final a moment before the last Upload call has returned
    # its acknowledgement (which the interceptor counts): wait for both calls.
    accepted = ("fedpca_proxy_uploads_total", (("outcome", "accepted"),))
    deadline = time.monotonic() + 10.0
    while True:
        status, text = _get(f"{base}/metrics")
        assert status == 200
        samples = _samples(text)
        if samples[accepted] == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert samples[("fedpca_proxy_queries", (("state", "done"),))] == 1
    assert samples[("fedpca_proxy_queries", (("state", "collecting"),))] == 0
    assert samples[("fedpca_proxy_uploads_total", (("outcome", "accepted"),))] == 2
    assert samples[("fedpca_proxy_uploads_total", (("outcome", "refused"),))] == 0
    assert samples[("fedpca_proxy_upload_bytes_total", ())] > 0
    # One observation per folded chunk: at least one chunk per owner.
    assert samples[("fedpca_proxy_fold_seconds_count", ())] >= 2
    assert samples[("fedpca_proxy_noise_seconds_count", ())] == 1
    assert samples[("fedpca_proxy_rpcs_total", (("code", "OK"), ("method", "SubmitQuery")))] == 1
    assert samples[("fedpca_proxy_owners_registered", ())] == 2
    assert samples[("fedpca_proxy_owners_connected", ())] == 2
    for owner in ("owner-1", "owner-2"):
        assert samples[("fedpca_proxy_owner_connected", (("owner", owner),))] == 1
    assert samples[("fedpca_proxy_oldest_open_query_age_seconds", ())] == 0  # none open
    # The expiry of the certificates the proxy serves with, as the files state it.
    proxy_files = running.tls(Role.PROXY, "proxy")
    for label, path in (("node", proxy_files.certificate), ("ca", proxy_files.ca_certificate)):
        expires = read_certificate(path).not_valid_after_utc.timestamp()
        name = "fedpca_proxy_certificate_expiry_timestamp_seconds"
        assert samples[(name, (("certificate", label),))] == expires
    spent = samples[("fedpca_proxy_analyst_epsilon_spent", (("analyst", "alice"),))]
    with running.analyst() as client:
        assert spent == pytest.approx(client.budget().epsilon_spent)
    assert samples[("fedpca_proxy_analyst_epsilon_limit", (("analyst", "alice"),))] == 100.0

    # A refused call is counted with its status (once the call has ended on the server:
    # the client may see the status a moment before).
    with running.analyst() as client, pytest.raises(Exception, match="unknown query"):
        client.status("missing")
    key = ("fedpca_proxy_rpcs_total", (("code", "NOT_FOUND"), ("method", "GetQueryStatus")))
    _eventually(lambda: _samples(_get(f"{base}/metrics")[1]).get(key) == 1)

    # Each owner counted its upload and reports its ledger.
    uploaded = ("fedpca_owner_tasks_total", (("outcome", "uploaded"),))
    for owner, metrics in owner_metrics.items():
        _eventually(
            lambda metrics=metrics: (
                _samples(generate_latest(metrics.registry).decode()).get(uploaded) == 1
            )
        )
        owner_samples = _samples(generate_latest(metrics.registry).decode())
        assert owner_samples[("fedpca_owner_tasks_total", (("outcome", "uploaded"),))] == 1
        assert owner_samples[("fedpca_owner_connected", ())] == 1
        # Under zcdp, the ledger's own figure: what it admits by (found by review: the
        # closed form reported less, so an exhausted budget stayed below its limit).
        node = running.nodes[owner]
        ledger_spent = node.ledger.spent(node.config.budget.delta)
        assert ledger_spent > 0
        assert owner_samples[("fedpca_owner_epsilon_spent", ())] == pytest.approx(ledger_spent)
        owner_certificate = read_certificate(running.tls(Role.OWNER, owner).certificate)
        expiry = ("fedpca_owner_certificate_expiry_timestamp_seconds", (("certificate", "node"),))
        assert owner_samples[expiry] == owner_certificate.not_valid_after_utc.timestamp()

    # An owner gone is named, and a query left waiting for it ages.
    running.stop_owner("owner-2")
    gone = ("fedpca_proxy_owner_connected", (("owner", "owner-2"),))
    _eventually(lambda: _samples(_get(f"{base}/metrics")[1]).get(gone) == 0)
    with running.analyst() as client:
        client.submit(_spec(public_key, "m2", quorum=2), TEST_SIGNING_KEY)
    time.sleep(0.2)
    samples = _samples(_get(f"{base}/metrics")[1])
    assert samples[("fedpca_proxy_owner_connected", (("owner", "owner-1"),))] == 1
    age = samples[("fedpca_proxy_oldest_open_query_age_seconds", ())]
    assert 0.2 <= age < 60


def test_owner_health_endpoints_follow_the_node(running: _MonitoredDeployment) -> None:
    node = running.nodes["owner-1"]
    metrics = OwnerMetrics(node)
    server = MonitoringServer("127.0.0.1:0", metrics.registry, live=node.alive, ready=node.ready)
    port = server.start()
    try:
        assert _get(f"http://127.0.0.1:{port}/healthz")[0] == 200
        status, body = _get(f"http://127.0.0.1:{port}/readyz")
        assert status == 200 and "task stream" in body
        running.stop_owner("owner-1")
        status, body = _get(f"http://127.0.0.1:{port}/readyz")
        assert status == 503 and "not connected" in body
        assert _get(f"http://127.0.0.1:{port}/healthz") == (503, "not ok: stopping\n")
        text = _get(f"http://127.0.0.1:{port}/metrics")[1]
        assert "fedpca_owner_connected 0.0" in text
    finally:
        server.stop()


@pytest.fixture
def fresh_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    monkeypatch.setattr(logs, "_chosen", None)
    monkeypatch.setattr(logs, "_level_set", False)
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_log_lines(fresh_logging: None, capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure_logging(logging.INFO, "json")
    logging.getLogger("fedpca.test").warning("owner %s declined", "hospital-a")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    record = json.loads(line)
    assert record["level"] == "WARNING" and record["logger"] == "fedpca.test"
    assert record["message"] == "owner hospital-a declined"
    # ISO 8601 in UTC with milliseconds (whole seconds of local time before).
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record["time"])
    # A later call (a serve subcommand) keeps the format and only lowers the level.
    logs.configure_logging(logging.DEBUG)
    logging.getLogger("fedpca.test").debug("more")
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1])["message"] == "more"
    logs.configure_logging(logging.WARNING)
    assert logging.getLogger().level == logging.DEBUG
    assert len([h for h in logging.getLogger().handlers if h.get_name() == "fedpca"]) == 1


def test_log_format_from_the_environment(
    fresh_logging: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(logs.LOG_FORMAT_ENV, "json")
    logs.configure_logging(logging.INFO)
    logging.getLogger("fedpca.test").info("hello")
    assert json.loads(capsys.readouterr().err.strip().splitlines()[-1])["message"] == "hello"
    monkeypatch.setattr(logs, "_chosen", None)
    monkeypatch.setenv(logs.LOG_FORMAT_ENV, "yaml")
    with pytest.raises(ValueError):
        logs.configure_logging(logging.INFO)


def test_the_shipped_alert_rules_name_only_metrics_the_nodes_export(
    running: _MonitoredDeployment,
) -> None:
    """deploy/prometheus/alerts.yaml: every metric its rules use is one a proxy or an
    owner node serves (a renamed metric would leave an alert that never fires)."""
    import re

    import yaml

    proxy = running.proxy
    assert proxy is not None and proxy.monitoring_port is not None
    served = set()
    texts = [_get(f"http://127.0.0.1:{proxy.monitoring_port}/metrics")[1]]
    texts += [
        generate_latest(OwnerMetrics(node).registry).decode() for node in running.nodes.values()
    ]
    for text in texts:
        for family in text_string_to_metric_families(text):
            served.update(sample.name for sample in family.samples)
    rules_file = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yaml"
    document = yaml.safe_load(rules_file.read_text())
    rules = [rule for group in document["groups"] for rule in group["rules"]]
    assert len(rules) >= 6 and all({"alert", "expr"} <= set(rule) for rule in rules)
    used = {name for rule in rules for name in re.findall(r"fedpca_[a-z_]+", rule["expr"])}
    assert "fedpca_proxy_owner_connected" in used
    assert used - served == set()


def test_a_nearly_full_disk_is_what_readiness_says(
    running: _MonitoredDeployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk had read as "not connected" at an owner (review): readiness and a
    metric now name the free space of each node's database folder."""
    import shutil

    from fedpca import monitoring

    proxy = running.proxy
    assert proxy is not None and proxy.monitoring_port is not None
    base = f"http://127.0.0.1:{proxy.monitoring_port}"
    node = running.nodes["owner-1"]
    assert node.ready()[0] and _get(f"{base}/readyz")[0] == 200
    real = shutil.disk_usage

    def nearly_full(path: Any) -> Any:
        usage = real(path)
        return usage._replace(free=10 * 2**20)

    monkeypatch.setattr(monitoring.shutil, "disk_usage", nearly_full)
    ready, why = node.ready()
    assert not ready
    assert why.startswith(f"the state folder {node.config.owner.state_dir} has 10 MiB free")
    status, body = _get(f"{base}/readyz")
    assert status == 503 and "the database's folder" in body and "10 MiB free" in body
    samples = _samples(_get(f"{base}/metrics")[1])
    assert samples[("fedpca_proxy_state_free_bytes", ())] == 10 * 2**20
    owner_samples = _samples(generate_latest(OwnerMetrics(node).registry).decode())
    assert owner_samples[("fedpca_owner_state_free_bytes", ())] == 10 * 2**20
