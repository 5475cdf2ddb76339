"""LAPACK's packed-storage eigensolver, called through scipy's exported C functions."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg

from fedpca.analyst.packed_eigen import packed_eigenvalues, packed_top_eigenvectors
from fedpca.codec.matrix import upper_triangle
from fedpca.errors import DataError


@pytest.mark.parametrize("m", [1, 2, 7, 60])
def test_packed_results_equal_scipy_eigh_on_the_full_matrix(m: int) -> None:
    rng = np.random.default_rng(m)
    a = rng.normal(size=(m, m))
    a = a + a.T  # indefinite, as a noisy covariance may be
    expected_values = scipy.linalg.eigh(a, eigvals_only=True)
    values = packed_eigenvalues(upper_triangle(a).astype(np.float64))
    np.testing.assert_allclose(values, expected_values[::-1], rtol=0, atol=1e-12 * m)
    for k in sorted({1, min(3, m), m}):
        top, vectors = packed_top_eigenvectors(upper_triangle(a).astype(np.float64), k)
        np.testing.assert_allclose(top, expected_values[::-1][:k], rtol=0, atol=1e-12 * m)
        assert vectors.shape == (k, m)
        # Unit eigenvectors: A u = lambda u, up to the sign LAPACK picks.
        np.testing.assert_allclose(vectors @ a, top[:, None] * vectors, atol=1e-10 * m)
        np.testing.assert_allclose(vectors @ vectors.T, np.eye(k), atol=1e-12 * m)


def test_the_triangle_is_the_row_major_upper_one() -> None:
    # A non-symmetric input's upper triangle is what counts (LAPACK's lower packed
    # storage, column by column, is the same sequence of values).
    a = np.array([[2.0, 1.0, 0.0], [-50.0, 2.0, 1.0], [99.0, -7.0, 2.0]])
    symmetric = np.triu(a) + np.triu(a, 1).T
    values = packed_eigenvalues(upper_triangle(a).astype(np.float64))
    np.testing.assert_allclose(values, np.linalg.eigvalsh(symmetric)[::-1], atol=1e-12)


def test_bad_input_is_refused() -> None:
    with pytest.raises(DataError, match="not the packed triangle"):
        packed_eigenvalues(np.zeros(5))
    with pytest.raises(DataError, match="writeable contiguous float64"):
        packed_eigenvalues(np.zeros(6, dtype=np.float32))
    frozen = np.zeros(6)
    frozen.setflags(write=False)
    with pytest.raises(DataError, match="writeable contiguous float64"):
        packed_eigenvalues(frozen)
    with pytest.raises(ValueError, match="k must be in"):
        packed_top_eigenvectors(np.zeros(6), 4)


def test_an_export_with_another_signature_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # An ILP64 build (or another routine) would be called with the wrong argument
    # sizes and corrupt memory: the exported C signature is checked first.
    from fedpca.analyst import packed_eigen

    assert "int" in packed_eigen._DSPEVX_SIGNATURE
    packed_eigen._dspevx_function.cache_clear()
    wider = tuple("int64_t" if t == "int" else t for t in packed_eigen._DSPEVX_SIGNATURE)
    monkeypatch.setattr(packed_eigen, "_DSPEVX_SIGNATURE", wider)
    try:
        with pytest.raises(RuntimeError, match="not the LAPACK call this module makes"):
            packed_eigenvalues(np.zeros(6))
    finally:
        packed_eigen._dspevx_function.cache_clear()
