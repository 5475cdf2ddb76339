"""LAPACK's packed-storage eigensolver, called through scipy's exported C functions."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg

from fedpca.analyst import packed_eigen
from fedpca.analyst.packed_eigen import packed_spectrum
from fedpca.codec.matrix import upper_triangle
from fedpca.errors import DataError


def _packed(a: np.ndarray) -> np.ndarray:
    return np.asarray(upper_triangle(a), dtype=np.float64)


@pytest.mark.parametrize("m", [1, 2, 7, 60, 300])
def test_the_spectrum_equals_scipy_eigh_on_the_full_matrix(m: int) -> None:
    rng = np.random.default_rng(m)
    a = rng.normal(size=(m, m))
    a = a + a.T  # indefinite, as a noisy covariance may be
    expected = scipy.linalg.eigh(a, eigvals_only=True)[::-1]
    for k in sorted({1, min(3, m), m}):
        values, vectors = packed_spectrum(_packed(a), k)
        np.testing.assert_allclose(values, expected, rtol=0, atol=1e-12 * m)
        assert vectors.shape == (k, m)
        # Unit eigenvectors of the k largest: A u = lambda u, up to LAPACK's sign.
        np.testing.assert_allclose(vectors @ a, values[:k, None] * vectors, atol=1e-10 * m)
        np.testing.assert_allclose(vectors @ vectors.T, np.eye(k), atol=1e-12 * m)


def test_clustered_and_repeated_eigenvalues() -> None:
    # A spiked covariance with a flat bulk (what a noisy release looks like) and an
    # exactly repeated eigenvalue: the vectors must still be orthonormal eigenvectors.
    rng = np.random.default_rng(3)
    m = 200
    q, _ = np.linalg.qr(rng.normal(size=(m, m)))
    spectrum = np.concatenate([[50.0, 50.0, 20.0], 1.0 + 1e-9 * rng.normal(size=m - 3)])
    a = (q * spectrum) @ q.T
    values, vectors = packed_spectrum(_packed(a), 5)
    np.testing.assert_allclose(values[:3], [50.0, 50.0, 20.0], rtol=1e-12)
    np.testing.assert_allclose(vectors @ vectors.T, np.eye(5), atol=1e-10)
    np.testing.assert_allclose(vectors @ a, values[:5, None] * vectors, atol=1e-9)


def test_the_triangle_is_the_row_major_upper_one() -> None:
    # A non-symmetric input's upper triangle is what counts (LAPACK's lower packed
    # storage, column by column, is the same sequence of values).
    a = np.array([[2.0, 1.0, 0.0], [-50.0, 2.0, 1.0], [99.0, -7.0, 2.0]])
    symmetric = np.triu(a) + np.triu(a, 1).T
    values, _ = packed_spectrum(_packed(a), 1)
    np.testing.assert_allclose(values, np.linalg.eigvalsh(symmetric)[::-1], atol=1e-12)


def test_bad_input_is_refused() -> None:
    with pytest.raises(DataError, match="not the packed triangle"):
        packed_spectrum(np.zeros(5), 1)
    with pytest.raises(DataError, match="writeable contiguous float64"):
        packed_spectrum(np.zeros(6, dtype=np.float32), 1)
    frozen = np.zeros(6)
    frozen.setflags(write=False)
    with pytest.raises(DataError, match="writeable contiguous float64"):
        packed_spectrum(frozen, 1)
    with pytest.raises(ValueError, match="k must be in"):
        packed_spectrum(np.zeros(6), 4)


def test_an_export_with_another_signature_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # An ILP64 build (or another routine) would be called with the wrong argument
    # sizes and corrupt memory: each exported C signature is checked first.
    packed_eigen._lapack.cache_clear()
    wider = dict(packed_eigen._SIGNATURES, dsptrd="cdddddi")
    monkeypatch.setattr(packed_eigen, "_SIGNATURES", wider)
    try:
        with pytest.raises(RuntimeError, match="not the LAPACK call this module makes"):
            packed_spectrum(np.zeros(6), 1)
    finally:
        packed_eigen._lapack.cache_clear()
