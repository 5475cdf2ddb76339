"""Sufficient-statistics specs: layout, sensitivities, vector round trips, addition."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedpca.errors import ConfigError, LayoutError
from fedpca.query import QueryKind, QuerySpec
from fedpca.stats import (
    CLASS_COUNTS,
    CLASS_SUMS,
    COUNT,
    SCATTER,
    SUM,
    StatisticsSpec,
    SufficientStatistics,
    sum_statistics,
    upper_triangle_length,
)

PCA = QueryKind.PCA
DCA = QueryKind.DCA


def _query(**overrides: object) -> QuerySpec:
    fields: dict[str, object] = {
        "query_id": "q-1",
        "kind": QueryKind.PCA,
        "n_features": 4,
        "epsilon": 1.0,
        "delta": 1e-6,
        "n_components": 2,
        "analyst_public_key_n": 7 * 11,
        "analyst_key_fingerprint": "ab",
    }
    fields.update(overrides)
    return QuerySpec(**fields)  # type: ignore[arg-type]


def _pca_stats(x: np.ndarray) -> SufficientStatistics:
    # Straight from the definition, independent of owner/statistics.py.
    return SufficientStatistics(x.T @ x, x.sum(axis=0), float(len(x)))


def _dca_stats(x: np.ndarray, y: np.ndarray, labels: tuple[float, ...]) -> SufficientStatistics:
    sums = np.array([x[y == c].sum(axis=0) for c in labels])
    counts = np.array([float((y == c).sum()) for c in labels])
    return SufficientStatistics.for_classes(x.T @ x, sums, counts)


def _clipped_rows(rng: np.random.Generator, n: int, m: int, c: float) -> np.ndarray:
    x = rng.normal(size=(n, m))
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x * np.minimum(1.0, c / norms) * 0.999


class TestSpecLayout:
    def test_pca_sections_in_protocol_order(self) -> None:
        spec = StatisticsSpec(PCA, 5, clip_norm=1.0)
        assert [s.name for s in spec.sections] == [SCATTER, SUM, COUNT]
        assert [s.length for s in spec.sections] == [15, 5, 1]
        assert spec.value_count == 21
        assert upper_triangle_length(5) == 15

    def test_dca_sections_do_not_send_pooled_sum_and_count(self) -> None:
        spec = StatisticsSpec(DCA, 5, clip_norm=1.0, class_labels=(-1, 1, 7))
        assert [s.name for s in spec.sections] == [SCATTER, CLASS_SUMS, CLASS_COUNTS]
        assert [s.length for s in spec.sections] == [15, 15, 3]
        assert spec.n_classes == 3
        assert spec.class_labels == (-1.0, 1.0, 7.0)
        with pytest.raises(LayoutError, match="no section 'sum'"):
            spec.section(SUM)

    def test_section_slices_tile_the_vector(self) -> None:
        spec = StatisticsSpec(DCA, 3, class_labels=(0, 1))
        slices = spec.section_slices()
        assert slices == {
            SCATTER: slice(0, 6),
            CLASS_SUMS: slice(6, 12),
            CLASS_COUNTS: slice(12, 14),
        }

    @pytest.mark.parametrize("kind", [PCA, DCA])
    def test_sensitivity_at_unit_clip_is_sqrt3(self, kind: QueryKind) -> None:
        labels = (0.0, 1.0) if kind is DCA else ()
        spec = StatisticsSpec(kind, 7, 1.0, labels)
        assert spec.l2_sensitivity == pytest.approx(math.sqrt(3), rel=1e-15)
        assert spec.max_abs_per_record == 1.0

    @pytest.mark.parametrize("c", [0.5, 2.0, 3.0])
    @pytest.mark.parametrize("kind", [PCA, DCA])
    def test_sensitivity_formula(self, kind: QueryKind, c: float) -> None:
        labels = (0.0, 1.0, 2.0) if kind is DCA else ()
        spec = StatisticsSpec(kind, 4, c, labels)
        assert spec.l2_sensitivity == pytest.approx(math.sqrt(c**4 + c**2 + 1), rel=1e-15)
        assert spec.section(SCATTER).l2_sensitivity == c * c
        assert spec.section(SCATTER).max_abs_per_record == c * c
        assert spec.max_abs_per_record == max(c * c, c, 1.0)

    def test_from_query(self) -> None:
        pca = StatisticsSpec.from_query(_query(clip_norm=2.0))
        assert pca == StatisticsSpec(PCA, 4, 2.0)
        # Class labels belong to DCA queries only (a NaN label was once accepted).
        with pytest.raises(ConfigError, match="PCA query takes no class_labels"):
            _query(class_labels=(1.0, 2.0))
        with pytest.raises(ConfigError, match="finite"):
            _query(kind=QueryKind.DCA, label_column=0, class_labels=(1.0, math.nan))
        dca = StatisticsSpec.from_query(
            _query(kind=QueryKind.DCA, label_column=0, class_labels=(1.0, 2.0))
        )
        assert dca == StatisticsSpec(DCA, 4, 1.0, (1.0, 2.0))

    @pytest.mark.parametrize(
        ("args", "match"),
        [
            ((PCA, 0, 1.0, ()), "n_features"),
            ((PCA, 3, 0.0, ()), "clip_norm"),
            ((PCA, 3, math.inf, ()), "clip_norm"),
            ((PCA, 3, 1.0, (0.0, 1.0)), "no class_labels"),
            ((DCA, 3, 1.0, (1.0,)), "two class labels"),
            ((DCA, 3, 1.0, (1.0, 1.0)), "distinct"),
            ((DCA, 3, 1.0, (1.0, math.nan)), "finite"),
            (("lda", 3, 1.0, ()), "unknown query kind"),
        ],
    )
    def test_invalid_specs_are_refused(self, args: tuple[object, ...], match: str) -> None:
        with pytest.raises(ConfigError, match=match):
            StatisticsSpec(*args)  # type: ignore[arg-type]


class TestSensitivityHolds:
    """Adding one clipped record never moves the vector further than the spec says."""

    @settings(max_examples=60, deadline=None)
    @given(
        x=hnp.arrays(np.float64, 4, elements=st.floats(-3, 3, allow_nan=False)),
        c=st.sampled_from([0.5, 1.0, 2.5]),
        label_index=st.integers(0, 2),
    )
    def test_one_record_change_is_bounded(self, x: np.ndarray, c: float, label_index: int) -> None:
        norm = np.linalg.norm(x)
        if norm > c:
            x = x * (c / norm)
        rng = np.random.default_rng(0)
        base = _clipped_rows(rng, 20, 4, c)
        labels = (-1.0, 0.0, 1.0)
        y = rng.choice(labels, size=20)
        for spec, before, after in [
            (StatisticsSpec(PCA, 4, c), _pca_stats(base), _pca_stats(np.vstack([base, x]))),
            (
                StatisticsSpec(DCA, 4, c, labels),
                _dca_stats(base, y, labels),
                _dca_stats(np.vstack([base, x]), np.append(y, labels[label_index]), labels),
            ),
        ]:
            delta = after.to_vector(spec) - before.to_vector(spec)
            slack = 1e-9 * max(1.0, c**2)
            assert np.linalg.norm(delta) <= spec.l2_sensitivity + slack
            for section, where in zip(spec.sections, spec.section_slices().values(), strict=True):
                part = delta[where]
                assert np.linalg.norm(part) <= section.l2_sensitivity + slack
                assert np.max(np.abs(part)) <= section.max_abs_per_record + slack

    @pytest.mark.parametrize("c", [0.5, 1.0, 2.0])
    def test_bound_is_attained_on_an_axis(self, c: float) -> None:
        x = np.zeros(4)
        x[2] = c
        empty = np.zeros((0, 4))
        spec = StatisticsSpec(PCA, 4, c)
        delta = _pca_stats(x[None, :]).to_vector(spec) - _pca_stats(empty).to_vector(spec)
        assert np.linalg.norm(delta) == pytest.approx(spec.l2_sensitivity, rel=1e-12)
        labels = (0.0, 1.0)
        dspec = StatisticsSpec(DCA, 4, c, labels)
        one = _dca_stats(x[None, :], np.array([1.0]), labels)
        none = _dca_stats(empty, np.zeros(0), labels)
        ddelta = one.to_vector(dspec) - none.to_vector(dspec)
        assert np.linalg.norm(ddelta) == pytest.approx(dspec.l2_sensitivity, rel=1e-12)


class TestVectorRoundTrip:
    def test_upper_triangle_is_row_major(self) -> None:
        r = np.array([[1.0, 2.0, 3.0], [2.0, 4.0, 5.0], [3.0, 5.0, 6.0]])
        stats = SufficientStatistics(r, np.array([7.0, 8.0, 9.0]), 10.0)
        vec = stats.to_vector(StatisticsSpec(PCA, 3))
        np.testing.assert_array_equal(vec, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])

    def test_dca_vector_layout(self) -> None:
        r = np.eye(2)
        stats = SufficientStatistics.for_classes(r, [[1.0, 2.0], [3.0, 4.0]], [5.0, 6.0])
        vec = stats.to_vector(StatisticsSpec(DCA, 2, class_labels=(0, 1)))
        np.testing.assert_array_equal(vec, [1, 0, 1, 1, 2, 3, 4, 5, 6])
        np.testing.assert_array_equal(stats.sums, [4.0, 6.0])
        assert stats.count == 11.0

    @settings(max_examples=40, deadline=None)
    @given(
        m=st.integers(1, 6),
        n_classes=st.integers(2, 4),
        seed=st.integers(0, 2**32 - 1),
    )
    def test_from_vector_inverts_to_vector(self, m: int, n_classes: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        # Arbitrary (noisy-looking) vectors: from_vector must mirror, to_vector must recover.
        for spec in (
            StatisticsSpec(PCA, m),
            StatisticsSpec(DCA, m, class_labels=tuple(range(n_classes))),
        ):
            vec = rng.normal(size=spec.value_count)
            stats = SufficientStatistics.from_vector(spec, vec)
            np.testing.assert_array_equal(stats.scatter, stats.scatter.T)
            np.testing.assert_array_equal(stats.to_vector(spec), vec)
            if spec.kind is DCA:
                assert stats.class_sums is not None and stats.class_counts is not None
                np.testing.assert_allclose(stats.sums, stats.class_sums.sum(axis=0))
                assert stats.count == pytest.approx(stats.class_counts.sum())

    def test_wrong_vector_length_is_refused(self) -> None:
        spec = StatisticsSpec(PCA, 3)
        with pytest.raises(LayoutError, match="has 10 values, got shape"):
            SufficientStatistics.from_vector(spec, np.zeros(9))

    def test_spec_mismatch_is_refused(self) -> None:
        stats = SufficientStatistics(np.eye(3), np.zeros(3), 1.0)
        with pytest.raises(LayoutError, match="3 features, the spec has 4"):
            stats.to_vector(StatisticsSpec(PCA, 4))
        with pytest.raises(LayoutError, match="per-class statistics"):
            stats.to_vector(StatisticsSpec(DCA, 3, class_labels=(0, 1)))


class TestSufficientStatistics:
    def test_addition_equals_statistics_of_pooled_rows(self) -> None:
        rng = np.random.default_rng(3)
        a, b, c = (rng.normal(size=(n, 3)) for n in (5, 8, 2))
        labels = (0.0, 1.0)
        ya, yb = (rng.choice(labels, size=len(t)) for t in (a, b))
        total = sum_statistics([_pca_stats(a), _pca_stats(b), _pca_stats(c)])
        pooled = _pca_stats(np.vstack([a, b, c]))
        np.testing.assert_allclose(total.scatter, pooled.scatter, rtol=1e-12)
        np.testing.assert_allclose(total.sums, pooled.sums, rtol=1e-12)
        assert total.count == 15.0
        dca = _dca_stats(a, ya, labels) + _dca_stats(b, yb, labels)
        dca_pooled = _dca_stats(np.vstack([a, b]), np.concatenate([ya, yb]), labels)
        assert dca.class_sums is not None and dca_pooled.class_sums is not None
        np.testing.assert_allclose(dca.class_sums, dca_pooled.class_sums, rtol=1e-12)
        np.testing.assert_array_equal(dca.class_counts, dca_pooled.class_counts)

    def test_dimension_mismatch_on_addition(self) -> None:
        a = SufficientStatistics(np.eye(3), np.zeros(3), 1.0)
        b = SufficientStatistics(np.eye(2), np.zeros(2), 1.0)
        with pytest.raises(LayoutError, match="3 and 2 features"):
            a + b
        d = SufficientStatistics.for_classes(np.eye(3), np.zeros((2, 3)), np.zeros(2))
        with pytest.raises(LayoutError, match="0 and 2 classes"):
            a + d
        with pytest.raises(LayoutError, match="empty"):
            sum_statistics([])

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"scatter": np.zeros((2, 3)), "sums": np.zeros(2), "count": 1}, "square"),
            ({"scatter": np.eye(2), "sums": np.zeros(3), "count": 1}, r"shape \(2,\)"),
            (
                {
                    "scatter": np.eye(2),
                    "sums": np.zeros(2),
                    "count": 1,
                    "class_sums": np.zeros((2, 2)),
                },
                "together",
            ),
            (
                {
                    "scatter": np.eye(2),
                    "sums": np.zeros(2),
                    "count": 1,
                    "class_sums": np.zeros((2, 3)),
                    "class_counts": np.zeros(2),
                },
                r"\(C, 2\)",
            ),
            (
                {
                    "scatter": np.eye(2),
                    "sums": np.zeros(2),
                    "count": 1,
                    "class_sums": np.zeros((2, 2)),
                    "class_counts": np.zeros(3),
                },
                "class_counts",
            ),
        ],
    )
    def test_shape_errors(self, kwargs: dict[str, object], match: str) -> None:
        with pytest.raises(LayoutError, match=match):
            SufficientStatistics(**kwargs)  # type: ignore[arg-type]

    def test_arrays_are_private_and_read_only(self) -> None:
        r = np.eye(2)
        stats = SufficientStatistics(r, np.zeros(2), 1.0)
        r[0, 0] = 5.0
        assert stats.scatter[0, 0] == 1.0
        with pytest.raises(ValueError, match="read-only"):
            stats.scatter[0, 0] = 2.0

    def test_only_frozen_arrays_owning_their_memory_are_shared(self) -> None:
        # Sharing is what keeps from_vector from copying an M x M scatter; it is safe
        # only when nothing else can write to the array.
        frozen = np.eye(2)
        frozen.setflags(write=False)
        assert SufficientStatistics(frozen, np.zeros(2), 1.0).scatter is frozen
        base = np.eye(2)
        view = base.view()
        view.setflags(write=False)
        stats = SufficientStatistics(view, np.zeros(2), 1.0)
        base[0, 0] = 5.0
        assert stats.scatter is not view and stats.scatter[0, 0] == 1.0
        vector = StatisticsSpec(PCA, 2)
        rebuilt = SufficientStatistics.from_vector(vector, np.arange(6.0))
        assert rebuilt.scatter.base is None and not rebuilt.scatter.flags.writeable

    def test_zeros(self) -> None:
        spec = StatisticsSpec(DCA, 3, class_labels=(0, 1, 2))
        zero = SufficientStatistics.zeros(spec)
        np.testing.assert_array_equal(zero.to_vector(spec), np.zeros(spec.value_count))
        assert SufficientStatistics.zeros(StatisticsSpec(PCA, 3)).n_classes == 0
