"""Upper-triangle flattening of symmetric matrices.

Scatter shares XᵀX are symmetric, so only the M(M+1)/2 entries with i <= j are ever
encoded, packed and encrypted; the analyst mirrors them back after decryption.
The order is row-major over i <= j, the order of ``numpy.triu_indices``.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray


def upper_triangle(matrix: NDArray[np.generic]) -> NDArray[np.generic]:
    """Flatten the upper triangle (diagonal included) row by row.

    Parameters
    ----------
    matrix : numpy.ndarray, shape (M, M)
        A symmetric matrix (the lower triangle is ignored, not checked).

    Returns
    -------
    numpy.ndarray, shape (M (M + 1) / 2,)
        ``[a00, a01, ..., a0(M-1), a11, a12, ..., a(M-1)(M-1)]``, same dtype.
    """
    array = np.asarray(matrix)
    if array.ndim != 2 or array.shape[0] != array.shape[1]:
        raise ValueError(f"expected a square matrix, got shape {array.shape}")
    rows, cols = np.triu_indices(array.shape[0])
    return array[rows, cols]


def symmetric_from_upper_triangle(
    values: NDArray[np.generic], dim: int | None = None
) -> NDArray[np.generic]:
    """Rebuild the symmetric matrix from its row-major upper triangle.

    Parameters
    ----------
    values : numpy.ndarray, shape (M (M + 1) / 2,)
        Output of :func:`upper_triangle` (any dtype, including object arrays of
        Python ints).
    dim : int, optional
        M; inferred from the length when omitted, checked when given.

    Returns
    -------
    numpy.ndarray, shape (M, M)
        ``A`` with ``A[i, j] = A[j, i]`` = the entry of (i, j), i <= j, in ``values``.
    """
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"expected a 1-D array, got shape {array.shape}")
    # Solve M (M + 1) / 2 = len exactly in integers.
    inferred = (math.isqrt(8 * array.size + 1) - 1) // 2
    if inferred * (inferred + 1) // 2 != array.size:
        raise ValueError(f"{array.size} values are not an upper triangle (M (M + 1) / 2)")
    if dim is not None and dim != inferred:
        raise ValueError(f"{array.size} values are the upper triangle of {inferred}, not {dim}")
    matrix = np.zeros((inferred, inferred), dtype=array.dtype)
    rows, cols = np.triu_indices(inferred)
    matrix[rows, cols] = array
    matrix[cols, rows] = array
    return matrix
