"""Lint, format and type checks run as part of the test suite, so CI enforces them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)


def test_ruff_lint_is_clean() -> None:
    result = _run(str(BIN / "ruff"), "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean() -> None:
    result = _run(str(BIN / "ruff"), "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean() -> None:
    result = _run(sys.executable, "scripts/typecheck.py")
    assert result.returncode == 0, result.stdout + result.stderr


def test_role_folders_are_not_top_level_imports(tmp_path: Path) -> None:
    """After install only ``fedpca`` is importable, never ``proxy``/``owner``/``analyst``."""
    for name in ("proxy", "owner", "analyst", "core", "proto"):
        result = subprocess.run(
            [sys.executable, "-c", f"import {name}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode != 0, f"`import {name}` must fail after install"
        assert "ModuleNotFoundError" in result.stderr
    ok = subprocess.run(
        [sys.executable, "-c", "import fedpca.owner, fedpca.proxy, fedpca.analyst, fedpca.v1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
