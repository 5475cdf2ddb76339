"""A failed ``init`` leaves nothing of its own behind, and nothing that was there changed.

A new operator's review: ``fedpca owner init`` with a mistyped pin wrote the folder,
then refused the value it read back, and the corrected retry was told "owner.toml
already exists; pass --force"; ``fedpca certs init`` with a bad proxy host name left a
CA behind that the retry refused to replace. Each case below fails after the command
began writing.
"""

from __future__ import annotations

import os
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

from fedpca.analyst.init import init_command as analyst_init
from fedpca.app.certs_cli import certs_group
from fedpca.owner.cli import owner_group
from fedpca.proxy.cli import proxy_group
from fedpca.transport.certs import init_certificates
from helpers import TEST_SIGNER

PIN = "sha256:" + "a" * 64


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    init_certificates(tmp_path / "certs", ["hospital-a"], ["alice"])
    return tmp_path / "certs"


def _tree(root: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every path under ``root``: its bytes (None for a folder) and permissions."""
    found = {}
    for path in [root, *root.rglob("*")]:
        content = path.read_bytes() if path.is_file() else None
        found[str(path.relative_to(root))] = (content, path.stat().st_mode)
    return found


def _owner_args(certs: Path, out: Path, data: Path, pin: str = PIN) -> list[str]:
    return [
        *("init", "--out", str(out), "--id", "hospital-a", "--proxy", "proxy.test:50051"),
        *("--certs", str(certs), "--data", str(data), "--max-records", "100"),
        *("--analyst-key", pin, "--analyst-signer", TEST_SIGNER),
    ]


def _run(group: click.Command, args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(group, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


def _cases(certs: Path, out: Path, data: Path) -> dict[str, tuple[click.Command, list[str], str]]:
    """role -> (command, arguments that fail once the folder is being written, the fix)."""
    return {
        # Refused when owner.toml is read back, after tls/ and state/ were written.
        "owner": (owner_group, _owner_args(certs, out, data, pin="sha256:abc"), PIN),
        # Refused when proxy.toml is read back (a malformed --listen is refused before
        # anything is written, as the tests of the addresses show).
        "proxy": (
            proxy_group,
            [
                *("init", "--out", str(out), "--owners", "hospital-a", "--certs", str(certs)),
                *("--budget-delta", "2"),
            ],
            "1e-5",
        ),
        # No certificate for this analyst id: refused while copying the TLS files.
        "analyst": (
            analyst_init,
            [
                *("--out", str(out), "--proxy", "proxy.test:50051", "--key-dir", "keys"),
                *("--certs", str(certs), "--id", "bob"),
            ],
            "alice",
        ),
    }


def _fixed(role: str, args: list[str], fix: str) -> list[str]:
    wrong = {"owner": "sha256:abc", "proxy": "2", "analyst": "bob"}[role]
    return [fix if arg == wrong else arg for arg in args]


@pytest.mark.parametrize("role", ["owner", "proxy", "analyst"])
def test_a_failed_init_leaves_no_folder_and_the_retry_works(
    role: str, certs: Path, tmp_path: Path
) -> None:
    data = tmp_path / "table.csv"
    np.savetxt(data, np.zeros((3, 4)), delimiter=",")
    out = tmp_path / "new" / "nested" / role  # its parents are made by init too
    command, args, fix = _cases(certs, out, data)[role]
    code, output = _run(command, args)
    assert code == 1 and "Error:" in output
    assert not (tmp_path / "new").exists(), sorted(map(str, (tmp_path / "new").rglob("*")))
    code, output = _run(command, _fixed(role, args, fix))
    assert code == 0, output
    assert (out / f"{role}.toml").is_file()


@pytest.mark.parametrize("role", ["owner", "proxy", "analyst"])
def test_a_failed_init_into_an_existing_folder_leaves_it_untouched(
    role: str, certs: Path, tmp_path: Path
) -> None:
    data = tmp_path / "table.csv"
    np.savetxt(data, np.zeros((3, 4)), delimiter=",")
    out = tmp_path / role
    command, args, fix = _cases(certs, out, data)[role]
    code, output = _run(command, _fixed(role, args, fix))
    assert code == 0, output
    (out / "data").mkdir()
    (out / "data" / "kept.csv").write_text("1,2\n")
    (out / "state" / "notes.txt").parent.mkdir(exist_ok=True)
    (out / "state" / "notes.txt").write_text("an operator's file\n")
    before = _tree(out)
    code, output = _run(command, [*args, "--force"])
    assert code == 1 and "Error:" in output
    # Nothing removed, nothing added, nothing rewritten: the configuration and TLS
    # files the forced run had replaced are back as they were.
    assert _tree(out) == before
    code, output = _run(command, [*_fixed(role, args, fix), "--force"])
    assert code == 0, output


def test_owner_init_removes_the_state_dir_it_made_elsewhere(certs: Path, tmp_path: Path) -> None:
    data = tmp_path / "table.csv"
    np.savetxt(data, np.zeros((3, 4)), delimiter=",")
    state = tmp_path / "var" / "lib" / "fedpca"
    args = _owner_args(certs, tmp_path / "hospital-a", data, pin="sha256:abc")
    code, _ = _run(owner_group, [*args, "--state-dir", str(state)])
    assert code == 1
    assert not (tmp_path / "var").exists() and not (tmp_path / "hospital-a").exists()
    # A state folder that existed keeps what it held.
    state.mkdir(parents=True)
    (state / "old.sqlite3").write_bytes(b"x")
    code, _ = _run(owner_group, [*args, "--state-dir", str(state)])
    assert code == 1 and sorted(os.listdir(state)) == ["old.sqlite3"]


def test_a_failed_certs_init_leaves_no_ca_and_never_replaces_one(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    code, output = _run(certs_group, ["init", "--out", str(out), "--proxy-host", "bad host"])
    assert code == 1 and "invalid proxy host name" in output
    assert not out.exists()
    code, output = _run(certs_group, ["init", "--out", str(out)])
    assert code == 0, output
    before = _tree(out)
    forced = ["init", "--out", str(out), "--force", "--proxy-host", "bad host"]
    code, output = _run(certs_group, forced)
    assert code == 1 and "invalid proxy host name" in output
    # The CA every node trusts is still the one it was (its key, its certificate).
    assert _tree(out) == before
