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
