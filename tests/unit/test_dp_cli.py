"""``fedpca dp calibrate`` and ``fedpca dp compose``: last line is the number, errors are clean."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedpca.app.cli import main
from fedpca.dp.calibration import (
    analytic_gaussian_sigma,
    classic_gaussian_sigma,
    gaussian_epsilon,
    zcdp_epsilon,
    zcdp_noise_multiplier,
)


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["dp", *args])
    return result.exit_code, result.output


def test_calibrate_prints_sigma_alone_on_the_last_line() -> None:
    code, output = run("calibrate", "--epsilon", "1", "--delta", "1e-5", "--sensitivity", "2")
    assert code == 0, output
    lines = output.strip().splitlines()
    assert len(lines) > 1 and "zcdp" in output
    assert float(lines[-1]) == zcdp_noise_multiplier(1.0, 1e-5) * 2.0
    code, output = run(
        "calibrate", "--epsilon", "1", "--delta", "1e-5", "--sensitivity", "2",
        "--mechanism", "analytic",
    )  # fmt: skip
    assert code == 0, output
    assert float(output.strip().splitlines()[-1]) == analytic_gaussian_sigma(1.0, 1e-5, 2.0)


def test_calibrate_classic() -> None:
    code, output = run(
        "calibrate", "--epsilon", "0.5", "--delta", "1e-6", "--sensitivity", "1.7320508075688772",
        "--mechanism", "classic",
    )  # fmt: skip
    assert code == 0, output
    assert float(output.strip().splitlines()[-1]) == classic_gaussian_sigma(
        0.5, 1e-6, 1.7320508075688772
    )


def test_calibrate_refuses_classic_at_epsilon_one_without_a_traceback() -> None:
    result = CliRunner().invoke(
        main, ["dp", "calibrate", "--epsilon", "1", "--delta", "1e-5", "--mechanism", "classic"]
    )
    assert result.exit_code != 0
    assert "analytic" in result.output and "Traceback" not in result.output
    assert "--mechanism analytic" in result.output  # this command's own spelling
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--epsilon", "1", "--delta", "2"], "2.0"),
        (["--epsilon", "-1", "--delta", "1e-5"], "-1.0"),
        (["--epsilon", "0", "--delta", "1e-5"], "x>0"),  # not "finite": inf is accepted
        (["--epsilon", "1", "--delta", "1e-5", "--sensitivity", "0"], "0.0"),
        (["--epsilon", "x", "--delta", "1e-5"], "x"),
        (["--epsilon", "1", "--delta", "1e-5", "--mechanism", "laplace"], "laplace"),
    ],
)
def test_calibrate_errors_are_clear(args: list[str], named: str) -> None:
    result = CliRunner().invoke(main, ["dp", "calibrate", *args])
    assert result.exit_code != 0
    assert "Error" in result.output and named in result.output
    assert isinstance(result.exception, SystemExit)


def test_calibrate_infinite_epsilon_says_not_private() -> None:
    code, output = run("calibrate", "--epsilon", "inf", "--delta", "1e-5")
    assert code == 0
    assert "NOT PRIVATE" in output and float(output.strip().splitlines()[-1]) == 0.0


def test_compose_prints_epsilon_last() -> None:
    code, output = run("compose", "--delta", "1e-5", "4", "4", "4", "4")
    assert code == 0, output
    # Four releases with z = 4 are one release with z = 2.
    assert float(output.strip().splitlines()[-1]) == pytest.approx(zcdp_epsilon(2.0, 1e-5))
    code, output = run("compose", "--delta", "1e-5", "--accountant", "pld-continuous", "4")
    assert code == 0
    assert float(output.strip().splitlines()[-1]) == pytest.approx(
        gaussian_epsilon(4.0, 1e-5), rel=1e-5
    )
    code, output = run("compose", "--delta", "1e-5", "4", "0")
    assert code == 0 and "NOT PRIVATE" in output
    assert math.isinf(float(output.strip().splitlines()[-1]))


def test_compose_errors_are_clear() -> None:
    code, output = run("compose", "--delta", "1e-5", "--", "-2")
    assert code != 0 and "-2.0" in output and "Traceback" not in output
    # Found by review: a multiplier whose square underflows (ZeroDivisionError) and
    # one below what the PLD accountant supports (CalibrationError) were tracebacks.
    code, output = run("compose", "--delta", "1e-5", "1e-300")
    assert code == 0 and "NOT PRIVATE" in output
    code, output = run("compose", "--delta", "1e-5", "--accountant", "pld-continuous", "0.01")
    assert code == 1 and "below the minimum 0.1 the PLD accountant supports" in output


def test_real_subprocess_of_the_console_script() -> None:
    script = Path(sys.executable).with_name("fedpca")
    assert script.exists(), f"console script not installed next to {sys.executable}"
    completed = subprocess.run(
        [str(script), "dp", "calibrate", "--epsilon", "1", "--delta", "1e-5", "--sensitivity", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert float(completed.stdout.strip().splitlines()[-1]) == zcdp_noise_multiplier(1.0, 1e-5)
    failed = subprocess.run(
        [str(script), "dp", "calibrate", "--epsilon", "1", "--delta", "1e-5", "--mechanism",
         "classic"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert failed.returncode != 0
    assert "analytic" in failed.stderr and "Traceback" not in failed.stderr


def test_a_command_prints_a_python_warning_as_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by an analyst's walkthrough: DCA's warnings reached the terminal as
    "/path/decode.py:214: DCAComponentsWarning: …" followed by a line of source."""
    import warnings

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after
    result = CliRunner().invoke(main, ["dp", "calibrate", "--epsilon", "1", "--delta", "1e-5"])
    assert result.exit_code == 0, result.output
    line = warnings.formatwarning(UserWarning("keep 2 components"), UserWarning, __file__, 7)
    assert line == "warning: keep 2 components (UserWarning)\n"
