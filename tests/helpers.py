"""Helpers shared by the test modules (importable as ``helpers``: pytest puts tests/ on
the path, see ``pythonpath`` in pyproject.toml)."""

from __future__ import annotations

import numpy as np

from fedpca.data import dataset_path


def dataset_table(name: str) -> np.ndarray:
    """A bundled dataset as one array: the label in column 0, the raw features after it."""
    return np.loadtxt(dataset_path(name), delimiter=",")
