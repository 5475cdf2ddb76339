"""Upper-triangle flattening of symmetric matrices.

Scatter shares XᵀX are symmetric, so only the M(M+1)/2 entries with i <= j are ever
encoded, packed and encrypted; the analyst mirrors them back after decryption.
The order is row-major over i <= j, the order of ``numpy.triu_indices``.

Both directions copy row by row rather than through ``numpy.triu_indices``: its two
index arrays are twice the size of an int64 triangle (32 MiB at M = 2,000), and the
roles hold these matrices at the widths where that matters.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from fedpca.errors import ConfigError


def upper_triangle_length(dim: int) -> int:
    """Number of entries i <= j of a ``dim x dim`` matrix: ``dim (dim + 1) / 2``."""
    if dim < 0:
        raise ConfigError(f"matrix dimension must be >= 0, got {dim!r}")
    return dim * (dim + 1) // 2


def upper_triangle(
    matrix: NDArray[np.generic], out: NDArray[np.generic] | None = None
) -> NDArray[np.generic]:
    """Flatten the upper triangle (diagonal included) row by row.

    Parameters
    ----------
    matrix : numpy.ndarray, shape (M, M)
        A symmetric matrix (the lower triangle is ignored, not checked).
    out : numpy.ndarray, shape (M (M + 1) / 2,), optional
        Where to write the triangle (e.g. the front of a longer vector), instead of a
        new array of ``matrix``'s dtype.

    Returns
    -------
    numpy.ndarray, shape (M (M + 1) / 2,)
        ``[a00, a01, ..., a0(M-1), a11, a12, ..., a(M-1)(M-1)]`` (``out`` if given).
    """
    array = np.asarray(matrix)
    if array.ndim != 2 or array.shape[0] != array.shape[1]:
        raise ValueError(f"expected a square matrix, got shape {array.shape}")
    m = array.shape[0]
    length = m * (m + 1) // 2
    if out is not None and out.shape != (length,):
        raise ValueError(f"out must have shape ({length},), got {out.shape}")
    flat = np.empty(length, dtype=array.dtype) if out is None else out
    start = 0
    for i in range(m):
        flat[start : start + m - i] = array[i, i:]
        start += m - i
    return flat


def symmetric_from_upper_triangle(
    values: NDArray[np.generic], dim: int | None = None, out: NDArray[np.generic] | None = None
) -> NDArray[np.generic]:
    """Rebuild the symmetric matrix from its row-major upper triangle.

    Parameters
    ----------
    values : numpy.ndarray, shape (M (M + 1) / 2,)
        Output of :func:`upper_triangle` (any dtype, including object arrays of
        Python ints).
    dim : int, optional
        M; inferred from the length when omitted, checked when given.
    out : numpy.ndarray, shape (M, M), optional
        Where to write the matrix (every entry is written), instead of a new array of
        ``values``' dtype.

    Returns
    -------
    numpy.ndarray, shape (M, M)
        ``A`` with ``A[i, j] = A[j, i]`` = the entry of (i, j), i <= j, in ``values``
        (``out`` if given).
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
    if out is not None and out.shape != (inferred, inferred):
        raise ValueError(f"out must have shape ({inferred}, {inferred}), got {out.shape}")
    matrix = np.empty((inferred, inferred), dtype=array.dtype) if out is None else out
    start = 0
    for i in range(inferred):
        row = array[start : start + inferred - i]
        matrix[i, i:] = row
        matrix[i:, i] = row
        start += inferred - i
    return matrix
