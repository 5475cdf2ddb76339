"""The scripts reproducing the published evaluation run in their ``--quick`` form.

Each script in benchmarks/experiments/ is run as a user would run it (a separate
process; the runtime script starts real proxy and owner processes over mutual TLS with
a 2048-bit key), writing into a temporary folder; the test then reads back what it
wrote. docs/experiments.md shows the full runs of the same scripts.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "experiments"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run(script: str, out: Path) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """Run ``script --quick``; its last output line, its CSV rows and its JSON document."""
    completed = subprocess.run(
        [sys.executable, str(SCRIPTS / script), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    stem = script.removesuffix(".py")
    png = (out / f"{stem}.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000
    with (out / f"{stem}.csv").open() as handle:
        table = list(csv.DictReader(handle))
    document = json.loads((out / f"{stem}.json").read_text())
    assert len(table) == len(document["rows"]) > 0
    assert "--quick" in document["command"] and document["parameters"]["quick"] is True
    assert document["machine"]["cpus_usable"] >= 1 and document["date_utc"]
    return completed.stdout.strip().splitlines()[-1], table, document


def test_f1_against_samples_per_owner(tmp_path: Path) -> None:
    last, _, document = _run("f1_vs_samples_per_owner.py", tmp_path)
    assert last.startswith("fedpca_spread=")
    rows = document["rows"]
    methods = {r["method"] for r in rows}
    assert methods == {
        "non-private PCA",
        "PrivateLocalPCA",
        "fedpca stats",
        "fedpca masked",
        "random subspace",
    }
    assert {r["samples_per_owner"] for r in rows} == {20, 80}
    assert all(0.0 <= r["f1_mean"] <= 1.0 and r["f1_std"] >= 0.0 for r in rows)
    assert all(r["runs"] == 2 for r in rows if r["method"] != "non-private PCA")
    # The stand-in's classes live in its top components: non-private PCA must beat a
    # random subspace (both deterministic for the fixed seeds).
    f1 = {r["method"]: r["f1_mean"] for r in rows if r["samples_per_owner"] == 20}
    assert f1["non-private PCA"] > f1["random subspace"] + 0.1


def test_captured_variance_against_epsilon(tmp_path: Path) -> None:
    last, _, document = _run("captured_variance_vs_epsilon.py", tmp_path)
    assert last.startswith("largest_gap_stats=")
    rows = document["rows"]
    assert {r["epsilon"] for r in rows} == {0.01, 0.1, 1.0}
    assert all(0.0 < r["captured_mean"] <= 1.0 + 1e-9 for r in rows)
    # At epsilon = 1 on 20,000 rows every mechanism finds the spiked subspace.
    assert all(r["captured_mean"] > 0.95 for r in rows if r["epsilon"] == 1.0)
    for epsilon in (0.01, 0.1, 1.0):
        sigma = {r["method"]: r["scatter_noise_sigma"] for r in rows if r["epsilon"] == epsilon}
        # docs/privacy.md: stats mode covers a capped owner's swap, L2 sensitivity √4.5
        # against Analyze-Gauss's 1 at the same noise multiplier.
        assert sigma["fedpca stats (add/remove)"] / sigma["Analyze-Gauss (add/remove)"] == (
            pytest.approx(math.sqrt(4.5), rel=1e-9)
        )
        # Masked mode: 4√2 + 4/N for the centred scatter against √2 for AᵀA under
        # replace-one (its z is calibrated for delta less the mask's M·2^-40).
        assert sigma["fedpca masked (replace-one)"] / sigma["Analyze-Gauss (replace-one)"] == (
            pytest.approx(4.0, rel=1e-3)
        )


def test_runtime_against_owners(tmp_path: Path) -> None:
    last, table, document = _run("runtime_vs_owners.py", tmp_path)
    assert last.startswith("fedpca_seconds_per_owner=")
    assert document["parameters"]["key_bits"] == 2048
    rows = document["rows"]
    assert {(r["owners"], r["series"].split(",")[0].split(" ")[0]) for r in rows} == {
        (owners, name) for owners in (2, 3) for name in ("fedpca", "PrivateLocalPCA")
    }
    for row in rows:
        assert row["seconds_mean"] > 0 and row["runs"] == 1
        if row["series"].startswith("fedpca, measured"):
            # The phases were read from the owners' logs and the proxy's /proc entry.
            assert 0 < row["encryption_window_mean"] < row["seconds_mean"]
            assert row["proxy_cpu_mean"] > 0 and row["decrypt_mean"] > 0
    assert {row["owners"] for row in table} == {"2", "3"}
