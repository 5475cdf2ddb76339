"""deploy/compose.yaml and deploy/kubernetes/ as shipped: their structure, and that what
they mount is what deploy/setup.sh and the init commands make.

The slow tier (tests/integration/test_deploy_example.py) runs setup.sh and checks every
mounted path and port against the generated tree, and runs the deployment across
network namespaces; these checks need no generated files.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from fedpca.owner.cli import owner_group
from fedpca.proxy.cli import proxy_group

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
NODE_ROOT = "/srv/fedpca"


def _compose() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return document


def _manifests(name: str) -> list[dict[str, Any]]:
    text = (DEPLOY / "kubernetes" / name).read_text()
    return [d for d in yaml.safe_load_all(text) if d]


def _version() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return str(project["version"])


def _setup_owners() -> list[str]:
    match = re.search(r'^OWNERS="([^"]+)"', (DEPLOY / "setup.sh").read_text(), re.M)
    assert match is not None
    return match.group(1).split()


def test_compose_runs_every_node_of_the_example_from_its_folder() -> None:
    services = _compose()["services"]
    owners = _setup_owners()
    assert sorted(services) == sorted(["proxy", *owners])
    for name, service in services.items():
        role = "proxy" if name == "proxy" else "owner"
        assert service["command"] == [role, "serve", "--config", f"{NODE_ROOT}/{role}.toml"]
        assert service["image"] == f"fedpca:{_version()}"
        # Runs as the user who owns the keys (setup.sh writes deploy/.env).
        assert service["user"].startswith("${FEDPCA_UID:?") and "${FEDPCA_GID:?" in service["user"]
        volumes = service["volumes"]
        folder = f"./example/{name}"
        # The node folder read-only, its state/ writable on top; nothing else.
        assert volumes == [f"{folder}:{NODE_ROOT}:ro", f"{folder}/state:{NODE_ROOT}/state"]
        assert service["healthcheck"]["test"][0] == "CMD"
        if role == "owner":
            # The data the owner folder's config names is committed in the example.
            assert (DEPLOY / "example" / name / "data" / f"{name}.csv").is_file()
            assert service["depends_on"] == {"proxy": {"condition": "service_healthy"}}
    assert services["proxy"]["ports"] == ["50051:50051", "127.0.0.1:9464:9464"]
    assert "readyz" in " ".join(services["proxy"]["healthcheck"]["test"])


def test_setup_creates_what_compose_mounts() -> None:
    script = (DEPLOY / "setup.sh").read_text()
    assert re.search(r"proxy init --out proxy\b", script)
    assert re.search(r'owner init --out "\$owner"', script)
    assert "--owners hospital-a,hospital-b,hospital-c" in script
    assert ",".join(_setup_owners()) in script  # certificates for exactly these owners
    assert '--data "$owner/data/$owner.csv"' in script
    assert "> ../.env" in script and "FEDPCA_UID" in script
    ignored = (DEPLOY / "example" / ".gitignore").read_text()
    for generated in ("certs/", "analyst/", "proxy/", "*/tls/", "*/state/", "*/owner.toml"):
        assert generated in ignored.splitlines(), generated


def _pod(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    (stateful,) = [m for m in manifests if m["kind"] == "StatefulSet"]
    assert stateful["spec"]["replicas"] == 1
    spec: dict[str, Any] = stateful["spec"]["template"]["spec"]
    return spec


def _check_pod(spec: dict[str, Any], role: str) -> dict[str, Any]:
    assert spec["securityContext"] == {
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "runAsNonRoot": True,
    }
    (container,) = spec["containers"]
    assert container["image"] == f"fedpca:{_version()}"
    # Never --new-database / --new-ledger: a lost volume is refused, not replaced by
    # an empty one (the first-start Job creates the state once).
    assert container["args"] == [role, "serve", "--config", f"{NODE_ROOT}/{role}.toml"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["monitoring"] == 9464
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert probe in container, probe
        http = container[probe].get("httpGet")
        if http is not None:
            assert http["port"] in ports and http["path"] in ("/healthz", "/readyz")
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert set(mounts) <= set(volumes) | {"state"}
    # The config file from its ConfigMap, at the path the args name.
    config = mounts["config"]
    assert config["mountPath"] == f"{NODE_ROOT}/{role}.toml"
    assert config["subPath"] == f"{role}.toml"
    assert volumes["config"]["configMap"]["items"] == [
        {"key": f"{role}.toml", "path": f"{role}.toml"}
    ]
    # The Secret gives exactly the files the config names (tls/ca.pem, ...), readable by
    # the pod's group (fsGroup): 0440, not the 0600 a non-root user could not read.
    assert mounts["tls"]["mountPath"] == f"{NODE_ROOT}/tls" and mounts["tls"]["readOnly"]
    secret = volumes["tls"]["secret"]
    assert secret["defaultMode"] == 0o440
    assert [(i["key"], i["path"]) for i in secret["items"]] == [
        ("ca.pem", "ca.pem"),
        ("cert.pem", "cert.pem"),
        ("key.pem", "key.pem"),
    ]
    assert mounts["state"]["mountPath"] == f"{NODE_ROOT}/state"
    return ports


def test_kubernetes_proxy() -> None:
    manifests = _manifests("proxy.yaml")
    ports = _check_pod(_pod(manifests), "proxy")
    assert ports["grpc"] == 50051
    services = {m["metadata"]["name"]: m["spec"] for m in manifests if m["kind"] == "Service"}
    # Owners are in other organisations: the gRPC port is exposed outside the cluster.
    assert services["fedpca-proxy"]["type"] == "LoadBalancer"
    assert services["fedpca-proxy"]["ports"] == [
        {"name": "grpc", "port": 50051, "targetPort": "grpc"}
    ]
    assert services["fedpca-proxy-monitoring"]["type"] == "ClusterIP"


def test_kubernetes_owner() -> None:
    manifests = _manifests("owner.yaml")
    assert not [m for m in manifests if m["kind"] == "Service"]  # it only dials out
    spec = _pod(manifests)
    _check_pod(spec, "owner")
    (container,) = spec["containers"]
    # Only the node's own setup: a node waiting for its proxy must not be restarted.
    assert container["startupProbe"]["exec"]["command"] == [
        "fedpca",
        "owner",
        "probe",
        "--local",
        "--config",
        f"{NODE_ROOT}/owner.toml",
    ]
    data = next(m for m in container["volumeMounts"] if m["name"] == "data")
    assert data == {"name": "data", "mountPath": f"{NODE_ROOT}/data", "readOnly": True}
    # The claim the data volume names is defined with it.
    claim = spec["volumes"][[v["name"] for v in spec["volumes"]].index("data")]
    claims = [m["metadata"]["name"] for m in manifests if m["kind"] == "PersistentVolumeClaim"]
    assert claim["persistentVolumeClaim"]["claimName"] in claims


@pytest.mark.parametrize(("role", "command"), [("owner", "new-ledger"), ("proxy", "new-database")])
def test_kubernetes_first_start_creates_the_state_once_on_the_pods_volume(
    role: str, command: str
) -> None:
    (stateful,) = [m for m in _manifests(f"{role}.yaml") if m["kind"] == "StatefulSet"]
    (job,) = _manifests(f"{role}-first-start.yaml")
    assert job["kind"] == "Job"
    pod, spec = stateful["spec"]["template"]["spec"], job["spec"]["template"]["spec"]
    assert spec["securityContext"] == pod["securityContext"]
    (container,) = spec["containers"]
    assert container["image"] == f"fedpca:{_version()}"
    assert container["args"] == [role, command, "--config", f"{NODE_ROOT}/{role}.toml"]
    group = {"owner": owner_group, "proxy": proxy_group}[role]
    assert CliRunner().invoke(group, [command, "--help"]).exit_code == 0
    # The same files at the same paths as the node's own container.
    assert container["volumeMounts"] == pod["containers"][0]["volumeMounts"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert [v for v in spec["volumes"] if v["name"] != "state"] == pod["volumes"]
    # The state volume is the claim the StatefulSet made for its pod 0, on its node.
    (template,) = stateful["spec"]["volumeClaimTemplates"]
    claim = f"{template['metadata']['name']}-{stateful['metadata']['name']}-0"
    assert volumes["state"]["persistentVolumeClaim"] == {"claimName": claim}
    (term,) = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchLabels"] == stateful["spec"]["selector"]["matchLabels"]
    assert term["topologyKey"] == "kubernetes.io/hostname"


def test_dockerfile_runs_from_the_node_folder() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert f"WORKDIR {NODE_ROOT}" in text and "USER 10001" in text
    assert 'ENTRYPOINT ["fedpca"]' in text
    # Keys and generated folders never enter the image's build context.
    assert "deploy" in (ROOT / ".dockerignore").read_text().split()


def _dockerignored(path: str) -> bool:
    """Docker's rule for .dockerignore, enough for these patterns: a pattern matches
    the path or one of its parent folders; ``*`` stays within a name, ``**/`` spans
    any number of folders; patterns are relative to the build context."""
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
        if re.fullmatch(regex + "(/.*)?", path):
            return True
    return False


def test_the_image_build_context_leaves_key_material_out() -> None:
    """The README's steps, run in the repository root, write the CA key, node keys and
    a proxy/ node folder next to the proxy/ sources: `COPY . .` took them into the
    image (review)."""
    secret = [
        "certs/ca/ca-key.pem",
        "certs/owner/hospital-a/key.pem",
        "keys/analyst.key.json",
        "keys/analyst.signing.pem",
        "proxy/tls/key.pem",
        "proxy/proxy.toml",
        "proxy/state/proxy.sqlite3",
        "hospital-a/tls/key.pem",
        "hospital-a/state/ledger.sqlite3",
        "alice/analyst.toml",
    ]
    assert [path for path in secret if not _dockerignored(path)] == []
    needed = ["pyproject.toml", "README.md", "core/fedpca/query.py", "proxy/fedpca/proxy/cli.py"]
    assert [path for path in needed if _dockerignored(path)] == []
