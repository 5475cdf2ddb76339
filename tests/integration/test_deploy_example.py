"""The shipped deployment, as shipped: deploy/setup.sh makes the example tree with the
documented commands, every path compose.yaml and the Kubernetes manifests mount exists
in it, their ports agree with the generated configs, and the compose services run
across hosts.

There is no container runtime here, so the multi-host test does what compose would do
without one: each service of compose.yaml runs on a host of its own (a network
namespace, see netns.py), with the service's command, environment and working folder,
every container path in its command translated through the service's volumes, and
host names resolving as on compose's network (the proxy is ``proxy``, the name in its
certificate). The analyst runs on a host of its own and queries PCA and DCA across
them; a plain script without a main guard fits once. It skips, saying why, where
network namespaces cannot be made (not root, no iproute2, not Linux).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from netns import Network, namespaces_unavailable

from fedpca.analyst.config import load_config as load_analyst_config
from fedpca.owner.config import load_config as load_owner_config
from fedpca.proxy.config import load_config as load_proxy_config
from fedpca.transport.certs import TlsMaterial

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NODE_ROOT = "/srv/fedpca"
FEDPCA = str(Path(sys.executable).parent / "fedpca")
"""The ``fedpca`` command of the environment running the tests (as in the image)."""


def _generated(directory: str, names: list[str]) -> set[str]:
    """What setup.sh makes: never copied from a developer's working tree."""
    folder = Path(directory)
    if folder.name == "deploy":
        return {".env"} & set(names)
    if folder.name == "example":
        return {"certs", "analyst", "proxy"} & set(names)
    if folder.parent.name == "example":
        return {"owner.toml", "tls", "state"} & set(names)
    return set()


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/ after `deploy/setup.sh` ran in it."""
    deploy = tmp_path_factory.mktemp("shipped") / "deploy"
    shutil.copytree(ROOT / "deploy", deploy, ignore=_generated)
    result = subprocess.run(
        ["sh", str(deploy / "setup.sh")],
        env={**os.environ, "FEDPCA": FEDPCA},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return deploy


def _services(deploy: Path) -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load((deploy / "compose.yaml").read_text())["services"]
    return services


def _volumes(deploy: Path, service: dict[str, Any]) -> list[tuple[Path, str, bool]]:
    mounts = []
    for volume in service["volumes"]:
        source, target, *mode = volume.split(":")
        mounts.append(((deploy / source).resolve(), target, mode == ["ro"]))
    return mounts


def _on_host(deploy: Path, service: dict[str, Any], path: str) -> Path:
    """A container path of ``service`` as a path of the host (through its volumes)."""
    matches = [
        (target, source)
        for source, target, _ in _volumes(deploy, service)
        if path == target or path.startswith(target + "/")
    ]
    assert matches, f"{path} is on no volume of the service"
    target, source = max(matches, key=lambda match: len(match[0]))
    return source / path[len(target) :].lstrip("/")


def _argv(deploy: Path, service: dict[str, Any]) -> list[str]:
    return [
        str(_on_host(deploy, service, arg)) if arg.startswith(NODE_ROOT) else arg
        for arg in service["command"]
    ]


def _published(service: dict[str, Any]) -> dict[int, str]:
    """container port -> "host_ip:host_port" of the service's published ports."""
    ports = {}
    for entry in service.get("ports", []):
        *host, container = entry.split(":")
        ports[int(container)] = ":".join(host)
    return ports


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


# --------------------------------------------------------------- the tree
def test_every_mounted_path_exists_and_ports_agree(example: Path) -> None:
    services = _services(example)
    env = dict(
        line.split("=", 1) for line in (example / ".env").read_text().splitlines() if "=" in line
    )
    proxy = load_proxy_config(_on_host(example, services["proxy"], f"{NODE_ROOT}/proxy.toml"))
    for name, service in services.items():
        for source, target, read_only in _volumes(example, service):
            assert source.exists(), f"{name}: {source} (mounted at {target}) does not exist"
            assert read_only == (target == NODE_ROOT), f"{name}: {target}"
        config_path = Path(_argv(example, service)[3])
        assert config_path.is_file(), config_path
        folder = _on_host(example, service, NODE_ROOT)
        if name == "proxy":
            config = proxy
            assert config.proxy.database.parent == folder / "state"
            tls = config.tls.files()
        else:
            owner = load_owner_config(config_path)
            assert owner.owner.id == name
            assert owner.owner.state_dir == folder / "state"
            assert owner.data.path.is_file() and owner.data.path.is_relative_to(folder)
            # Owners dial the proxy by its service name, on the port it listens on.
            host, _, port = owner.owner.proxy.rpartition(":")
            assert host in services and int(port) == _port(proxy.proxy.listen)
            assert name in proxy.owners.allowed
            assert _port(owner.monitoring.listen or "") == 9464
            tls = owner.tls.files()
        material = TlsMaterial.load(tls)
        assert material.identity.node_id == name
        # Compose runs the container as the user who made the files: it can read its key.
        key = tls.private_key.stat()
        assert (str(key.st_uid), str(key.st_gid)) == (env["FEDPCA_UID"], env["FEDPCA_GID"])
        assert stat.S_IMODE(key.st_mode) & 0o400
    published = _published(services["proxy"])
    assert published[_port(proxy.proxy.listen)] == str(_port(proxy.proxy.listen))
    assert published[_port(proxy.monitoring.listen or "")] == "127.0.0.1:9464"
    # The analyst on the Docker host reaches the published port.
    analyst = load_analyst_config(example / "example" / "analyst" / "analyst.toml")
    assert analyst.proxy == f"localhost:{_port(proxy.proxy.listen)}"
    assert analyst.key_dir is not None and (analyst.key_dir / "analyst.key.json").is_file()


def test_kubernetes_mounts_are_the_node_folders(example: Path) -> None:
    for manifest, folder, role in (
        ("proxy.yaml", example / "example" / "proxy", "proxy"),
        ("owner.yaml", example / "example" / "hospital-a", "owner"),
    ):
        documents = list(yaml.safe_load_all((example / "kubernetes" / manifest).read_text()))
        (stateful,) = [d for d in documents if d and d["kind"] == "StatefulSet"]
        spec = stateful["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        covered = []
        for mount in container["volumeMounts"]:
            source = volumes.get(mount["name"], {})
            if "configMap" in source:  # kubectl create configmap --from-file=<folder>/<key>
                for item in source["configMap"]["items"]:
                    assert (folder / item["key"]).is_file(), item
            elif "secret" in source:  # kubectl create secret generic --from-file=<folder>/tls/
                for item in source["secret"]["items"]:
                    assert (folder / "tls" / item["key"]).is_file(), item
            covered.append(mount["mountPath"])
        # Every file the config names lies on one of the mounts.
        config_file = folder / f"{role}.toml"
        if role == "proxy":
            config: Any = load_proxy_config(config_file)
            named = [config.proxy.database, *vars(config.tls.files()).values()]
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports["grpc"] == _port(config.proxy.listen)
        else:
            config = load_owner_config(config_file)
            named = [config.data.path, config.owner.state_dir, *vars(config.tls.files()).values()]
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["monitoring"] == _port(config.monitoring.listen)
        for path in named:
            inside = f"{NODE_ROOT}/{Path(path).relative_to(folder).as_posix()}"
            assert any(inside == m or inside.startswith(m + "/") for m in covered), inside


# ----------------------------------------------------------- across hosts
_GUARDLESS_SCRIPT = """
from fedpca.analyst import FederatedPCA

pca = FederatedPCA(
    n_components=2,
    epsilon=0.5,
    delta=1e-5,
    bounds=(-1, 1),
    proxy="proxy:50051",
    ca="{tls}/ca.pem",
    cert="{tls}/cert.pem",
    key="{tls}/key.pem",
    private_key_path="{keys}",
).fit(n_features=34)
print("owners", pca.n_owners_, "of", pca.n_owners_registered_)
"""


def _wait(condition: Any, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout:.0f} s")
        time.sleep(0.5)


def _healthy(network: Network, name: str, service: dict[str, Any]) -> bool:
    """compose's healthcheck of ``service``, run on its host."""
    test = [
        sys.executable if word == "python" else word for word in service["healthcheck"]["test"][1:]
    ]
    return network.run(name, test, timeout=30).returncode == 0


def test_the_compose_services_run_across_hosts(example: Path, tmp_path: Path) -> None:
    reason = namespaces_unavailable()
    if reason is not None:
        # Under .ci/run (FEDPCA_NO_SKIPS=1, tests/conftest.py) this skip is a failure.
        pytest.skip(f"multi-host deployment test needs network namespaces: {reason}")
    services = _services(example)
    analyst = example / "example" / "analyst"
    with Network([*services, "analyst"]) as network:
        logs: dict[str, Path] = {}
        for name in ["proxy", *[s for s in services if s != "proxy"]]:
            service = services[name]
            logs[name] = tmp_path / f"{name}.log"
            with logs[name].open("wb") as log:
                network.popen(
                    name,
                    [FEDPCA, *_argv(example, service)],
                    log=log,
                    cwd=_on_host(example, service, NODE_ROOT),
                    env={str(k): str(v) for k, v in service.get("environment", {}).items()},
                )
            if name == "proxy":  # depends_on: {proxy: {condition: service_healthy}}
                _wait(
                    lambda service=service: _healthy(network, "proxy", service),
                    "the proxy was not healthy",
                )
        for name, service in services.items():
            _wait(
                lambda name=name, service=service: _healthy(network, name, service),
                f"{name} was not healthy: {logs[name].read_text()[-2000:]}",
            )
        # The proxy's logs are JSON lines, as compose asks.
        first = logs["proxy"].read_text().splitlines()
        assert json.loads(next(line for line in first if line.startswith("{")))["level"]

        # What Kubernetes runs as the owner's startup probe, on the owner's host.
        probe = network.run(
            "hospital-a",
            [FEDPCA, "owner", "probe", "--config", str(example / "example/hospital-a/owner.toml")],
        )
        assert probe.returncode == 0, probe.stdout + probe.stderr
        assert probe.stdout.count("ok  ") == 6

        # The analyst's own host: "localhost" is not the proxy there.
        config = str(analyst / "analyst.toml")
        local = network.run("analyst", [FEDPCA, "analyst", "budget", "--config", config])
        assert local.returncode == 1 and "connection refused" in local.stderr

        query = [
            "--config",
            config,
            "--proxy",
            "proxy:50051",
            "--features",
            "34",
            "--epsilon",
            "1",
            "--delta",
            "1e-5",
            "--bounds",
            "-1:1",
        ]
        pca = network.run(
            "analyst",
            [
                FEDPCA,
                "analyst",
                "pca",
                *query,
                "--components",
                "3",
                "--out",
                str(tmp_path / "pca.json"),
            ],
        )
        assert pca.returncode == 0, pca.stderr[-3000:]
        assert "owners:      3 of 3 registered (quorum 3)" in pca.stdout
        document = json.loads((tmp_path / "pca.json").read_text())
        assert document["owners"]["contributed"] == 3 and document["owners"]["registered"] == 3
        assert len(document["components"]) == 3 and len(document["components"][0]) == 34
        assert document["space"].startswith("each feature scaled by feature_bounds onto")
        tolerance = 6 * max(document["noise_sigma"].values()) + 1
        assert abs(document["n_samples"] - 351) < tolerance

        dca = network.run(
            "analyst",
            [
                FEDPCA,
                "analyst",
                "dca",
                *query,
                "--components",
                "1",
                "--classes",
                "-1,1",
                "--out",
                str(tmp_path / "dca.json"),
            ],
        )
        assert dca.returncode == 0, dca.stderr[-3000:]
        assert json.loads((tmp_path / "dca.json").read_text())["classes"] == [-1.0, 1.0]

        # The README's estimator in a plain script, no main guard: one query, not several.
        script = tmp_path / "analysis.py"
        script.write_text(_GUARDLESS_SCRIPT.format(tls=analyst / "tls", keys=analyst / "keys"))
        listed = [FEDPCA, "analyst", "list", "--config", config, "--proxy", "proxy:50051"]
        before = network.run("analyst", listed).stdout.strip().splitlines()
        fitted = network.run("analyst", [sys.executable, str(script)], cwd=tmp_path)
        assert fitted.returncode == 0, fitted.stderr[-3000:]
        assert "owners 3 of 3" in fitted.stdout
        after = network.run("analyst", listed).stdout.strip().splitlines()
        assert len(after) == len(before) + 1 and len(before) == 3  # header + pca + dca

        metrics = network.run(
            "analyst",
            [
                sys.executable,
                "-c",
                "import urllib.request as r; print(r.urlopen('http://proxy:9464/metrics').read().decode())",
            ],
        )
        assert 'fedpca_proxy_queries{state="done"} 3.0' in metrics.stdout
        assert 'fedpca_proxy_uploads_total{outcome="accepted"} 9.0' in metrics.stdout
