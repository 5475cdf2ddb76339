"""Owner preprocessing: public-bound scaling, out-of-bounds policy, row clipping."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedpca.errors import ConfigError, DataError
from fedpca.preprocess import (
    FeatureBounds,
    clip_rows,
    preprocess,
    preprocess_for_query,
    scale_to_unit_box,
)
from fedpca.query import QueryKind, QuerySpec


def _query(**overrides: object) -> QuerySpec:
    fields: dict[str, object] = {
        "query_id": "q",
        "kind": QueryKind.PCA,
        "n_features": 3,
        "epsilon": 1.0,
        "delta": 1e-6,
        "n_components": 1,
        "analyst_public_key_n": 77,
        "analyst_key_fingerprint": "f",
    }
    fields.update(overrides)
    return QuerySpec(**fields)  # type: ignore[arg-type]


class TestFeatureBounds:
    def test_parse_one_pair_for_all_features(self) -> None:
        bounds = FeatureBounds.parse("-2:10", n_features=3)
        assert bounds.lower == (-2.0, -2.0, -2.0)
        assert bounds.upper == (10.0, 10.0, 10.0)

    def test_parse_per_feature_list(self) -> None:
        bounds = FeatureBounds.parse("0:1, -5:5 ,1e3:2e3", n_features=3)
        assert bounds.lower == (0.0, -5.0, 1000.0)
        assert bounds.upper == (1.0, 5.0, 2000.0)

    @pytest.mark.parametrize(
        ("text", "n", "match"),
        [
            ("0-1", 3, "expected 'LO:HI'"),
            ("0:1:2", 3, "expected 'LO:HI'"),
            ("a:1", 3, "not two numbers"),
            ("0:", 3, "not two numbers"),
            ("1:0", 3, "lower < upper"),
            ("1:1", 3, "lower < upper"),
            ("0:inf", 3, "finite"),
            ("0:1", None, "give n_features"),
            ("0:1,0:1", 3, "2 entries, expected 3"),
        ],
    )
    def test_parse_errors(self, text: str, n: int | None, match: str) -> None:
        with pytest.raises(ConfigError, match=match):
            FeatureBounds.parse(text, n_features=n)

    def test_from_arrays_and_query(self) -> None:
        bounds = FeatureBounds.from_arrays(np.array([0, 0, 0]), [1, 2, 3])
        assert bounds.upper == (1.0, 2.0, 3.0)
        assert bounds.n_features == 3
        with pytest.raises(ConfigError, match="2 upper"):
            FeatureBounds.from_arrays([0, 0, 0], [1, 2])
        with pytest.raises(ConfigError, match="numbers"):
            FeatureBounds.from_arrays(["x"], [1])
        q = _query(feature_lower=(0.0, 0.0, 0.0), feature_upper=(1.0, 1.0, 4.0))
        assert FeatureBounds.from_query(q) == FeatureBounds((0, 0, 0), (1, 1, 4))
        assert FeatureBounds.from_query(_query()) is None


class TestScaling:
    def test_bounds_map_onto_minus_one_one(self) -> None:
        bounds = FeatureBounds((0.0, -10.0), (4.0, 10.0))
        x = np.array([[0.0, -10.0], [4.0, 10.0], [2.0, 0.0], [1.0, 5.0]])
        np.testing.assert_allclose(
            scale_to_unit_box(x, bounds),
            np.array([[-1, -1], [1, 1], [0, 0], [-0.5, 0.5]]),
            atol=1e-15,
        )

    def test_values_outside_the_bounds_are_clipped_never_refused(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        bounds = FeatureBounds((0.0, 0.0), (1.0, 1.0))
        with caplog.at_level("DEBUG"):
            out = scale_to_unit_box([[2.0, -3.0], [0.5, 0.5]], bounds)
        np.testing.assert_array_equal(out, [[1.0, -1.0], [0.0, 0.0]])
        # Which or how many values were outside is private: nothing about it is logged.
        assert caplog.text == ""

    def test_bounds_too_wide_to_scale_are_refused_so_no_value_inside_becomes_nan(
        self,
    ) -> None:
        # Review: with [-8.98e307, 1.7e308] a value of 1e306 scaled to NaN and failed
        # the owner's encoding after its budget was reserved, which depended on the data.
        with pytest.raises(ConfigError, match="span more than a float can scale"):
            FeatureBounds((-8.98e307,), (1.7e308,))
        widest = FeatureBounds((-4e307,), (4e307,))
        values = np.array([[-4e307], [-1e306], [0.0], [1e306], [4e307]])
        scaled = scale_to_unit_box(values, widest)
        assert np.all(np.isfinite(scaled)) and np.all(np.abs(scaled) <= 1.0)
        assert scaled[0, 0] == -1.0 and scaled[-1, 0] == 1.0

    def test_shape_errors(self) -> None:
        bounds = FeatureBounds((0.0,), (1.0,))
        with pytest.raises(DataError, match="2 features, the bounds declare 1"):
            scale_to_unit_box([[0.5, 0.5]], bounds)
        with pytest.raises(DataError, match="record 1, feature 1"):
            scale_to_unit_box([[math.nan]], bounds)


class TestClipping:
    def test_rows_within_the_norm_are_unchanged_bit_for_bit(self) -> None:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(50, 6)) / 10.0
        x[3] = [0.6, 0.8, 0, 0, 0, 0]  # exactly on the sphere
        x[7] *= 100.0  # one long row
        out = clip_rows(x, 1.0)
        keep = np.arange(50) != 7
        assert np.array_equal(out[keep], x[keep])
        assert np.linalg.norm(out[7]) <= 1.0
        np.testing.assert_allclose(out[7] / np.linalg.norm(out[7]), x[7] / np.linalg.norm(x[7]))

    @settings(max_examples=80, deadline=None)
    @given(
        x=hnp.arrays(
            np.float64,
            hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=6),
            elements=st.floats(-1e6, 1e6, allow_nan=False),
        ),
        c=st.floats(1e-3, 1e3),
    )
    # Found by hypothesis: the scaled norm rounded to c, the plain norm above it.
    @example(x=np.array([[548.0, 1e-5]]), c=548.0)
    def test_every_clipped_row_is_within_the_norm(self, x: np.ndarray, c: float) -> None:
        out = clip_rows(x, c)
        assert (np.linalg.norm(out, axis=1) <= c).all()
        within = np.linalg.norm(x, axis=1) <= c
        assert np.array_equal(out[within], x[within])

    def test_huge_raw_rows_are_clipped_along_their_direction(self) -> None:
        # Squaring 1e300 overflows; the clip must still keep the row's direction.
        out = clip_rows([[1e300, -1e300, 0.0], [3e200, 4e200, 0.0]], 1.0)
        np.testing.assert_allclose(out[0], [2**-0.5, -(2**-0.5), 0.0])
        np.testing.assert_allclose(out[1], [0.6, 0.8, 0.0])

    def test_bad_clip_norm(self) -> None:
        with pytest.raises(ConfigError):
            clip_rows([[1.0]], 0.0)
        with pytest.raises(ConfigError):
            clip_rows([[1.0]], math.inf)

    def test_preprocess_without_bounds_keeps_raw_values(self) -> None:
        x = np.array([[0.1, 0.2], [30.0, 40.0]])
        out = preprocess(x, None, clip_norm=5.0)
        assert np.array_equal(out[0], x[0])
        np.testing.assert_allclose(out[1], [3.0, 4.0])

    def test_preprocess_scales_then_clips(self) -> None:
        bounds = FeatureBounds((0.0, 0.0), (10.0, 10.0))
        out = preprocess([[10.0, 10.0], [5.0, 7.5]], bounds, clip_norm=1.0)
        # (1, 1) has norm √2 > 1 and is clipped; (0, 0.5) is inside and exact.
        np.testing.assert_allclose(out[0], [1 / math.sqrt(2)] * 2)
        np.testing.assert_array_equal(out[1], [0.0, 0.5])

    def test_preprocess_for_query_uses_the_public_query(self) -> None:
        q = _query(feature_lower=(0.0, 0.0, 0.0), feature_upper=(2.0, 2.0, 2.0), clip_norm=0.5)
        out = preprocess_for_query([[2.0, 1.0, 1.0]], q)
        np.testing.assert_allclose(out, [[0.5, 0.0, 0.0]])
        # A value outside the public bounds is clipped to them, then the row clipped.
        np.testing.assert_allclose(preprocess_for_query([[3.0, 1.0, 1.0]], q), [[0.5, 0.0, 0.0]])
        with pytest.raises(DataError, match="2 features, the query has 3"):
            preprocess_for_query([[1.0, 1.0]], q)
