"""``fedpca demo`` refuses what it cannot do before any process starts."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from fedpca.app.cli import main


def test_an_out_folder_that_cannot_be_made_is_a_clear_error(tmp_path: Path) -> None:
    """Found by review: ``--out afile/sub`` (afile a file) ended in a NotADirectoryError
    traceback."""
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    result = CliRunner().invoke(main, ["demo", "--owners", "2", "--out", str(afile / "sub")])
    assert result.exit_code == 1, result.output
    assert f"--out {afile / 'sub'}: cannot make a folder there" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_the_demo_asks_for_the_delta_the_estimators_default_to() -> None:
    """The demo's --delta defaulted to 1e-5 while FederatedPCA's and every estimator's
    delta defaults to 1e-6 (an analyst's walkthrough)."""
    import inspect

    from fedpca.analyst.estimators import FederatedPCA
    from fedpca.app.demo import demo_command

    (delta,) = [option for option in demo_command.params if option.name == "delta"]
    assert delta.default == inspect.signature(FederatedPCA).parameters["delta"].default
