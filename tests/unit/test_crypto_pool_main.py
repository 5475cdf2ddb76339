"""A script without ``if __name__ == "__main__":`` runs once, however many crypto workers
it starts.

With the spawn and forkserver start methods, multiprocessing makes every new process
(and the fork server) import the parent's main module; a script that fits an estimator
at top level then submitted its query again from the workers. The pool's workers never
import it (``fedpca.codec._processes``): each run below appends one line per execution
of the script's top level to a marker file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = """
import os, sys
with open(sys.argv[1], "a") as marker:
    marker.write(f"{os.getpid()}\\n")
from fedpca.codec import CryptoPool, SlotLayout, generate_keypair
public_key, private_key = generate_keypair(512, allow_insecure_test_key=True)
layout = SlotLayout(key_bits=512, slot_bits=16, slots_per_ciphertext=8, value_count=40)
with CryptoPool(2, start_method=sys.argv[2]) as pool:
    packed = pool.encrypt_packed(public_key, list(range(-20, 20)), layout, 1000)
    values = pool.decrypt_packed(private_key, packed)
assert list(values) == list(range(-20, 20)), values
print("decrypted", len(values))
"""


def _run(args: list[str], cwd: Path, marker: Path) -> None:
    result = subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "decrypted 40" in result.stdout
    # The script's top level ran exactly once: in the parent, never in a worker.
    assert len(marker.read_text().splitlines()) == 1


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_guardless_script_runs_once(tmp_path: Path, start_method: str) -> None:
    script = tmp_path / "analysis.py"
    script.write_text(_SCRIPT)
    marker = tmp_path / "marker"
    _run([str(script), str(marker), start_method], tmp_path, marker)


def test_a_guardless_module_run_with_dash_m_runs_once(tmp_path: Path) -> None:
    package = tmp_path / "study"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "analysis.py").write_text(_SCRIPT)
    marker = tmp_path / "marker"
    _run(["-m", "study.analysis", str(marker), "forkserver"], tmp_path, marker)
