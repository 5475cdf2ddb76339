"""The local cluster's pure helpers (its processes are exercised by the integration tests)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import numpy as np
import pytest

from fedpca.app.cluster import LocalCluster, split_rows, write_toml
from fedpca.errors import ConfigError


def test_split_rows_partitions_every_row_once() -> None:
    parts = split_rows(103, 4, seed=3)
    assert sorted(np.concatenate(parts).tolist()) == list(range(103))
    assert {len(p) for p in parts} <= {25, 26}
    with pytest.raises(ConfigError):
        split_rows(3, 4)


def test_relative_workdir_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cluster = LocalCluster(workdir=Path("relative/work"), owner_tables=[np.zeros((2, 3))])
    assert cluster.workdir.is_absolute()
    assert cluster.proxy_config == tmp_path / "relative" / "work" / "proxy.toml"
    assert os.path.isabs(cluster.owner_config("owner-1"))


def test_write_toml_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    document = {"a": {"s": 'q"uote', "f": float("inf"), "b": True, "n": None, "l": ["x", 1.5]}}
    write_toml(path, document)
    parsed = tomllib.loads(path.read_text())
    assert parsed == {"a": {"s": 'q"uote', "f": float("inf"), "b": True, "l": ["x", 1.5]}}
