"""Upper-triangle flattening and mirroring, and the codec's public surface."""

from __future__ import annotations

import numpy as np
import pytest

import fedpca.codec as codec
from fedpca.codec import symmetric_from_upper_triangle, upper_triangle


def test_upper_triangle_is_row_major_over_i_le_j() -> None:
    matrix = np.array([[1, 2, 3], [2, 4, 5], [3, 5, 6]])
    assert upper_triangle(matrix).tolist() == [1, 2, 3, 4, 5, 6]


def test_mirroring_restores_a_symmetric_matrix() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 5))
    scatter = x.T @ x
    flat = upper_triangle(scatter)
    assert flat.shape == (15,)
    rebuilt = symmetric_from_upper_triangle(flat)
    assert np.array_equal(rebuilt, np.triu(scatter) + np.triu(scatter, 1).T)
    assert np.array_equal(rebuilt, rebuilt.T)
    assert symmetric_from_upper_triangle(flat, dim=5).shape == (5, 5)


def test_mirroring_keeps_python_ints_of_any_size() -> None:
    flat = np.array([2**80, -(2**70), 3], dtype=object)
    assert symmetric_from_upper_triangle(flat).tolist() == [[2**80, -(2**70)], [-(2**70), 3]]


@pytest.mark.parametrize("m", [1, 2, 7, 40])
def test_row_by_row_copies_follow_numpy_triu_indices(m: int) -> None:
    rng = np.random.default_rng(m)
    matrix = rng.integers(-1000, 1000, size=(m, m))
    rows, cols = np.triu_indices(m)
    assert np.array_equal(upper_triangle(matrix), matrix[rows, cols])
    rebuilt = symmetric_from_upper_triangle(matrix[rows, cols])
    assert np.array_equal(rebuilt[rows, cols], matrix[rows, cols])
    assert np.array_equal(rebuilt[cols, rows], matrix[rows, cols])
    # Written into the front of a longer vector, left as it was after the triangle.
    vector = np.full(m * (m + 1) // 2 + 3, -1, dtype=np.int64)
    assert upper_triangle(matrix, out=vector[:-3]) is not None
    assert np.array_equal(vector[:-3], matrix[rows, cols]) and vector[-3:].tolist() == [-1] * 3
    with pytest.raises(ValueError, match="out must have shape"):
        upper_triangle(matrix, out=vector)


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="square"):
        upper_triangle(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="upper triangle"):
        symmetric_from_upper_triangle(np.zeros(4))
    with pytest.raises(ValueError, match="not 4"):
        symmetric_from_upper_triangle(np.zeros(6), dim=4)


def test_public_surface_resolves() -> None:
    for name in codec.__all__:
        assert getattr(codec, name) is not None
    with pytest.raises(AttributeError):
        codec.does_not_exist  # noqa: B018
