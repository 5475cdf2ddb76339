"""Type-check fedpca as it is installed.

mypy resolves modules from folders, but fedpca maps several top-level folders into
one import root with setuptools' package-dir, which only exists at install time.
This script mirrors that mapping as a tree of symlinks and runs mypy on it.

Usage: python scripts/typecheck.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_tree(target: Path) -> Path:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dir: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    packages: list[str] = config["tool"]["setuptools"]["packages"]
    for package in packages:
        # The longest mapped prefix decides where a package's files live.
        prefix = max(
            (p for p in package_dir if package == p or package.startswith(p + ".")), key=len
        )
        rest = package[len(prefix) :].lstrip(".").split(".") if package != prefix else []
        source = ROOT / package_dir[prefix] / Path(*rest)
        dest = target / Path(*package.split("."))
        dest.mkdir(parents=True, exist_ok=True)
        for file in source.iterdir():
            if file.suffix in (".py", ".pyi") or file.name == "py.typed":
                os.symlink(file, dest / file.name)
    return target


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        tree = build_tree(Path(tmp))
        command = [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "-p",
            "fedpca",
        ]
        return subprocess.call(command, cwd=tree, env={**os.environ, "MYPYPATH": str(tree)})


if __name__ == "__main__":
    raise SystemExit(main())
