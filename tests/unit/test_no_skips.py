"""Under FEDPCA_NO_SKIPS=1 (.ci/run) a skip fails the run; elsewhere it stays a skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

SKIPPING = """
import pytest

def test_skips_inside():
    pytest.skip("a tool is missing")

@pytest.mark.skipif(True, reason="marked to skip")
def test_skips_by_mark():
    pass

@pytest.mark.xfail(reason="expected to fail")
def test_expected_failure():
    assert False

def test_passes():
    pass
"""

SKIPPING_MODULE = """
import pytest

pytest.importorskip("a_module_that_is_not_installed")

def test_never_collected():
    pass
"""


def _run(path: Path, no_skips: str | None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "FEDPCA_NO_SKIPS"}
    if no_skips is not None:
        env["FEDPCA_NO_SKIPS"] = no_skips
    env["PYTHONPATH"] = str(TESTS)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no_skips",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            str(path),
        ],
        cwd=path if path.is_dir() else path.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "test_skipping.py").write_text(SKIPPING)
    (tmp_path / "test_skipping_module.py").write_text(SKIPPING_MODULE)
    return tmp_path


@pytest.mark.parametrize("no_skips", [None, "0"])
def test_skips_stay_skips_without_the_variable(folder: Path, no_skips: str | None) -> None:
    run = _run(folder, no_skips)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 3 skipped, 1 xfailed" in run.stdout


def test_every_skip_fails_under_the_variable(folder: Path) -> None:
    run = _run(folder / "test_skipping.py", "1")
    assert run.returncode == 1, run.stdout + run.stderr
    forbidden = [line for line in run.stdout.splitlines() if "FEDPCA_NO_SKIPS=1 forbids" in line]
    for reason in ("a tool is missing", "marked to skip"):
        assert any(reason in line for line in forbidden), run.stdout
    # The expected failure and the passing test are what they were.
    assert "XFAIL" in run.stdout and "1 passed" in run.stdout
    assert "skipped" not in run.stdout.splitlines()[-1]


def test_a_skipped_module_fails_under_the_variable(folder: Path) -> None:
    run = _run(folder / "test_skipping_module.py", "1")
    # A module that cannot be collected stops the run: pytest's exit code 2.
    assert run.returncode == 2, run.stdout + run.stderr
    assert "FEDPCA_NO_SKIPS=1 forbids" in run.stdout
    assert "a_module_that_is_not_installed" in run.stdout
