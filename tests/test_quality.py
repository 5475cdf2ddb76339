"""Lint, format, type checks and the dependency rule, run by the test suite so CI enforces them."""

from __future__ import annotations

import ast
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
    # The source roots are in pyproject's [tool.mypy]: mypy resolves the fedpca
    # namespace from the folders themselves, as an editor does.
    result = _run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout + result.stderr


# The layers of the import graph: kernel <- roles <- application wiring.
KERNEL = "core"
ROLES = ("owner", "proxy", "analyst")
APP = "app"


def _fedpca_imports(path: Path) -> set[str]:
    """Every fedpca module a source file imports, at module level or inside functions."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "fedpca" or name.startswith("fedpca.")}


def _layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in (*ROLES, APP):
        return parts[1]
    return KERNEL


def test_the_dependency_rule_holds() -> None:
    """The kernel imports no role or app; a role imports the kernel only; app imports all."""
    allowed = {KERNEL: {KERNEL}, APP: {KERNEL, APP, *ROLES}}
    allowed.update({role: {KERNEL, role} for role in ROLES})
    violations = []
    checked = 0
    for folder in (KERNEL, *ROLES, APP):
        for path in sorted((ROOT / folder / "fedpca").rglob("*.py")):
            checked += 1
            for module in sorted(_fedpca_imports(path)):
                if _layer_of(module) not in allowed[folder]:
                    violations.append(f"{path.relative_to(ROOT)} imports {module}")
    assert checked > 40, "the source folders were not found"
    assert violations == [], "\n".join(violations)


MAX_MODULE_LINES = 650
"""Modules stay near 600 lines; the margin is for a module whose docstring carries a
derivation the code beside it relies on (fedpca.stats)."""


def test_no_source_module_grows_past_the_size_limit() -> None:
    """A module past the limit gets split by concern (generated protobuf code excepted)."""
    too_long = []
    for folder in (KERNEL, *ROLES, APP):
        for path in sorted((ROOT / folder / "fedpca").rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > MAX_MODULE_LINES:
                too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert too_long == [], "\n".join(too_long)


def test_no_product_module_uses_the_test_only_noise_sampler() -> None:
    """The seeded float sampler is insecure (and repeats its noise); only its own module
    defines it. A test audit found that a product default switched to it passed every
    test of the fast tier."""
    users = []
    for folder in (KERNEL, *ROLES, APP):
        for path in sorted((ROOT / folder / "fedpca").rglob("*.py")):
            if path.relative_to(ROOT).as_posix() == "core/fedpca/dp/noise.py":
                continue
            if "TestOnlySeededSampler" in path.read_text(encoding="utf-8"):
                users.append(str(path.relative_to(ROOT)))
    assert users == []


def test_every_source_folder_is_a_portion_of_the_fedpca_namespace() -> None:
    """Folder = import path: <folder>/fedpca/... and no fedpca/__init__.py anywhere."""
    for folder in (KERNEL, *ROLES, APP, "proto"):
        assert (ROOT / folder / "fedpca").is_dir(), folder
        assert not (ROOT / folder / "fedpca" / "__init__.py").exists(), folder
        stray = [p.name for p in (ROOT / folder).iterdir() if p.name != "fedpca"]
        assert stray == [], f"{folder}/ holds {stray} outside its fedpca/ portion"


def test_role_folders_are_not_top_level_imports(tmp_path: Path) -> None:
    """After install only ``fedpca`` is importable, never ``proxy``/``owner``/``analyst``."""
    for name in ("proxy", "owner", "analyst", "core", "proto", "app"):
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
        [
            sys.executable,
            "-c",
            "import fedpca.owner, fedpca.proxy, fedpca.analyst, fedpca.app, fedpca.v1",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
