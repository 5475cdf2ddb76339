"""Every eigenvalue and the top eigenvectors of a symmetric matrix in packed storage.

The analyst's release keeps R as its M(M+1)/2 upper-triangle values; the eigensolver of
:func:`scipy.linalg.eigh` needs the full M x M matrix, which at M = 2,000 is 30.5 MiB
next to the release's 15.3 MiB, more than the 29.6 MiB of ciphertexts the analyst
received. LAPACK's packed-storage routines work on the triangle itself, in place, with
O(M) workspace, so the covariance's working copy is half that size.

:func:`packed_spectrum` reduces the matrix to tridiagonal form once (``dsptrd``), takes
every eigenvalue from a copy of the tridiagonal (``dsterf``), the k largest again with
their blocks (``dstebz``), their eigenvectors (``dstein``) and transforms those back
(``dopmtr``): what LAPACK's ``dspevx`` does for one range, with the reduction shared
between the eigenvalues and the eigenvectors (two ``dspevx`` calls reduce twice).

Why this module calls LAPACK by hand: ``scipy.linalg.lapack`` wraps no packed-storage
routine, but ``scipy.linalg.cython_lapack`` exports every LAPACK routine (through C
wrappers that take care of the Fortran calling details) for compiled code, as capsules
holding C function pointers, each named by its C signature. :func:`_lapack` checks that
signature, reads the pointer and calls it with :mod:`ctypes`, the way numba calls
SciPy's LAPACK.

Layout: a row-major upper triangle (row i: entries (i, i), (i, i+1), ...) is, entry for
entry, LAPACK's column-major *lower* packed storage of the same symmetric matrix
(column j: entries (j, j), (j+1, j), ...), so it is passed with ``UPLO = 'L'``.
"""

from __future__ import annotations

import ctypes
import functools
import math
from ctypes import byref, c_char_p, c_double, c_int, c_void_p
from typing import Any

import numpy as np
import numpy.typing as npt
import scipy.linalg.cython_lapack

from fedpca.errors import DataError

__all__ = ["packed_spectrum"]

FloatArray = npt.NDArray[np.float64]

_SIGNATURES: dict[str, str] = {
    # What each argument points to, in order: c = char, i = int, d = double. ``int`` must
    # be C's 32-bit int: an ILP64 build exports other signatures and is refused.
    "dsptrd": "ciddddi",
    "dsterf": "iddi",
    "dstebz": "cciddiidddiidiidii",
    "dstein": "iddidiididiii",
    "dopmtr": "ccciidddidi",
}
_CTYPES: dict[str, Any] = {"c": c_char_p, "i": c_void_p, "d": c_void_p}  # addresses
_C_NAMES = {"char": "c", "int": "i", "double": "d"}

# Python's own C API, through a handle of this module's (argument types set here do not
# change ctypes.pythonapi's for anyone else).
_PYTHON_API = ctypes.PyDLL(None)
_PYTHON_API.PyCapsule_GetName.restype = c_char_p
_PYTHON_API.PyCapsule_GetName.argtypes = [ctypes.py_object]
_PYTHON_API.PyCapsule_GetPointer.restype = c_void_p
_PYTHON_API.PyCapsule_GetPointer.argtypes = [ctypes.py_object, c_char_p]


def _pointee(argument: str) -> str:
    """'int *' -> 'i'; '__pyx_t_5scipy_6linalg_13cython_lapack_d *' -> 'd'."""
    name = argument.strip().removesuffix("*").strip()
    if name.endswith("cython_lapack_d"):
        name = "double"
    return _C_NAMES.get(name, "?")


@functools.cache
def _lapack(name: str) -> Any:
    """The LAPACK routine ``name`` that scipy.linalg.cython_lapack exports, callable.

    Raises
    ------
    RuntimeError
        The exported function does not take pointers to :data:`_SIGNATURES`' types.
    """
    capsule = scipy.linalg.cython_lapack.__pyx_capi__[name]
    declared = _PYTHON_API.PyCapsule_GetName(capsule)
    text = declared.decode("ascii") if declared else ""
    arguments = text[text.find("(") + 1 : text.rfind(")")].split(",")
    expected = _SIGNATURES[name]
    if not text.startswith("void (") or "".join(_pointee(a) for a in arguments) != expected:
        raise RuntimeError(f"scipy's {name} is {text!r}, not the LAPACK call this module makes")
    address = _PYTHON_API.PyCapsule_GetPointer(capsule, declared)
    return ctypes.CFUNCTYPE(None, *(_CTYPES[c] for c in expected))(address)


def _call(name: str, *arguments: Any) -> None:
    """Call LAPACK's ``name``: ints and floats by reference, arrays by address."""
    info = c_int(0)
    converted: list[Any] = []
    for value in arguments:
        if isinstance(value, np.ndarray):
            converted.append(value.ctypes.data)
        elif isinstance(value, bytes | c_int):
            converted.append(value if isinstance(value, bytes) else byref(value))
        elif isinstance(value, float):
            converted.append(byref(c_double(value)))
        else:
            converted.append(byref(c_int(int(value))))
    _lapack(name)(*converted, byref(info))
    if info.value < 0:
        raise ValueError(f"{name}: argument {-info.value} is invalid")
    if info.value > 0:
        raise DataError(f"the eigensolver ({name}) did not converge (info {info.value})")


def _order(packed: FloatArray) -> int:
    m = (math.isqrt(8 * packed.size + 1) - 1) // 2
    if packed.ndim != 1 or m * (m + 1) // 2 != packed.size or m < 1:
        raise DataError(f"{packed.shape} values are not the packed triangle of a matrix")
    if packed.dtype != np.float64 or not packed.flags.c_contiguous or not packed.flags.writeable:
        raise DataError("the packed triangle must be a writeable contiguous float64 vector")
    return m


def packed_spectrum(packed: FloatArray, k: int) -> tuple[FloatArray, FloatArray]:
    """Every eigenvalue and the top k unit eigenvectors of a symmetric matrix.

    Parameters
    ----------
    packed : the matrix's row-major upper triangle, M(M+1)/2 float64 values; it is
        overwritten (it holds the reduction to tridiagonal form afterwards).
    k : how many eigenvectors, of the largest eigenvalues.

    Returns
    -------
    (M,) every eigenvalue, descending, and (k, M) the eigenvectors of the k largest, in
    the same order, as rows.
    """
    m = _order(packed)
    if not 1 <= k <= m:
        raise ValueError(f"k must be in [1, {m}], got {k}")
    diagonal = np.empty(m, dtype=np.float64)
    off_diagonal = np.zeros(max(m - 1, 1), dtype=np.float64)
    tau = np.zeros(max(m - 1, 1), dtype=np.float64)
    _call("dsptrd", b"L", m, packed, diagonal, off_diagonal, tau)

    eigenvalues = diagonal.copy()
    _call("dsterf", m, eigenvalues, off_diagonal.copy())  # ascending, in place

    found, blocks = c_int(0), c_int(0)
    top = np.empty(m, dtype=np.float64)
    block_of = np.empty(m, dtype=np.intc)
    splits = np.empty(m, dtype=np.intc)
    _call(
        "dstebz",
        b"I",
        b"B",  # by block: what dstein takes
        m,
        0.0,
        0.0,
        m - k + 1,
        m,
        0.0,  # LAPACK's default tolerance
        diagonal,
        off_diagonal,
        found,
        blocks,
        top,
        block_of,
        splits,
        np.empty(4 * m, dtype=np.float64),
        np.empty(3 * m, dtype=np.intc),
    )
    if found.value != k:
        raise DataError(f"the eigensolver found {found.value} of the {k} largest eigenvalues")
    # Column-major M x k: in C order, row j is the j-th eigenvector.
    vectors = np.empty((k, m), dtype=np.float64)
    _call(
        "dstein",
        m,
        diagonal,
        off_diagonal,
        k,
        top,
        block_of,
        splits,
        vectors,
        m,
        np.empty(5 * m, dtype=np.float64),
        np.empty(m, dtype=np.intc),
        np.empty(k, dtype=np.intc),
    )
    _call("dopmtr", b"L", b"L", b"N", m, k, packed, tau, vectors, m, np.empty(k, dtype=np.float64))
    descending = np.argsort(top[:k], kind="stable")[::-1]
    return eigenvalues[::-1].copy(), vectors[descending].copy()
