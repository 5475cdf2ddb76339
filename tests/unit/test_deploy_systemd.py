"""deploy/systemd/ as shipped: each unit runs the role's serve command on the folder its
init command writes, may write only that folder's state/, and passes systemd's own
checks (``systemd-analyze verify``, where installed).

The units cannot be started here (no systemd as PID 1 in the test sandbox); what they
run is what the compose file runs (tests/unit/test_deploy_manifests.py), and the same
folder-read-only, state-writable layout is exercised there.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from fedpca.app.cli import main as fedpca_cli
from fedpca.owner.config import load_config as load_owner_config
from fedpca.proxy.config import load_config as load_proxy_config
from fedpca.proxy.open_files import needed_open_files
from fedpca.transport.certs import init_certificates

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "deploy" / "systemd"
VENV_FEDPCA = "/opt/fedpca/venv/bin/fedpca"
ROLES = ("proxy", "owner")


def _unit(role: str) -> dict[str, dict[str, list[str]]]:
    """Section -> key -> values (a key may repeat in systemd units)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in (UNITS / f"fedpca-{role}.service").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{role}: {line!r} before any section"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _one(unit: dict[str, dict[str, list[str]]], section: str, key: str) -> str:
    values = unit[section][key]
    assert len(values) == 1, f"{key} given {len(values)} times"
    return values[0]


def _node_folder(role: str, tmp_path: Path) -> Path:
    """The folder ``fedpca <role> init`` writes, as the unit's comment says to make it."""
    certs = tmp_path / "certs"
    init_certificates(certs, owner_ids=["hospital-a", "hospital-b"], analyst_ids=["alice"])
    folder = tmp_path / role
    if role == "proxy":
        args = ["proxy", "init", "--out", str(folder), "--certs", str(certs)]
        args += ["--owners", "hospital-a,hospital-b"]
    else:
        data = tmp_path / "table.csv"
        data.write_text("".join(f"{i % 2},{i},{i * 2}\n" for i in range(20)))
        args = ["owner", "init", "--out", str(folder), "--id", "hospital-a"]
        args += ["--proxy", "proxy.example.org:50051", "--certs", str(certs)]
        args += ["--data", str(data), "--label-column", "0", "--max-records", "100"]
        args += ["--analyst-key", "sha256:" + "ab" * 32, "--analyst-signer", "ed25519:" + "cd" * 32]
    fedpca_cli.main(args, standalone_mode=False)
    return folder


@pytest.mark.parametrize("role", ROLES)
def test_unit_serves_the_folder_its_init_command_writes(role: str, tmp_path: Path) -> None:
    unit = _unit(role)
    service = unit["Service"]
    workdir = _one(unit, "Service", "WorkingDirectory")
    argv = shlex.split(_one(unit, "Service", "ExecStart"))
    assert argv[:4] == [VENV_FEDPCA, role, "serve", "--config"]
    assert argv[4:] == [f"{workdir}/{role}.toml"]
    # Written only where the node keeps its state, as in compose (folder read-only).
    assert _one(unit, "Service", "ProtectSystem") == "strict"
    assert service["ReadWritePaths"] == [f"{workdir}/state"]
    assert _one(unit, "Service", "User") == "fedpca"
    assert _one(unit, "Service", "NoNewPrivileges") == "yes"
    assert _one(unit, "Service", "UMask") == "0077"
    assert _one(unit, "Install", "WantedBy") == "multi-user.target"

    # The command line parses with the real CLI against a freshly initialised folder
    # put where the unit expects it, and that folder keeps its state under state/.
    folder = _node_folder(role, tmp_path)
    local_argv = [str(folder / f"{role}.toml") if a == argv[4] else a for a in argv[1:]]
    with fedpca_cli.make_context("fedpca", [role, "--help"], resilient_parsing=True) as root:
        group = fedpca_cli.get_command(root, role)
    assert isinstance(group, click.Group)
    command = group.commands["serve"]
    with command.make_context("serve", local_argv[2:]) as context:
        assert context.params["config_path"] == folder / f"{role}.toml"
    if role == "proxy":
        database = load_proxy_config(folder / "proxy.toml").proxy.database
        assert database.parent == folder / "state"
    else:
        assert load_owner_config(folder / "owner.toml").owner.state_dir == folder / "state"


def test_proxy_unit_lets_a_thousand_owners_connect() -> None:
    limit = int(_one(_unit("proxy"), "Service", "LimitNOFILE"))
    assert limit >= needed_open_files(1000)


@pytest.mark.parametrize("role", ROLES)
def test_systemd_analyze_verify_accepts_the_unit(role: str, tmp_path: Path) -> None:
    verify = shutil.which("systemd-analyze")
    if verify is None:
        pytest.skip("systemd-analyze is not installed on this machine")
    # verify checks that ExecStart's program exists: point it at this environment's.
    installed = Path(sys.executable).parent / "fedpca"
    assert installed.is_file(), f"no fedpca command next to {sys.executable}"
    text = (UNITS / f"fedpca-{role}.service").read_text().replace(VENV_FEDPCA, str(installed))
    copy = tmp_path / f"fedpca-{role}.service"
    copy.write_text(text)
    done = subprocess.run(
        [verify, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    # Warnings (unknown keys, bad values) do not change the exit code: none expected.
    assert done.stderr.strip() == "", done.stderr
