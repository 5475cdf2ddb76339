"""Eigenvalues and top eigenvectors of a symmetric matrix held in packed storage.

The analyst's release keeps R as its M(M+1)/2 upper-triangle values; the eigensolver of
:func:`scipy.linalg.eigh` needs the full M x M matrix, which at M = 2,000 is 30.5 MiB
next to the release's 15.3 MiB, more than the 29.6 MiB of ciphertexts the analyst
received. LAPACK's ``dspevx`` works on the packed triangle itself (in place, with
O(M) workspace), so the covariance's working copy is half that size.

Why this module calls LAPACK by hand: ``scipy.linalg.lapack`` wraps no packed-storage
eigensolver, but ``scipy.linalg.cython_lapack`` exports every LAPACK routine (through
C wrappers that take care of the Fortran calling details) for compiled code, as
capsules holding C function pointers, each named by its C signature.
:func:`_dspevx_function` checks that signature, reads the pointer and calls it with
:mod:`ctypes`, the way numba calls SciPy's LAPACK. Only ``dspevx`` is used.

Layout: a row-major upper triangle (row i: entries (i, i), (i, i+1), ...) is, entry for
entry, LAPACK's column-major *lower* packed storage of the same symmetric matrix
(column j: entries (j, j), (j+1, j), ...), so it is passed with ``UPLO = 'L'``.
"""

from __future__ import annotations

import ctypes
import functools
import math
from ctypes import POINTER, byref, c_char_p, c_double, c_int, c_void_p
from typing import Any

import numpy as np
import numpy.typing as npt
import scipy.linalg.cython_lapack

from fedpca.errors import DataError

__all__ = ["packed_eigenvalues", "packed_top_eigenvectors"]

FloatArray = npt.NDArray[np.float64]

_DSPEVX_ARGUMENTS: list[Any] = [
    c_char_p,  # JOBZ: 'N' eigenvalues only, 'V' and eigenvectors
    c_char_p,  # RANGE: 'A' all, 'I' the IL-th to IU-th smallest
    c_char_p,  # UPLO
    POINTER(c_int),  # N
    c_void_p,  # AP (destroyed)
    POINTER(c_double),  # VL
    POINTER(c_double),  # VU
    POINTER(c_int),  # IL
    POINTER(c_int),  # IU
    POINTER(c_double),  # ABSTOL
    POINTER(c_int),  # M: eigenvalues found
    c_void_p,  # W
    c_void_p,  # Z
    POINTER(c_int),  # LDZ
    c_void_p,  # WORK (8 N)
    c_void_p,  # IWORK (5 N)
    c_void_p,  # IFAIL (N)
    POINTER(c_int),  # INFO
]


_DSPEVX_SIGNATURE = (
    ("char",) * 3
    + ("int", "double", "double", "double", "int", "int")
    + (
        "double",
        "int",
        "double",
        "double",
        "int",
        "double",
        "int",
        "int",
        "int",
    )
)
"""What each argument of scipy's exported dspevx points to: ``int`` must be C's 32-bit
int (an ILP64 build would export another signature and is refused, not miscalled)."""

# Python's own C API, through a handle of this module's (argument types set here do not
# change ctypes.pythonapi's for anyone else).
_PYTHON_API = ctypes.PyDLL(None)
_PYTHON_API.PyCapsule_GetName.restype = c_char_p
_PYTHON_API.PyCapsule_GetName.argtypes = [ctypes.py_object]
_PYTHON_API.PyCapsule_GetPointer.restype = c_void_p
_PYTHON_API.PyCapsule_GetPointer.argtypes = [ctypes.py_object, c_char_p]


def _pointee(argument: str) -> str:
    """'int *' -> 'int'; '__pyx_t_5scipy_6linalg_13cython_lapack_d *' -> 'double'."""
    name = argument.strip().removesuffix("*").strip()
    return "double" if name.endswith("cython_lapack_d") else name


@functools.cache
def _dspevx_function() -> Any:
    """The dspevx that scipy.linalg.cython_lapack exports, callable.

    Raises
    ------
    RuntimeError
        The exported function does not take pointers to :data:`_DSPEVX_SIGNATURE`.
    """
    name = "dspevx"
    capsule = scipy.linalg.cython_lapack.__pyx_capi__[name]
    declared = _PYTHON_API.PyCapsule_GetName(capsule)
    text = declared.decode("ascii") if declared else ""
    arguments = text[text.find("(") + 1 : text.rfind(")")].split(",")
    if not text.startswith("void (") or tuple(_pointee(a) for a in arguments) != _DSPEVX_SIGNATURE:
        raise RuntimeError(f"scipy's {name} is {text!r}, not the LAPACK call this module makes")
    address = _PYTHON_API.PyCapsule_GetPointer(capsule, declared)
    return ctypes.CFUNCTYPE(None, *_DSPEVX_ARGUMENTS)(address)


def _order(packed: FloatArray) -> int:
    m = (math.isqrt(8 * packed.size + 1) - 1) // 2
    if packed.ndim != 1 or m * (m + 1) // 2 != packed.size or m < 1:
        raise DataError(f"{packed.shape} values are not the packed triangle of a matrix")
    if packed.dtype != np.float64 or not packed.flags.c_contiguous or not packed.flags.writeable:
        raise DataError("the packed triangle must be a writeable contiguous float64 vector")
    return m


def _dspevx(packed: FloatArray, first: int, vectors: bool) -> tuple[FloatArray, FloatArray]:
    """Eigenvalues first..m (1-based, ascending) and, with ``vectors``, their vectors."""
    m = _order(packed)
    count = m - first + 1
    values = np.empty(m, dtype=np.float64)
    z = np.empty((count, m) if vectors else (1, 1), dtype=np.float64)
    work = np.empty(8 * m, dtype=np.float64)
    iwork = np.empty(5 * m, dtype=np.intc)
    ifail = np.empty(m, dtype=np.intc)
    found, info = c_int(0), c_int(0)
    every = first == 1 and not vectors
    _dspevx_function()(
        b"V" if vectors else b"N",
        b"A" if every else b"I",
        b"L",
        byref(c_int(m)),
        packed.ctypes.data,
        byref(c_double(0.0)),
        byref(c_double(0.0)),
        byref(c_int(first)),
        byref(c_int(m)),
        byref(c_double(0.0)),  # LAPACK's default tolerance
        byref(found),
        values.ctypes.data,
        z.ctypes.data,
        byref(c_int(m if vectors else 1)),
        work.ctypes.data,
        iwork.ctypes.data,
        ifail.ctypes.data,
        byref(info),
    )
    if info.value < 0:
        raise ValueError(f"dspevx: argument {-info.value} is invalid")
    if info.value > 0:
        what = "eigenvectors" if vectors else "eigenvalues"
        raise DataError(f"the eigensolver did not converge for {info.value} {what}")
    if found.value != count:
        raise DataError(f"the eigensolver found {found.value} of {count} eigenvalues")
    # Z is column-major M x count: in C order, row i is the i-th eigenvector.
    return values[:count], z


def packed_eigenvalues(packed: FloatArray) -> FloatArray:
    """Every eigenvalue, descending, of the symmetric matrix whose row-major upper
    triangle is ``packed`` (overwritten)."""
    values, _ = _dspevx(packed, 1, vectors=False)
    return values[::-1].copy()


def packed_top_eigenvectors(packed: FloatArray, k: int) -> tuple[FloatArray, FloatArray]:
    """The k largest eigenvalues (descending) and their unit eigenvectors as the rows
    of a (k, M) array, of the matrix whose row-major upper triangle is ``packed``
    (overwritten)."""
    m = _order(packed)
    if not 1 <= k <= m:
        raise ValueError(f"k must be in [1, {m}], got {k}")
    values, vectors = _dspevx(packed, m - k + 1, vectors=True)
    return values[::-1].copy(), vectors[::-1].copy()
